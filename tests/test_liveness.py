"""Liveness intervals and peak live bytes on hand-made graphs, against hand-computed values."""
import pytest
from hypothesis import given, settings, strategies as st

import jitgraph as jg
from jitgraph.ir import base
from jitgraph.passes.liveness import default_order, intervals, live_bytes, peak_bytes


def small_graph():
    """x -> a=relu -> b=reshape(a) -> c=exp(b) -> s=sum(c);  d=a*w.  Every f32[4] is 16 B."""
    g = jg.Graph("small")
    x = g.input("x", (4,))
    w = g.param("w", (4,))
    a = jg.relu(x)                   # %2, step 0
    b = a.reshape(2, 2)              # %3, step 1 (view of a)
    c = jg.exp(b)                    # %4, step 2
    s = jg.sum(c)                    # %5, step 3 (4 B)
    d = a * w                        # %6, step 4
    jg.tanh(x)                       # %7: dead, not in the default order
    g.output(loss=s, out=d)
    return g, (a, b, c, s, d)


def test_default_order_is_the_live_computing_nodes():
    g, (a, b, c, s, d) = small_graph()
    assert default_order(g) == [a.id, b.id, c.id, s.id, d.id]


def test_intervals_views_extend_their_base_and_outputs_live_to_the_end():
    g, (a, b, c, s, d) = small_graph()
    assert base(g, b.id) == a.id and base(g, c.id) == c.id
    # a is read through the view b by c (step 2) and directly by d (step 4)
    assert intervals(g) == {a.id: (0, 4), c.id: (2, 3), s.id: (3, 4), d.id: (4, 4)}


def test_peak_bytes_by_hand():
    g, _ = small_graph()
    # step: 0 a=16, 1 a=16, 2 a+c=32, 3 a+c+s=36, 4 a+s+d=36
    ivs = intervals(g)
    assert live_bytes(g, ivs, 5) == [16, 16, 32, 36, 36]
    assert peak_bytes(g) == (36, 3)


def test_leaves_option_counts_params_all_step_and_inputs_until_last_read():
    g, (a, b, c, s, d) = small_graph()
    x, w = g.inputs["x"], g.params["w"]
    ivs = intervals(g, leaves=True)
    assert ivs[x] == (0, 0) and ivs[w] == (0, 4)
    assert live_bytes(g, ivs, 5) == [48, 32, 48, 52, 52]
    assert peak_bytes(g, leaves=True) == (52, 3)


def test_persistent_values_get_no_arena_interval():
    g, (a, b, c, s, d) = small_graph()
    ivs = intervals(g, persistent={d.id})
    assert d.id not in ivs and ivs[a.id] == (0, 4)
    assert peak_bytes(g, persistent={d.id}) == (36, 3)


def test_kernel_steps_keep_fused_intermediates_in_registers():
    g, (a, b, c, s, d) = small_graph()
    order = [a.id, (c.id, s.id), d.id]          # exp and sum fused; the view is not a step
    ivs = intervals(g, order)
    assert ivs == {a.id: (0, 2), s.id: (1, 2), d.id: (2, 2)}
    assert peak_bytes(g, order) == (36, 2)
    # a member read outside its kernel does need a buffer
    assert intervals(g, [(a.id, c.id), s.id, d.id])[a.id] == (0, 2)


def test_a_custom_order_changes_the_intervals():
    g, (a, b, c, s, d) = small_graph()
    ivs = intervals(g, [a.id, d.id, c.id, s.id])
    assert ivs == {a.id: (0, 2), d.id: (1, 3), c.id: (2, 3), s.id: (3, 3)}
    assert peak_bytes(g, [a.id, d.id, c.id, s.id]) == (48, 2)


def test_reading_a_value_before_it_is_computed_is_an_error():
    g, (a, b, c, s, d) = small_graph()
    with pytest.raises(ValueError, match=r"%\d+ \(relu\) is read at step 0 but not computed"):
        intervals(g, [c.id, a.id, s.id, d.id])
    with pytest.raises(ValueError, match=r"\(relu\).*not computed"):
        intervals(g, [c.id, s.id, d.id])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 3), st.booleans()),
                min_size=1, max_size=12))
def test_peak_matches_a_brute_force_simulation(spec):
    """Random chains of unary/binary ops: the interval peak equals a step-by-step simulation that
    allocates each result and frees a value after its last reader (outputs never)."""
    g = jg.Graph("random")
    vals = [g.input("x", (3,))]
    for pick, size, binary in spec:
        x = vals[pick % len(vals)]
        x = x if x.shape == (3 * size,) else jg.broadcast_to(jg.sum(x), (3 * size,))
        y = x * vals[(pick + 1) % len(vals)] if binary and vals[(pick + 1) % len(vals)].shape \
            == x.shape else jg.exp(x)
        vals.append(y)
    g.output(out=vals[-1])
    order = default_order(g)
    readers = {}
    for t, nid in enumerate(order):
        for i in g.nodes[nid].inputs:
            readers[i] = t
    live, peak = {}, 0
    for t, nid in enumerate(order):
        live[nid] = g.nodes[nid].type.nbytes
        peak = max(peak, sum(live.values()))
        for i in list(live):
            if readers.get(i, t) <= t and i != g.outputs["out"]:
                del live[i]
    assert peak_bytes(g)[0] == peak


def test_given_kernel_outputs_decide_which_members_get_buffers():
    g, (a, b, c, s, d) = small_graph()
    order = [(a.id, c.id, s.id), (d.id,)]        # a is read by d outside its kernel
    assert intervals(g, order) == {a.id: (0, 1), s.id: (0, 1), d.id: (1, 1)}
    # the fusion pass may say a member needs memory although only its own kernel reads it
    ivs = intervals(g, order, outputs=[(a.id, c.id, s.id), (d.id,)])
    assert ivs == {a.id: (0, 1), c.id: (0, 0), s.id: (0, 1), d.id: (1, 1)}


def test_inlined_constants_have_no_buffer_and_no_order():
    g = jg.Graph("const")
    x = g.input("x", (4,))
    k = jg.full_like(x, 2.0)
    y = jg.exp(x * k)
    g.output(y=y)
    # k has no step: inlined into the kernel reading it
    assert intervals(g, [(y.node.inputs[0], y.id)], inlined={k.id}) == {y.id: (0, 0)}
    with pytest.raises(ValueError, match="not computed"):
        intervals(g, [(y.node.inputs[0], y.id)])

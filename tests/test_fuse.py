"""The fusion pass: fused, unfused and the interpreter agree on every fusion pattern (elementwise
chains with broadcasts and several outputs, reductions with prologues, row ops with prologue and
epilogue, GEMM epilogues, cross-entropy forward + backward, the optimizer update, whole
training steps), and the fuse IR shows the groups."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph.ops import apply
from jitgraph.plan import rows_flags
from jitgraph.passes.pipeline import Options, run_pipeline
from jitgraph.runtime.cpu.lower import PARALLEL_MIN_WORK

TOL = {np.float32: dict(rtol=2e-5, atol=2e-6), np.float64: dict(rtol=1e-11, atol=1e-12),
       np.int32: dict(rtol=0, atol=0)}


def feeds_for(g, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, nid in g.inputs.items():
        t = g.nodes[nid].type
        if t.dtype == "i32":
            out[name] = rng.integers(0, 5, t.shape).astype(np.int32)
        elif name.startswith("pos"):
            out[name] = rng.uniform(0.5, 2.0, t.shape).astype(t.np_dtype)
        else:
            out[name] = rng.standard_normal(t.shape).astype(t.np_dtype)
    return out


def check(g, min_fused=1):
    """Fused and unfused programs both match the interpreter on every output; the fused one
    has at least `min_fused` multi-node kernels. Returns the fused program."""
    feeds = feeds_for(g)
    ref = jg.interp.run(g, feeds, {})
    fused = jg.compile(g, fuse=True)
    assert sum(k.kind != "node" and len(k.nodes) > 1
               for k in fused._products.kernels.kernels) >= min_fused, fused.ir("fuse")
    for prog in (fused, jg.compile(g, fuse=False)):
        got = prog.run(**feeds)
        for k, v in ref.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            np.testing.assert_allclose(got[k], v, err_msg=k, **TOL[v.dtype.type])
    return fused


def kernel_graph(g, **opts):
    return run_pipeline(g, Options(**opts)).kernels


# ---- grouping ------------------------------------------------------------------------------
def test_chain_is_one_kernel_with_an_output_per_value_read_outside():
    g = jg.Graph("chain")
    x, y = g.input("x", (5, 7)), g.input("y", (7,))
    h = jg.tanh(x * y + x)
    out = jg.relu(jg.sigmoid(jg.sqr(h) - y) * x)
    g.output(out=out, h=h)
    kg = kernel_graph(g)
    (k,) = kg.kernels
    assert k.kind == "elementwise" and len(k.nodes) == 8
    assert set(k.outputs) == {h.id, out.id}          # h is a graph output too
    assert kg.outputs_of(k) == k.outputs
    assert len(kernel_graph(g, fuse=False).kernels) == 8


def test_bytes_moved_counts_only_values_crossing_kernels():
    g = jg.Graph("bytes")
    x = g.input("x", (4, 8))
    g.output(out=jg.exp(jg.exp(x) + 1.0))
    one = 4 * 8 * 4
    assert kernel_graph(g).bytes_moved() == 2 * one                   # read x, write out
    # exp: x -> t; full: -> c (4 B); add: t, c -> u; exp: u -> out
    assert kernel_graph(g, fuse=False).bytes_moved() == 6 * one + 2 * 4


def test_no_group_spans_a_node_outside_it():
    # d = c * s with c = exp(a) and s = softmax(c) over axis 0 (not fusable): d may not join c's
    # kernel, which would have to run both before and after s
    g = jg.Graph("convex")
    a = g.input("a", (3, 4))
    c = jg.exp(a)
    s = jg.softmax(c, axis=0)
    d = c * s
    g.output(d=d)
    kg = kernel_graph(g)
    home = {nid: k.id for k in kg.kernels for nid in k.nodes}
    assert home[c.id] < home[s.id] < home[d.id]
    check(g, min_fused=0)


def test_rows_flags():
    assert rows_flags((4, 3, 5), (5,)) == (False, True)
    assert rows_flags((4, 3, 5), (4, 3, 1)) == (True, False)
    assert rows_flags((4, 3, 5), (4, 1, 5)) is None
    assert rows_flags((4, 1, 5), (4, 1, 5)) == (True, True)


def mlp(batch=8, n_in=13, hidden=11, n_out=5):
    g = jg.Graph("mlp")
    x, y = g.input("x", (batch, n_in)), g.input("y", (batch,), "i32")
    w1 = g.param("w1", (n_in, hidden), init=jg.init.he_normal())
    b1 = g.param("b1", (hidden,), init=jg.init.normal(0.0, 0.1))
    w2 = g.param("w2", (hidden, n_out), init=jg.init.he_normal())
    b2 = g.param("b2", (n_out,))
    g.output(loss=jg.cross_entropy(jg.relu(x @ w1 + b1) @ w2 + b2, y))
    return g


def test_mlp_training_program_has_three_times_fewer_kernels():
    opts = dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-3))
    st = run_pipeline(mlp(), Options(**opts))
    unfused = kernel_graph(mlp(), fuse=False, **opts)
    assert len(unfused.kernels) >= 3 * len(st.kernels.kernels)
    assert st.kernels.bytes_moved() < unfused.bytes_moved()
    text = st.ir["fuse"]
    assert "[gemm]" in text and "[cross_entropy]" in text and "matmul, %" in text
    assert "bytes_moved=" in text


# ---- fused kernels agree with unfused and the interpreter ------------------------------------
@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_elementwise_chains_with_broadcasts(dt):
    g = jg.Graph(f"ew_{dt}")
    a, b = g.input("a", (7, 1, 5), dt), g.input("b", (3, 5), dt)
    s, p = g.input("s", (), dt), g.input("pos_p", (7, 3, 5), dt)
    big, bias = g.input("big", (301, 1873), dt), g.input("bias", (1873,), dt)
    assert 301 * 1873 * 3 >= PARALLEL_MIN_WORK      # the big chain runs in parallel chunks
    h = jg.tanh(a * b + s)
    g.output(h=h, out=jg.gelu(h / p - jg.full_like(p, 0.5)) * 2.0 + jg.clamp(a, lo=0.0),
             big=jg.sigmoid(jg.relu(big + bias) * 3.0), bigsq=jg.sqr(big - bias),
             sc=jg.exp(s * s + 1.0), w=jg.where(jg.step(a), b, a))
    check(g)


@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_reductions_with_prologue(dt):
    g = jg.Graph(f"red_{dt}")
    x, w = g.input("x", (6, 11, 13), dt), g.input("w", (13,), dt)
    r = g.input("r", (6, 11, 1), dt)
    sq = jg.sqr(x * w)
    g.output(sumsq=jg.sum(jg.sqr(x)), mean_last=jg.mean(x * w + r, axis=-1),
             max0=jg.max(jg.exp(x - r), axis=0), lse=jg.logsumexp(x * 0.5, axis=(1, 2)),
             am=jg.argmax(jg.abs(x) * w, axis=1), cols=jg.sum(sq, axis=(0, 1), keepdims=True),
             sq=sq)
    check(g, min_fused=5)


@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_row_ops_with_prologue_and_epilogue(dt):
    g = jg.Graph(f"rows_{dt}")
    x, gr = g.input("x", (4, 3, 37), dt), g.input("g", (4, 3, 37), dt)
    w, b = g.input("w", (37,), dt), g.input("b", (37,), dt)
    r = g.input("r", (4, 3, 1), dt)
    y = jg.softmax(x * 0.25 + r)
    g.output(sm=y, lsm=jg.log_softmax(x - w) * 2.0,
             ln=jg.layer_norm(x + gr, w, b), rms=jg.rms_norm(jg.silu(x), w),
             smb=apply("softmax_back", y, gr * w, axis=2),
             rmsb=apply("rms_norm_back", x * w, gr, eps=1e-6) + x,
             lnb=apply("layer_norm_back", x, gr * 2.0, eps=1e-5))
    prog = check(g, min_fused=5)
    assert "[rows]" in prog.ir("fuse")


def test_row_ops_fuse_large_rows_in_parallel():
    g = jg.Graph("rows_big")
    x = g.input("x", (512, 1024))
    g.output(out=jg.layer_norm(jg.softmax(x * 0.125) * 3.0, g.input("w", (1024,))))
    check(g, min_fused=1)


@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_gemm_epilogues(dt):
    g = jg.Graph(f"gemm_{dt}")
    x, w, b = g.input("x", (9, 17), dt), g.input("w", (17, 23), dt), g.input("b", (23,), dt)
    res = g.input("res", (9, 23), dt)
    xb = g.input("xb", (2, 3, 17), dt)
    h = x @ w + b
    g.output(gelu=jg.gelu(h), h=h, resid=(x @ w) * 0.5 + res,
             tr=jg.relu(jg.matmul(x, res, ta=True) - 1.0),
             raw=jg.matmul(x, res, ta=True),     # the GEMM's own value is read outside too
             batched=jg.tanh(xb @ w + b))
    check(g, min_fused=3)


@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_gemm_prologues(dt):
    """An elementwise group whose values only the GEMM reads computes its operand inside the
    GEMM's kernel (into scratch space): on x, on w, on both, batched x, two operands from one
    input, with and without an epilogue."""
    g = jg.Graph(f"prologue_{dt}")
    x, w, b = g.input("x", (9, 17), dt), g.input("w", (17, 23), dt), g.input("b", (23,), dt)
    xb, m = g.input("xb", (2, 3, 17), dt), g.input("m", (17, 23), dt)
    g.output(a=jg.relu(jg.relu(x * 2.0) @ w + b),
             c=x @ (w * m),
             d=jg.tanh(xb - 1.0) @ jg.sqr(w),
             e=jg.matmul(jg.exp(x * 0.1), jg.exp(x * 0.2), ta=True))
    prog = check(g, min_fused=4)
    kernels = prog._products.kernels.kernels
    assert len(kernels) == 4 and all(k.kind == "gemm" for k in kernels), prog.ir("fuse")
    assert [len(k.outputs) for k in kernels] == [1, 1, 1, 1]     # operands never stored
    itemsize = 4 if dt == "f32" else 8
    assert prog.stats()["workspace_bytes"] >= 9 * 17 * itemsize   # they live in scratch space


def test_gemm_prologue_only_when_the_gemm_alone_reads_it():
    g = jg.Graph("shared")
    x, w = g.input("x", (6, 5)), g.input("w", (5, 4))
    h = jg.relu(x - 0.5)
    g.output(y=h @ w, s=jg.sum(h))          # h is read by the sum too: stored, no prologue
    prog = check(g, min_fused=0)
    g2 = prog._products.kernels.graph
    gemm = next(k for k in prog._products.kernels.kernels
                if any(g2.nodes[i].op == "matmul" for i in k.nodes))
    assert [g2.nodes[i].op for i in gemm.nodes] == ["matmul"], prog.ir("fuse")


def test_gemm_prologue_in_a_training_program_matches_the_interpreter():
    """Masked weights (w * m, m an input): the backward needs x and the gradient, not w * m,
    so the forward GEMM computes its operand in its prologue every step."""
    g = jg.Graph("masked")
    x, y = g.input("x", (16, 12)), g.input("y", (16,), "i32")
    m = g.input("m", (12, 5))
    w = g.param("w", (12, 5), init=jg.init.he_normal())
    g.output(loss=jg.cross_entropy(x @ (w * m), y))
    prog = train_compare(g, jg.optim.SGD(lr=0.1, momentum=0.9))
    assert any(k.kind == "gemm" and len(k.nodes) > 1 and k.anchor != k.nodes[0]
               for k in prog._products.kernels.kernels), prog.ir("fuse")


def test_gemm_epilogue_never_overwrites_an_operand():
    # h = x @ w + x_sq: the result may not be written over an operand the epilogue still reads
    g = jg.Graph("carrier")
    x, w = g.input("x", (8, 8)), g.input("w", (8, 8))
    h = x @ w + jg.sqr(x)
    g.output(out=jg.relu(h @ w + h))
    check(g, min_fused=1)


@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_gemm_accumulates_a_second_product(dt):
    """a @ b + c @ d with neither product read elsewhere: one gemm kernel whose second GEMM adds
    into the first's output (beta = 1), with transposes, batched rows, a chain of three
    products, an epilogue after the sum, none, and the sum read outside; a product read twice
    (p) or a sum in a GEMM's epilogue (e) is no accumulation."""
    g = jg.Graph(f"acc_{dt}")
    x, x2, z = g.input("x", (9, 17), dt), g.input("x2", (9, 17), dt), g.input("z", (9, 5), dt)
    w, v, u = g.input("w", (17, 23), dt), g.input("v", (23, 5), dt), g.input("u", (9, 23), dt)
    xb, zb = g.input("xb", (2, 3, 17), dt), g.input("zb", (2, 3, 5), dt)
    b = g.input("b", (23,), dt)
    p = jg.sqr(z) @ v.T
    g.output(lora=jg.relu(x @ w + jg.matmul(z, v, tb=True)),
             bare=jg.matmul(u, x, ta=True) + jg.matmul(u, x2, ta=True),
             chain=(x2 @ w + (z * 2.0) @ v.T) + (x * 3.0) @ w,
             batched=jg.tanh(xb @ w + zb @ v.T),
             p=p + (x * 0.5) @ w + p, e=(x2 @ (w * 2.0) + b) + (z - 1.0) @ v.T)
    prog = check(g, min_fused=4)
    kg = prog._products.kernels
    accs = [k for k in kg.kernels if k.accumulate]
    assert len(accs) >= 4, prog.ir("fuse")
    for k in accs:
        assert k.kind == "gemm" and k.anchor not in [m for m, _ in k.accumulate]
        assert all(kg.graph.nodes[m].op == "matmul" and kg.graph.nodes[a].op == "add"
                   for m, a in k.accumulate)
    assert "accumulate" in prog.ir("fuse")


def test_gemm_accumulation_in_training_matches_the_interpreter():
    """x read by two weights: its gradient is the sum of two products (dx = g1 w1^T + g2 w2^T),
    accumulated in one kernel; a LoRA-style forward W x + B (A x) likewise."""
    g = jg.Graph("acc_train")
    x, y = g.input("x", (16, 12)), g.input("y", (16,), "i32")
    w1 = g.param("w1", (12, 10), init=jg.init.he_normal())
    w2 = g.param("w2", (12, 10), init=jg.init.he_normal())
    a = g.param("a", (12, 3), init=jg.init.he_normal())
    bb = g.param("bb", (3, 6), init=jg.init.he_normal())
    w3 = g.param("w3", (10, 6), init=jg.init.he_normal())
    h = jg.tanh(x @ w1) * jg.sigmoid(x @ w2)
    g.output(loss=jg.cross_entropy(h @ w3 + (h @ jg.matmul(w1, a, ta=True)) @ bb, y))
    prog = train_compare(g, jg.optim.AdamW(lr=1e-2, weight_decay=0.1))
    assert sum(len(k.accumulate) for k in prog._products.kernels.kernels) >= 2, prog.ir("fuse")


def test_gemm_accumulation_only_where_the_backend_lowers_it():
    g = jg.Graph("acc_kinds")
    x, z = g.input("x", (9, 17)), g.input("z", (9, 5))
    w, v = g.input("w", (17, 23)), g.input("v", (5, 23))
    g.output(y=x @ w + z @ v)
    assert any(k.accumulate for k in kernel_graph(g).kernels)
    kinds = frozenset(("node", "elementwise", "gemm"))
    assert not any(k.accumulate for k in kernel_graph(g, kinds=kinds).kernels)


@pytest.mark.parametrize("labels", [True, False])
def test_cross_entropy_forward_and_backward_in_one_kernel(labels):
    g = jg.Graph("ce")
    logits = g.input("logits", (9, 7))
    t = g.input("y", (9,), "i32") if labels else jg.softmax(g.input("t", (9, 7)))
    g.output(loss=jg.cross_entropy(logits, t),
             grad=apply("cross_entropy_back", logits, t, g.input("pos_g", ())))
    prog = check(g)
    assert "[cross_entropy]" in prog.ir("fuse")


# ---- training steps: fused vs unfused vs interpreter -------------------------------------------
def train_compare(g, opt, steps=3, rtol=2e-4, atol=2e-5):
    """Fused and unfused training steps against the interpreter, step for step."""
    progs = [jg.compile(g, loss="loss", optimizer=opt, fuse=f) for f in (True, False)]
    tg = jg.training_graph(g, loss="loss", optimizer=opt)
    state = tg.init_params(0)
    for i in range(steps):
        b = feeds_for(g, i)
        ref = jg.interp.run(tg, {**b, **opt.runtime_inputs(i)}, state)   # updates `state`
        for prog in progs:
            np.testing.assert_allclose(prog.step(**b)["loss"], ref["loss"], rtol=rtol, atol=atol)
            for k in prog.params:
                np.testing.assert_allclose(prog.params[k], state[k], rtol=rtol, atol=atol,
                                           err_msg=f"step {i} {k}")
            for k in prog.state:
                np.testing.assert_allclose(prog.state[k], state[k], rtol=rtol, atol=atol,
                                           err_msg=f"step {i} {k}")
    return progs[0]


def test_adamw_update_is_one_kernel_and_matches():
    g = mlp()
    prog = train_compare(g, jg.optim.AdamW(lr=1e-2, weight_decay=0.1))
    kernels = prog._products.kernels.kernels
    # every update op sits in one elementwise kernel or in the epilogue of its gradient's GEMM
    homes = {k.kind for k in kernels if any(prog.graph.nodes[m].op == "adam_step" for m in k.nodes)}
    assert homes <= {"elementwise", "gemm"}
    assert sum(k.kind == "elementwise" and any(prog.graph.nodes[m].op == "adam_step"
                                               for m in k.nodes) for k in kernels) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mnist_mlp_b100", "mnist_cnn_b100", "transformer_block"])
def test_workload_training_steps_fused_match_unfused(name):
    from jitgraph.cli import workloads
    w = workloads.WORKLOADS[name](scale=0.1)
    progs = [jg.compile(w.graph, loss=w.loss, optimizer=w.optimizer, fuse=f) for f in (True, False)]
    for _ in range(2):
        a, b = (p.step(**w.feeds)["loss"] for p in progs)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for k in progs[1].params:   # Adam steps ~lr in the sign of tiny gradients: atol lr / 10
        np.testing.assert_allclose(progs[0].params[k], progs[1].params[k], rtol=1e-3, atol=1e-4,
                                   err_msg=k)
    assert progs[0].stats()["kernels"] < progs[1].stats()["kernels"]


# ---- grouping that keeps memory low (issues 6 and 8) ------------------------------------------
def adam_kernels(g):
    st = run_pipeline(g, Options(loss="loss", optimizer=jg.optim.Adam(lr=1e-3)))
    return st.graph, st.kernels.kernels


def test_bias_corrections_get_their_own_kernel_and_updates_do_not_wait_for_them():
    tg, kernels = adam_kernels(mlp())
    home = {n: t for t, k in enumerate(kernels) for n in k.nodes}
    scalar = [t for t, k in enumerate(kernels) if all(tg.nodes[n].type.shape == ()
                                                      for n in k.nodes)]
    assert len(scalar) == 1 and scalar[0] == 0          # depends only on opt/step: runs first
    # w2's update (in its dW GEMM's epilogue) runs before w1's gradient exists
    grad_w1 = tg.nodes[tg.nodes[tg.updates["opt/m/w1"]].inputs[1]]
    assert home[tg.updates["w2"]] < home[grad_w1.id]


def test_backward_nodes_stay_out_of_forward_kernels():
    tg, kernels = adam_kernels(mlp())
    fwd = set(jg.passes.fuse.forward_nodes(tg))
    steps = [n.id for n in tg.nodes if n.op == "step"]       # relu's mask, used by the backward
    assert steps and all(n not in fwd for n in steps)
    for k in kernels:
        assert not (set(k.nodes) & fwd and set(k.nodes) & set(steps)), k


@pytest.mark.parametrize("fuse", [True, False])
def test_checkpointed_transformer_groups_are_acyclic(fuse):
    # recomputed GEMMs with silu epilogues once formed two groups that each read the other's
    # outputs (no single group spanned an outside node)
    from jitgraph.cli import workloads
    from jitgraph.passes.memory_check import check_plan
    w = workloads.WORKLOADS["transformer_block"](scale=0.25)
    st = run_pipeline(w.graph, Options(loss=w.loss, optimizer=w.optimizer, fuse=fuse,
                                       checkpoint="sqrt"))
    home = {n: t for t, k in enumerate(st.kernels.kernels) for n in k.nodes}
    g = st.graph
    for n, t in home.items():
        for i in g.nodes[n].inputs:
            b = jg.ir.base(g, i)
            assert home.get(b, -1) <= t, (g.label(n), g.label(b))
    check_plan(st.kernels, st.memory)

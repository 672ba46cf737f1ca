"""A bad step changes nothing: check_finite's guard (passes/guard.py), index inputs range-checked
before the driver runs, and the evaluator compiled with its program's options.

The oracle for "as if it had not been called" is a twin program that never saw the bad batch:
after the bad step both take the same good steps and must agree bit for bit.
"""
import numpy as np
import pytest

import jitgraph as jg

CONFIGS = [dict(fuse=f, plan_memory=p) for f in (True, False) for p in (True, False)]
CONFIG_IDS = [f"fuse={c['fuse']},plan={c['plan_memory']}" for c in CONFIGS]


def _mlp(n=4, d=6, h=5, c=3):
    g = jg.Graph("mlp")
    x = g.input("x", (n, d))
    y = g.input("y", (n,), "i32")
    w1 = g.param("w1", (d, h), init=jg.init.normal(0.0, 0.5))
    b1 = g.param("b1", (h,), init=jg.init.zeros())
    w2 = g.param("w2", (h, c), init=jg.init.normal(0.0, 0.5))
    logits = jg.tanh(x @ w1 + b1) @ w2
    g.output(loss=jg.cross_entropy(logits, y), logits=logits)
    return g


def _batch(seed, n=4, d=6, c=3):
    r = np.random.default_rng(seed)
    return {"x": r.standard_normal((n, d)).astype(np.float32),
            "y": r.integers(0, c, n).astype(np.int32)}


def _snapshot(prog):
    return {**{k: prog.params[k] for k in prog.params}, **{k: prog.state[k] for k in prog.state}}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


OPTIMIZERS = {
    "adamw": lambda: jg.optim.AdamW(lr=lambda t: 0.01 / t),
    "sgd-momentum-accumulate2": lambda: jg.optim.SGD(lr=0.1, momentum=0.9, accumulate=2),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_a_non_finite_step_leaves_the_program_as_if_not_called(cfg, opt):
    g = _mlp()
    prog = jg.compile(g, loss="loss", optimizer=OPTIMIZERS[opt](), check_finite=True, **cfg)
    twin = jg.compile(g, loss="loss", optimizer=OPTIMIZERS[opt](), **cfg)
    if cfg["plan_memory"]:                     # the guarded update still writes in place
        assert prog.stats()["memory"]["updates_copied"] == 0
    for s in range(3):                         # mid-accumulation for accumulate=2
        _assert_same(prog.step(**_batch(s)), twin.step(**_batch(s)))
    before, calls = _snapshot(prog), prog.calls
    bad = _batch(99)
    bad["x"][2, 1] = np.nan
    with pytest.raises(FloatingPointError, match="loss is not finite; the update was not applied"):
        prog.step(**bad)
    _assert_same(_snapshot(prog), before)
    assert prog.calls == calls
    for s in range(3, 7):                      # the program stays usable, on the twin's track
        _assert_same(prog.step(**_batch(s)), twin.step(**_batch(s)))
    _assert_same(_snapshot(prog), _snapshot(twin))


def test_guarded_updates_run_after_the_flag_apart_from_the_gradients():
    """The guard's flag reads every gradient, so an update in a GEMM epilogue would write its
    new values for the gate to copy: the gated update nodes fuse apart from the gradients'
    kernels (one update kernel, which reads each gradient and writes each param and moment
    once), and the step still equals the unguarded twin's, whose updates sit in the epilogues."""
    from jitgraph.passes.guard import gated_nodes
    from jitgraph.registry import get_op
    g = _mlp(n=16, d=32, h=24)
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-2), check_finite=True)
    twin = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-2))
    kg = prog._products.kernels
    gated = gated_nodes(kg.graph)
    assert gated
    is_update = lambda kgr, m: "update" in get_op(kgr.graph.nodes[m].op).fusion   # noqa: E731
    assert all(len({m in gated for m in k.nodes}) == 1 for k in kg.kernels)
    assert not any(k.kind == "gemm" and any(is_update(kg, m) for m in k.nodes)
                   for k in kg.kernels)
    assert {k.kind for k in kg.kernels if any(m in gated for m in k.nodes)} == {"elementwise"}
    assert sum(any(is_update(kg, m) for m in k.nodes) for k in kg.kernels) == 1
    tk = twin._products.kernels                 # the twin's weight updates: in GEMM epilogues
    assert any(k.kind == "gemm" and any(is_update(tk, m) for m in k.nodes) for k in tk.kernels)
    assert prog.stats()["memory"]["updates_copied"] == 0
    for s in range(4):
        _assert_same(prog.step(**_batch(s, n=16, d=32)), twin.step(**_batch(s, n=16, d=32)))
    _assert_same(_snapshot(prog), _snapshot(twin))


def test_an_infinite_gradient_is_named_and_not_applied():
    g = jg.Graph("sqrt")
    x = g.input("x", (3,))
    w = g.param("w", (3,), init=jg.init.constant(1.0))
    v = g.param("v", (3,), init=jg.init.constant(2.0))
    g.output(loss=jg.sum(v * x) + jg.sum(jg.sqrt(w * x)))
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1), check_finite=True)
    before = _snapshot(prog)
    # loss finite (sqrt(0) = 0), d/dw sqrt(w x) = x / (2 sqrt(w x)) = inf at x = 0; grad of v
    # is finite: the error names the first flagged gradient, and v is not updated either
    with pytest.raises(FloatingPointError, match="gradient of param w is not finite"):
        prog.step(x=np.array([0.0, 1.0, 1.0], np.float32))
    _assert_same(_snapshot(prog), before)
    prog.step(x=np.ones(3, np.float32))
    np.testing.assert_allclose(prog.params["v"], 2.0 - 0.1, rtol=1e-6)


def test_user_updates_are_gated_without_an_optimizer():
    g = jg.Graph("count")
    x = g.input("x", (3,))
    c = g.param("c", (3,), init=jg.init.zeros(), trainable=False)
    g.update(c=c + x)
    g.output(y=jg.log(x))
    prog = jg.compile(g, check_finite=True)
    prog.step(x=np.ones(3, np.float32))
    with pytest.raises(FloatingPointError, match="output y is not finite"):
        prog.step(x=np.array([1.0, -1.0, 1.0], np.float32))
    np.testing.assert_array_equal(prog.params["c"], [1, 1, 1])
    prog.step(x=np.full(3, 2.0, np.float32))
    np.testing.assert_array_equal(prog.params["c"], [3, 3, 3])


def test_check_finite_off_keeps_the_old_behaviour_and_no_flag_outputs():
    prog = jg.compile(_mlp(), loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    assert not any(k.startswith("check/") for k in prog.graph.outputs)
    bad = _batch(0)
    bad["x"][0, 0] = np.nan
    assert np.isnan(prog.step(**bad)["loss"])       # no check asked for: no error


# ---- index inputs ---------------------------------------------------------------------------
@pytest.mark.parametrize("label", [3, -1, 2**31 - 1, -2**31])
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=CONFIG_IDS[:2])
def test_labels_out_of_range_raise_before_any_update(cfg, label):
    g = _mlp()
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=0.01), **cfg)
    prog.step(**_batch(0))
    before, calls = _snapshot(prog), prog.calls
    bad = _batch(1)
    bad["y"][2] = label
    with pytest.raises(IndexError) as e:
        jg.interp.run(g, bad, g.init_params(0))
    with pytest.raises(IndexError, match=rf"input y\[2\] = {label} is out of range \[0, 3\) "
                                         r"for cross_entropy \(%\d+\)"):
        prog.step(**bad)
    assert "out of range" in str(e.value)           # the interpreter refuses it too
    _assert_same(_snapshot(prog), before)
    assert prog.calls == calls
    prog.step(**_batch(2))                         # still usable


def test_token_ids_are_checked_through_a_reshape():
    g = jg.Graph("emb")
    ids = g.input("ids", (2, 3), "i32")
    table = g.param("table", (5, 4), init=jg.init.normal(0.0, 1.0))
    rows = jg.get_rows(table, jg.reshape(ids, (6,)))
    g.output(loss=jg.sum(jg.sqr(rows)))
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    good = np.array([[0, 1, 2], [3, 4, 0]], np.int32)
    prog.step(ids=good)
    before = prog.params["table"]
    with pytest.raises(IndexError, match=r"input ids\[1,1\] = 5 is out of range \[0, 5\) for "
                                         r"get_rows \(%\d+\), get_rows_back"):
        prog.step(ids=np.array([[0, 1, 2], [3, 5, 0]], np.int32))
    np.testing.assert_array_equal(prog.params["table"], before)


def test_index_facts_come_from_the_op_registry():
    from jitgraph.validate import index_inputs
    g = _mlp()
    assert {k: b for k, (b, _) in index_inputs(g).items()} == {"y": 3}
    h = jg.Graph("soft")                      # probability targets index nothing
    z = h.input("z", (2, 3))
    t = h.input("t", (2, 3))
    h.output(loss=jg.cross_entropy(z, t))
    assert index_inputs(h) == {}


# ---- the evaluator --------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_evaluator_keeps_the_programs_options(cfg):
    g = _mlp()
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1), checkpoint="sqrt", **cfg)
    prog.step(**_batch(0))
    ev = prog.evaluator()
    b = _batch(1)
    got = ev.run(**b)
    (inner,) = ev._programs.values()
    assert inner.options.fuse == cfg["fuse"] and inner.options.plan_memory == cfg["plan_memory"]
    assert inner.options.checkpoint is None and inner.options.optimizer is None
    direct = jg.compile(g, **cfg)
    assert inner.stats()["kernels"] == direct.stats()["kernels"]
    params = {k: prog.params[k] for k in prog.params}
    want = jg.interp.run(g, b, params)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)

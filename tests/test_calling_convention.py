"""The driver's calling convention (issue 16): inputs are read where the caller's arrays lie,
converted once per call only when they must be; no kernel writes into an input; outputs are
received into the caller's arrays with `step_into` / `run_into`.

Oracles: the reference interpreter; a copy of every input taken before the step; the program's
own output buffer (left untouched when an output goes straight into the caller's array).
"""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp
from jitgraph.testing import fuzz, runner
from jitgraph.passes.memory_check import check_plan
from jitgraph.types import ShapeError

CONFIGS = [dict(fuse=f, plan_memory=p) for f in (True, False) for p in (True, False)]
CONFIG_IDS = [f"fuse={c['fuse']},plan={c['plan_memory']}" for c in CONFIGS]


def _axpb(n=(4, 6)):
    g = jg.Graph("axpb")
    a, b = g.input("a", n), g.input("b", n)
    g.output(y=jg.tanh(a * 2.0 + b))
    return g


def _want(a, b):
    return np.tanh(np.asarray(a, np.float32) * np.float32(2) + np.asarray(b, np.float32))


def _rng(seed=0):
    return np.random.default_rng(seed)


def _f32(shape, seed=0):
    return _rng(seed).standard_normal(shape).astype(np.float32)


def _io_entry(prog, name):
    return int(prog._io[prog._products.memory.inputs[name].pointer])


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_an_input_is_read_where_it_lies(cfg):
    prog = jg.compile(_axpb(), **cfg)
    plan = prog._products.memory
    assert {s.region for s in plan.inputs.values()} == {"input"}
    assert plan.inputs.keys() == {"a", "b"}
    a, b = _f32((4, 6), 1), _f32((4, 6), 2)
    np.testing.assert_allclose(prog.step(a=a, b=b)["y"], _want(a, b), rtol=1e-6, atol=1e-6)
    assert _io_entry(prog, "a") == a.ctypes.data and _io_entry(prog, "b") == b.ctypes.data
    a *= -3.0                                  # the caller changes its array between steps
    b[1] = 7.0
    np.testing.assert_allclose(prog.step(a=a, b=b)["y"], _want(a, b), rtol=1e-6, atol=1e-6)
    assert not prog._stage                     # nothing was converted


def _unaligned(a):
    buf = np.zeros(a.nbytes + 1, np.uint8)
    u = buf[1:].view(a.dtype).reshape(a.shape)
    u[...] = a
    assert not u.flags.aligned
    return u


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_other_inputs_are_converted_once_per_call(cfg):
    prog = jg.compile(_axpb(), **cfg)
    big = _f32((8, 12), 3)
    cases = {
        "strided": (big[::2, ::2], _f32((4, 6), 4)),
        "f64": (_f32((4, 6), 5).astype(np.float64), _f32((4, 6), 6)),
        "int": (np.arange(24, dtype=np.int64).reshape(4, 6) % 5 - 2, _f32((4, 6), 7)),
        "fortran": (np.asfortranarray(_f32((4, 6), 8)), _f32((4, 6), 9)),
        "list": (_f32((4, 6), 10).tolist(), _f32((4, 6), 11)),
        "unaligned": (_unaligned(_f32((4, 6), 12)), _f32((4, 6), 13)),
    }
    for what, (a, b) in cases.items():
        a_before = np.array(a, copy=True)
        got = prog.step(a=a, b=b)["y"]
        np.testing.assert_allclose(got, _want(a, b), rtol=1e-6, atol=1e-6, err_msg=what)
        np.testing.assert_array_equal(np.asarray(a), a_before, err_msg=what)
    assert "a" in prog._stage and prog._stage["a"][0].flags.c_contiguous
    with pytest.raises(ShapeError, match="input a: expected dtype float32, got complex64"):
        prog.step(a=np.zeros((4, 6), np.complex64), b=_f32((4, 6)))
    with pytest.raises(ShapeError, match=r"input a: expected shape float32\[4,6\]"):
        prog.step(a=_f32((6, 4)), b=_f32((4, 6)))
    with pytest.raises(ShapeError, match="missing input b"):
        prog.step(a=_f32((4, 6)))


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_an_output_is_received_into_the_callers_array(cfg):
    prog = jg.compile(_axpb(), copy_outputs=False, **cfg)
    assert prog._products.memory.outputs["y"].region == "output"
    a, b = _f32((4, 6), 1), _f32((4, 6), 2)
    first = prog.step(a=a, b=b)["y"]           # a view of the program's own buffer
    kept = first.copy()
    z = np.full((4, 6), np.nan, np.float32)
    res = prog.step_into({"y": z}, a=-a, b=b)
    assert res["y"] is z
    np.testing.assert_allclose(z, _want(-a, b), rtol=1e-6, atol=1e-6)
    # written straight into z: the program's own buffer still holds the first step's output
    np.testing.assert_array_equal(first, kept)
    np.testing.assert_allclose(prog.run_into({"y": z}, a=a, b=-b)["y"], _want(a, -b),
                               rtol=1e-6, atol=1e-6)
    # the next plain step writes into the program's buffer again
    np.testing.assert_allclose(prog.step(a=a, b=a)["y"], _want(a, a), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(z, _want(a, -b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_outputs_that_cannot_take_the_callers_array_are_copied_into_it(cfg):
    prog = jg.compile(_axpb(), **cfg)
    a, b = _f32((4, 6), 1), _f32((4, 6), 2)
    want = _want(a, b)
    big = np.zeros((8, 12), np.float32)
    outs = {"strided": big[::2, ::2], "f64": np.zeros((4, 6), np.float64),
            "fortran": np.zeros((4, 6), np.float32, order="F")}
    for what, z in outs.items():
        assert prog.step_into({"y": z}, a=a, b=b)["y"] is z
        np.testing.assert_allclose(z, want, rtol=1e-6, atol=1e-6, err_msg=what)
    # the caller's output is one of the inputs: computed aside, then copied over it
    a2 = a.copy()
    prog.step_into({"y": a2}, a=a2, b=b)
    np.testing.assert_allclose(a2, want, rtol=1e-6, atol=1e-6)
    b2 = b.copy()
    prog.step_into({"y": b2[::-1]}, a=a, b=b2[::-1])    # overlapping, reversed
    np.testing.assert_allclose(b2[::-1], _want(a, b[::-1]), rtol=1e-6, atol=1e-6)
    with pytest.raises(KeyError, match="no output 'z'"):
        prog.step_into({"z": np.zeros((4, 6), np.float32)}, a=a, b=b)
    with pytest.raises(ShapeError, match="output y: expected a writeable array of float32"):
        prog.step_into({"y": np.zeros((6, 4), np.float32)}, a=a, b=b)
    ro = np.zeros((4, 6), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ShapeError, match="read-only"):
        prog.step_into({"y": ro}, a=a, b=b)
    with pytest.raises(ShapeError, match="got int32"):
        prog.step_into({"y": np.zeros((4, 6), np.int32)}, a=a, b=b)
    assert prog.calls == 5                     # the refused calls ran nothing


def test_an_input_may_be_called_out():
    g = jg.Graph("named_out")
    x = g.input("out", (3,))
    g.output(y=x + 1.0)
    prog = jg.compile(g)
    z = np.zeros(3, np.float32)
    prog.step_into({"y": z}, out=np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(z, [1, 2, 3])
    np.testing.assert_array_equal(prog.step(out=np.ones(3, np.float32))["y"], [2, 2, 2])


def _graphs():
    """Graphs where the planner would like to reuse an input's buffer (it dies in an
    elementwise kernel of its exact type), each with its loss (or None) and feeds."""
    out = {}
    g = jg.Graph("relu_dies")
    x = g.input("x", (16, 8))
    g.output(y=jg.relu(x))
    out["relu(x)"] = (g, None)
    g = jg.Graph("chain")
    x = g.input("x", (16, 8))
    g.output(s=jg.sum(jg.sqr(jg.neg(jg.exp(jg.scale(x, 0.1))))))
    out["chain"] = (g, None)
    g = jg.Graph("mlp")
    x, y = g.input("x", (16, 8)), g.input("y", (16,), "i32")
    w1 = g.param("w1", (8, 8), init=jg.init.normal(0.0, 0.5))
    w2 = g.param("w2", (8, 3), init=jg.init.normal(0.0, 0.5))
    h = jg.relu(jg.tanh(x) + jg.relu(x @ w1))            # x read by elementwise ops and a GEMM
    g.output(loss=jg.cross_entropy(h @ w2, y))
    out["mlp train"] = (g, "loss")
    return out


def _feeds(g, seed):
    r = _rng(seed)
    return {k: (r.integers(0, 3, g.nodes[i].type.shape).astype(np.int32)
                if g.nodes[i].type.dtype == "i32" else
                r.standard_normal(g.nodes[i].type.shape).astype(np.float32))
            for k, i in g.inputs.items()}


@pytest.mark.parametrize("name", list(_graphs()))
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_an_input_is_never_written(cfg, name):
    g, loss = _graphs()[name]
    opt = jg.optim.SGD(lr=0.1) if loss else None
    prog = jg.compile(g, loss=loss, optimizer=opt, **cfg)
    check_plan(prog._products.kernels, prog._products.memory)
    params = {k: prog.params[k] for k in prog.params}
    ref = jg.training_graph(g, loss, opt) if opt else g
    for step in range(2):
        feeds = _feeds(g, step)
        before = {k: v.copy() for k, v in feeds.items()}
        got = prog.step(**feeds)
        for k in feeds:
            np.testing.assert_array_equal(feeds[k], before[k], err_msg=f"input {k} was written")
        extra = opt.runtime_inputs(step) if opt else {}
        want = interp.run(ref, {**before, **extra}, params)
        for k in got:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
        for k in prog.params:
            np.testing.assert_allclose(prog.params[k], params[k], rtol=1e-4, atol=1e-5)


def test_an_output_view_fed_back_as_an_input_is_copied_first():
    """With copy_outputs=False an output is a view of the program's buffer; fed back as an input
    it lies in memory the step writes, so it is converted first."""
    g = jg.Graph("rnn")
    h = g.input("h", (4, 4))
    w = g.param("w", (4, 4), init=jg.init.normal(0.0, 0.5))
    g.output(h2=jg.tanh(h @ w) + h)
    prog = jg.compile(g, copy_outputs=False)
    wv = prog.params["w"]
    hv = _f32((4, 4))
    for _ in range(3):
        want = np.tanh(hv @ wv) + hv
        hv = prog.step(h=hv)["h2"]
        np.testing.assert_allclose(hv, want, rtol=1e-5, atol=1e-6)
    assert "h" in prog._stage


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_outputs_that_are_inputs_params_or_shared(cfg):
    g = jg.Graph("odd_outputs")
    x = g.input("x", (2, 3))
    c = g.param("c", (2, 3), init=jg.init.normal(0.0, 1.0), trainable=False)
    t = jg.exp(x)
    g.output(same=x, flat=jg.reshape(x, (6,)), p=c, t1=t, t2=t, u=t + c)
    g.update(c=x)                              # a param takes an input: copied by address
    for copy in (True, False):
        prog = jg.compile(g, copy_outputs=copy, **cfg)
        xv = _f32((2, 3), 1)
        c0 = prog.params["c"]
        got = prog.step(x=xv)
        want = {"same": xv, "flat": xv.reshape(6), "p": c0, "t1": np.exp(xv), "t2": np.exp(xv),
                "u": np.exp(xv) + c0}
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=k)
        np.testing.assert_array_equal(prog.params["c"], xv)
        outs = {k: np.zeros(v.shape, np.float32) for k, v in want.items()}
        res = prog.step_into(outs, x=-xv)
        want = {"same": -xv, "flat": -xv.reshape(6), "p": xv, "t1": np.exp(-xv),
                "t2": np.exp(-xv), "u": np.exp(-xv) + xv}
        for k, v in want.items():
            assert res[k] is outs[k]
            np.testing.assert_allclose(outs[k], v, rtol=1e-6, err_msg=k)
        np.testing.assert_array_equal(prog.params["c"], -xv)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_checks_and_the_evaluator_read_the_callers_arrays(cfg):
    g = jg.Graph("clf")
    x, y = g.input("x", (4, 5)), g.input("y", (4,), "i32")
    w = g.param("w", (5, 3), init=jg.init.normal(0.0, 0.5))
    logits = x @ w
    g.output(loss=jg.cross_entropy(logits, y), logits=logits)
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1), check_finite=True, **cfg)
    xv, yv = _f32((4, 5)), np.array([0, 1, 2, 1], np.int32)
    prog.step(x=xv, y=yv)
    w1 = prog.params["w"]
    bad = yv.copy()
    bad[2] = 3
    with pytest.raises(IndexError, match=r"input y\[2\] = 3 is out of range \[0, 3\)"):
        prog.step(x=xv, y=bad)
    with pytest.raises(IndexError, match=r"input y\[0\] = -1"):
        prog.step(x=xv, y=np.array([-1, 0, 0, 0], np.int64))       # converted, then checked
    nan = xv.copy()
    nan[0, 0] = np.nan
    with pytest.raises(FloatingPointError):
        prog.step(x=nan, y=yv)
    np.testing.assert_array_equal(prog.params["w"], w1)
    ev = prog.evaluator()
    np.testing.assert_allclose(ev.run(x=xv)["logits"], xv @ w1, rtol=1e-5, atol=1e-6)
    z = np.zeros((4, 3), np.float32)
    assert ev.run_into({"logits": z}, x=xv)["logits"] is z
    np.testing.assert_allclose(z, xv @ w1, rtol=1e-5, atol=1e-6)
    lossbuf = np.zeros((), np.float32)
    prog.step_into({"loss": lossbuf}, x=xv, y=yv)
    assert lossbuf[()] > 0
    np.testing.assert_allclose(ev.run(x=xv)["logits"], xv @ prog.params["w"], rtol=1e-5,
                               atol=1e-6)


def test_inputs_take_no_arena_bytes():
    g = jg.Graph("mlp")
    x, y = g.input("x", (100, 784)), g.input("y", (100,), "i32")
    w1 = g.param("w1", (784, 500), init=jg.init.he_normal())
    w2 = g.param("w2", (500, 10), init=jg.init.he_normal())
    g.output(loss=jg.cross_entropy(jg.relu(x @ w1) @ w2, y))
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-3))
    m = prog.stats()["memory"]
    assert m["input_bytes"] == 100 * 784 * 4 + 100 * 4 + 4 + 4      # x, y, opt/lr, opt/step
    assert m["arena_bytes"] < 100 * 784 * 4 + 2 * 100 * 500 * 4 + 20000   # x is not in it
    assert "input#0@0 +313600" in prog.ir("memory")


# ---- random graphs against the interpreter, outputs into the caller's arrays ---------------------
class _Checked:
    """A program whose steps check that no input changed, alternating `step` and `step_into`
    (outputs into fresh NaN-filled arrays of the caller) on inputs fed as given."""

    def __init__(self, prog):
        self.prog, self.params, self.state, self.n = prog, prog.params, prog.state, 0
        self.shapes = None

    def step(self, **feeds):
        before = {k: np.array(v, copy=True) for k, v in feeds.items()}
        if self.shapes is None or self.n % 2 == 0:
            got = self.prog.step(**feeds)
        else:
            outs = {k: np.full(s, np.nan, d) for k, (s, d) in self.shapes.items()}
            got = self.prog.step_into(outs, **feeds)
            assert all(got[k] is outs[k] for k in outs)
        self.shapes = {k: (v.shape, v.dtype) for k, v in got.items()}
        self.n += 1
        for k, v in feeds.items():
            if not np.array_equal(np.asarray(v), before[k], equal_nan=True):
                raise AssertionError(f"input {k} was written by the step")
        return got


def test_random_graphs_never_write_their_inputs():
    cases, i = [], 0
    while len(cases) < 6:
        c = fuzz.case_at(16, i)
        i += 1
        if c is not None:
            cases.append(c)
    for c in cases:
        runner.check_case(c, steps=3, grad_check=False, raise_on_fail=True,
                      compile_fn=lambda case, fuse, plan: _Checked(runner._compile(case, fuse, plan)))

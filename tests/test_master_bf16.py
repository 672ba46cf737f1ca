"""bf16 master weights (Adam/SGD(master="bf16"), --master bf16): the stochastic rounding op
sround_bf16 against its numpy reference and against its definition (one of the two
neighbouring bf16 values, unbiased), the update against a numpy SGD that rounds so, training
that follows f32, half the params' bytes, and a resumed run equal to an unbroken one."""
import zlib

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp
from jitgraph.half import to_f32
from jitgraph.ops.update import sround_bf16_bits

EPS = 2.0 ** -8


def _sround_graph(n):
    g = jg.Graph("sround")
    x, t = g.input("x", (n,)), g.input("t", ())
    g.output(r=jg.ops.apply("sround_bf16", x, t, seed=5, salt=11))
    return g


def _neighbours(x):
    """The bf16 bits of the two bf16 values around float32 x: toward zero and away from it."""
    b = x.view(np.uint32)
    lo = (b >> 16).astype(np.uint32)
    return lo.astype(np.uint16), (lo + 1).astype(np.uint16)


def test_sround_is_one_of_the_two_neighbours_and_matches_its_reference():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4000) * 10.0 ** rng.uniform(-40, 38, 4000)).astype(np.float32)
    x[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.5, -2.0, 3.0e-41]   # exact, special, subnormal
    g = _sround_graph(x.size)
    prog = jg.compile(g)
    for t in (1, 2, 1000):
        got = prog.step(x=x, t=np.float32(t))["r"]
        assert got.dtype == np.uint16
        np.testing.assert_array_equal(got, sround_bf16_bits(x, t, 5, 11))
        ref = interp.run(g, {"x": x, "t": np.float32(t)})["r"]
        np.testing.assert_array_equal(got, ref)
        lo, hi = _neighbours(x)
        fin = np.isfinite(x)
        assert np.all((got[fin] == lo[fin]) | (got[fin] == hi[fin]))
        exact = fin & (x.view(np.uint32) & 0xFFFF == 0)
        np.testing.assert_array_equal(got[exact], lo[exact])       # a bf16 value stays itself
        v = to_f32(got, "bf16")
        assert v[2] == np.inf and v[3] == -np.inf and np.isnan(v[4])
    # the steps draw different bits
    a, b = (prog.step(x=x, t=np.float32(t))["r"] for t in (3, 4))
    assert np.mean(a != b) > 0.2


@pytest.mark.parametrize("v", [1.0 + 0.3 * 2.0 ** -7, -3.0e-5 * (1 + 0.81 * 2.0 ** -7)])
def test_sround_is_unbiased(v):
    """A value rounded many times (over elements, and over steps) averages to itself: up with
    probability (its distance from the lower neighbour) / (their spacing)."""
    x32 = np.float32(v)
    lo, hi = (float(to_f32(b, "bf16")[0]) for b in _neighbours(np.array([x32])))
    p = (float(x32) - lo) / (hi - lo)
    n = 200_000
    prog = jg.compile(_sround_graph(n))
    got = to_f32(prog.step(x=np.full(n, x32), t=np.float32(9))["r"], "bf16").astype(np.float64)
    assert set(np.unique(got)) == {lo, hi}
    sigma = abs(hi - lo) * np.sqrt(p * (1 - p) / n)
    assert abs(got.mean() - float(x32)) < 5 * sigma
    small = jg.compile(_sround_graph(4))                  # one element, many steps
    ups = [small.step(x=np.full(4, x32), t=np.float32(t))["r"][0] == _neighbours(
        np.array([x32]))[1][0] for t in range(1, 3001)]
    assert abs(np.mean(ups) - p) < 5 * np.sqrt(p * (1 - p) / 3000)


def test_master_bf16_sgd_matches_a_numpy_sgd_that_rounds_stochastically():
    """loss = sum(w * g) has gradient g exactly: SGD with master="bf16" stores w as bf16 bits,
    and each step's bits are those of numpy's f32 w - lr * g rounded by the reference
    rounding with the param's salt (crc32 of its name) and the step t."""
    shape = (6, 50)
    g = jg.Graph("lin")
    gin = g.input("g", shape)
    w = g.param("w", shape, init=jg.init.normal(0.0, 1.0))
    g.output(loss=jg.sum(w * gin))
    opt = jg.optim.SGD(lr=0.01, master="bf16", seed=4)
    prog = jg.compile(g, loss="loss", optimizer=opt)
    bits = prog.params["w"]
    assert bits.dtype == np.uint16
    rng = np.random.default_rng(1)
    for t in range(1, 7):
        grad = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 0, shape)).astype(np.float32)
        prog.step(g=grad)
        new = to_f32(bits, "bf16") - np.float32(0.01) * grad
        bits = sround_bf16_bits(new, t, 4, zlib.crc32(b"w"))
        np.testing.assert_array_equal(prog.params["w"], bits, err_msg=f"step {t}")


def test_master_bf16_trains_as_f32_with_half_the_param_bytes(mlp, mlp_data):
    g, (x, y) = mlp, mlp_data
    res = {}
    for master in ("f32", "bf16"):
        prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=0.01, master=master))
        losses = [float(prog.step(x=x, y=y)["loss"]) for _ in range(30)]
        ev = float(prog.evaluator().run(x=x, y=y)["loss"])
        res[master] = (losses, sum(prog.params.view(k).nbytes for k in prog.params),
                       prog.stats()["persistent_bytes"], ev,
                       sum(prog.state.view(k).nbytes for k in prog.state))
    (la, pa, sa, ea, ma), (lb, pb, sb, eb, mb) = res["f32"], res["bf16"]
    assert pb * 2 == pa and ma == mb                  # the params halve, AdamW's state stays
    assert sb - mb <= (sa - ma) // 2 + 256            # the persistent region: params + state
    assert lb[-1] < 0.5 * lb[0]                       # it learns
    assert not np.array_equal(la, lb)
    # the weights differ by bf16 roundings (relative 2^-8 each, unbiased): losses follow
    np.testing.assert_allclose(lb, la, rtol=16 * EPS, atol=0)
    # the evaluator reads the bf16 weights (its loss: that of the next step's forward)
    assert np.isfinite(eb) and abs(eb - lb[-1]) < 0.1 * lb[-1]
    with pytest.raises(ValueError, match="master must be 'f32' or 'bf16'"):
        jg.optim.SGD(lr=0.1, master="f16")


def test_master_bf16_resumes_bit_for_bit(mlp, mlp_data):
    """Three steps, params and state copied into a fresh program at call 3, three more: the
    bits of six unbroken steps (the rounding's randomness is (seed, step), nothing else)."""
    g, (x, y) = mlp, mlp_data
    opt = jg.optim.AdamW(lr=0.01, master="bf16", seed=2, accumulate=2)

    def run(prog, calls):
        for c in calls:
            prog.step(x=np.roll(x, c, 0), y=np.roll(y, c, 0))
    a = jg.compile(g, loss="loss", optimizer=opt)
    run(a, range(8))
    b = jg.compile(g, loss="loss", optimizer=opt)
    run(b, range(4))
    c = jg.compile(g, loss="loss", optimizer=opt, seed=99)
    for k in b.params:
        c.params[k] = to_f32(b.params[k], "bf16")     # f32 values round back to the same bits
    for k in b.state:
        c.state[k] = b.state[k]
    c.calls = b.calls
    run(c, range(4, 8))
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], c.params[k], err_msg=k)
    for k in a.state:
        np.testing.assert_array_equal(a.state[k], c.state[k], err_msg=k)
    assert not np.array_equal(a.params["w1"], b.params["w1"])
    # bf16 bits (what a checkpoint gives back) are taken as bits, and only by a bf16 slot
    c.params["w1"] = a.params["w1"].view(np.int16)
    np.testing.assert_array_equal(c.params["w1"], a.params["w1"])
    f32 = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=0.01))
    with pytest.raises(jg.ShapeError, match=r"param w1: expected float32\[20,48\], got "
                                            r"uint16\[20,48\] \(bf16 bits"):
        f32.params["w1"] = a.params["w1"]

"""Dynamic loss scaling (jg.compile(loss_scale=), jitgraph.optim.LossScale) and the finite-step
guard's "skip" mode: a power-of-two scale changes no f32 bit; an f16 step that overflows is
skipped (params and state bit for bit as before), halves the scale and is counted; clean steps
double it; f16 training with it follows f32 within f16's rounding."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph.optim import LOSS_SCALE, LossScale, Scaler

EPS = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11}


def _snapshot(prog):
    return {**{k: prog.params[k] for k in prog.params}, **{k: prog.state[k] for k in prog.state}}


def test_scaler_follows_gradscaler_rules():
    s = Scaler(LossScale(init=8.0, interval=3))
    seq = []
    for finite in (True, True, False, True, True, True, True, False, False):
        s.update(finite)
        seq.append(s.scale)
    assert seq == [8, 8, 4, 4, 4, 8, 8, 4, 2]
    s.update(True, applied=False)          # an accumulation micro-step does not count
    assert s.good == 0
    r = Scaler(LossScale())
    r.load(s.state())
    assert r.state() == s.state()
    tiny = Scaler(LossScale(init=1.0, min_scale=0.25))
    tiny.update(False)
    tiny.update(False)
    with pytest.raises(FloatingPointError, match="no loss scale removes"):
        tiny.update(False)
    with pytest.raises(ValueError, match="interval must be an int >= 1"):
        LossScale(interval=0)


def test_power_of_two_scale_changes_no_f32_bit(mlp, mlp_data):
    """In f32 a scale of 2**k multiplies every gradient exactly and 1/S undoes it exactly: the
    params after a few steps are bitwise those without scaling."""
    g, (x, y) = mlp, mlp_data
    runs = {}
    for ls in (False, LossScale(init=2.0 ** 12, interval=2)):
        prog = jg.compile(g, loss="loss", optimizer=jg.optim.Adam(lr=0.01), loss_scale=ls)
        losses = [float(prog.step(x=x, y=y)["loss"]) for _ in range(6)]
        runs[ls is not False] = (losses, _snapshot(prog), prog)
    assert runs[True][2].scaler.scale == 2.0 ** 15      # doubled after every 2 clean steps
    assert runs[False][2].scaler is None and LOSS_SCALE in runs[True][2].graph.inputs
    assert runs[True][0] == runs[False][0]
    for k, v in runs[False][1].items():
        np.testing.assert_array_equal(runs[True][1][k], v, err_msg=k)


def test_f16_overflow_is_skipped_then_trains_as_f32(mlp, mlp_data):
    """precision="f16" with an initial scale so large that the f16 gradients overflow: each
    such step changes no param or moment bit, halves S and counts; then the steps apply, and
    the losses of the applied steps follow the f32 run's within f16 roundings."""
    g, (x, y) = mlp, mlp_data
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.Adam(lr=0.01), precision="f16",
                      loss_scale=LossScale(init=2.0 ** 24, interval=4))
    assert prog.check_finite == "skip" and prog.scaler.scale == 2.0 ** 24
    applied, skips, scales = [], [], []
    for i in range(30):
        before, calls = _snapshot(prog), prog.calls
        loss = float(prog.step(x=x, y=y)["loss"])
        skips.append(prog.last_skipped)
        scales.append(prog.scaler.scale)
        if prog.last_skipped:
            assert prog.calls == calls
            after = _snapshot(prog)
            for k, v in before.items():
                np.testing.assert_array_equal(after[k], v, err_msg=f"step {i}: {k}")
        else:
            assert prog.calls == calls + 1
            applied.append(loss)
    assert skips[0] and prog.skipped == sum(skips) and len(applied) >= 15
    # GradScaler's rule over the observed steps: halve on a skip, double after 4 clean ones
    s, good, want_scales = 2.0 ** 24, 0, []
    for skipped in skips:
        if skipped:
            s, good = s / 2, 0
        else:
            good += 1
            if good == 4:
                s, good = s * 2, 0
        want_scales.append(s)
    assert scales == want_scales and max(scales[sum(skips):]) > min(scales)    # it grew again
    ref = jg.compile(g, loss="loss", optimizer=jg.optim.Adam(lr=0.01))
    want = [float(ref.step(x=x, y=y)["loss"]) for _ in range(len(applied))]
    assert applied[-1] < 0.6 * applied[0]
    np.testing.assert_allclose(applied, want, rtol=16 * EPS["f16"], atol=0)


def test_f16_scaling_is_on_by_default_and_off_on_request(mlp):
    g = mlp
    on = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1), precision="f16")
    assert on.scaler is not None and on.scaler.scale == 2.0 ** 16
    assert "opt/loss_scale" in on.ir("autodiff") and "opt/loss_scale" in on.ir("optimizer")
    off = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1), precision="f16",
                     loss_scale=False)
    assert off.scaler is None and not off.check_finite
    assert jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1),
                      precision="bf16").scaler is None
    with pytest.raises(ValueError, match="check_finite=True would raise"):
        jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1), precision="f16",
                   check_finite=True)
    with pytest.raises(ValueError, match="loss_scale needs an optimizer"):
        jg.compile(g, loss="loss", loss_scale=True)
    with pytest.raises(ValueError, match="check_finite='maybe'"):
        jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1), check_finite="maybe")


def test_skip_mode_counts_a_nan_batch_and_goes_on(mlp, mlp_data):
    g, (x, y) = mlp, mlp_data
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1), check_finite="skip")
    prog.step(x=x, y=y)
    before = _snapshot(prog)
    bad = x.copy()
    bad[3, 4] = np.nan
    prog.step(x=bad, y=y)                    # no FloatingPointError
    assert prog.last_skipped and prog.skipped == 1 and prog.calls == 1
    for k, v in before.items():
        np.testing.assert_array_equal(prog.params[k] if k in prog.params else prog.state[k], v)
    prog.step(x=x, y=y)
    assert not prog.last_skipped and prog.calls == 2
    # the evaluator of a skipping program runs plain forwards
    assert np.isnan(prog.evaluator().run(x=bad, y=y)["loss"])


# ---- AdamW's moments stored in bf16 (Adam(moments="bf16"), --moments bf16) -------------------
def test_bf16_moments_match_a_numpy_adamw_that_rounds_them():
    """loss = sum(w * g) has gradient g exactly (an input, new each step): the compiled AdamW
    with moments="bf16" keeps m and v as bf16 bits and gives the params of a numpy AdamW that
    computes in f32 and rounds m and v to bf16 after each step (jitgraph.half.round_to, itself
    checked against numpy's bits), and not those of one that does not round."""
    from jitgraph.half import round_to, to_f32
    shape = (6, 50)
    g = jg.Graph("lin")
    gin = g.input("g", shape)
    w = g.param("w", shape, init=jg.init.normal(0.0, 1.0))
    g.output(loss=jg.sum(w * gin))
    opt = jg.optim.AdamW(lr=0.01, weight_decay=0.1, moments="bf16")
    prog = jg.compile(g, loss="loss", optimizer=opt)
    assert prog.state.view("opt/m/w").dtype == np.uint16
    f = np.float32
    p = p_exact = prog.params["w"].astype(f)
    m = v = m_exact = v_exact = np.zeros(shape, f)
    rng = np.random.default_rng(1)
    for t in range(1, 9):
        grad = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 1, shape)).astype(f)
        prog.step(g=grad)
        c1, c2 = f(1 / (1 - f(0.9) ** t)), f(1 / (1 - f(0.999) ** t))

        def adamw(p, m, v):
            m = f(0.9) * m + f(0.1) * grad
            v = f(0.999) * v + f(0.001) * grad * grad
            return p * f(1 - 0.01 * 0.1) - f(0.01) * (m * c1) / (np.sqrt(v * c2) + f(1e-8)), m, v
        p, m, v = adamw(p, m, v)
        m, v = to_f32(round_to(m, "bf16"), "bf16"), to_f32(round_to(v, "bf16"), "bf16")
        p_exact, m_exact, v_exact = adamw(p_exact, m_exact, v_exact)
    got_m, got_v = (to_f32(prog.state[k], "bf16") for k in ("opt/m/w", "opt/v/w"))
    # one bf16 unit: an f32 result one ulp off the reference's may round the other way
    np.testing.assert_allclose(got_m, m, rtol=2 * EPS["bf16"], atol=0)
    np.testing.assert_allclose(got_v, v, rtol=2 * EPS["bf16"], atol=0)
    assert np.mean(got_v == v) > 0.95
    # the params: where the moments agree, to f32's rounding; a moment one bf16 unit off
    # moves its param by at most lr * 2 units of each step's update
    w = prog.params["w"]
    assert np.isclose(w, p, rtol=1e-5, atol=1e-6).mean() > 0.95
    np.testing.assert_allclose(w, p, rtol=0, atol=8 * 0.01 * 2 * EPS["bf16"])
    assert np.isclose(w, p_exact, rtol=1e-5, atol=1e-6).mean() < 0.5     # the rounding shows


def test_bf16_moments_halve_the_state_and_train_as_f32(mlp, mlp_data):
    g, (x, y) = mlp, mlp_data
    res = {}
    for md in ("f32", "bf16"):
        prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=0.01, moments=md))
        res[md] = ([float(prog.step(x=x, y=y)["loss"]) for _ in range(20)],
                   sum(prog.state.view(k).nbytes for k in prog.state))
    assert res["bf16"][1] * 2 == res["f32"][1]
    assert not np.array_equal(res["bf16"][0], res["f32"][0])
    np.testing.assert_allclose(res["bf16"][0], res["f32"][0], rtol=4 * EPS["bf16"], atol=0)
    with pytest.raises(ValueError, match="moments must be 'f32' or 'bf16'"):
        jg.optim.AdamW(moments="f16")

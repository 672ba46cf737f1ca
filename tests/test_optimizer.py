"""Optimizer pass and training_graph: updates against hand-written numpy formulas."""
import dataclasses
import math
import pickle

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp, optim
from jitgraph.passes.autodiff import grad
from jitgraph.passes.optimizer import apply_optimizer

N, D, K = 6, 3, 4


def linear_graph(n=N, dtype="f32"):
    """loss = mean((x @ w + b - t)^2): gradients have a closed form."""
    g = jg.Graph("linear")
    x, t = g.input("x", (n, D), dtype), g.input("t", (n, K), dtype)
    w = g.param("w", (D, K), dtype, init=jg.init.normal())
    b = g.param("b", (K,), dtype, init=jg.init.normal())
    g.output(loss=jg.mean(jg.sqr(x @ w + b - t)))
    return g


def closed_form_grads(p, x, t):
    r = 2 * (x @ p["w"] + p["b"] - t) / t.size
    return {"w": x.T @ r, "b": r.sum(0)}


def data(seed=0, n=N):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, D)), rng.standard_normal((n, K))


def ref_step(opt, p, state, gr, t):
    """One optimizer step in float64, written from the formulas (PyTorch / ggml)."""
    if opt.clip_norm is not None:
        norm = np.sqrt(sum(np.sum(v * v) for v in gr.values()))
        gr = {k: v * min(1.0, opt.clip_norm / (norm + 1e-6)) for k, v in gr.items()}
    lr = opt.lr_at(t)
    out = {}
    for k in p:
        gk = gr[k]
        if isinstance(opt, optim.SGD):
            d = gk + opt.weight_decay * p[k]
            if opt.momentum:
                state[("m", k)] = opt.momentum * state.get(("m", k), 0.0) + d
                d = state[("m", k)]
            out[k] = p[k] - lr * d
            continue
        if not opt.decoupled:
            gk = gk + opt.weight_decay * p[k]
        m = state[("m", k)] = opt.beta1 * state.get(("m", k), 0.0) + (1 - opt.beta1) * gk
        v = state[("v", k)] = opt.beta2 * state.get(("v", k), 0.0) + (1 - opt.beta2) * gk * gk
        mh, vh = m / (1 - opt.beta1 ** t), v / (1 - opt.beta2 ** t)
        decay = 1 - lr * opt.weight_decay if opt.decoupled else 1.0
        out[k] = p[k] * decay - lr * mh / (np.sqrt(vh) + opt.eps)
    return out


OPTIMIZERS = [
    optim.SGD(0.125),
    optim.SGD(0.125, momentum=0.9, weight_decay=0.0625),
    optim.Adam(0.0625, weight_decay=0.125),
    optim.Adam(0.0625, beta1=0.0),
    optim.Adam(lambda t: 0.05 / t, beta1=0.5, beta2=0.75, eps=1e-3),
    optim.AdamW(0.0625, weight_decay=0.25),
    optim.SGD(0.5, momentum=0.5, clip_norm=0.1),
    optim.AdamW(0.0625, clip_norm=0.05),
]


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("opt", OPTIMIZERS,
                         ids=[f"{type(o).__name__}{i}" for i, o in enumerate(OPTIMIZERS)])
def test_two_steps_match_formulas(opt, dtype):
    g = linear_graph(dtype=dtype)
    tg = jg.training_graph(g, optimizer=opt)
    state = tg.init_params(seed=3)
    p = {k: state[k].astype(np.float64) for k in ("w", "b")}
    ref_state = {}
    for call in range(2):
        x, t = data(call)
        out = interp.run(tg, {"x": x, "t": t, **opt.runtime_inputs(call)}, state)
        assert np.isclose(out["loss"], np.mean((x @ p["w"] + p["b"] - t) ** 2), rtol=1e-5)
        p = ref_step(opt, p, ref_state, closed_form_grads(p, x, t), call + 1)
        for k in p:
            np.testing.assert_allclose(state[k], p[k], rtol=2e-5, atol=1e-6, err_msg=k)
            assert state[k].dtype == np.dtype(jg.types.DTYPES[dtype])
        for (slot, k), v in ref_state.items():
            np.testing.assert_allclose(state[f"opt/{slot}/{k}"], v, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("op, attrs, args", [
    ("ema", {"beta": 0.75}, (0.5, -2.0)),
    ("ema_sq", {"beta": 0.875}, (0.25, -3.0)),
    ("adam_step", {"eps": 1e-3, "wd": 0.5}, (1.5, -0.25, 0.0625, 0.125, 2.0, 4.0)),
])
def test_update_ops_reference_and_kernel_expression(op, attrs, args):
    """The fused update ops: numpy reference (f32 and f64) and the codegen expression agree
    with the formula written out here."""
    b = attrs.get("beta")
    expect = {"ema": lambda o, x: b * o + (1 - b) * x,
              "ema_sq": lambda o, x: b * o + (1 - b) * x * x,
              "adam_step": lambda p, m, v, lr, c1, c2:
                  p * (1 - lr * attrs["wd"]) - lr * (m * c1) / (math.sqrt(v * c2) + attrs["eps"]),
              }[op](*args)
    d = jg.ops.get_op(op)
    assert d.vjp is None
    for dt in (np.float32, np.float64):
        got = d.ref(attrs, *[np.full((2, 3), a, dt) for a in args])
        assert got.dtype == dt and got.shape == (2, 3)
        np.testing.assert_allclose(got, expect, rtol=1e-6 if dt == np.float32 else 1e-14)
    lits = {k: repr(float(v)) for k, v in attrs.items()}
    assert eval(d.expr.format(*map(repr, args), **lits), {"math": math}) == \
        pytest.approx(expect, rel=1e-14)                                     # noqa: S307


def test_clipping_bounds_the_update_norm():
    opt = optim.SGD(1.0, clip_norm=0.01)
    tg = jg.training_graph(linear_graph(), optimizer=opt)
    state = tg.init_params()
    before = {k: state[k].copy() for k in ("w", "b")}
    x, t = data()
    interp.run(tg, {"x": x, "t": t, **opt.runtime_inputs(0)}, state)
    step = np.sqrt(sum(np.sum((state[k] - before[k]) ** 2) for k in before))
    assert step == pytest.approx(0.01, rel=1e-4)


def test_clipping_leaves_small_gradients_alone():
    opt, plain = optim.SGD(0.5, clip_norm=1e6), optim.SGD(0.5)
    x, t = data()
    results = []
    for o in (opt, plain):
        tg = jg.training_graph(linear_graph(), optimizer=o)
        state = tg.init_params()
        interp.run(tg, {"x": x, "t": t, **o.runtime_inputs(0)}, state)
        results.append(state["w"])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)


@pytest.mark.parametrize("opt", [optim.AdamW(0.05, clip_norm=0.5), optim.SGD(0.25, momentum=0.9)],
                         ids=["adamw_clip", "sgd_momentum"])
def test_accumulation_equals_one_step_on_the_concatenated_batch(opt):
    k, b = 3, 4
    micro = dataclasses.replace(opt, accumulate=k)
    big = jg.training_graph(linear_graph(k * b), optimizer=opt)
    small = jg.training_graph(linear_graph(b), optimizer=micro)
    s_big, s_small = big.init_params(), small.init_params()
    for step in range(2):                     # two applied steps: accumulators must reset
        x, t = data(step, k * b)
        out_big = interp.run(big, {"x": x, "t": t, **opt.runtime_inputs(step)}, s_big)
        losses = []
        for j in range(k):
            call = step * k + j
            frozen = {n: v.copy() for n, v in s_small.items() if not n.startswith("opt/acc/")}
            xs, ts = x[j * b:(j + 1) * b], t[j * b:(j + 1) * b]
            out = interp.run(small, {"x": xs, "t": ts, **micro.runtime_inputs(call)}, s_small)
            # the reported loss is the unscaled micro-batch loss
            assert out["loss"] == pytest.approx(
                np.mean((xs @ frozen["w"] + frozen["b"] - ts) ** 2), rel=1e-5)
            losses.append(out["loss"])
            if j < k - 1:                      # params and moments bit-identical
                for n, v in frozen.items():
                    assert np.array_equal(s_small[n], v), n
        assert np.mean(losses) == pytest.approx(out_big["loss"], rel=1e-5)
        for n in s_big:
            np.testing.assert_allclose(s_small[n], s_big[n], rtol=1e-5, atol=1e-7, err_msg=n)
        for n in s_small:
            if n.startswith("opt/acc/"):
                assert not s_small[n].any(), n


def test_runtime_inputs_contract():
    opt = optim.SGD(lambda t: 1.0 / t, accumulate=3)
    got = [opt.runtime_inputs(c) for c in range(7)]
    assert [float(r["opt/step"]) for r in got] == [1, 1, 1, 2, 2, 2, 3]
    assert [float(r["opt/apply"]) for r in got] == [0, 0, 1, 0, 0, 1, 0]
    assert [float(r["opt/lr"]) for r in got] == pytest.approx([1, 1, 1, .5, .5, .5, 1 / 3])
    for r in got:
        assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 and v.shape == ()
                   for v in r.values())
    assert set(optim.Adam().runtime_inputs(0)) == {"opt/lr", "opt/step"}
    tg = jg.training_graph(linear_graph(), optimizer=opt)
    assert {n for n in tg.inputs if n.startswith("opt/")} == {"opt/lr", "opt/step", "opt/apply"}
    for n in ("opt/lr", "opt/step", "opt/apply"):
        assert tg.nodes[tg.inputs[n]].type == jg.TensorType("f32", ())


def test_optimizer_objects_are_data():
    a = optim.AdamW(lr=3e-4, weight_decay=0.1)
    assert pickle.loads(pickle.dumps(a)) == a
    assert a.spec() == {"kind": "AdamW", "lr": 3e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                        "weight_decay": 0.1, "clip_norm": None, "accumulate": 1,
                        "moments": "f32", "master": "f32", "seed": 0}
    assert optim.AdamW().weight_decay == 0.01 and optim.Adam().weight_decay == 0.0
    with pytest.raises(AttributeError):
        a.lr = 1.0
    assert optim.SGD(lr=_halving).spec()["lr"] == "schedule:_halving"


def _halving(t):
    return 0.5 ** t


@pytest.mark.parametrize("make, msg", [
    (lambda: optim.SGD(-1.0), "lr"), (lambda: optim.SGD(0.1, momentum=1.0), "momentum"),
    (lambda: optim.Adam(beta2=1.5), "beta2"), (lambda: optim.Adam(eps=0.0), "eps"),
    (lambda: optim.AdamW(clip_norm=0.0), "clip_norm"),
    (lambda: optim.SGD(0.1, accumulate=0), "accumulate"),
    (lambda: optim.SGD(0.1, weight_decay=float("nan")), "weight_decay")])
def test_bad_hyperparameters_are_rejected(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


def test_bad_schedule_value_names_the_step():
    with pytest.raises(ValueError, match="step 2"):
        optim.SGD(lambda t: float("nan") if t == 2 else 0.1).runtime_inputs(1)


def test_state_params_names_and_init():
    g = linear_graph()
    tg = jg.training_graph(g, optimizer=optim.AdamW(accumulate=2))
    ps = tg.init_params(seed=5)
    expect = {"w", "b"} | {f"opt/{s}/{p}" for s in ("m", "v", "acc") for p in ("w", "b")}
    assert set(ps) == expect
    fresh = g.init_params(seed=5)
    for n in ("w", "b"):
        np.testing.assert_array_equal(ps[n], fresh[n])
        assert not ps[f"opt/m/{n}"].any() and ps[f"opt/m/{n}"].shape == fresh[n].shape
    assert set(tg.trainable_params()) == {"w", "b"}
    assert set(tg.updates) == expect
    assert not any(o.startswith("grad/") for o in tg.outputs)
    sgd = jg.training_graph(g, optimizer=optim.SGD(0.1)).init_params()
    assert set(sgd) == {"w", "b"}


def test_ir_shows_backward_and_update_nodes():
    tg = jg.training_graph(linear_graph(), optimizer=optim.AdamW())
    text = str(tg)
    w_update = tg.updates["w"]
    assert f"update w <- %{w_update}" in text
    assert "adam_step(w, " in text and "ema_sq(opt/v/w, " in text
    assert "matmul(x, " in text and "ta=True" in text        # dW = x^T @ dy


def test_report_and_errors():
    g = linear_graph()
    gg, _ = grad(g)
    tg, rep = apply_optimizer(gg, optim.SGD(0.1, momentum=0.9, accumulate=4))
    assert rep.stats["params"] == 2 and rep.stats["state_tensors"] == 4
    assert rep.stats["state_bytes"] == 2 * 4 * (D * K + K)
    assert "unscaled" in str(rep)
    with pytest.raises(jg.ShapeError, match="no grad/<param> outputs"):
        apply_optimizer(g, optim.SGD(0.1))
    with pytest.raises(jg.ShapeError, match="no output 'nope'"):
        apply_optimizer(gg, optim.SGD(0.1), loss="nope")
    with pytest.raises(ValueError, match="optimizer"):
        jg.training_graph(g)


def test_mixed_precision_params():
    g = jg.Graph("mixed")
    x = g.input("x", (4, 2), "f64")
    w = g.param("w", (2, 2), "f64", init=jg.init.normal())
    v = g.param("v", (2,), "f32", init=jg.init.normal())
    g.output(loss=jg.sum(jg.sqr(x @ w)) + jg.cast(jg.sum(jg.sqr(v)), "f64"))
    opt = optim.Adam(0.1, clip_norm=1.0)
    tg = jg.training_graph(g, optimizer=opt)
    ps = tg.init_params()
    for c in range(3):
        interp.run(tg, {"x": np.ones((4, 2)), **opt.runtime_inputs(c)}, ps)
    assert ps["w"].dtype == np.float64 and ps["v"].dtype == np.float32


def cls_graph(n, d, k, h=16):
    g = jg.Graph("mlp")
    x, y = g.input("x", (n, d)), g.input("y", (n,), "i32")
    w1 = g.param("w1", (d, h), init=jg.init.he_uniform())
    b1 = g.param("b1", (h,))
    w2 = g.param("w2", (h, k), init=jg.init.he_uniform())
    logits = jg.relu(x @ w1 + b1) @ w2
    g.output(loss=jg.cross_entropy(logits, y))
    return g


@pytest.mark.parametrize("opt", [optim.AdamW(0.02), optim.SGD(0.2, momentum=0.9)],
                         ids=["adamw", "sgd"])
def test_training_an_mlp_reduces_the_loss(opt):
    n, d, k = 64, 8, 3
    rng = np.random.default_rng(1)
    centers = 2 * rng.standard_normal((k, d))
    labels = rng.integers(0, k, n)
    x = centers[labels] + 0.5 * rng.standard_normal((n, d))
    y = labels.astype(np.int32)
    tg = jg.training_graph(cls_graph(n, d, k), optimizer=opt)
    state = tg.init_params()
    losses = [float(interp.run(tg, {"x": x, "y": y, **opt.runtime_inputs(c)}, state)["loss"])
              for c in range(60)]
    assert losses[0] > 0.5
    assert losses[-1] < 0.2 * losses[0]

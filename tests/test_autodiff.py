"""The autodiff pass: accumulation, what gets gradients, reports and errors."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp
from jitgraph.passes.autodiff import grad
from jitgraph.testing import check_grad

RNG = np.random.default_rng(0)


def run_grads(g, feeds, params, **kw):
    gg, rep = grad(g, **kw)
    return interp.run(gg, feeds, params), gg, rep


def test_value_used_several_times_accumulates():
    # loss = sum(h*h) + sum(h) + sum(w*w*w), h = tanh(x @ w): w and h each have several users
    g = jg.Graph("multi")
    x = g.input("x", (5, 3), "f64")
    w = g.param("w", (3, 3), "f64")
    h = jg.tanh(x @ w)
    g.output(loss=jg.sum(h * h) + jg.sum(h) + jg.sum(w * w * w))
    xv, wv = RNG.standard_normal((5, 3)), RNG.standard_normal((3, 3))
    out, _, _ = run_grads(g, {"x": xv}, {"w": wv})
    hv = np.tanh(xv @ wv)
    expect = xv.T @ ((2 * hv + 1) * (1 - hv ** 2)) + 3 * wv ** 2
    np.testing.assert_allclose(out["grad/w"], expect, rtol=1e-12)


def test_gradient_wrt_chosen_inputs():
    g = jg.Graph("lin")
    x = g.input("x", (4, 3), "f64")
    w = g.param("w", (3, 2), "f64")
    g.output(loss=jg.sum(jg.sqr(x @ w)))
    xv, wv = RNG.standard_normal((4, 3)), RNG.standard_normal((3, 2))
    out, gg, _ = run_grads(g, {"x": xv}, {"w": wv}, inputs=["x"])
    np.testing.assert_allclose(out["grad/x"], 2 * (xv @ wv) @ wv.T, rtol=1e-12)
    np.testing.assert_allclose(out["grad/w"], 2 * xv.T @ (xv @ wv), rtol=1e-12)
    out, gg, _ = run_grads(g, {"x": xv}, {"w": wv}, wrt=[], inputs=["x"])
    assert [k for k in gg.outputs if k.startswith("grad/")] == ["grad/x"]


def test_integer_values_get_no_gradient():
    g = jg.Graph("ints")
    x = g.input("x", (4, 3))
    y = g.input("y", (4, 3), "i32")
    w = g.param("w", (3,))
    g.output(loss=jg.sum(x * w * jg.cast(y, "f32")))
    xv, yv, wv = RNG.standard_normal((4, 3)), RNG.integers(-3, 3, (4, 3)), RNG.standard_normal(3)
    out, gg, _ = run_grads(g, {"x": xv, "y": yv}, {"w": wv})
    assert set(k for k in gg.outputs if k.startswith("grad/")) == {"grad/w"}
    np.testing.assert_allclose(out["grad/w"], (xv * yv).sum(0), rtol=1e-5)
    with pytest.raises(jg.ShapeError, match="input 'y' is not float"):
        grad(g, inputs=["y"])
    h = jg.Graph("intparam")
    k = h.param("k", (3,), "i32", trainable=False)
    v = h.param("v", (3,))
    h.output(loss=jg.sum(v * jg.cast(k, "f32")))
    with pytest.raises(jg.ShapeError, match="param 'k' is not float"):
        grad(h, wrt=["k"])


def test_non_differentiable_path_gives_zero_gradient():
    g = jg.Graph("argmax")
    x = g.input("x", (6, 4))
    y = g.input("y", (6,), "i32")
    w = g.param("w", (4, 4))
    v = g.param("v", (4, 4))
    correct = jg.count_equal(jg.argmax(x @ v, axis=-1), y)
    g.output(loss=jg.mean(x @ w) + jg.cast(correct, "f32"))
    xv, yv = RNG.standard_normal((6, 4)), RNG.integers(0, 4, 6)
    out, _, _ = run_grads(g, {"x": xv, "y": yv}, {"w": RNG.standard_normal((4, 4)),
                                                  "v": RNG.standard_normal((4, 4))})
    assert not out["grad/v"].any()
    np.testing.assert_allclose(out["grad/w"], np.repeat(xv.sum(0)[:, None] / 24, 4, 1), rtol=1e-5)


def test_unused_param_gets_zero_gradient_and_a_report_line():
    g = jg.Graph("unused")
    x = g.input("x", (2, 3))
    w = g.param("w", (3,))
    g.param("u", (5, 2))
    g.param("frozen", (3,), trainable=False)
    g.output(loss=jg.sum(x * w))
    out, gg, rep = run_grads(g, {"x": np.ones((2, 3))}, {"w": np.ones(3), "u": np.ones((5, 2)),
                                                        "frozen": np.ones(3)})
    assert out["grad/u"].shape == (5, 2) and not out["grad/u"].any()
    assert "grad/frozen" not in gg.outputs
    assert any("u" in line and "zero" in line for line in rep.lines)
    assert rep.stats["grads"] == 2 and rep.stats["forward_nodes"] == len(g.nodes)
    assert rep.stats["backward_nodes"] == len(gg.nodes) - len(g.nodes) > 0


def test_forward_outputs_and_values_are_kept():
    g = jg.Graph("keep")
    x = g.input("x", (3,))
    w = g.param("w", (3,))
    g.output(loss=jg.sum(jg.exp(x * w)), pred=x * w)
    gg, _ = grad(g)
    assert gg.outputs["loss"] == g.outputs["loss"] and gg.outputs["pred"] == g.outputs["pred"]
    assert gg.nodes[: len(g.nodes)] == g.nodes
    assert "grad/w" in gg.outputs
    assert jg.grad(g).outputs == gg.outputs          # the public wrapper returns the graph


@pytest.mark.parametrize("build, msg", [
    (lambda g, t: g.output(out=t), "no output 'loss'"),
    (lambda g, t: g.output(loss=t), "must be a float scalar"),
    (lambda g, t: g.output(loss=jg.argmax(jg.sum(t, axis=0), axis=0)), "must be a float scalar"),
])
def test_bad_loss_is_rejected(build, msg):
    g = jg.Graph("bad")
    w = g.param("w", (3, 2))
    build(g, w * 2.0)
    with pytest.raises(jg.ShapeError, match=msg):
        grad(g)


def test_unknown_names_are_rejected():
    g = jg.Graph("names")
    w = g.param("w", (3,))
    g.output(loss=jg.sum(w))
    with pytest.raises(jg.ShapeError, match="'q' is not a param"):
        grad(g, wrt=["q"])
    with pytest.raises(jg.ShapeError, match="'q' is not an input"):
        grad(g, inputs=["q"])


def test_mlp_gradients_match_finite_differences():
    g = jg.Graph("mlp")
    x = g.input("x", (5, 4))
    t = g.input("t", (5, 3))
    w1 = g.param("w1", (4, 6))
    b1 = g.param("b1", (6,))
    w2 = g.param("w2", (6, 3))
    logits = jg.tanh(x @ w1 + b1) @ w2
    g.output(loss=jg.mean(jg.logsumexp(logits, axis=-1) - jg.sum(logits * t, axis=-1)))
    params = {"w1": RNG.standard_normal((4, 6)), "b1": RNG.standard_normal(6),
              "w2": RNG.standard_normal((6, 3))}
    res = check_grad(g, {"x": RNG.standard_normal((5, 4)), "t": np.eye(3)[[0, 1, 2, 1, 0]]},
                     params, loss="loss", wrt_inputs=("x",))
    assert set(res.errors) == {"w1", "b1", "w2", "x"}
    assert all(checked > 0 for _, _, checked, _ in res.errors.values())

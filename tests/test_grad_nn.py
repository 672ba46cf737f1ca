"""Gradients of the NN ops and losses: autodiff against finite differences in float64
(jitgraph.testing.check_grad), the *_back references against vjps composed from primitive ops,
and whole blocks (MLP, CNN, attention) end to end."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph.ops import get_op
from jitgraph.testing import check_grad
from jitgraph.types import dtype_name

RNG = np.random.default_rng(1)


def randn(*shape):
    return RNG.standard_normal(shape)


def check(fn, params, inputs=None, **kw):
    """check_grad of fn(*params, *inputs) (tensors in that order) w.r.t. every param, asserting
    that elements were actually checked (not all skipped as kinks)."""
    inputs = inputs or {}
    g = jg.Graph("t")
    ts = [g.param(k, v.shape, "f64") for k, v in params.items()]
    ts += [g.input(k, v.shape, dtype_name(v.dtype)) for k, v in inputs.items()]
    g.output(out=fn(*ts))
    res = check_grad(g, inputs, params, max_elements=kw.pop("max_elements", 24), **kw)
    for k in params:
        assert res.errors[k][2] >= res.errors[k][3], res   # most elements checked
    return res


# ---- per-op finite-difference checks -----------------------------------------------------------
@pytest.mark.parametrize("shape,axis", [((5,), 0), ((3, 4), -1), ((2, 3, 4), 1), ((4, 1), 0)])
@pytest.mark.parametrize("op", [jg.softmax, jg.log_softmax])
def test_softmax_grad(op, shape, axis):
    check(lambda x: op(x, axis=axis), {"x": randn(*shape)})


@pytest.mark.parametrize("shape", [(6,), (3, 5), (2, 2, 7), (4, 1)])
def test_norm_grads(shape):
    w, b = randn(shape[-1]), randn(shape[-1])
    check(lambda x, w: jg.rms_norm(x, w, eps=1e-3), {"x": randn(*shape), "w": w})
    if shape[-1] > 1:      # layer_norm of one element is constant 0
        check(lambda x, w, b: jg.layer_norm(x, w, b, eps=1e-3),
              {"x": randn(*shape), "w": w, "b": b})


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("shape", [(3, 2, 4), (2, 5, 1, 6)])
def test_rope_grad(mode, shape):
    pos = RNG.integers(0, 20, shape[-3]).astype(np.int32)
    check(lambda x, p: jg.rope(x, p, theta=100.0, mode=mode), {"x": randn(*shape)}, {"pos": pos})
    check(lambda x, p: jg.apply("rope_back", x, p, theta=100.0, mode=mode),
          {"x": randn(*shape)}, {"pos": pos})


@pytest.mark.parametrize("shape,n_past", [((4, 4), 0), ((2, 3, 5), 2)])
def test_causal_mask_grad(shape, n_past):
    check(lambda x: jg.softmax(jg.causal_mask(x, n_past)), {"x": randn(*shape)})
    check(lambda x: jg.apply("causal_mask", x, n_past=n_past, value=0.0), {"x": randn(*shape)})


CONVS = [((2, 2, 5, 4), (3, 2, 3, 2), 1, 0, 1), ((1, 3, 6, 5), (2, 3, 3, 3), 2, 1, 1),
         ((1, 1, 7, 7), (2, 1, 2, 3), (2, 1), (0, 1), (2, 1))]


@pytest.mark.parametrize("xs,ws,stride,padding,dilation", CONVS)
def test_conv2d_grad(xs, ws, stride, padding, dilation):
    check(lambda x, w, b: jg.conv2d(x, w, b, stride, padding, dilation),
          {"x": randn(*xs), "w": randn(*ws), "b": randn(ws[0])})


@pytest.mark.parametrize("xs,ws,stride,padding,dilation", CONVS[1:])
def test_conv2d_back_ops_grad(xs, ws, stride, padding, dilation):
    a = dict(stride=jg.ops.conv._pair(stride, ""), padding=jg.ops.conv._pair(padding, ""),
             dilation=jg.ops.conv._pair(dilation, ""))
    gs = get_op("conv2d").ref(a, randn(*xs), randn(*ws)).shape
    check(lambda w, g: jg.apply("conv2d_back_input", w, g, in_hw=xs[2:], **a),
          {"w": randn(*ws), "g": randn(*gs)})
    check(lambda x, g: jg.apply("conv2d_back_weight", x, g, kernel=ws[2:], **a),
          {"x": randn(*xs), "g": randn(*gs)})


POOLS = [((1, 2, 4, 4), 2, None, 0), ((2, 1, 5, 5), 3, 2, 1), ((1, 1, 3, 6), (1, 3), (1, 2), (0, 1))]


@pytest.mark.parametrize("xs,kernel,stride,padding", POOLS)
def test_pool_grads(xs, kernel, stride, padding):
    check(lambda x: jg.max_pool2d(x, kernel, stride, padding), {"x": randn(*xs)})
    check(lambda x: jg.avg_pool2d(x, kernel, stride, padding), {"x": randn(*xs)})


def test_max_pool2d_grad_with_ties():
    """Rounded inputs tie inside windows: d sum(max_pool)/dx is 1 at a window's (first) maximum,
    0 elsewhere; tied elements are kinks (one-sided differences disagree) and are skipped."""
    x = np.round(randn(2, 2, 6, 6), 0)
    res = check(lambda x: jg.sum(jg.max_pool2d(x, 2)), {"x": x}, expect=(0.0, 1.0), max_elements=144)
    checked, skipped = res.errors["x"][2:]
    assert skipped > 0 and checked + skipped == x.size


def test_avg_pool2d_back_grad():
    check(lambda g: jg.apply("avg_pool2d_back", g, kernel=(3, 3), stride=(2, 2), padding=(1, 1),
                             in_hw=(5, 6)), {"g": randn(2, 1, 3, 3)})


@pytest.mark.parametrize("n,c", [(1, 3), (4, 5), (7, 2)])
def test_cross_entropy_grad(n, c):
    y = RNG.integers(0, c, n).astype(np.int32)
    check(jg.cross_entropy, {"z": randn(n, c) * 2}, {"y": y})
    p = RNG.dirichlet(np.ones(c), n)
    check(jg.cross_entropy, {"z": randn(n, c), "p": p})          # gradient w.r.t. the target too
    check(jg.cross_entropy, {"z": randn(n, c), "p": np.abs(randn(n, c))})   # unnormalised target


def test_mse_and_linear_grad():
    check(jg.mse, {"a": randn(3, 4), "b": randn(3, 4)})
    check(jg.linear, {"x": randn(2, 3), "w": randn(3, 4), "b": randn(4)})


# ---- *_back references agree with vjps composed from primitive ops -----------------------------
def composed_grad(fn, x, g_out, extra=None):
    """grad of sum(fn(x) * g_out) w.r.t. x through the primitive ops' vjps."""
    extra = extra or {}
    gr = jg.Graph("c")
    xt = gr.param("x", x.shape, "f64")
    ins = {k: gr.input(k, v.shape, dtype_name(v.dtype)) for k, v in extra.items()}
    r = gr.input("r", g_out.shape, "f64")
    gr.output(loss=jg.sum(fn(xt, **ins) * r))
    return jg.interp.run(jg.grad(gr, "loss"), {"r": g_out, **extra}, {"x": x})["grad/x"]


def test_softmax_back_matches_composed():
    x, g = randn(3, 6), randn(3, 6)

    def sm(t):
        e = jg.exp(t - jg.logsumexp(t, axis=0, keepdims=True))
        return e / jg.sum(e, axis=0, keepdims=True)
    y = get_op("softmax").ref({"axis": 0}, x)
    np.testing.assert_allclose(get_op("softmax_back").ref({"axis": 0}, y, g),
                               composed_grad(sm, x, g), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("eps", [1e-6, 0.1])
def test_norm_backs_match_composed(eps):
    x, g = randn(4, 7), randn(4, 7)

    def rms(t):
        return t / jg.sqrt(jg.mean(jg.sqr(t), axis=-1, keepdims=True) + eps)

    def ln(t):
        return rms(t - jg.mean(t, axis=-1, keepdims=True))
    np.testing.assert_allclose(get_op("rms_norm_back").ref({"eps": eps}, x, g),
                               composed_grad(rms, x, g), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(get_op("layer_norm_back").ref({"eps": eps}, x, g),
                               composed_grad(ln, x, g), rtol=1e-10, atol=1e-12)


def test_cross_entropy_back_matches_composed():
    z, y = randn(5, 4), np.array([3, 0, 1, 1, 2], np.int32)
    gr = jg.Graph("c")
    zt = gr.param("x", (5, 4), "f64")
    onehot = jg.get_rows(gr.input("eye", (4, 4), "f64"), gr.input("y", (5,), "i32"))
    gr.output(loss=jg.sum((zt - jg.logsumexp(zt, axis=1, keepdims=True)) * onehot) * (-0.3 / 5))
    want = jg.interp.run(jg.grad(gr, "loss"), {"eye": np.eye(4), "y": y}, {"x": z})["grad/x"]
    np.testing.assert_allclose(get_op("cross_entropy_back").ref({}, z, y, np.float64(0.3)), want,
                               rtol=1e-10, atol=1e-12)


# ---- composite graphs --------------------------------------------------------------------------
def test_mlp_cross_entropy():
    y = np.array([0, 2, 1, 2], np.int32)

    def mlp(w1, b1, w2, b2, x, y):
        return jg.cross_entropy(jg.linear(jg.tanh(jg.linear(x, w1, b1)), w2, b2), y)
    check(mlp, {"w1": randn(5, 6) * 0.5, "b1": randn(6), "w2": randn(6, 3), "b2": randn(3)},
          {"x": randn(4, 5), "y": y})


def test_cnn_block():
    def cnn(w, b, wd, x, y):
        h = jg.max_pool2d(jg.relu(jg.conv2d(x, w, b, padding=1)), 2)
        return jg.cross_entropy(h.reshape(2, -1) @ wd, y)
    check(cnn, {"w": randn(3, 2, 3, 3), "b": randn(3), "wd": randn(12, 4)},
          {"x": randn(2, 2, 4, 4), "y": np.array([1, 3], np.int32)})


def test_attention_block():
    seq, dim, heads, vocab = 4, 8, 2, 6
    hd = dim // heads

    def attn(emb, wn, wq, wk, wv, wo, tok, pos, y):
        x = jg.get_rows(emb, tok)                                  # [seq, dim]
        h = jg.rms_norm(x, wn)
        q = jg.rope((h @ wq).reshape(seq, heads, hd), pos, mode="neox")
        k = jg.rope((h @ wk).reshape(seq, heads, hd), pos, mode="neox")
        v = (h @ wv).reshape(seq, heads, hd)
        q, k, v = (jg.permute(t, (1, 0, 2)) for t in (q, k, v))   # [heads, seq, hd]
        s = jg.matmul(q, k, tb=True) * (1.0 / np.sqrt(hd))
        a = jg.softmax(jg.causal_mask(s)) @ v                      # [heads, seq, hd]
        o = jg.permute(a, (1, 0, 2)).reshape(seq, dim) @ wo + x
        return jg.cross_entropy(o @ emb.T, y)
    params = {k: randn(*s) * 0.5 for k, s in [("emb", (vocab, dim)), ("wn", (dim,)),
                                              ("wq", (dim, dim)), ("wk", (dim, dim)),
                                              ("wv", (dim, dim)), ("wo", (dim, dim))]}
    inputs = {"tok": np.array([1, 4, 4, 0], np.int32), "pos": np.arange(seq, dtype=np.int32),
              "y": np.array([4, 4, 0, 5], np.int32)}
    check(attn, params, inputs, max_elements=12)

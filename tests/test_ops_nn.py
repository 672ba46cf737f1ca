"""NN ops and losses against independent computations: explicit Python loops, closed forms,
properties (adjoint identities for the backward ops), f32 and f64, and error messages."""
import math

import numpy as np
import pytest

import jitgraph as jg
from jitgraph.ops import get_op
from jitgraph.types import ShapeError, dtype_name

RNG = np.random.default_rng(0)


def randn(*shape, dtype=np.float64):
    return RNG.standard_normal(shape).astype(dtype)


def run(fn, *arrays):
    """Build fn(inputs...) as a graph with one input per array; run it with the interpreter."""
    g = jg.Graph("t")
    ts = [g.input(f"a{i}", a.shape, dtype_name(a.dtype)) for i, a in enumerate(arrays)]
    g.output(out=fn(*ts))
    return jg.interp.run(g, {f"a{i}": a for i, a in enumerate(arrays)})["out"]


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)


DTYPES = [np.float32, np.float64]


def rows(x, axis):
    """The 1-D lines of x along axis, as (index, line) pairs."""
    xm = np.moveaxis(x, axis, -1)
    return [(i, xm[i]) for i in np.ndindex(xm.shape[:-1])]


# ---- softmax / log_softmax ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", [((1,), -1), ((7,), 0), ((3, 13), -1), ((2, 5, 3), 1),
                                        ((4, 1), -1), ((2, 3, 4), 0)])
def test_softmax_closed_form(shape, axis, dtype):
    x = randn(*shape, dtype=dtype) * 3
    y = run(lambda t: jg.softmax(t, axis=axis), x)
    ly = run(lambda t: jg.log_softmax(t, axis=axis), x)
    assert y.dtype == dtype and ly.dtype == dtype
    ym, lym = np.moveaxis(y, axis, -1), np.moveaxis(ly, axis, -1)
    for i, line in rows(x.astype(np.float64), axis):
        den = sum(math.exp(v) for v in line)
        np.testing.assert_allclose(ym[i], [math.exp(v) / den for v in line], **tol(dtype))
        np.testing.assert_allclose(lym[i], [v - math.log(den) for v in line], **tol(dtype))
    np.testing.assert_allclose(y.sum(axis=axis), 1, **tol(dtype))
    np.testing.assert_allclose(ly, np.log(y), rtol=1e-4 if dtype == np.float32 else 1e-10)


def test_softmax_is_stable_for_huge_logits_and_masked_entries():
    x = np.array([[1000.0, 999.0, -np.inf], [-1e4, -1e4, -1e4]])
    y = run(jg.softmax, x)
    e = 1 / (1 + math.exp(-1))
    np.testing.assert_allclose(y, [[e, 1 - e, 0], [1 / 3, 1 / 3, 1 / 3]], rtol=1e-12)
    ly = run(jg.log_softmax, x)
    assert np.isneginf(ly[0, 2]) and np.isfinite(ly[1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_back_is_the_jacobian_product(dtype):
    x, g = randn(3, 5, dtype=dtype), randn(3, 5, dtype=dtype)
    y = get_op("softmax").ref({"axis": 1}, x)
    gx = get_op("softmax_back").ref({"axis": 1}, y, g)
    assert gx.dtype == dtype
    for r in range(3):
        jac = [[y[r, i] * ((i == j) - y[r, j]) for j in range(5)] for i in range(5)]
        np.testing.assert_allclose(gx[r], np.array(jac).T @ g[r], **tol(dtype))


# ---- norms -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 13), (2, 3, 5), (4, 2)])
def test_rms_norm(shape, dtype):
    x = randn(*shape, dtype=dtype)
    eps = 1e-3
    y = run(lambda t: jg.rms_norm(t, eps=eps), x)
    assert y.dtype == dtype
    for i, line in rows(x.astype(np.float64), -1):
        ms = sum(v * v for v in line) / len(line)
        np.testing.assert_allclose(y[i], [v / math.sqrt(ms + eps) for v in line], **tol(dtype))
    y0 = run(lambda t: jg.rms_norm(t, eps=0.0), x)
    np.testing.assert_allclose(np.sqrt(np.mean(y0.astype(np.float64) ** 2, axis=-1)), 1, **tol(dtype))


def test_rms_norm_weight_multiplies_after():
    x, w = randn(3, 6), randn(6)
    y = run(lambda t, tw: jg.rms_norm(t, tw), x, w)
    np.testing.assert_allclose(y, run(jg.rms_norm, x) * w, rtol=1e-14)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2,), (7,), (3, 13), (2, 3, 5)])
def test_layer_norm(shape, dtype):
    x = randn(*shape, dtype=dtype) * 2 + 1
    y = run(lambda t: jg.layer_norm(t, eps=0.0), x)
    assert y.dtype == dtype
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-5 if dtype == np.float32 else 1e-12)
    np.testing.assert_allclose(y.var(-1), 1, **tol(dtype))
    w, b = randn(shape[-1], dtype=dtype), randn(shape[-1], dtype=dtype)
    eps = 1e-2
    yw = run(lambda t, tw, tb: jg.layer_norm(t, tw, tb, eps=eps), x, w, b)
    for i, line in rows(x.astype(np.float64), -1):
        mu = sum(line) / len(line)
        var = sum((v - mu) ** 2 for v in line) / len(line)
        want = [(v - mu) / math.sqrt(var + eps) * wk + bk for v, wk, bk in zip(line, w, b)]
        np.testing.assert_allclose(yw[i], want, **tol(dtype))


# ---- rope --------------------------------------------------------------------------------------
def rope_loop(x, pos, theta, mode):
    """ggml's rope written out: pair (a, b) of each head rotated by pos * theta^(-2i/d)."""
    out = x.astype(np.float64).copy()
    d = x.shape[-1]
    for idx in np.ndindex(x.shape[:-1]):
        p = pos[idx[-2]]
        for i in range(d // 2):
            a, b = (2 * i, 2 * i + 1) if mode == "normal" else (i, i + d // 2)
            ang = p * theta ** (-2 * i / d)
            x0, x1 = x[idx + (a,)], x[idx + (b,)]
            out[idx + (a,)] = x0 * math.cos(ang) - x1 * math.sin(ang)
            out[idx + (b,)] = x0 * math.sin(ang) + x1 * math.cos(ang)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("shape,theta", [((5, 3, 8), 10000.0), ((2, 3, 1, 2), 10.0),
                                         ((1, 7, 2, 6), 500.0)])
def test_rope_matches_loop(shape, theta, mode, dtype):
    x = randn(*shape, dtype=dtype)
    pos = RNG.integers(0, 50, shape[-3]).astype(np.int32)
    y = run(lambda t, p: jg.rope(t, p, theta=theta, mode=mode), x, pos)
    assert y.dtype == dtype
    np.testing.assert_allclose(y, rope_loop(x, pos, theta, mode), **tol(dtype))
    # a rotation: norms of pairs are kept, rope_back undoes it, position 0 is the identity
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), **tol(dtype))
    back = get_op("rope_back").ref({"theta": theta, "mode": mode}, y, pos)
    np.testing.assert_allclose(back, x, **tol(dtype))
    zero = np.zeros_like(pos)
    np.testing.assert_array_equal(run(lambda t, p: jg.rope(t, p, mode=mode), x, zero), x)


def test_rope_modes_differ():
    x, pos = randn(3, 1, 4), np.arange(3, dtype=np.int32)
    assert not np.allclose(run(lambda t, p: jg.rope(t, p, mode="normal"), x, pos),
                           run(lambda t, p: jg.rope(t, p, mode="neox"), x, pos))


# ---- causal_mask -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,n_past", [((4, 4), 0), ((3, 5), 2), ((2, 3, 3), 0), ((1, 1), 0),
                                          ((5, 2), 1)])
def test_causal_mask(shape, n_past):
    x = randn(*shape)
    y = run(lambda t: jg.causal_mask(t, n_past=n_past), x)
    for idx in np.ndindex(shape):
        i, j = idx[-2:]
        assert y[idx] == (-np.inf if j > i + n_past else x[idx])


# ---- conv2d ------------------------------------------------------------------------------------
def conv_loop(x, w, stride, padding, dilation):
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, o, oh, ow))
    for b, oc, p, q, ic, i, j in np.ndindex(n, o, oh, ow, c, kh, kw):
        r, s = p * sh - ph + i * dh, q * sw - pw + j * dw
        if 0 <= r < h and 0 <= s < wd:
            out[b, oc, p, q] += x[b, ic, r, s] * w[oc, ic, i, j]
    return out


CONVS = [  # x shape, w shape, stride, padding, dilation
    ((2, 3, 7, 5), (2, 3, 3, 2), (2, 1), (1, 0), (1, 2)),
    ((1, 1, 5, 5), (3, 1, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 2, 4, 6), (1, 2, 1, 1), (1, 2), (0, 0), (1, 1)),
    ((1, 2, 1, 7), (2, 2, 1, 3), (1, 3), (0, 2), (1, 1)),
    ((3, 1, 6, 6), (2, 1, 2, 2), (2, 2), (0, 0), (2, 2)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xs,ws,stride,padding,dilation", CONVS)
def test_conv2d_matches_loop(xs, ws, stride, padding, dilation, dtype):
    x, w, b = randn(*xs, dtype=dtype), randn(*ws, dtype=dtype), randn(ws[0], dtype=dtype)
    y = run(lambda t, tw, tb: jg.conv2d(t, tw, tb, stride, padding, dilation), x, w, b)
    assert y.dtype == dtype
    want = conv_loop(x.astype(np.float64), w.astype(np.float64), stride, padding, dilation)
    np.testing.assert_allclose(y, want + b[:, None, None], **tol(dtype))


@pytest.mark.parametrize("xs,ws,stride,padding,dilation", CONVS)
def test_conv2d_back_ops_are_adjoints(xs, ws, stride, padding, dilation):
    """<conv(x, w), g> = <x, back_input(w, g)> = <w, back_weight(x, g)> (conv is bilinear)."""
    x, w = randn(*xs), randn(*ws)
    a = {"stride": stride, "padding": padding, "dilation": dilation}
    y = get_op("conv2d").ref(a, x, w)
    g = randn(*y.shape)
    gx = get_op("conv2d_back_input").ref({**a, "in_hw": xs[2:]}, w, g)
    gw = get_op("conv2d_back_weight").ref({**a, "kernel": ws[2:]}, x, g)
    assert gx.shape == x.shape and gw.shape == w.shape
    np.testing.assert_allclose(np.vdot(x, gx), np.vdot(y, g), rtol=1e-10)
    np.testing.assert_allclose(np.vdot(w, gw), np.vdot(y, g), rtol=1e-10)
    # one element against the loop: d<conv(x, w), g>/dx[0,0,0,0] = <conv(e, w), g>, e = unit x
    e = np.zeros_like(x)
    e[(0,) * 4] = 1
    np.testing.assert_allclose(gx[(0,) * 4], np.vdot(conv_loop(e, w, stride, padding, dilation), g),
                               rtol=1e-10, atol=1e-12)


# ---- pooling -----------------------------------------------------------------------------------
def pool_loop(x, kernel, stride, padding, kind):
    n, c, h, wd = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    oh, ow = (h + 2 * ph - kh) // sh + 1, (wd + 2 * pw - kw) // sw + 1
    out = np.zeros((n, c, oh, ow))
    arg = {}
    for idx in np.ndindex(n, c, oh, ow):
        b, ch, p, q = idx
        vals = []
        for i, j in np.ndindex(kh, kw):
            r, s = p * sh - ph + i, q * sw - pw + j
            inside = 0 <= r < h and 0 <= s < wd
            vals.append((x[b, ch, r, s] if inside else (-np.inf if kind == "max" else 0.0), (r, s)))
        if kind == "max":
            best = max(range(len(vals)), key=lambda k: (vals[k][0], -k))   # first maximum
            out[idx], arg[idx] = vals[best][0], vals[best][1]
        else:
            out[idx] = sum(v for v, _ in vals) / (kh * kw)
    return out, arg


POOLS = [((2, 3, 6, 6), (2, 2), None, (0, 0)), ((1, 2, 7, 5), (3, 3), (2, 2), (1, 1)),
         ((1, 1, 5, 4), (3, 2), (1, 1), (1, 0)), ((2, 1, 1, 3), (1, 3), (1, 1), (0, 1))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("xs,kernel,stride,padding", POOLS)
def test_pool_matches_loop(xs, kernel, stride, padding, kind, dtype):
    x = randn(*xs, dtype=dtype)
    fn = jg.max_pool2d if kind == "max" else jg.avg_pool2d
    y = run(lambda t: fn(t, kernel, stride, padding), x)
    assert y.dtype == dtype
    want, _ = pool_loop(x.astype(np.float64), kernel, stride or kernel, padding, kind)
    np.testing.assert_allclose(y, want, **tol(dtype))


@pytest.mark.parametrize("xs,kernel,stride,padding", POOLS)
def test_max_pool2d_back_routes_to_first_maximum(xs, kernel, stride, padding):
    x = np.round(randn(*xs), 1)          # ties happen: the first maximum takes the gradient
    stride = stride or kernel
    a = {"kernel": kernel, "stride": stride, "padding": padding}
    out, arg = pool_loop(x, kernel, stride, padding, "max")
    g = randn(*out.shape)
    want = np.zeros_like(x)
    for (b, ch, p, q), (r, s) in arg.items():
        want[b, ch, r, s] += g[b, ch, p, q]
    np.testing.assert_allclose(get_op("max_pool2d_back").ref(a, x, g), want, rtol=1e-12)


@pytest.mark.parametrize("xs,kernel,stride,padding", POOLS)
def test_avg_pool2d_back_is_adjoint(xs, kernel, stride, padding):
    x = randn(*xs)
    a = {"kernel": kernel, "stride": stride or kernel, "padding": padding}
    y = get_op("avg_pool2d").ref(a, x)
    g = randn(*y.shape)
    gx = get_op("avg_pool2d_back").ref({**a, "in_hw": xs[2:]}, g)
    np.testing.assert_allclose(np.vdot(x, gx), np.vdot(y, g), rtol=1e-10)


# ---- losses ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,c", [(1, 1), (1, 7), (5, 3), (13, 10)])
def test_cross_entropy_labels_and_probabilities(n, c, dtype):
    z = randn(n, c, dtype=dtype) * 2
    y = RNG.integers(0, c, n).astype(np.int32)
    loss = run(jg.cross_entropy, z, y)
    assert loss.dtype == dtype and loss.shape == ()
    zz = z.astype(np.float64)
    want = sum(math.log(sum(math.exp(v) for v in zz[i])) - zz[i, y[i]] for i in range(n)) / n
    np.testing.assert_allclose(loss, want, **tol(dtype))
    onehot = np.eye(c, dtype=dtype)[y]
    np.testing.assert_allclose(run(jg.cross_entropy, z, onehot), loss, **tol(dtype))
    p = RNG.dirichlet(np.ones(c), n).astype(dtype)
    want_p = -sum(p[i, k] * (zz[i, k] - math.log(sum(math.exp(v) for v in zz[i])))
                  for i in range(n) for k in range(c)) / n
    np.testing.assert_allclose(run(jg.cross_entropy, z, p), want_p, **tol(dtype))


def test_cross_entropy_extremes():
    y = np.array([2, 0, 1], np.int32)
    perfect = np.eye(4)[y] * 100.0
    assert 0 <= run(jg.cross_entropy, perfect, y) < 1e-40
    np.testing.assert_allclose(run(jg.cross_entropy, np.full((3, 4), 7.0), y), math.log(4), rtol=1e-14)
    huge = np.array([[1e4, 0.0], [0.0, 1e4], [-1e4, 1e4]])
    np.testing.assert_allclose(run(jg.cross_entropy, huge, np.array([1, 1, 1], np.int32)),
                               1e4 / 3, rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_back_closed_form(dtype):
    z, y = randn(4, 5, dtype=dtype), np.array([0, 4, 2, 2], np.int32)
    g = np.asarray(0.7, dtype)
    got = get_op("cross_entropy_back").ref({}, z, y, g)
    assert got.dtype == dtype
    for i in range(4):
        den = sum(math.exp(v) for v in z[i].astype(np.float64))
        want = [(math.exp(z[i, k]) / den - (k == y[i])) / 4 * 0.7 for k in range(5)]
        np.testing.assert_allclose(got[i], want, **tol(dtype))


def test_cross_entropy_label_out_of_range():
    with pytest.raises(IndexError, match=r"label out of range \[0, 3\)"):
        run(jg.cross_entropy, randn(2, 3), np.array([0, 3], np.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mse_and_linear(dtype):
    a, b = randn(3, 7, dtype=dtype), randn(3, 7, dtype=dtype)
    want = sum((float(u) - float(v)) ** 2 for u, v in zip(a.flat, b.flat)) / a.size
    np.testing.assert_allclose(run(jg.mse, a, b), want, **tol(dtype))
    x, w, bias = randn(2, 3, dtype=dtype), randn(3, 5, dtype=dtype), randn(5, dtype=dtype)
    want = [[sum(x[i, k] * w[k, j] for k in range(3)) + bias[j] for j in range(5)] for i in range(2)]
    np.testing.assert_allclose(run(jg.linear, x, w, bias), want, **tol(dtype))


# ---- graph-level properties --------------------------------------------------------------------
def test_nn_ops_round_trip_through_json():
    g = jg.Graph("nn")
    x = g.input("x", (2, 3, 6, 6))
    w = g.param("w", (4, 3, 3, 3))
    pos = g.input("pos", (4,), "i32")
    h = jg.avg_pool2d(jg.max_pool2d(jg.conv2d(x, w, padding=1), 2, padding=1), 2)
    q = jg.rope(h, pos, mode="neox")
    s = jg.softmax(jg.causal_mask(q.reshape(4, 8), n_past=1))
    loss = jg.cross_entropy(jg.layer_norm(jg.rms_norm(s)), g.input("y", (4,), "i32"))
    g.output(loss=loss)
    g2 = jg.Graph.from_json(g.to_json())
    assert g2.fingerprint() == g.fingerprint() and str(g2) == str(g)
    feeds = {"x": randn(2, 3, 6, 6), "pos": np.arange(4, dtype=np.int32),
             "y": np.array([0, 1, 3, 2], np.int32)}
    ps = g.init_params()
    assert jg.interp.run(g2, feeds, ps)["loss"] == jg.interp.run(g, feeds, ps)["loss"]


# ---- errors ------------------------------------------------------------------------------------
def build(shapes, fn):
    g = jg.Graph("e")
    ts = [g.input(f"x{i}", s, dt) for i, (s, dt) in enumerate(shapes)]
    return fn(*ts)


ERRORS = [
    ([((2, 3, 5, 5), "f32"), ((4, 2, 3, 3), "f32")], lambda x, w: jg.conv2d(x, w),
     r"conv2d: channels differ: x0 f32\[2,3,5,5\], x1 f32\[4,2,3,3\] \(expected C == w.shape\[1\]: "
     r"3 != 2\)"),
    ([((2, 3, 5), "f32"), ((4, 3, 3, 3), "f32")], lambda x, w: jg.conv2d(x, w),
     r"conv2d: expected 4-D operands .*x0 f32\[2,3,5\]"),
    ([((1, 1, 2, 2), "f32"), ((1, 1, 3, 3), "f32")], lambda x, w: jg.conv2d(x, w),
     r"conv2d: window \(3, 3\) .* larger than the padded input x0 f32\[1,1,2,2\]"),
    ([((1, 1, 4, 4), "f32"), ((1, 1, 3, 3), "f64")], lambda x, w: jg.conv2d(x, w),
     r"conv2d: dtypes differ"),
    ([((1, 1, 4, 4), "f32"), ((1, 1, 3, 3), "f32")], lambda x, w: jg.conv2d(x, w, stride=0),
     r"conv2d: attribute stride must be two ints >= 1, got \(0, 0\)"),
    ([((1, 1, 4, 4), "f32"), ((1, 1, 3, 3), "f32")], lambda x, w: jg.conv2d(x, w, padding=(1, 2, 3)),
     r"conv2d: padding: expected an int or a pair of ints"),
    ([((1, 1, 4, 4), "f32")], lambda x: jg.max_pool2d(x, 2, padding=2),
     r"max_pool2d: padding \(2, 2\) must be at most half the kernel \(2, 2\)"),
    ([((1, 1, 4, 4), "f32")], lambda x: jg.avg_pool2d(x, 5), r"avg_pool2d: window \(5, 5\)"),
    ([((4, 4), "i32")], lambda x: jg.softmax(x), r"softmax: operand must be a float \(f32, f64, f16, bf16\), got x0 i32"),
    ([((4, 4), "f32")], lambda x: jg.softmax(x, axis=2), r"softmax: axis 2 out of range"),
    ([((3, 2, 5), "f32"), ((3,), "i32")], lambda x, p: jg.rope(x, p), r"rope: head_dim must be even"),
    ([((3, 2, 4), "f32"), ((2,), "i32")], lambda x, p: jg.rope(x, p),
     r"rope: positions x1 i32\[2\] do not fit x0 f32\[3,2,4\] \(expected i32\[3\]"),
    ([((3, 2, 4), "f32"), ((3,), "f32")], lambda x, p: jg.rope(x, p), r"rope: positions x1 f32\[3\]"),
    ([((2, 4), "f32"), ((2,), "i32")], lambda x, p: jg.rope(x, p), r"rope: x .* must be at least 3-D"),
    ([((3, 2, 4), "f32"), ((3,), "i32")], lambda x, p: jg.rope(x, p, mode="glm"),
     r"rope: mode must be one of \('normal', 'neox'\), got 'glm'"),
    ([((4,), "f32")], lambda x: jg.causal_mask(x), r"causal_mask: operand .* must be at least 2-D"),
    ([((4, 4), "f32")], lambda x: jg.causal_mask(x, n_past=-1), r"causal_mask: n_past must be >= 0"),
    ([((4, 4), "f32")], lambda x: jg.layer_norm(x, eps=-1.0), r"layer_norm: eps must be >= 0"),
    ([((4, 3), "f32"), ((5,), "i32")], lambda z, y: jg.cross_entropy(z, y),
     r"cross_entropy: target x1 i32\[5\] does not fit logits x0 f32\[4,3\] \(expected i32\[4\] "
     r"class labels or f32\[4,3\] probabilities\)"),
    ([((4, 3), "f32"), ((4,), "f32")], lambda z, y: jg.cross_entropy(z, y),
     r"cross_entropy: target x1 f32\[4\] does not fit"),
    ([((4, 3), "f32"), ((4, 3), "f64")], lambda z, y: jg.cross_entropy(z, y),
     r"cross_entropy: target x1 f64\[4,3\] does not fit"),
    ([((4,), "f32"), ((4,), "i32")], lambda z, y: jg.cross_entropy(z, y),
     r"cross_entropy: logits must be \[N, C\]"),
    ([((4, 3), "f32"), ((3, 4), "f32")], lambda a, b: jg.mse(a, b),
     r"mse: shapes differ: x0 f32\[4,3\] vs x1 f32\[3,4\]"),
    ([((2, 3), "f32"), ((2, 4), "f32")], lambda y, g: jg.apply("softmax_back", y, g, axis=1),
     r"softmax_back: shapes differ: x0 f32\[2,3\], x1 f32\[2,4\]"),
    ([((1, 2, 4, 4), "f32"), ((1, 2, 2, 3), "f32")],
     lambda w, g: jg.apply("conv2d_back_input", w, g, in_hw=(5, 5)),
     r"conv2d_back_input: gradient x1 f32\[1,2,2,3\] does not match the forward output "
     r"\(expected \[1,1,2,2\]\)"),
]


@pytest.mark.parametrize("shapes,fn,msg", ERRORS)
def test_errors_name_op_operands_and_expectation(shapes, fn, msg):
    with pytest.raises(ShapeError, match=msg):
        build(shapes, fn)


def test_pool_back_shape_rule_rejects_wrong_gradient():
    with pytest.raises(ShapeError, match=r"max_pool2d_back: gradient x1 f32\[1,2,3,2\] does not "
                                         r"match the forward output \(expected \[1,2,2,2\]\)"):
        build([((1, 2, 4, 4), "f32"), ((1, 2, 3, 2), "f32")],
              lambda x, g: jg.apply("max_pool2d_back", x, g, kernel=(2, 2), stride=(2, 2)))

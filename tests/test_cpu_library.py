"""The hand-written CPU kernels (runtime/cpu/library.py) against the ops' numpy references, in
float32 (rtol 1e-5) and float64 (rtol 1e-12), on odd sizes and edge cases. Each kernel is
compiled once per dtype (and per rank); numba caches the machine code on disk."""
from __future__ import annotations

import numpy as np
import pytest

from jitgraph.ops import get_op
from jitgraph.runtime.cpu import library as lib
from jitgraph.runtime.cpu.lib_common import PAR_MIN_WORK

DTYPES = [(np.float32, 1e-5), (np.float64, 1e-12)]


@pytest.fixture(params=DTYPES, ids=["f32", "f64"])
def dt(request):
    return request.param


def ref(op, *arrays, **attrs):
    d = get_op(op)
    return d.ref(d.check_attrs(attrs), *arrays)


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def close(got, want, tol):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def call(kernel, ins, out_like, *params):
    """Run `kernel(*ins, out, *params)` into a fresh array shaped like `out_like`, pre-filled with
    garbage so a kernel that skips an element fails."""
    out = np.full(np.shape(out_like), 7.25, np.asarray(out_like).dtype)
    kernel(*ins, out, *params)
    return out


# ---- data movement ---------------------------------------------------------------------------
def test_permute(dt):
    dtype, _ = dt
    rng = np.random.default_rng(0)
    x = rand(rng, (3, 5, 7, 2), dtype)
    for axes in [(0, 1, 3, 2), (3, 2, 1, 0), (1, 0, 2, 3), (2, 0, 3, 1), (0, 1, 2, 3),
                 (0, 2, 1, 3), (2, 1, 0, 3)]:     # the last four keep the last axis: row copies
        want = ref("permute", x, axes=axes)
        np.testing.assert_array_equal(call(lib.permute, [x], want, axes), want)
    x3 = rand(rng, (4, 6, 5), dtype)
    for axes in [(1, 0, 2), (0, 1, 2), (2, 1, 0)]:
        want = ref("permute", x3, axes=axes)
        np.testing.assert_array_equal(call(lib.permute, [x3], want, axes), want)
    for shape in [(37, 41), (1, 13), (70, 1)]:          # blocked 2-D transpose, tile edges
        x2 = rand(rng, shape, dtype)
        np.testing.assert_array_equal(call(lib.permute, [x2], x2.T, (1, 0)), x2.T)
    x3 = rand(rng, (2, 33, 35), dtype)                  # batched swap of the last two axes
    want = ref("permute", x3, axes=(0, 2, 1))
    np.testing.assert_array_equal(call(lib.permute, [x3], want, (0, 2, 1)), want)


SLICES = [((1, 3, 1), (4, -1, -2), (0, 7, 3), (1, 0, -1)),
          ((0, 3, 2), (0, 5, 1), (6, 0, -3), (0, 2, 1)),
          ((2, 3, 1), (3, 3, 1), (0, 7, 1), (0, 2, 1))]      # an empty axis


def test_slice_and_slice_back(dt):
    dtype, _ = dt
    rng = np.random.default_rng(1)
    x = rand(rng, (3, 5, 7, 2), dtype)
    for sl in SLICES:
        starts, steps = tuple(s[0] for s in sl), tuple(s[2] for s in sl)
        want = ref("slice", x, slices=sl)
        np.testing.assert_array_equal(call(lib.slice, [x], want, starts, steps), want)
        g = rand(rng, want.shape, dtype)
        want_b = ref("slice_back", g, shape=x.shape, slices=sl)
        np.testing.assert_array_equal(call(lib.slice_back, [g], want_b, starts, steps), want_b)


def test_pad_and_concat(dt):
    dtype, _ = dt
    rng = np.random.default_rng(2)
    x = rand(rng, (3, 5, 7, 2), dtype)
    for pads, value in [(((1, 0), (0, 2), (3, 1), (0, 0)), -2.5), (((0, 0),) * 4, 0.0),
                        (((2, 2), (1, 1), (0, 0), (1, 3)), 0.0)]:
        want = ref("pad", x, pads=pads, value=value)
        got = call(lib.pad, [x], want, tuple(b for b, _ in pads), value)
        np.testing.assert_array_equal(got, want)
    for axis in range(3):
        parts = [rand(rng, tuple(n if k == axis else d for k, d in enumerate((4, 3, 5))), dtype)
                 for n in (1, 3, 0, 7)]
        want = ref("concat", *parts, axis=axis)
        out, off = np.full(want.shape, 7.25, dtype), 0
        for p in parts:                                  # the codegen's call sequence
            lib.embed(p, out, tuple(off if k == axis else 0 for k in range(3)))
            off += p.shape[axis]
        np.testing.assert_array_equal(out, want)


def test_get_rows_and_back(dt):
    dtype, tol = dt
    rng = np.random.default_rng(3)
    w = rand(rng, (11, 3), dtype)
    idx = np.array([[0, 10, 3, 3, 7], [1, 1, 1, 0, 10]], np.int32)     # repeats
    np.testing.assert_array_equal(call(lib.get_rows, [w, idx], w[idx]), w[idx])
    g = rand(rng, (2, 5, 3), dtype)
    want = np.zeros((11, 3), dtype)
    for i in np.ndindex(idx.shape):                                    # explicit scatter-add
        want[idx[i]] += g[i]
    close(call(lib.get_rows_back, [g, idx], want), ref("get_rows_back", g, idx, n_rows=11), tol)
    close(call(lib.get_rows_back, [g, idx], want), want, tol)
    with pytest.raises(IndexError):
        lib.get_rows(w, np.array([[11]], np.int32), np.empty((1, 1, 3), dtype))
    with pytest.raises(IndexError):
        lib.get_rows_back(g[:1, :1], np.array([[-1]], np.int32), np.empty((11, 3), dtype))


# ---- row-wise ops ----------------------------------------------------------------------------
def masked(rng, shape, dtype):
    """Random values with a partly -inf row, a fully -inf row and tied maxima."""
    x = rand(rng, shape, dtype)
    x[0, 1, :3] = -np.inf
    x[1, 2, :] = -np.inf
    x[2, 0, :] = 1.5
    return x


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_softmax_family(dt):
    dtype, tol = dt
    rng = np.random.default_rng(4)
    x = masked(rng, (3, 5, 7), dtype)
    g = rand(rng, x.shape, dtype)
    for axis in (0, 1, 2, -1):
        for op in ("softmax", "log_softmax"):
            close(call(getattr(lib, op), [x], x, axis), ref(op, x, axis=axis), tol)
        y = np.nan_to_num(ref("softmax", x, axis=axis))
        close(call(lib.softmax_back, [y, g], x, axis), ref("softmax_back", y, g, axis=axis), tol)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_last_axis_reductions(dt):
    dtype, tol = dt
    rng = np.random.default_rng(5)
    for shape in [(3, 5, 7), (4, 1), (13,)]:
        x = masked(rng, shape, dtype) if len(shape) == 3 else rand(rng, shape, dtype)
        ax = len(shape) - 1
        np.testing.assert_array_equal(call(lib.max_last, [x], ref("max", x, axes=(ax,))),
                                      ref("max", x, axes=(ax,)))
        want = ref("argmax", x, axis=ax, keepdims=True)
        np.testing.assert_array_equal(call(lib.argmax_last, [x], want), want)
        want = ref("logsumexp", x, axes=(ax,))
        close(call(lib.logsumexp_last, [x], want), want, tol)


def test_count_equal():
    rng = np.random.default_rng(6)
    a = rng.integers(0, 3, (7, 13)).astype(np.int32)
    b = rng.integers(0, 3, (7, 13)).astype(np.int32)
    for x, y in [(a, b), (a.astype(np.float32), b.astype(np.float32)), (a, a)]:
        out = np.zeros((), np.int32)
        lib.count_equal(x, y, out)
        assert out == ref("count_equal", x, y) == sum(int(u == v) for u, v in zip(x.flat, y.flat))


def test_cross_entropy(dt):
    dtype, tol = dt
    rng = np.random.default_rng(7)
    for n, c in [(13, 7), (1, 1), (5, 2)]:
        logits = rand(rng, (n, c), dtype) * 3
        labels = rng.integers(0, c, n).astype(np.int32)
        probs = rng.random((n, c)).astype(dtype)
        probs /= probs.sum(1, keepdims=True)
        g = np.asarray(1.7, dtype)
        for t in (labels, probs):
            close(call(lib.cross_entropy, [logits, t], np.zeros((), dtype)),
                  ref("cross_entropy", logits, t), tol)
            close(call(lib.cross_entropy_back, [logits, t, g], logits),
                  ref("cross_entropy_back", logits, t, g), tol)
    with pytest.raises(IndexError):
        lib.cross_entropy(logits, np.full(5, 2, np.int32), np.zeros((), dtype))


# ---- norms, rope, causal mask ----------------------------------------------------------------
def test_norms(dt):
    dtype, tol = dt
    rng = np.random.default_rng(8)
    for shape, eps in [((3, 13), 1e-5), ((2, 3, 7), 1e-6), ((1, 1), 1e-3), ((2, 2), 0.0)]:
        x, g = rand(rng, shape, dtype), rand(rng, shape, dtype)
        for op in ("rms_norm", "layer_norm"):
            if op == "layer_norm" and shape[-1] == 1:
                continue                                    # variance 0: 0 / sqrt(eps)
            close(call(getattr(lib, op), [x], x, eps), ref(op, x, eps=eps), tol)
            close(call(getattr(lib, op + "_back"), [x, g], x, eps),
                  ref(op + "_back", x, g, eps=eps), tol)


def test_rope(dt):
    dtype, tol = dt
    rng = np.random.default_rng(9)
    x = rand(rng, (2, 5, 3, 6), dtype)
    pos = np.array([0, 3, 1, 7, 2], np.int32)
    # the kernels' other paths: no batch axis, two batch axes, and a slab loop
    # long enough to run in parallel (x.size >= 4 * PAR_MIN_WORK)
    for shape in [(5, 3, 6), (2, 2, 5, 2, 4), (9, 5, 96, 128)]:
        xs = rand(rng, shape, dtype)
        for mode in ("normal", "neox"):
            for op in ("rope", "rope_back"):
                close(call(getattr(lib, op), [xs, pos], xs, 500.0, mode == "neox"),
                      ref(op, xs, pos, theta=500.0, mode=mode), tol)
    for mode in ("normal", "neox"):
        for op in ("rope", "rope_back"):
            got = call(getattr(lib, op), [x, pos], x, 500.0, mode == "neox")
            close(got, ref(op, x, pos, theta=500.0, mode=mode), tol)
        back = call(lib.rope_back, [call(lib.rope, [x, pos], x, 1e4, mode == "neox"), pos], x,
                    1e4, mode == "neox")
        close(back, x, 50 * tol)                             # rope_back inverts rope
        # the kernels programs call: the cos/sin table in caller-given scratch (garbage-filled)
        work = np.full(lib.workspace_size_rope(x.shape, pos.shape), np.nan, dtype)
        for op in ("rope", "rope_back"):
            got = call(getattr(lib, op + "_work"), [x, pos], x, work, 500.0, mode == "neox")
            close(got, ref(op, x, pos, theta=500.0, mode=mode), tol)


def test_causal_mask(dt):
    dtype, _ = dt
    rng = np.random.default_rng(10)
    x = rand(rng, (2, 5, 7), dtype)
    for n_past, value in [(0, -np.inf), (2, -np.inf), (9, -np.inf), (1, 0.0)]:
        want = ref("causal_mask", x, n_past=n_past, value=value)
        np.testing.assert_array_equal(call(lib.causal_mask, [x], x, n_past, value), want)


# ---- conv2d and pooling ----------------------------------------------------------------------
CONVS = [  # N, C, H, W, O, kh, kw, stride, padding, dilation
    (2, 3, 7, 5, 4, 3, 3, (1, 1), (1, 1), (1, 1)),
    (1, 2, 11, 13, 3, 3, 2, (2, 1), (0, 2), (2, 1)),
    (3, 1, 5, 5, 1, 1, 1, (1, 1), (0, 0), (1, 1)),
    (2, 2, 8, 9, 5, 3, 3, (2, 2), (1, 1), (1, 1)),
]


@pytest.mark.parametrize("cfg", CONVS)
def test_conv2d(dt, cfg):
    dtype, tol = dt
    N, C, H, W, O, kh, kw, s, p, d = cfg
    rng = np.random.default_rng(11)
    x, w = rand(rng, (N, C, H, W), dtype), rand(rng, (O, C, kh, kw), dtype)
    attrs = dict(stride=s, padding=p, dilation=d)
    want = ref("conv2d", x, w, **attrs)
    work = np.empty(lib.workspace_size_conv2d(x.shape, w.shape, want.shape, *s, *p, *d), dtype)
    params = s + p + d
    close(call(lib.conv2d, [x, w], want, work, *params), want, tol * 10)
    g = rand(rng, want.shape, dtype)
    close(call(lib.conv2d_back_input, [w, g], x, work, *params),
          ref("conv2d_back_input", w, g, in_hw=(H, W), **attrs), tol * 10)
    close(call(lib.conv2d_back_weight, [x, g], w, work, *params),
          ref("conv2d_back_weight", x, g, kernel=(kh, kw), **attrs), tol * 10)


POOLS = [  # N, C, H, W, kernel, stride, padding
    (2, 3, 7, 5, (2, 2), (2, 2), (0, 0)),
    (1, 2, 11, 13, (3, 2), (2, 1), (1, 1)),      # overlapping windows, padding
    (3, 1, 5, 5, (3, 3), (1, 1), (1, 0)),
    (4, 8, 67, 65, (2, 2), (2, 2), (0, 0)),     # planes split over threads (prange branch)
    (2, 8, 66, 63, (3, 3), (2, 2), (1, 1)),
]


@pytest.mark.parametrize("cfg", POOLS)
def test_pools(dt, cfg):
    dtype, tol = dt
    N, C, H, W, k, s, p = cfg
    rng = np.random.default_rng(12)
    x = np.round(rand(rng, (N, C, H, W), dtype))          # many tied maxima
    x[0, 0, :2, :2] = -np.inf
    attrs = dict(kernel=k, stride=s, padding=p)
    params = k + s + p
    want = ref("max_pool2d", x, **attrs)
    np.testing.assert_array_equal(call(lib.max_pool2d, [x], want, *params), want)
    g = rand(rng, want.shape, dtype)
    close(call(lib.max_pool2d_back, [x, g], x, *params), ref("max_pool2d_back", x, g, **attrs), tol)
    x[0, 0, :2, :2] = 0
    want = ref("avg_pool2d", x, **attrs)
    close(call(lib.avg_pool2d, [x], want, *params), want, tol)
    close(call(lib.avg_pool2d_back, [g], x, *params),
          ref("avg_pool2d_back", g, in_hw=(H, W), **attrs), tol)


# ---- the parallel (prange) paths -------------------------------------------------------------
def test_parallel_paths(dt):
    """Inputs above PAR_MIN_WORK take the prange loops; they must agree with the references."""
    dtype, tol = dt
    rng = np.random.default_rng(13)
    x = rand(rng, (PAR_MIN_WORK // 200, 211), dtype)
    g = rand(rng, x.shape, dtype)
    close(call(lib.softmax, [x], x, 1), ref("softmax", x, axis=1), tol)
    y = ref("softmax", x, axis=1)
    close(call(lib.softmax_back, [y, g], x, 1), ref("softmax_back", y, g, axis=1), tol)
    close(call(lib.layer_norm_back, [x, g], x, 1e-5), ref("layer_norm_back", x, g, eps=1e-5), tol)
    labels = rng.integers(0, x.shape[1], x.shape[0]).astype(np.int32)
    close(call(lib.cross_entropy, [x, labels], np.zeros((), dtype)),
          ref("cross_entropy", x, labels), tol)
    close(call(lib.cross_entropy_back, [x, labels, np.asarray(0.5, dtype)], x),
          ref("cross_entropy_back", x, labels, np.asarray(0.5, dtype)), tol)
    xr = rand(rng, (4, 64, 8, 64), dtype)
    pos = np.arange(64, dtype=np.int32)
    close(call(lib.rope, [xr, pos], xr, 1e4, True), ref("rope", xr, pos, mode="neox"), tol)

"""Reductions and shape ops against explicit Python loops over indices (the oracle)."""
import itertools
import math

import numpy as np
import pytest

import jitgraph as jg

DT = {"f32": np.float32, "f64": np.float64}
RTOL = {"f32": 1e-5, "f64": 1e-12}


def evaluate(fn, *arrays):
    g = jg.Graph("t")
    ins = [g.input(f"a{i}", a.shape, a.dtype) for i, a in enumerate(arrays)]
    g.output(out=fn(*ins))
    return jg.interp.run(g, {f"a{i}": a for i, a in enumerate(arrays)})["out"]


def loop_reduce(f, x, axes, keepdims):
    """Group the elements of x by their index on the kept axes and reduce each group with f."""
    groups = {}
    for idx in np.ndindex(*x.shape):
        key = tuple(0 if ax in axes else i for ax, i in enumerate(idx))
        groups.setdefault(key, []).append(float(x[idx]))
    kshape = tuple(1 if ax in axes else d for ax, d in enumerate(x.shape))
    out = np.empty(kshape)
    for key in np.ndindex(*kshape):
        out[key] = f(groups[key])
    return out if keepdims else out.reshape([d for ax, d in enumerate(x.shape) if ax not in axes])


def _lse(vs):
    m = max(vs)
    return m if math.isinf(m) else m + math.log(math.fsum(math.exp(v - m) for v in vs))


REDUCTIONS = {"sum": (jg.sum, math.fsum), "mean": (jg.mean, lambda vs: math.fsum(vs) / len(vs)),
              "max": (jg.max, max), "logsumexp": (jg.logsumexp, _lse)}
AXES = [((7, 13), None), ((7, 13), 0), ((7, 13), -1), ((3, 1, 5), (0, 2)), ((3, 1, 5), 1),
        ((2, 3, 4), (1,)), ((13,), 0), ((1,), None), ((2, 3), ())]


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("shape,axis", AXES, ids=str)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_reductions(name, shape, axis, keepdims, dtype):
    fn, f = REDUCTIONS[name]
    x = np.random.default_rng(7).uniform(-3, 3, shape).astype(DT[dtype])
    out = evaluate(lambda t: fn(t, axis=axis, keepdims=keepdims), x)
    axes = range(len(shape)) if axis is None else [a % len(shape) for a in np.atleast_1d(axis)]
    assert out.dtype == x.dtype
    want = loop_reduce(f, x, set(axes), keepdims)
    assert out.shape == want.shape
    np.testing.assert_allclose(out, want, rtol=RTOL[dtype], atol=1e-6 if dtype == "f32" else 0)


def test_integer_sum_and_max():
    x = np.array([[5, -2, 7], [1, 9, -4]], np.int32)
    s, m = evaluate(lambda t: jg.sum(t, axis=1), x), evaluate(lambda t: jg.max(t, axis=0), x)
    assert s.dtype == np.int32 and list(s) == [10, 6]
    assert m.dtype == np.int32 and list(m) == [5, 9, 7]
    with pytest.raises(jg.ShapeError, match=r"mean: operand must be a float \(f32, f64, f16, bf16\), got a0 i32\[2,3\]"):
        evaluate(jg.mean, x)


def test_logsumexp_is_stable():
    x = np.array([[1000.0, 1000.0, -np.inf], [-1000.0, -1001.0, -np.inf], [-np.inf] * 3])
    out = evaluate(lambda t: jg.logsumexp(t, axis=1), x)
    assert out[0] == pytest.approx(1000 + math.log(2), rel=1e-15)
    assert out[1] == pytest.approx(-1000 + math.log1p(math.exp(-1)), rel=1e-15)
    assert out[2] == -np.inf


def test_argmax_first_maximum_and_count_equal():
    x = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, 2.0], [-5.0, -4.0, -9.0, -4.5]], np.float32)
    want = [max(range(len(r)), key=lambda i: (r[i], -i)) for r in x.tolist()]
    out = evaluate(jg.argmax, x)
    assert out.dtype == np.int32 and list(out) == want == [1, 0, 1]
    assert evaluate(lambda t: jg.argmax(t, axis=0, keepdims=True), x).tolist() == [[1, 0, 0, 1]]
    a = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    b = np.array([[1, 0, 3], [4, 5, 0]], np.int32)
    c = evaluate(jg.count_equal, a, b)
    assert c.dtype == np.int32 and c.shape == () and int(c) == 4


# ---- shape ops -----------------------------------------------------------------------------
def _arange(shape, dtype="f64"):
    return (np.arange(math.prod(shape)) * 1.5 - 4).astype(DT[dtype]).reshape(shape)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_reshape_permute_transpose(dtype):
    x = _arange((2, 3, 5), dtype)
    flat = [x[i, j, k] for i in range(2) for j in range(3) for k in range(5)]
    r = evaluate(lambda t: jg.reshape(t, (5, -1)), x)
    assert r.shape == (5, 6) and r.dtype == x.dtype and r.reshape(-1).tolist() == flat
    p = evaluate(lambda t: jg.permute(t, (2, 0, 1)), x)
    assert p.shape == (5, 2, 3)
    assert all(p[k, i, j] == x[i, j, k] for i, j, k in itertools.product(range(2), range(3), range(5)))
    t2 = evaluate(lambda t: t.T, x)
    assert t2.shape == (5, 3, 2) and all(t2[k, j, i] == x[i, j, k]
                                         for i, j, k in np.ndindex(2, 3, 5))


def test_broadcast_to():
    x = _arange((3, 1))
    out = evaluate(lambda t: jg.broadcast_to(t, (2, 3, 4)), x)
    assert out.shape == (2, 3, 4)
    assert all(out[a, b, c] == x[b, 0] for a, b, c in np.ndindex(2, 3, 4))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis):
    shapes = [(2, 3), (2, 3), (2, 3)]
    shapes = [tuple(k + 1 if i == axis % 2 else d for i, d in enumerate(s)) for k, s in enumerate(shapes)]
    xs = [_arange(s) + 100 * k for k, s in enumerate(shapes)]
    out = evaluate(lambda *ts: jg.concat(ts, axis=axis), *xs)
    ax = axis % 2
    want = []    # walk the output along `axis`, taking slabs from each operand in turn
    for x in xs:
        for i in range(x.shape[ax]):
            want.append(x[i] if ax == 0 else x[:, i])
    want = np.array(want) if ax == 0 else np.array(want).T
    np.testing.assert_array_equal(out, want)


SLICES = [((7,), [(None, None, None)]), ((7,), [(2, 5, None)]), ((7,), [(None, None, -1)]),
          ((13,), [(11, 1, -3)]), ((13,), [(1, None, 4)]), ((7,), [(5, 2, None)]),
          ((5, 6), [(1, 4), (None, None, -2)]), ((5, 6), [(-2, None), (4, 0, -1)]),
          ((3, 4, 5), [None, (1, 3), (4, None, -4)]), ((4, 3), [(-100, 100, 3)])]


@pytest.mark.parametrize("shape,specs", SLICES, ids=str)
def test_slice(shape, specs):
    x = _arange(shape)
    out = evaluate(lambda t: jg.slice(t, *specs), x)
    ranges = []
    for ax, d in enumerate(shape):
        s = specs[ax] if ax < len(specs) and specs[ax] is not None else (None, None, None)
        ranges.append(list(range(d))[slice(*s)])
    want = np.empty([len(r) for r in ranges])
    for out_idx in np.ndindex(*want.shape):
        want[out_idx] = x[tuple(r[i] for r, i in zip(ranges, out_idx))]
    np.testing.assert_array_equal(out, want)


def test_slice_back_scatters():
    g = np.array([[1.0, 2.0], [3.0, 4.0]])
    out = evaluate(lambda t: jg.apply("slice_back", t, shape=(5, 3), slices=((4, -1, -3), (0, 3, 2))), g)
    want = np.zeros((5, 3))
    for i, r in enumerate(range(4, -1, -3)):
        for j, c in enumerate(range(0, 3, 2)):
            want[r, c] = g[i, j]
    np.testing.assert_array_equal(out, want)
    with pytest.raises(jg.ShapeError, match="slice_back: gradient a0 f64.2,2. does not match slice"):
        evaluate(lambda t: jg.apply("slice_back", t, shape=(5, 3), slices=((0, 5, 1), (0, 3, 2))), g)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_pad(dtype):
    x = _arange((2, 3), dtype)
    out = evaluate(lambda t: jg.pad(t, [(1, 2), (0, 3)], value=-7.0), x)
    assert out.shape == (5, 6) and out.dtype == x.dtype
    for i, j in np.ndindex(5, 6):
        inside = 1 <= i < 3 and j < 3
        assert out[i, j] == (x[i - 1, j] if inside else -7.0)
    assert evaluate(lambda t: jg.pad(t, [(2, 0)]), x).shape == (2, 5)   # leading axes unpadded


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_get_rows_and_back(dtype):
    w = _arange((5, 3), dtype)
    idx = np.array([[4, 0, 4], [1, 1, 2]], np.int32)
    out = evaluate(jg.get_rows, w, idx)
    assert out.shape == (2, 3, 3) and out.dtype == w.dtype
    assert all(out[i, j, k] == w[idx[i, j], k] for i, j, k in np.ndindex(2, 3, 3))
    gr = _arange((2, 3, 3), dtype)
    back = evaluate(lambda t, i: jg.apply("get_rows_back", t, i, n_rows=6), gr, idx)
    want = np.zeros((6, 3))
    for i, j in np.ndindex(2, 3):
        for k in range(3):
            want[idx[i, j], k] += gr[i, j, k]
    assert back.dtype == w.dtype
    np.testing.assert_allclose(back, want, rtol=RTOL[dtype])


def test_get_rows_index_errors():
    w, bad = _arange((5, 3)), np.array([0, 5], np.int32)
    with pytest.raises(IndexError, match=r"get_rows: index out of range \[0, 5\)"):
        evaluate(jg.get_rows, w, bad)
    with pytest.raises(IndexError, match="get_rows_back: index out of range"):
        evaluate(lambda t, i: jg.apply("get_rows_back", t, i, n_rows=5), w[:2], bad)
    with pytest.raises(jg.ShapeError, match=r"get_rows: indices must be i32, got a1 f64\[2\]"):
        evaluate(jg.get_rows, w, bad.astype(np.float64))


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_matmul(ta, tb, dtype):
    rng = np.random.default_rng(3)
    m, k, n = 7, 13, 5
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(DT[dtype])
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(DT[dtype])
    out = evaluate(lambda x, w: jg.matmul(x, w, ta=ta, tb=tb), a, b)
    A, B = (a.T if ta else a), (b.T if tb else b)
    want = [[math.fsum(float(A[i, p]) * float(B[p, j]) for p in range(k)) for j in range(n)]
            for i in range(m)]
    assert out.dtype == a.dtype
    np.testing.assert_allclose(out, want, rtol=RTOL[dtype] * 10, atol=1e-5)


def test_batched_matmul_broadcasts():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((3, 1, 2, 4)), rng.standard_normal((5, 4, 3))
    out = evaluate(jg.matmul, a, b)
    assert out.shape == (3, 5, 2, 3)
    for i, j in np.ndindex(3, 5):
        np.testing.assert_allclose(out[i, j], [[sum(a[i, 0, r, p] * b[j, p, c] for p in range(4))
                                                for c in range(3)] for r in range(2)], rtol=1e-12)

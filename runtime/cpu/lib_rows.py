"""Row-wise kernels: softmax, log_softmax, softmax_back, last-axis max / argmax / logsumexp,
count_equal, cross_entropy, cross_entropy_back.

A "row" is the run of elements along the op's axis; for an axis other than the last, row r of
x viewed as [outer, n, inner] starts at (r // inner) * n * inner + r % inner with stride inner.
Sums accumulate in float64 (more accurate than the float32 references, well inside rtol 1e-5);
exp/log run in the array's dtype. Rows run in a prange when there is enough work."""
from __future__ import annotations

import math

from numba import prange

from .lib_common import PAR_MIN_WORK, kernel, pkernel


@kernel
def split_axis(shape, axis):
    """(outer, n, inner): the sizes before, at and after `axis` (negative: from the end)."""
    axis = axis % len(shape)
    outer, inner = 1, 1
    for k in range(axis):
        outer *= shape[k]
    for k in range(axis + 1, len(shape)):
        inner *= shape[k]
    return outer, shape[axis], inner


@kernel
def _row_max(xf, base, n, stride):
    """max of a row, or 0 when it is not finite (the references' log-sum-exp shift)."""
    m = xf[base]
    for k in range(1, n):
        v = xf[base + k * stride]
        if v > m:
            m = v
    return m if math.isfinite(m) else xf.dtype.type(0)


@kernel
def _row_lse(xf, base, n, stride):
    """(shift m, log(sum(exp(x - m)))) of a row."""
    m = _row_max(xf, base, n, stride)
    s = 0.0
    for k in range(n):
        s += math.exp(xf[base + k * stride] - m)
    return m, math.log(s)


@kernel
def _softmax_row(xf, of, base, n, stride, log):
    """One exp per element: softmax stores exp(x - m) and rescales by 1 / sum."""
    if log:
        m, ls = _row_lse(xf, base, n, stride)
        for k in range(n):
            of[base + k * stride] = xf[base + k * stride] - m - ls
        return
    m = _row_max(xf, base, n, stride)
    s = 0.0
    for k in range(n):
        e = math.exp(xf[base + k * stride] - m)
        of[base + k * stride] = e
        s += e
    inv = xf.dtype.type(1.0 / s)
    for k in range(n):
        of[base + k * stride] *= inv


@pkernel
def _softmax(x, out, axis, log):
    outer, n, inner = split_axis(x.shape, axis)
    xf, of = x.reshape(x.size), out.reshape(out.size)
    if x.size == 0:
        return
    if x.size * 8 < PAR_MIN_WORK:
        for r in range(outer * inner):
            _softmax_row(xf, of, (r // inner) * n * inner + r % inner, n, inner, log)
    else:
        for r in prange(outer * inner):
            _softmax_row(xf, of, (r // inner) * n * inner + r % inner, n, inner, log)


@kernel
def softmax(x, out, axis):
    """softmax: out = exp(x - logsumexp(x, axis)) along `axis` (any shape, float)."""
    _softmax(x, out, axis, False)


@kernel
def log_softmax(x, out, axis):
    """log_softmax: out = x - logsumexp(x, axis) along `axis` (any shape, float)."""
    _softmax(x, out, axis, True)


@kernel
def _softmax_back_row(yf, gf, of, base, n, stride):
    d = 0.0
    for k in range(n):
        d += gf[base + k * stride] * yf[base + k * stride]
    for k in range(n):
        i = base + k * stride
        of[i] = yf[i] * (gf[i] - d)


@pkernel
def softmax_back(y, g, out, axis):
    """softmax_back(y = softmax(x), g): out = y * (g - sum(g * y, axis)) (ggml soft_max_back)."""
    outer, n, inner = split_axis(y.shape, axis)
    yf, gf, of = y.reshape(y.size), g.reshape(g.size), out.reshape(out.size)
    if y.size == 0:
        return
    if y.size * 3 < PAR_MIN_WORK:
        for r in range(outer * inner):
            _softmax_back_row(yf, gf, of, (r // inner) * n * inner + r % inner, n, inner)
    else:
        for r in prange(outer * inner):
            _softmax_back_row(yf, gf, of, (r // inner) * n * inner + r % inner, n, inner)


@kernel
def max_last(x, out):
    """max over the last axis (axes=(ndim-1,), keepdims either way: out has x.size / n elements).
    NaN propagates as in np.max."""
    n = x.shape[x.ndim - 1]
    xf, of = x.reshape(x.size), out.reshape(out.size)
    for r in range(of.size):
        m = xf[r * n]
        for k in range(1, n):
            v = xf[r * n + k]
            if v > m or v != v:
                m = v
                if v != v:
                    break
        of[r] = m


@kernel
def argmax_last(x, out):
    """argmax over the last axis into i32 `out` (index of the first maximum; of the first NaN if
    any, as np.argmax)."""
    n = x.shape[x.ndim - 1]
    xf, of = x.reshape(x.size), out.reshape(out.size)
    for r in range(of.size):
        best, m = 0, xf[r * n]
        for k in range(1, n):
            v = xf[r * n + k]
            if m != m:
                break
            if v > m or v != v:
                best, m = k, v
        of[r] = best


@kernel
def logsumexp_last(x, out):
    """logsumexp over the last axis (keepdims either way): m + log(sum(exp(x - m))), m the row
    maximum (0 when it is infinite, as the reference)."""
    n = x.shape[x.ndim - 1]
    xf, of = x.reshape(x.size), out.reshape(out.size)
    for r in range(of.size):
        m, ls = _row_lse(xf, r * n, n, 1)
        of[r] = ls + m


@kernel
def count_equal(x, y, out):
    """count_equal: out (0-d i32) = number of positions where x == y (same shapes)."""
    xf, yf = x.reshape(x.size), y.reshape(y.size)
    c = 0
    for i in range(xf.size):
        if xf[i] == yf[i]:
            c += 1
    out[()] = c


@kernel
def _ce_row(lf, t, r, c):
    """(-sum_j t_rj log_softmax(l_r)_j, sum_j t_rj) for label (1-D int) or probability targets."""
    m, ls = _row_lse(lf, r * c, c, 1)
    if t.ndim == 1:
        k = int(t.reshape(t.size)[r])
        if k < 0 or k >= c:
            raise IndexError("cross_entropy: label out of range")
        return m + ls - lf[r * c + k], 1.0
    tf = t.reshape(t.size)
    loss, tsum = 0.0, 0.0
    for j in range(c):
        loss -= tf[r * c + j] * (lf[r * c + j] - m - ls)
        tsum += tf[r * c + j]
    return loss, tsum


@pkernel
def cross_entropy(logits, target, out):
    """cross_entropy: out (0-d) = mean over rows of -sum(target * log_softmax(logits)); logits
    [N, C]; target i32[N] labels or [N, C] probabilities. Raises IndexError for a bad label."""
    N, C = logits.shape
    lf = logits.reshape(logits.size)
    total = 0.0
    if N * C * 5 < PAR_MIN_WORK:
        for r in range(N):
            total += _ce_row(lf, target, r, C)[0]
    else:
        for r in prange(N):
            total += _ce_row(lf, target, r, C)[0]
    out[()] = total / N


@kernel
def _ce_back_row(lf, t, of, r, c, scale):
    m, ls = _row_lse(lf, r * c, c, 1)
    tsum = _ce_row(lf, t, r, c)[1] if t.ndim == 2 else 1.0
    for j in range(c):
        of[r * c + j] = math.exp(lf[r * c + j] - m - ls) * tsum * scale
    if t.ndim == 1:
        of[r * c + int(t.reshape(t.size)[r])] -= scale
    else:
        tf = t.reshape(t.size)
        for j in range(c):
            of[r * c + j] -= tf[r * c + j] * scale


@pkernel
def cross_entropy_back(logits, target, g, out):
    """cross_entropy_back: out [N, C] = (softmax(logits) * sum(target) - target) * g / N, with
    g the 0-d loss gradient; targets as in cross_entropy."""
    N, C = logits.shape
    lf, of = logits.reshape(logits.size), out.reshape(out.size)
    scale = g[()] / N
    if N * C * 8 < PAR_MIN_WORK:
        for r in range(N):
            _ce_back_row(lf, target, of, r, C, scale)
    else:
        for r in prange(N):
            _ce_back_row(lf, target, of, r, C, scale)

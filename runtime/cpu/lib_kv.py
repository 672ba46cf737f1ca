"""KV-cache kernels: set_rows (rows of a table written at run-time indices) and kv_attention
(attention over the filled part of a KV cache, the positions read at run time), and the float16
rounding they use for llama.cpp's F16 cache (f16=True).

half(x): x rounded to the nearest float16 (ties to even, half's subnormals, overflow to +-inf,
NaN kept) in float64 arithmetic, exact for f32 and f64 inputs: Veltkamp's splitting by 2^42 + 1
rounds a double to its 11 leading bits (half's precision), and adding and removing 1.5 * 2^28
rounds to a multiple of 2^-24 (half's subnormal quantum) below 2^-14. A few flops, no libm call
(ops/f16.py's frexp/ldexp expression calls libm, element by element). Checked against numpy's
astype(float16) on every float32 (tests/test_generate.py samples it).
"""
from __future__ import annotations

import math

from numba import njit

from .approx import vexp
from .lib_common import _OPTS, kernel
from .minmax import fmaximum

# the reductions of kv_attention's score and softmax loops may reassociate (they vectorise), as
# the rows kernels' do (runtime/cpu/lower.py FASTMATH); half() keeps its own strict arithmetic
fkernel = njit(**{**_OPTS, "fastmath": {"reassoc", "nsz", "contract"}})


@njit(inline="always", error_model="numpy")
def _half(d):
    """float64 d rounded to float16, branch-free (selects: the loops calling it vectorise); only
    inlined into kernels without fastmath (its splitting must not reassociate)."""
    a = abs(d)
    t = d * 4398046511105.0                           # 2^42 + 1: Veltkamp's split at 11 bits
    r = t - (t - d)
    sub = math.copysign((a + 402653184.0) - 402653184.0, d)   # 1.5 * 2^28: quantum 2^-24
    r = sub if a < 6.103515625e-05 else r             # below 2^-14: half's subnormals
    return r if a < 65520.0 or d != d else math.copysign(math.inf, d)


@kernel
def half(x):
    """x (f32 or f64) rounded to float16 (ties to even, subnormals, +-inf, NaN), as a float64."""
    return _half(float(x))


@kernel
def set_rows(table, idx, rows, out, axis, f16):
    """set_rows: out = table with out[..., idx[s], ...] = rows[..., s, ...] along `axis` (a
    repeated index keeps its last row; f16: the rows rounded to float16). When `out` is
    `table`'s buffer (the memory plan's in-place write: a KV cache param updated by it) only the
    rows are written; otherwise the table is copied first. Raises IndexError for an index
    outside [0, table.shape[axis])."""
    n = table.shape[axis]
    outer = 1
    for k in range(axis):
        outer *= table.shape[k]
    inner = table.size // (outer * n) if outer * n else 0
    tf, of, rf = table.reshape(table.size), out.reshape(out.size), rows.reshape(rows.size)
    ix = idx.reshape(idx.size)
    m = ix.size
    for s in range(m):
        if ix[s] < 0 or ix[s] >= n:
            raise IndexError("set_rows: index out of range")
    if table.ctypes.data != out.ctypes.data:
        for i in range(of.size):
            of[i] = tf[i]
    for o in range(outer):
        for s in range(m):
            dst = (o * n + ix[s]) * inner
            src = (o * m + s) * inner
            if f16:
                for j in range(inner):
                    of[dst + j] = half(rf[src + j])
            else:
                for j in range(inner):
                    of[dst + j] = rf[src + j]


def workspace_size_kv_attention(q_shape, k_shape):
    """Scratch elements of kv_attention: the probabilities of one query row and its query."""
    return k_shape[2] + q_shape[2]


@fkernel
def _scores(qr, kt, g, n, scale, sc):
    """sc[j] = (qr . kt[g, :, j]) * scale for j < n, and their maximum: head_dim passes of
    sc += q_d kt[g, d] over contiguous rows (vectorised), the maximum by llvm.maximum."""
    for j in range(n):
        sc[j] = 0.0
    for d in range(qr.size):
        qd = qr[d]
        row = kt[g, d]
        for j in range(n):
            sc[j] += qd * row[j]
    m = sc.dtype.type(-math.inf)
    for j in range(n):
        x = sc[j] * scale
        sc[j] = x
        m = fmaximum(m, x)
    return m


@fkernel
def _exp_sum(sc, n, m):
    """sc[j] = e^(sc[j] - m) for j < n (runtime/cpu/approx.py vexp: vectorises); their sum in
    float64."""
    tot = 0.0
    for j in range(n):
        e = vexp(sc[j] - m)
        sc[j] = e
        tot += e
    return tot


@kernel
def _normalise(sc, n, inv, f16):
    """sc[j] *= inv for j < n, rounded to float16 when f16 (strict arithmetic)."""
    if f16:
        for j in range(n):
            sc[j] = _half(float(sc[j] * inv))
    else:
        for j in range(n):
            sc[j] = sc[j] * inv


@fkernel
def _weighted(sc, vt, g, n, o):
    """o[d] = sum_j sc[j] vt[g, d, j] over j < n (contiguous dot products, reassociated)."""
    for d in range(o.size):
        acc = o.dtype.type(0.0)
        row = vt[g, d]
        for j in range(n):
            acc += sc[j] * row[j]
        o[d] = acc


@kernel
def kv_attention(q, kt, vt, pos, out, work, scale, f16):
    """kv_attention: q [S, H, hd], kt and vt [Hkv, hd, R] (the caches, rows last), pos i32[S]
    -> out [S, H, hd]; query (s, h) attends to rows j <= pos[s] of kv head g = h // (H / Hkv):
    scores (q . kt[g, :, j]) * scale in the array's dtype, softmax (e^(x - max), the sum in
    float64, times its inverse), then sum_j p_j vt[g, :, j]. f16: q and the probabilities
    rounded to float16 first. work: R + hd elements. Raises IndexError for a position outside
    [0, R)."""
    S, H, hd = q.shape
    Hkv, R = kt.shape[0], kt.shape[2]
    rep = H // Hkv
    sc = work[:R]
    qr = work[R:R + hd]
    T = out.dtype.type
    sct = T(scale)
    for s in range(S):
        p = pos[s]
        if p < 0 or p >= R:
            raise IndexError("kv_attention: position out of range")
        for h in range(H):
            g = h // rep
            for d in range(hd):
                qr[d] = _half(float(q[s, h, d])) if f16 else q[s, h, d]
            m = _scores(qr, kt, g, p + 1, sct, sc)
            if not math.isfinite(m):
                m = T(0.0)
            _normalise(sc, p + 1, T(1.0 / _exp_sum(sc, p + 1, m)), f16)
            _weighted(sc, vt, g, p + 1, out[s, h])

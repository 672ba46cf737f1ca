"""Causal self-attention kernels (jitgraph/ops/attention.py): attention and attention_back.

Flash attention's blocking, with the products on BLAS: one task per (batch, kv head) (a prange
over them), and in it, for each query head sharing that kv head and each block of BQ query
rows i0..i0+m, only the keys the block can see (j < i0 + m):
  forward   S = scale Q K^T (one GEMM into the task's scratch, m x keys, contiguous), the
            keys past each row's own position set to -inf, E = e^(S - the block's max) in
            place, one flat pass over the contiguous block (the masked entries come out 0),
            out = (E V) / rowsum(E) (a GEMM writing the output rows, then each row scaled by
            its 1 / sum). A row whose sum underflows there (its own max 35 or more below the
            block's) is redone with its own max, as is every row of a block holding a
            non-finite score (_probs)
  backward  S and E again (recomputed: no S x S tensor is ever stored), P = E / rowsum(E)
            in the pass that forms dS, dP = dO V^T, dS = P (dP - rowsum(dO * out)) scale,
            dq = dS K, dk^T += Q^T dS, dv^T += dO^T P
  stored    (attention_store / attention_back_stored, passes/attention.py) the forward keeps
            E and 1 / rowsum(E) in its output; the backward starts at dP
Q, K, V and the gradients are read and written where they lie ([B, S, heads, D]: a head's rows
are a strided matrix, and the GEMMs take the row stride), but for the kv head's K and V, which
a task transposes once ([D, S]), and its dk and dv, summed transposed and written back once:
no product with head_dim inside runs in OpenBLAS's transposed forms (see _transposed). A task
owns its kv head's dk and dv, so no two tasks write the same bytes. Inside the prange every
GEMM runs on one BLAS thread (the tasks are the parallelism). Scratch, all of it carved from
the caller's workspace (_task_words: the kernels allocate nothing): BQ x S floats per task for
a block of scores (backward: and one of dP) and [D, S] for each transposed k, v, dk, dv (per
task, not per thread: numba's thread id and count are not cacheable in machine code); at most
S / BQ times a score row per query, where the scores composed from primitives took S x S.

Each of these choices (BLAS blocks over query rows, the block's max, the exps in one flat pass
over the block, K and V transposed once per task) measured faster than what it replaced; rows
one at a time without BLAS and the query heads packed into one block lost (bench/README.md:
"Figures behind the code", attention kernels).
"""
from __future__ import annotations

import math
from types import FunctionType

from numba import njit, prange

from jitgraph.ops.attention import PROBS_BLOCK, REDO_BELOW

from .approx import vexp
from .blas import _N, _T, _xgemm, one_thread, restore_threads
from .lib_common import _OPTS, PAR_MIN_WORK
from .minmax import fmaximum

# the row loops' reductions may reassociate (they vectorise), as the rows kernels' do
_FAST = {**_OPTS, "fastmath": {"reassoc", "nsz", "contract"}}
fkernel = njit(**_FAST)
pfkernel = njit(parallel=True, **_FAST)

# query rows per block (32 ran stories260K's backward faster than 16 or 64); the blocks of
# attention_store's probabilities are these blocks (jitgraph/ops/attention.py's layout)
BQ = PROBS_BLOCK


# Each (batch, kv head) task's scratch, carved from the kernel's workspace (the kernels allocate
# nothing), its parts in this order, each rounded up to ALIGN elements (64 bytes in float32):
#   attention              scores block [BQ, S], k^T [D, S], 1 / rowsums [BQ]
#   attention_back         scores block, dP block [BQ, S], k^T, v^T, dk^T, dv^T, 1 / rowsums
#   attention_store        k^T
#   attention_back_stored  dP block, v^T, dk^T, dv^T, dO's rows scaled [BQ, D]
# (the [D, S] parts: the kv head's keys, values and their gradients transposed, see _transposed;
# with S < BQ, BQ is S). A task's slab is _task_words elements, task t's at t times that.
ALIGN = 16
FWD, BACK, STORE, BACK_STORED = 0, 1, 2, 3


@fkernel
def _up(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


@fkernel
def _task_words(kind, S, D):
    """Scratch elements of one task of kernel `kind` (FWD, BACK, STORE or BACK_STORED)."""
    rows = min(BQ, S)
    blk, t, small = _up(rows * S), _up(D * S), _up(rows)
    if kind == FWD:
        return blk + t + small
    if kind == BACK:
        return 2 * blk + 4 * t + small
    if kind == STORE:
        return t
    return blk + 3 * t + _up(rows * D)


# _task_words and _up run as Python here (code generation sizes the scratch; calling the kernels
# would load numba's compiled code first): the same functions
_task_words_py = FunctionType(_task_words.py_func.__code__, {**globals(), "_up": _up.py_func})


def _workspace(kind, q_shape, k_shape):
    return q_shape[0] * k_shape[2] * int(_task_words_py(kind, q_shape[1], q_shape[3]))


def workspace_size_attention(q_shape, k_shape):
    return _workspace(FWD, q_shape, k_shape)


def workspace_size_attention_back(q_shape, k_shape):
    return _workspace(BACK, q_shape, k_shape)


def workspace_size_attention_store(q_shape, k_shape):
    return _workspace(STORE, q_shape, k_shape)


@fkernel
def _mm(c, ldc, a, lda, ta, bm, ldb, tb, m, n, k, alpha, beta):
    """Row-major c[m, n] (row stride ldc) = alpha op(a) op(bm) + beta c, op(a) [m, k] and
    op(bm) [k, n]; lda and ldb are the row strides of a and bm as stored (one BLAS call)."""
    _xgemm(c, _T if tb else _N, _T if ta else _N, n, m, k, alpha, bm, ldb, a, lda, beta, ldc)


@fkernel
def _row_exp(row, n, ncols, mx):
    """row[:ncols] -> e^(x_j - mx) for keys j < n, 0 from n on; returns the row's sum. The exp
    runs over the whole width, then a select: a conditional exp is a branch LLVM does not
    vectorise, and every row's loop has the same trip count."""
    T = row.dtype.type
    tot = T(0.0)
    for j in range(ncols):
        e = vexp(row[j] - mx)
        e = e if j < n else T(0.0)
        row[j] = e
        tot += e
    return tot


@fkernel
def _row_max(row, n):
    """max(row[:n]), 0 when that is not finite (the exps then carry the NaN or inf)."""
    T = row.dtype.type
    mx = T(-math.inf)
    for j in range(n):
        mx = fmaximum(mx, row[j])  # vectorises (Python's max does not)
    return mx if math.isfinite(mx) else T(0.0)


# A row whose exps, shifted by the block's max, sum below this is redone with its own max: its
# largest term is then under 2^-50, so terms that left the normal range (under 2^-126, or
# 2^-1022 in float64) are under 2^-76 of the row's sum, past float32's and float64's precision
# in it; every term above them keeps its relative rounding. The shift itself rounds x - top to
# within |x - top| 2^-24 (float32) where x - rowmax rounded to |x - rowmax| 2^-24, below what
# the scores carry from their GEMM (|x| 2^-24 and more): against float64 on the same float32
# inputs the outputs' error is the same either way (stories260K's shape, q scaled 1 to 10:
# 4.2e-7 to 6.7e-6 with the row's max, 4.2e-7 to 6.7e-6 with the block's). REDO_BELOW is
# jitgraph/ops/attention.py's: attention_store's stored exps follow the same rule.


@fkernel
def _probs(q, kt, b, h, i0, m, ncols, sct, sc, inv):
    """sc: the block's m x ncols scores, contiguous (row ii: query i0 + ii), = scale * q[b,
    i0:i0+m, h] kt[:, :ncols] (one GEMM; kt [D, S]: the kv head's keys transposed, see
    _transposed), the keys past each row's own position set to -inf; then every entry -> e^(x - top) with top the max over the whole block (one flat max
    pass and one flat exp pass over the contiguous block: they vectorise in full, where loops
    over rows of 32 to 128 keys spent their time in remainders; the masked entries come out
    0). Not normalised: inv[ii] = 1 / the row's sum, which the caller folds into what it
    computes from the row. A row summing below REDO_BELOW gets its scores again (one row's
    GEMM: the first pass overwrote them) and its own max; when the block holds a NaN or an
    infinity every row takes its own max (the reference's semantics: a non-finite score
    poisons its own row only)."""
    H, D = q.shape[2], q.shape[3]
    S = kt.shape[1]
    T = sc.dtype.type
    _mm(sc, ncols, q[b, i0:, h], H * D, False, kt, S, False, m, ncols, D, sct, 0.0)
    for ii in range(m):
        for j in range(i0 + ii + 1, ncols):
            sc[ii, j] = T(-math.inf)
    flat = sc.reshape(m * ncols)
    top = T(-math.inf)
    for x in range(m * ncols):
        top = fmaximum(top, flat[x])
    if not math.isfinite(top):
        for ii in range(m):
            row = sc[ii]
            n = i0 + ii + 1
            inv[ii] = T(1.0) / _row_exp(row, n, ncols, _row_max(row, n))
        return
    for x in range(m * ncols):
        flat[x] = vexp(flat[x] - top)
    for ii in range(m):
        row = sc[ii]
        tot = T(0.0)
        for j in range(ncols):
            tot += row[j]
        if tot < T(REDO_BELOW):
            n = i0 + ii + 1
            _mm(row, ncols, q[b, i0 + ii:, h], H * D, False, kt, S, False, 1, ncols, D,
                sct, 0.0)
            tot = _row_exp(row, n, ncols, _row_max(row, n))
        inv[ii] = T(1.0) / tot


@njit(inline="always", **_FAST)
def _task(t, q, k):
    """(batch b, kv head g, query heads per kv head) of task t."""
    Hkv = k.shape[2]
    return t // Hkv, t % Hkv, q.shape[2] // Hkv


@njit(inline="always", **_FAST)
def _block(S, i0):
    """(rows m, keys ncols) of the query block starting at row i0."""
    m = min(BQ, S - i0)
    return m, i0 + m


# The kv head's k (and, backward, v) transposed once per task, kt [D, S], so that the products
# with head_dim as their inner dimension read it untransposed, and dk, dv summed transposed,
# [D, S], then written back once: OpenBLAS's small kernels ran the transposed forms at half the
# speed (one Zen 4 thread, us a call: scores [32, 80] k 8 as q k^T 0.92-1.15, as q kt 0.61;
# dP = dO v^T 1.15-1.21 / dO vt 0.57-0.60; dk [80, 8] += dS^T q 1.02-1.12, as dk^T += q^T dS
# 0.44-0.47).
@fkernel
def _transposed(x, b, g, xt):
    """xt [D, S] (contiguous) = x[b, :, g, :] ([S, D], rows strided) transposed; returns xt."""
    S, D = x.shape[1], x.shape[3]
    for j in range(S):
        for d in range(D):
            xt[d, j] = x[b, j, g, d]
    return xt


@fkernel
def _flat(slab, at, n):
    """(the n elements at element `at` of a task's slab, the next part's start)."""
    return slab[at:at + n], at + _up(n)


@fkernel
def _part(slab, at, shape0, shape1):
    """_flat as a [shape0, shape1] array."""
    x, nxt = _flat(slab, at, shape0 * shape1)
    return x.reshape((shape0, shape1)), nxt


@fkernel
def _write_back(xt, x, b, g):
    """x[b, :, g, :] = xt^T."""
    S, D = x.shape[1], x.shape[3]
    for j in range(S):
        for d in range(D):
            x[b, j, g, d] = xt[d, j]


@fkernel
def _fwd_task(t, q, k, v, out, slab, sct):
    S, D = q.shape[1], q.shape[3]
    b, g, rep = _task(t, q, k)
    rows = min(BQ, S)
    sc, at = _flat(slab, 0, rows * S)
    kt, at = _part(slab, at, D, S)
    inv = _flat(slab, at, rows)[0]
    _transposed(k, b, g, kt)
    for h in range(g * rep, (g + 1) * rep):
        for i0 in range(0, S, BQ):
            m, ncols = _block(S, i0)
            blk = sc[:m * ncols].reshape((m, ncols))     # contiguous: _probs's flat max
            _fwd_block(q, kt, v, out, b, h, g, i0, m, ncols, sct, blk, inv)


@fkernel
def _fwd_block(q, kt, v, out, b, h, g, i0, m, ncols, sct, blk, inv):
    """One block of query rows: its exps into blk (m x ncols), the rows' 1 / sums into inv,
    out's rows = (blk v) inv."""
    H, D = q.shape[2], q.shape[3]
    Hkv = v.shape[2]
    _probs(q, kt, b, h, i0, m, ncols, sct, blk, inv)
    _mm(out[b, i0:, h], H * D, blk, ncols, False, v[b, :, g], Hkv * D, False,
        m, D, ncols, 1.0, 0.0)
    for ii in range(m):
        for d in range(D):
            out[b, i0 + ii, h, d] *= inv[ii]


@fkernel
def _row_dot(dout, out, b, i, h):
    """rowsum(dO * out) of query row i, head h (= sum_j p_ij dp_ij), summed in float64."""
    di = 0.0
    for d in range(out.shape[3]):
        di += float(dout[b, i, h, d]) * float(out[b, i, h, d])
    return out.dtype.type(di)


@fkernel
def _dq_dk(q, k, dq, dkt, b, h, g, i0, m, ncols, dblk):
    """dq rows of the block = dS k; dk^T += q^T dS (dS: dblk, m x ncols; dkt [D, S])."""
    H, D = q.shape[2], q.shape[3]
    Hkv, S = k.shape[2], dkt.shape[1]
    _mm(dq[b, i0:, h], H * D, dblk, ncols, False, k[b, :, g], Hkv * D, False, m, D, ncols,
        1.0, 0.0)
    _mm(dkt, S, q[b, i0:, h], H * D, True, dblk, ncols, False, D, ncols, m, 1.0, 1.0)


@fkernel
def _back_task(t, q, k, v, out, dout, dq, dk, dv, slab, sct):
    B, S, H, D = q.shape
    b, g, rep = _task(t, q, k)
    rows = min(BQ, S)
    sc, at = _flat(slab, 0, rows * S)
    dp, at = _flat(slab, at, rows * S)
    kt, at = _part(slab, at, D, S)
    vt, at = _part(slab, at, D, S)
    dkt, at = _part(slab, at, D, S)
    dvt, at = _part(slab, at, D, S)
    inv = _flat(slab, at, rows)[0]
    _transposed(k, b, g, kt)
    _transposed(v, b, g, vt)
    dkt[:, :] = 0.0
    dvt[:, :] = 0.0
    for h in range(g * rep, (g + 1) * rep):
        for i0 in range(0, S, BQ):
            m, ncols = _block(S, i0)
            blk = sc[:m * ncols].reshape((m, ncols))     # both contiguous: row stride ncols
            dblk = dp[:m * ncols].reshape((m, ncols))
            _probs(q, kt, b, h, i0, m, ncols, sct, blk, inv)
            go = dout[b, i0:, h]
            _mm(dblk, ncols, go, H * D, False, vt, S, False, m, ncols, D, 1.0, 0.0)
            for ii in range(m):
                i = i0 + ii
                dit = _row_dot(dout, out, b, i, h)
                w = inv[ii]
                prow, drow = blk[ii], dblk[ii]
                for j in range(ncols):
                    p = prow[j] * w
                    prow[j] = p
                    drow[j] = p * (drow[j] - dit) * sct
            _dq_dk(q, k, dq, dkt, b, h, g, i0, m, ncols, dblk)
            _mm(dvt, S, go, H * D, True, blk, ncols, False, D, ncols, m, 1.0, 1.0)
    _write_back(dkt, dk, b, g)
    _write_back(dvt, dv, b, g)


@fkernel
def _store_task(t, q, k, v, out, e, r, slab, sct):
    """_fwd_task, the exps of each block kept in `e` (attention_store's layout: (b, h) after
    (b, h), blocks one after the other) and the rows' 1 / sums in r [B, H, S]."""
    B, S, H, D = q.shape
    b, g, rep = _task(t, q, k)
    per = e.shape[0] // (B * H)
    kt = _transposed(k, b, g, _part(slab, 0, D, S)[0])
    for h in range(g * rep, (g + 1) * rep):
        at = (b * H + h) * per
        for i0 in range(0, S, BQ):
            m, ncols = _block(S, i0)
            _fwd_block(q, kt, v, out, b, h, g, i0, m, ncols, sct,
                       e[at:at + m * ncols].reshape((m, ncols)), r[b, h, i0:i0 + m])
            at += m * ncols


@fkernel
def _back_stored_task(t, q, k, v, out, e, r, dout, dq, dk, dv, slab, sct):
    """_back_task on the stored exps: no scores, no exps; P = e r is formed in the dS pass
    (never written back: the stored block stays as it is) and dv += e^T (r dO), the rows of
    dO scaled by r in a small copy."""
    B, S, H, D = q.shape
    b, g, rep = _task(t, q, k)
    per = e.shape[0] // (B * H)
    rows = min(BQ, S)
    dp, at = _flat(slab, 0, rows * S)
    vt, at = _part(slab, at, D, S)
    dkt, at = _part(slab, at, D, S)
    dvt, at = _part(slab, at, D, S)
    gs = _part(slab, at, rows, D)[0]
    _transposed(v, b, g, vt)
    dkt[:, :] = 0.0
    dvt[:, :] = 0.0
    for h in range(g * rep, (g + 1) * rep):
        at = (b * H + h) * per
        for i0 in range(0, S, BQ):
            m, ncols = _block(S, i0)
            blk = e[at:at + m * ncols].reshape((m, ncols))
            at += m * ncols
            dblk = dp[:m * ncols].reshape((m, ncols))
            go = dout[b, i0:, h]
            _mm(dblk, ncols, go, H * D, False, vt, S, False, m, ncols, D, 1.0, 0.0)
            for ii in range(m):
                i = i0 + ii
                dit = _row_dot(dout, out, b, i, h)
                w = r[b, h, i]
                for d in range(D):
                    gs[ii, d] = dout[b, i, h, d] * w
                prow, drow = blk[ii], dblk[ii]
                for j in range(ncols):
                    drow[j] = (prow[j] * w) * (drow[j] - dit) * sct
            _dq_dk(q, k, dq, dkt, b, h, g, i0, m, ncols, dblk)
            _mm(dvt, S, gs, D, True, blk, ncols, False, D, ncols, m, 1.0, 1.0)
    _write_back(dkt, dk, b, g)
    _write_back(dvt, dv, b, g)


@fkernel
def _slab(work, t, kind, S, D):
    """Task t's flat scratch in the workspace of kernel `kind` (_task_words elements)."""
    n = _task_words(kind, S, D)
    return work[t * n:(t + 1) * n]


@fkernel
def _parallel(q, k):
    """Run the (batch, kv head) tasks in a prange: more than one, and work enough."""
    B, S, H, D = q.shape
    return B * k.shape[2] > 1 and B * H * S * S * D >= PAR_MIN_WORK


@fkernel
def _grads(grad, q, k):
    """(dq, dk, dv): the flat gradient buffer's three parts in their operands' shapes."""
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    nq, nk = B * S * H * D, B * S * Hkv * D
    return (grad[:nq].reshape((B, S, H, D)), grad[nq:nq + nk].reshape((B, S, Hkv, D)),
            grad[nq + nk:nq + 2 * nk].reshape((B, S, Hkv, D)))


@fkernel
def _stored(stored, q):
    """(out, e, r): attention_store's flat result in parts (jitgraph/ops/attention.py)."""
    B, S, H, D = q.shape
    nq = B * S * H * D
    ne = stored.shape[0] - nq - B * H * S
    return (stored[:nq].reshape((B, S, H, D)), stored[nq:nq + ne],
            stored[nq + ne:nq + ne + B * H * S].reshape((B, H, S)))


@pfkernel
def attention(q, k, v, out, work, scale):
    """attention: q [B, S, H, D], k and v [B, S, Hkv, D] -> out [B, S, H, D], causal, query head
    h over kv head h // (H / Hkv). work: workspace_size_attention(q_shape, k_shape) elements."""
    B, S, D = q.shape[0], q.shape[1], q.shape[3]
    tasks = B * k.shape[2]
    sct = out.dtype.type(scale)
    was = one_thread()
    if _parallel(q, k):
        for t in prange(tasks):
            _fwd_task(t, q, k, v, out, _slab(work, t, FWD, S, D), sct)
    else:
        for t in range(tasks):
            _fwd_task(t, q, k, v, out, _slab(work, t, FWD, S, D), sct)
    restore_threads(was)


@pfkernel
def attention_back(q, k, v, out, dout, grad, work, scale):
    """attention_back: q, out, dout [B, S, H, D], k, v [B, S, Hkv, D] -> grad, flat: dq, dk, dv
    one after the other, each C-ordered in its operand's shape. work:
    workspace_size_attention_back(q_shape, k_shape) elements."""
    B, S, D = q.shape[0], q.shape[1], q.shape[3]
    tasks = B * k.shape[2]
    dq, dk, dv = _grads(grad, q, k)
    sct = grad.dtype.type(scale)
    was = one_thread()
    if _parallel(q, k):
        for t in prange(tasks):
            _back_task(t, q, k, v, out, dout, dq, dk, dv, _slab(work, t, BACK, S, D), sct)
    else:
        for t in range(tasks):
            _back_task(t, q, k, v, out, dout, dq, dk, dv, _slab(work, t, BACK, S, D), sct)
    restore_threads(was)


def workspace_size_attention_back_stored(q_shape, k_shape):
    return _workspace(BACK_STORED, q_shape, k_shape)


@pfkernel
def attention_store(q, k, v, stored, work, scale):
    """attention_store: attention's output, then its exps and the rows' factors (the layout of
    jitgraph/ops/attention.py), into the flat `stored`. work:
    workspace_size_attention_store(q_shape, k_shape) elements."""
    out, e, r = _stored(stored, q)
    S, D = q.shape[1], q.shape[3]
    tasks = q.shape[0] * k.shape[2]
    sct = stored.dtype.type(scale)
    was = one_thread()
    if _parallel(q, k):
        for t in prange(tasks):
            _store_task(t, q, k, v, out, e, r, _slab(work, t, STORE, S, D), sct)
    else:
        for t in range(tasks):
            _store_task(t, q, k, v, out, e, r, _slab(work, t, STORE, S, D), sct)
    restore_threads(was)


@pfkernel
def attention_back_stored(q, k, v, stored, dout, grad, work, scale):
    """attention_back_stored: attention_back's gradients (flat: dq, dk, dv) from what
    attention_store kept. work: workspace_size_attention_back_stored(q_shape, k_shape)."""
    B, S, D = q.shape[0], q.shape[1], q.shape[3]
    tasks = B * k.shape[2]
    out, e, r = _stored(stored, q)
    dq, dk, dv = _grads(grad, q, k)
    sct = grad.dtype.type(scale)
    was = one_thread()
    if _parallel(q, k):
        for t in prange(tasks):
            _back_stored_task(t, q, k, v, out, e, r, dout, dq, dk, dv,
                              _slab(work, t, BACK_STORED, S, D), sct)
    else:
        for t in range(tasks):
            _back_stored_task(t, q, k, v, out, e, r, dout, dq, dk, dv,
                              _slab(work, t, BACK_STORED, S, D), sct)
    restore_threads(was)

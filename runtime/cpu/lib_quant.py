"""Storage-type kernels: a frozen weight read as its GGUF file holds it (jitgraph/types.py STORAGE).

`kind` is the storage type's ggml type number (F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K below). A
weight is uint8[rows, row_bytes]: each row its K elements in blocks along the row (any C-contiguous
integer array of those bytes will do, as bf16's uint16[rows, K]; numba cannot type a float16
array, so an f16 weight comes as its bytes or its uint16 bits).
- dequantize_row / dequantize_rows / get_rows_q: ggml's dequantize_row_* (ggml-quants.c), bit
  for bit: the same float32 operations in the same order (no FMA: fastmath is off).
- qgemm: out = alpha x @ W^T + beta out (tb, a linear layer's forward, W [N, K]) or
  alpha x @ W + beta out (its input gradient, W [K, N]) without the whole W in float32: tiles of
  W dequantized into per-thread scratch (`work`, qgemm_workspace elements) and multiplied there by
  OpenBLAS on one thread; for a few rows of x (decode), W's rows dequantized one at a time into
  L1 and dotted (or, W [K, N], added) straight from there; for one row of x (W [N, K]) each row
  of W read and dotted in one pass (lib_qdot.dot_rows).
- qgemm8: out = alpha xc @ W^T + beta out, xc each row of x converted first as ggml's CPU dot
  does (the matmul attribute xq): 8-bit quants dotted with W's in integers, or f16 (lib_qdot8).
- quantize_rows: float32 rows to f16, bf16 or q8_0 (ggml's rounding: quantize_row_q8_0_ref).
Tiles and column chunks have fixed sizes, so a result's bits do not depend on the thread count.
"""
from __future__ import annotations

from types import FunctionType

import numpy as np
from numba import njit, prange

from jitgraph.types import STORAGE

from .approx import _from_bits
from .blas import (GEMV_WEIGHT, _pool_threads, _serial_max, _small_max, _tiled, one_thread,
                   restore_threads)
from .halfconv import bf16_f32, bf16_round_bits
from .lib_common import PAR_MIN_WORK, kernel, pkernel
from .lib_qdot import LANES, _half, _scale_min_k4, dot_rows, has_row_dot
from .lib_qdot8 import dot_rows8, has_row_dot8, q8_layout

F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K = (STORAGE[t][0] for t in
                                           ("f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"))
KINDS = {name: s[0] for name, s in STORAGE.items()}          # storage name -> kind code
QK_K = 256

# rows of x up to which qgemm dequantizes W a row at a time into L1 and uses it there (dot or
# axpy): sgemm on a tile runs 2-8 rows of x far below its peak (bench/README.md, "Figures behind
# the code", quantized matmul)
FUSED_MAX_M = 8
# float32 elements of a thread's tile of dequantized W (2 MB): big enough that sgemm's repacking
# of x per tile stays small next to the tile's product, small enough to stay in L3
TILE_ELEMS = 1 << 19
TILE_ROWS_MIN = 16           # W rows (tb) or x columns (not tb) per tile, at least
CHUNK_COLS = 512             # W columns per chunk, not tb (a multiple of every block size)

_dot_kernel = njit(cache=True, nogil=True, error_model="numpy",
                   fastmath={"reassoc", "contract", "nsz"})


@kernel
def geometry(kind):
    """(elements, bytes) of one block of storage kind `kind`, or (0, 0) for an unknown kind."""
    if kind == F16 or kind == BF16:
        return 1, 2
    if kind == Q8_0:
        return 32, 34
    if kind == Q4_0:
        return 32, 18
    if kind == Q4_K:
        return QK_K, 144
    if kind == Q5_K:
        return QK_K, 176
    if kind == Q6_K:
        return QK_K, 210
    return 0, 0


# ---- dequantization (ggml-quants.c dequantize_row_*) -------------------------------------------
@kernel
def _dq_f16(src, out):
    h = src.view(np.uint16)
    for i in range(out.shape[0]):
        out[i] = _half(h[i])


@kernel
def _dq_bf16(src, out):
    h = src.view(np.uint16)
    for i in range(out.shape[0]):
        out[i] = bf16_f32(h[i])


@kernel
def _blocks(src, out, nb):
    """(bytes [blocks, nb], f16 words [blocks, nb / 2], out [blocks, block]): a row's blocks as
    2-D views, the block length a run-time value (a loop of known short length is unrolled into
    scalar code; one of unknown length is vectorised)."""
    n = src.shape[0] // nb
    return (src[:n * nb].reshape((n, nb)), src[:n * nb].view(np.uint16).reshape((n, nb // 2)),
            out.reshape((n, out.shape[0] // max(n, 1))))


@kernel
def _dq_q8_0(src, out):
    q, h, y = _blocks(src, out, 34)
    q = q.view(np.int8)
    for b in range(y.shape[0]):
        d = _half(h[b, 0])
        for j in range(y.shape[1]):
            y[b, j] = np.float32(q[b, j + 2]) * d


@kernel
def _dq_q4_0(src, out):
    q, h, y = _blocks(src, out, 18)
    half = y.shape[1] // 2
    for b in range(y.shape[0]):
        d = _half(h[b, 0])
        for j in range(half):
            y[b, j] = np.float32(np.int32(q[b, j + 2] & 15) - 8) * d
            y[b, j + half] = np.float32(np.int32(q[b, j + 2] >> 4) - 8) * d


@kernel
def _dq_q4_k(src, out):
    h = src.view(np.uint16)
    for b in range(out.shape[0] // QK_K):
        blk, y = src[b * 144:(b + 1) * 144], out[b * QK_K:(b + 1) * QK_K]
        d, dmin = _half(h[b * 72]), _half(h[b * 72 + 1])
        sc, qs = blk[4:16], blk[16:144]
        for g in range(4):
            s1, m1 = _scale_min_k4(2 * g, sc)
            s2, m2 = _scale_min_k4(2 * g + 1, sc)
            d1, n1, d2, n2 = d * s1, dmin * m1, d * s2, dmin * m2
            q, y1, y2 = qs[32 * g:32 * g + 32], y[64 * g:64 * g + 32], y[64 * g + 32:64 * g + 64]
            for l in range(32):
                y1[l] = d1 * np.float32(q[l] & 0xF) - n1
                y2[l] = d2 * np.float32(q[l] >> 4) - n2


@kernel
def _dq_q5_k(src, out):
    q, h, y = _blocks(src, out, 176)
    n32 = y.shape[1] // 8
    for b in range(y.shape[0]):
        d, dmin, sc = _half(h[b, 0]), _half(h[b, 1]), q[b, 4:16]
        for g in range(4):            # as q4_k, the fifth bits from qh's bits 2 g and 2 g + 1
            s1, m1 = _scale_min_k4(2 * g, sc)
            s2, m2 = _scale_min_k4(2 * g + 1, sc)
            d1, n1, d2, n2 = d * s1, dmin * m1, d * s2, dmin * m2
            for l in range(n32):
                v, e = q[b, 48 + 32 * g + l], np.int32(q[b, 16 + l]) >> (2 * g)
                y[b, 64 * g + l] = d1 * np.float32((v & 0xF) | ((e & 1) << 4)) - n1
                y[b, 64 * g + 32 + l] = d2 * np.float32((v >> 4) | ((e & 2) << 3)) - n2


@kernel
def _dq_q6_k(src, out):
    q, h, y = _blocks(src, out, 210)
    sc = q.view(np.int8)
    n16 = y.shape[1] // 16
    for b in range(y.shape[0]):
        d = _half(h[b, 104])
        for g in range(8):            # 32 elements: 128 * (g // 4) + 32 * (g % 4) + l
            lo, hb, m = 64 * (g // 4) + 32 * (g % 2), 128 + 32 * (g // 4), (g % 4) // 2 * 4
            sh, o = 2 * (g % 4), 128 * (g // 4) + 32 * (g % 4)
            for s in range(2):
                ds = d * np.float32(sc[b, 192 + 8 * (g // 4) + 2 * (g % 4) + s])
                for l in range(16 * s, 16 * s + n16):
                    v = ((q[b, lo + l] >> m) & 0xF) | (((q[b, hb + l] >> sh) & 3) << 4)
                    y[b, o + l] = ds * np.float32(np.int32(v) - 32)


@kernel
def _dequantize(kind, src, out):
    """out's elements from the bytes src (whole blocks; lengths unchecked)."""
    if kind == F16:
        _dq_f16(src, out)
    elif kind == BF16:
        _dq_bf16(src, out)
    elif kind == Q8_0:
        _dq_q8_0(src, out)
    elif kind == Q4_0:
        _dq_q4_0(src, out)
    elif kind == Q4_K:
        _dq_q4_k(src, out)
    elif kind == Q5_K:
        _dq_q5_k(src, out)
    elif kind == Q6_K:
        _dq_q6_k(src, out)


@kernel
def _check_row(kind, nbytes, k):
    blk, nb = geometry(kind)
    if blk == 0:
        raise ValueError("lib_quant: unknown storage kind (expected a ggml type number of "
                         "jitgraph.types.STORAGE: 1, 30, 8, 2, 12, 13 or 14)")
    if k % blk != 0 or nbytes != k // blk * nb:
        raise ValueError("lib_quant: a row's bytes do not hold its elements in whole blocks of "
                         "this storage kind (row_bytes != K / block * block_bytes)")


@kernel
def dequantize_row(kind, src, out):
    """out[K] = the float32 values of one stored row src (uint8[row_bytes])."""
    src = src.view(np.uint8)
    _check_row(kind, src.shape[0], out.shape[0])
    _dequantize(kind, src, out)


@pkernel
def dequantize_rows(kind, src, r0, r1, out):
    """out[0:r1-r0, :] = rows r0..r1 of the stored src (uint8[rows, row_bytes])."""
    src = src.view(np.uint8)
    _check_row(kind, src.shape[1], out.shape[1])
    if r1 - r0 > out.shape[0] or r0 < 0 or r1 > src.shape[0]:
        raise ValueError("dequantize_rows: rows r0..r1 outside src or more than out holds")
    if (r1 - r0) * out.shape[1] < PAR_MIN_WORK:
        for r in range(r0, r1):
            _dequantize(kind, src[r], out[r - r0])
    else:
        for r in prange(r0, r1):
            _dequantize(kind, src[r], out[r - r0])


@pkernel
def get_rows_q(w, kind, idx, out):
    """out[i, :] = dequantized row idx[i] of w (uint8[rows, row_bytes]); idx checked by the
    caller."""
    w = w.view(np.uint8)
    _check_row(kind, w.shape[1], out.shape[1])
    if idx.shape[0] * out.shape[1] < PAR_MIN_WORK:
        for i in range(idx.shape[0]):
            _dequantize(kind, w[idx[i]], out[i])
    else:
        for i in prange(idx.shape[0]):
            _dequantize(kind, w[idx[i]], out[i])


# ---- qgemm ------------------------------------------------------------------------------------
@kernel
def _tile_rows(k):
    """W rows per tile (tb): TILE_ELEMS floats, at least TILE_ROWS_MIN rows, a multiple of 16."""
    return max(TILE_ROWS_MIN, TILE_ELEMS // max(k, 1) // 16 * 16)


@kernel
def _slab(m, n, k, fused):
    """float32 elements of one thread's scratch for qgemm (either transpose flag)."""
    if fused:
        return max(k, LANES, min(n, CHUNK_COLS))       # a row of W, or a chunk of one
    rows = min(_tile_rows(k), n)                        # tb: [rows, k]
    kt = max(TILE_ROWS_MIN, TILE_ELEMS // CHUNK_COLS)   # not tb: [kt, chunk]
    return max(rows * k, min(kt, k) * min(n, CHUNK_COLS))


# _slab run as Python (code generation sizes the scratch; calling the kernel would load numba's
# compiled code first): the same function, with the kernel it calls as Python too
_slab_py = FunctionType(_slab.py_func.__code__, {**globals(), "_tile_rows": _tile_rows.py_func})


def qgemm_workspace(kind, m, n, k, threads):
    """float32 elements qgemm's `work` must hold for out [m, n] with inner dimension k, one
    slab per thread (threads: numba's pool size, blas.bt_copies())."""
    if geometry.py_func(kind)[0] == 0:
        raise ValueError(f"qgemm_workspace: unknown storage kind {kind}; expected one of "
                         f"{sorted(KINDS.values())}")
    return int(max(1, threads) * _slab_py(m, n, k, m <= FUSED_MAX_M))


@_dot_kernel
def _dot(a, b):
    """sum a[i] b[i] in float32, reassociated (vector lanes)."""
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@_dot_kernel
def _axpy(s, x, y):
    """y += s x."""
    for i in range(y.shape[0]):
        y[i] += s * x[i]


@kernel
def _scale_rows(beta, out, c0, c1):
    """out[:, c0:c1] *= beta (beta 0: zeros, whatever out held, as BLAS)."""
    for i in range(out.shape[0]):
        row = out[i, c0:c1]
        if beta == 0.0:
            row[:] = 0.0
        elif beta != 1.0:
            for j in range(row.shape[0]):
                row[j] *= beta


@kernel
def _fused_nt(kind, alpha, x, w, beta, out, buf, n0, n1):
    """out[:, n0:n1] for W rows n0..n1, each dequantized into buf and dotted with x's rows."""
    a, bt = np.float32(alpha), np.float32(beta)
    for n in range(n0, n1):
        _dequantize(kind, w[n], buf)
        for i in range(x.shape[0]):
            s = a * _dot(x[i], buf)
            out[i, n] = s if beta == 0.0 else s + bt * out[i, n]


@kernel
def _fused_nn(kind, alpha, x, w, beta, out, buf, c0, c1, blk, nb):
    """out[:, c0:c1] = alpha x @ W[:, c0:c1] + beta out: W's rows' chunk dequantized into buf,
    added into out's rows scaled by x's elements."""
    _scale_rows(beta, out, c0, c1)
    b0, b1 = c0 // blk * nb, c1 // blk * nb
    a = np.float32(alpha)
    for kk in range(w.shape[0]):
        _dequantize(kind, w[kk, b0:b1], buf)
        for i in range(x.shape[0]):
            _axpy(a * x[i, kk], buf, out[i, c0:c1])


@kernel
def _tile_nt(kind, alpha, x, w, beta, out, slab, n0, n1, small):
    """out[:, n0:n1] = alpha x @ W[n0:n1]^T + beta out[:, n0:n1]: W's rows into the slab, sgemm."""
    k = x.shape[1]
    t = slab[:(n1 - n0) * k].reshape((n1 - n0, k))
    for r in range(n0, n1):
        _dequantize(kind, w[r], t[r - n0])
    _tiled(False, True, alpha, x, k, t, k, beta, out[:, n0:], out.shape[1],
           x.shape[0], n1 - n0, k, small)


@kernel
def _tile_nn(kind, alpha, x, w, beta, out, slab, c0, c1, blk, nb, small):
    """out[:, c0:c1] = alpha x @ W[:, c0:c1] + beta out: W's rows k0..k1 of the chunk into the
    slab [kt, c1 - c0], sgemm accumulating over the k tiles."""
    k, cw = x.shape[1], c1 - c0
    kt = max(TILE_ROWS_MIN, min(k, slab.shape[0] // cw))
    b0, b1 = c0 // blk * nb, c1 // blk * nb
    bt = beta
    for k0 in range(0, k, kt):
        k1 = min(k, k0 + kt)
        t = slab[:(k1 - k0) * cw].reshape((k1 - k0, cw))
        for r in range(k0, k1):
            _dequantize(kind, w[r, b0:b1], t[r - k0])
        _tiled(False, False, alpha, x[:, k0:], k, t, cw, bt, out[:, c0:], out.shape[1],
               x.shape[0], cw, k1 - k0, small)
        bt = 1.0


@kernel
def _span(p, parts, units):
    """Units [u0, u1) of part p of `parts` (contiguous, sizes differing by at most one)."""
    return p * units // parts, (p + 1) * units // parts


@kernel
def _unit(u, size, total):
    """[start, end) of unit u of `size` elements over `total`."""
    return u * size, min(total, (u + 1) * size)


@kernel
def _run_part(p, parts, units, fused, tb, kind, alpha, x, w, beta, out, work, slab, blk, nb,
              small):
    s = work[p * slab:(p + 1) * slab]
    u0, u1 = _span(p, parts, units)
    n = out.shape[1]
    if tb and fused and x.shape[0] == 1 and has_row_dot(kind):    # decode: rows in one pass
        dot_rows(kind, alpha, x[0], w, beta, out[0], u0, u1)
    elif tb:
        size = 1 if fused else min(_tile_rows(x.shape[1]), n)
        for u in range(u0, u1):
            a, b = _unit(u, size, n)
            if fused:
                _fused_nt(kind, alpha, x, w, beta, out, s[:x.shape[1]], a, b)
            else:
                _tile_nt(kind, alpha, x, w, beta, out, s, a, b, small)
    else:
        for u in range(u0, u1):
            a, b = _unit(u, CHUNK_COLS, n)
            if fused:
                _fused_nn(kind, alpha, x, w, beta, out, s[:b - a], a, b, blk, nb)
            else:
                _tile_nn(kind, alpha, x, w, beta, out, s, a, b, blk, nb, small)


@pkernel
def qgemm_path(ta, tb, alpha, x, w, beta, out, kind, work, fused):
    """qgemm with the path chosen: W a row (or chunk) at a time in L1 (fused) or in tiles."""
    w = w.view(np.uint8)
    if ta:
        raise ValueError("qgemm: x transposed (ta) is not supported; a stored weight's "
                         "gradient is never taken")
    m, n = out.shape
    k = x.shape[1]
    if x.shape[0] != m or w.shape[0] != (n if tb else k):
        raise ValueError("qgemm: shapes differ: x [M, K], w [N, row_bytes] (tb) or "
                         "[K, row_bytes] (not tb), out [M, N]")
    _check_row(kind, w.shape[1], k if tb else n)
    if m == 0 or n == 0:
        return
    blk, nb = geometry(kind)
    slab = _slab(m, n, k, fused)
    if work.shape[0] < slab:
        raise ValueError("qgemm: work holds fewer float32 elements than one thread's slab "
                         "(qgemm_workspace)")
    if k == 0:
        _scale_rows(beta, out, 0, n)
        return
    if tb:
        units = n if fused else (n + min(_tile_rows(k), n) - 1) // min(_tile_rows(k), n)
    else:
        units = (n + CHUNK_COLS - 1) // CHUNK_COLS
    parts = min(_pool_threads(), units, work.shape[0] // slab)
    small = _small_max()
    was = one_thread()
    if tb and fused and m == 1 and has_row_dot(kind):   # a GEMV: on the pool as blas._gemv
        par = parts > 1 and GEMV_WEIGHT * n * k > _serial_max()
    else:
        par = parts > 1 and (m + 4) * n * k >= PAR_MIN_WORK
    if par:
        for p in prange(parts):
            _run_part(p, parts, units, fused, tb, kind, alpha, x, w, beta, out, work, slab,
                      blk, nb, small)
    else:
        _run_part(0, 1, units, fused, tb, kind, alpha, x, w, beta, out, work, slab, blk, nb,
                  small)
    restore_threads(was)


@kernel
def qgemm(ta, tb, alpha, x, w, beta, out, kind, work):
    """out[M, N] = alpha * x @ op(W) + beta * out, W the float32 values of the stored w
    (uint8[rows, row_bytes]): tb, W [N, K] (x @ W^T); not tb, W [K, N]. x float32 [M, K], C order.
    work: qgemm_workspace(kind, M, N, K, threads) float32 elements."""
    qgemm_path(ta, tb, alpha, x, w, beta, out, kind, work, out.shape[0] <= FUSED_MAX_M)


@pkernel
def qgemm8(alpha, x, w, beta, out, kind, work):
    """out[M, N] = alpha xc @ W^T + beta out: xc each row of x (float32 [M, K]) converted for
    W's kind as ggml's dot does (lib_qdot8: 8-bit quants, or f16), W [N, K] stored
    (uint8[N, row_bytes]) of a kind has_row_dot8 accepts. work: at least one q8_layout per pool
    thread (float32; qgemm_workspace for tb is more). W's rows split over the pool for each row
    of x, as a GEMV (a prompt's rows read W once each)."""
    w = w.view(np.uint8)
    m, n = out.shape
    k = x.shape[1]
    if not has_row_dot8(kind):
        raise ValueError("qgemm8: x converted as ggml's dot does is dotted with f16, q8_0, "
                         "q4_k or q6_k weights only")
    if x.shape[0] != m or w.shape[0] != n:
        raise ValueError("qgemm8: shapes differ: x [M, K], w [N, row_bytes], out [M, N]")
    _check_row(kind, w.shape[1], k)
    if m == 0 or n == 0:
        return
    if k == 0:
        _scale_rows(beta, out, 0, n)
        return
    slab = q8_layout(kind, k)[3]
    parts = min(_pool_threads(), n, work.shape[0] // slab)
    if parts < 1:
        raise ValueError("qgemm8: work holds fewer float32 elements than one quantized row of "
                         "x (q8_layout)")
    was = one_thread()
    if parts > 1 and GEMV_WEIGHT * n * k > _serial_max():
        for r in range(m):
            for p in prange(parts):
                u0, u1 = _span(p, parts, n)
                dot_rows8(kind, alpha, x[r], w, beta, out[r], u0, u1,
                          work[p * slab:(p + 1) * slab])
    else:
        for r in range(m):
            dot_rows8(kind, alpha, x[r], w, beta, out[r], 0, n, work[:slab])
    restore_threads(was)


# ---- quantization (writers) --------------------------------------------------------------------
@pkernel
def _q8_0_blocks(x, qs, d):
    """ggml's quantize_row_q8_0_ref over x [rows, K]: d = amax / 127 per block of 32, q =
    roundf(x / d) (x * (1/d), as ggml; halves away from zero) into qs (int8, x's shape)."""
    rows, k = x.shape
    for r in prange(rows):
        xr, qr, dr = x[r], qs[r], d[r]
        for b in range(k // 32):
            amax = np.float32(0.0)
            for j in range(32):
                v = abs(xr[b * 32 + j])
                amax = v if v > amax else amax
            db = amax / np.float32(127.0)
            inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
            dr[b] = db
            for j in range(32):
                v = np.float64(xr[b * 32 + j] * inv)      # the product in float32, as ggml
                a = np.floor(abs(v) + 0.5)                # exact in float64
                qr[b * 32 + j] = np.int8(a if v >= 0 else -a)


@pkernel
def _bf16_rows(x, out):
    """ggml's GGML_FP32_TO_BF16 over the bits x (uint32 [rows, K]) into out (uint16): round to
    nearest even, a NaN kept quiet (its high bits, the quiet bit set)."""
    for r in prange(x.shape[0]):
        xr, yr = x[r], out[r]
        for j in range(xr.shape[0]):
            yr[j] = bf16_round_bits(np.int64(xr[j]))


def quantize_rows(kind, x):
    """uint8[rows, row_bytes]: the float32 rows x [rows, K] stored as `kind` (F16, BF16 or Q8_0),
    rounded as ggml does (f16 and bf16 to nearest even, bf16 NaN kept quiet)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize_rows: expected float32 rows [rows, K], got shape {x.shape}")
    rows, k = x.shape
    if kind == F16:
        return x.astype(np.float16).view(np.uint8).reshape(rows, 2 * k)
    if kind == BF16:
        out = np.empty((rows, k), np.uint16)
        _bf16_rows(x.view(np.uint32), out)
        return out.view(np.uint8)
    if kind == Q8_0:
        if k % 32:
            raise ValueError(f"quantize_rows: q8_0 needs rows of whole blocks of 32, got K = {k}")
        bad = ~np.isfinite(x).all(axis=1)
        if bad.any():           # ggml's rounding of inf / NaN to int8 is undefined
            raise ValueError(f"quantize_rows: q8_0 of non-finite values (row "
                             f"{int(np.argmax(bad))} of {rows}); expected finite floats")
        qs = np.empty((rows, k), np.int8)
        d = np.empty((rows, k // 32), np.float32)
        _q8_0_blocks(x, qs, d)
        out = np.empty((rows, k // 32, 34), np.uint8)
        out[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(rows, k // 32, 2)
        out[:, :, 2:] = qs.view(np.uint8).reshape(rows, k // 32, 32)
        return out.reshape(rows, k // 32 * 34)
    names = {v: n for n, v in KINDS.items()}
    raise ValueError(f"quantize_rows: cannot quantize to {names.get(kind, kind)!r}; expected "
                     f"f16, bf16 or q8_0")

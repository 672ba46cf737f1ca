"""Decode's matrix-vector product on a stored weight: out[n] = alpha x . W[n] + beta out[n] for
one row x, each row of W (uint8[row_bytes], its GGUF storage kind) read and dotted in one pass.

Each element is ggml's dequantized value (the same float32 operations as lib_quant's
dequantize_row_*, a multiply-add possibly fused) times x's element, added into a LANES-wide
accumulator (the caller's scratch) summed once per row: the loops over a block's elements have a
fixed length and vectorise (int8 / nibble -> float32 converts, multiply-adds), so no row is
written out as float32 first. Only the summation order differs from dequantize-then-dot, as a
vectorised dot's does. Also here: the f16 -> float32 conversion (`_half`, ggml's, bit for bit;
`half`, the CPU's own where it has F16C: one instruction, equal for every non-NaN value) and
K-quants' 6-bit scales, which lib_quant's dequantization shares.
"""
from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from jitgraph.types import STORAGE

from .approx import _from_bits
from .lib_common import kernel

F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K = (STORAGE[t][0] for t in
                                     ("f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k"))
DOT_KINDS = (F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K)      # the kinds with a one-pass row dot
QK_K = 256
LANES = 32                   # float32 accumulator lanes per row (the scratch dot_rows needs)

_dot_kernel = njit(cache=True, nogil=True, error_model="numpy",
                   fastmath={"reassoc", "contract", "nsz"})


def _host_has_f16c() -> bool:
    try:
        return bool(llvm.get_host_cpu_features().get("f16c", False))
    except RuntimeError:
        return False


HAS_F16C = _host_has_f16c()


@kernel
def _half(h):
    """float32 value of the f16 bits h: ggml's fp16 -> fp32 without F16C (ggml-impl.h): no
    subnormal float operand, so exact under flush-to-zero too."""
    two_w = (np.int64(h) & 0x7FFF) << 17
    norm = _from_bits(np.int32((two_w >> 4) + (0xE0 << 23))) * np.float32(2.0 ** -112)
    den = _from_bits(np.int32((two_w >> 17) | (126 << 23))) - np.float32(0.5)
    v = den if two_w < (1 << 27) else norm
    return -v if h & 0x8000 else v


@intrinsic
def _half_f16c(typingctx, h):
    """float32 value of the f16 bits h (an unsigned 16-bit integer) by LLVM's fpext from half:
    F16C's vcvtph2ps, vectorised in loops (a NaN comes out quiet, its payload kept)."""
    if not isinstance(h, types.Integer) or h.bitwidth != 16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(h), codegen


half = _half_f16c if HAS_F16C else _half


@kernel
def _scale_min_k4(j, s):
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 bytes s."""
    if j < 4:
        return np.float32(s[j] & 63), np.float32(s[j + 4] & 63)
    return (np.float32((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)),
            np.float32((s[j + 4] >> 4) | ((s[j] >> 6) << 4)))


@_dot_kernel
def _sum(acc):
    s = np.float32(0.0)
    for j in range(LANES):
        s += acc[j]
    return s


@_dot_kernel
def _row_f16(w, x, acc):
    h = w.view(np.uint16)
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += half(h[i]) * x[i]
    return s


@_dot_kernel
def _row_bf16(w, x, acc):
    h = w.view(np.uint16)
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += _from_bits(np.int32(np.uint32(h[i]) << np.uint32(16))) * x[i]
    return s


@_dot_kernel
def _row_q8_0(w, x, acc):
    nb = x.shape[0] // 32
    q = w[:nb * 34].reshape((nb, 34)).view(np.int8)
    h = w[:nb * 34].view(np.uint16)
    acc[:] = 0.0
    for b in range(nb):
        d = half(h[17 * b])
        for j in range(32):
            acc[j] += (np.float32(q[b, j + 2]) * d) * x[32 * b + j]
    return _sum(acc)


@_dot_kernel
def _row_q4_0(w, x, acc):
    nb = x.shape[0] // 32
    q = w[:nb * 18].reshape((nb, 18))
    h = w[:nb * 18].view(np.uint16)
    acc[:] = 0.0
    for b in range(nb):
        d = half(h[9 * b])
        for j in range(16):
            v = q[b, j + 2]
            acc[j] += (np.float32(np.int32(v & 15) - 8) * d) * x[32 * b + j] + \
                (np.float32(np.int32(v >> 4) - 8) * d) * x[32 * b + 16 + j]
    return _sum(acc)


@_dot_kernel
def _row_q4_k(w, x, acc):
    nb = x.shape[0] // QK_K
    h = w[:nb * 144].view(np.uint16)
    acc[:] = 0.0
    for b in range(nb):
        blk = w[144 * b:144 * b + 144]
        d, dmin = half(h[72 * b]), half(h[72 * b + 1])
        sc = blk[4:16]
        for g in range(4):
            s1, m1 = _scale_min_k4(2 * g, sc)
            s2, m2 = _scale_min_k4(2 * g + 1, sc)
            d1, n1, d2, n2 = d * s1, dmin * m1, d * s2, dmin * m2
            q, xo = blk[16 + 32 * g:48 + 32 * g], QK_K * b + 64 * g
            for l in range(32):
                acc[l] += (d1 * np.float32(q[l] & 0xF) - n1) * x[xo + l] + \
                    (d2 * np.float32(q[l] >> 4) - n2) * x[xo + 32 + l]
    return _sum(acc)


@_dot_kernel
def _row_q6_k(w, x, acc):
    nb = x.shape[0] // QK_K
    h = w[:nb * 210].view(np.uint16)
    sc8 = w.view(np.int8)
    acc[:] = 0.0
    for b in range(nb):
        d = half(h[105 * b + 104])
        for p in range(2):              # ggml's two halves of 128: ql += 64, qh += 32, sc += 8
            ql, qh = w[210 * b + 64 * p:], w[210 * b + 128 + 32 * p:]
            sc, xo = 210 * b + 192 + 8 * p, QK_K * b + 128 * p
            a1, a2 = d * np.float32(sc8[sc]), d * np.float32(sc8[sc + 1])
            b1, b2 = d * np.float32(sc8[sc + 2]), d * np.float32(sc8[sc + 3])
            c1, c2 = d * np.float32(sc8[sc + 4]), d * np.float32(sc8[sc + 5])
            e1, e2 = d * np.float32(sc8[sc + 6]), d * np.float32(sc8[sc + 7])
            for l in range(32):         # scale is = l / 16
                lo = l < 16
                da, db, dc, de = (a1 if lo else a2), (b1 if lo else b2), (c1 if lo else c2), \
                    (e1 if lo else e2)
                u, v, e = np.int32(ql[l]), np.int32(ql[l + 32]), np.int32(qh[l])
                q1 = ((u & 0xF) | ((e & 3) << 4)) - 32
                q2 = ((v & 0xF) | (((e >> 2) & 3) << 4)) - 32
                q3 = ((u >> 4) | (((e >> 4) & 3) << 4)) - 32
                q4 = ((v >> 4) | (((e >> 6) & 3) << 4)) - 32
                acc[l] += (da * np.float32(q1)) * x[xo + l] + \
                    (db * np.float32(q2)) * x[xo + 32 + l] + \
                    (dc * np.float32(q3)) * x[xo + 64 + l] + (de * np.float32(q4)) * x[xo + 96 + l]
    return _sum(acc)


@kernel
def has_row_dot(kind):
    """Whether dot_rows reads storage kind `kind`."""
    return kind in DOT_KINDS


@kernel
def _row(kind, w, x, acc):
    if kind == F16:
        return _row_f16(w, x, acc)
    if kind == BF16:
        return _row_bf16(w, x, acc)
    if kind == Q8_0:
        return _row_q8_0(w, x, acc)
    if kind == Q4_0:
        return _row_q4_0(w, x, acc)
    if kind == Q4_K:
        return _row_q4_k(w, x, acc)
    return _row_q6_k(w, x, acc)


@kernel
def dot_rows(kind, alpha, x, w, beta, out, acc, n0, n1):
    """out[n] = alpha x . W[n] + beta out[n] (beta 0: out not read) for W's rows n0..n1: x
    float32 [K], w uint8[rows, row_bytes] of a kind has_row_dot accepts (lengths checked by the
    caller), acc LANES float32 of scratch."""
    a, bt = np.float32(alpha), np.float32(beta)
    for n in range(n0, n1):
        s = a * _row(kind, w[n], x, acc)
        out[n] = s if beta == 0.0 else s + bt * out[n]

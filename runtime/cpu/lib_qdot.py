"""Decode's matrix-vector product on a stored weight: out[n] = alpha x . W[n] + beta out[n] for
one row x, each row of W (uint8[row_bytes], its GGUF storage kind) read and dotted in one pass.

Each element is ggml's dequantized value (the same float32 operations as lib_quant's
dequantize_row_*, a multiply-add possibly fused) times x's element, added into a LANES-wide
accumulator on the stack (registers) summed once per row: the loops over a block's elements have a
fixed length and vectorise (int8 / nibble -> float32 converts, multiply-adds), so no row is
written out as float32 first. Only the summation order differs from dequantize-then-dot, as a
vectorised dot's does. Also here: the f16 -> float32 conversion (`_half`, ggml's, bit for bit;
`half`, the CPU's own where it has F16C: one instruction, equal for every non-NaN value) and
K-quants' 6-bit scales, which lib_quant's dequantization shares.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import carray

from jitgraph.types import STORAGE

from .approx import _from_bits
from .lib_common import cpu_has, kernel

F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K = (STORAGE[t][0] for t in
                                     ("f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k"))
DOT_KINDS = (F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K)      # the kinds with a one-pass row dot
QK_K = 256
LANES = 32                   # float32 accumulator lanes per row (on the stack, _lanes)

_dot_kernel = njit(cache=True, nogil=True, error_model="numpy",
                   fastmath={"reassoc", "contract", "nsz"})
# the row dots and their parts, inlined into their caller by numba: a stack accumulator handed
# to a call LLVM leaves out of line is a pointer that escapes, and back in memory
_inline_kernel = njit(cache=True, nogil=True, error_model="numpy", inline="always",
                      fastmath={"reassoc", "contract", "nsz"})


HAS_F16C = cpu_has("f16c")


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


@intrinsic
def _lanes(typingctx):
    """A LANES float32 accumulator on the stack (an alloca): unlike an array passed in, it
    aliases neither x nor W, so LLVM keeps it in vector registers across a row's blocks instead
    of storing and reloading it each block (a store-to-load chain that bounded the row dots)."""
    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=LANES)
    return types.CPointer(types.float32)(), codegen


@_inline_kernel
def _sum(acc):
    s = np.float32(0.0)
    for j in range(LANES):
        s += acc[j]
    return s


@_inline_kernel
def _row_f16(w, x):
    h = w.view(np.uint16)
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += half(h[i]) * x[i]
    return s


@_inline_kernel
def _row_bf16(w, x):
    h = w.view(np.uint16)
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += _from_bits(np.int32(np.uint32(h[i]) << np.uint32(16))) * x[i]
    return s


@_inline_kernel
def _row_q8_0(w, x):
    nb = x.shape[0] // 32
    q = w.view(np.int8)
    h = w[:nb * 34].view(np.uint16)
    acc = carray(_lanes(), LANES)
    acc[:] = 0.0
    for b in range(nb):
        d = half(h[17 * b])
        for j in range(32):
            acc[j] += (np.float32(q[34 * b + 2 + j]) * d) * x[32 * b + j]
    return _sum(acc)


@_inline_kernel
def _row_q4_0(w, x):
    nb = x.shape[0] // 32
    h = w[:nb * 18].view(np.uint16)
    acc = carray(_lanes(), LANES)
    acc[:] = 0.0
    for b in range(nb):
        d = half(h[9 * b])
        for j in range(16):
            v = np.int32(w[18 * b + 2 + j])
            acc[j] += ((np.float32(np.int32(v & 15)) - np.float32(8.0)) * d) * x[32 * b + j]
            acc[16 + j] += ((np.float32(np.int32(v >> 4)) - np.float32(8.0)) * d) * \
                x[32 * b + 16 + j]
    return _sum(acc)


@_inline_kernel
def _row_q4_k(w, x):
    nb = x.shape[0] // QK_K
    h = w[:nb * 144].view(np.uint16)
    acc = carray(_lanes(), LANES)
    acc[:] = 0.0
    for b in range(nb):
        sc = w[144 * b + 4:144 * b + 16]
        d, dmin = half(h[72 * b]), half(h[72 * b + 1])
        for g in range(4):
            s1, m1 = _scale_min_k4(2 * g, sc)
            s2, m2 = _scale_min_k4(2 * g + 1, sc)
            d1, n1, d2, n2 = d * s1, dmin * m1, d * s2, dmin * m2
            qo, xo = 144 * b + 16 + 32 * g, QK_K * b + 64 * g
            for l in range(32):
                v = w[qo + l]            # int32 casts: numba's int64 lanes would halve the width
                acc[l] += (d1 * np.float32(np.int32(v & 0xF)) - n1) * x[xo + l] + \
                    (d2 * np.float32(np.int32(v >> 4)) - n2) * x[xo + 32 + l]
    return _sum(acc)


@_inline_kernel
def _q6_quarter(acc, scl, w, ql, qh, shift, da, db, x, xo):
    """acc[:32] += one 32-element quarter of a Q6_K half-block: the quants of ql's bytes
    ql..ql+31 (low nibbles, or high with shift 4) and qh's 2-bit fields at `shift`, the first 16
    scaled by da and the last 16 by db, read from scl (a per-lane scale: one loop of a fixed 32
    with no select, which LLVM vectorises; two loops of 16 it unrolls to scalar code)."""
    scl[:16] = da
    scl[16:] = db
    for l in range(32):
        q = ((w[ql + l] >> (shift & 4)) & 0xF) | (((w[qh + l] >> shift) & 3) << 4)
        acc[l] += (scl[l] * (np.float32(np.int32(q)) - np.float32(32.0))) * x[xo + l]


@_inline_kernel
def _row_q6_k(w, x):
    nb = x.shape[0] // QK_K
    h = w[:nb * 210].view(np.uint16)
    sc8 = w.view(np.int8)
    acc = carray(_lanes(), LANES)
    scl = carray(_lanes(), LANES)
    acc[:] = 0.0
    for b in range(nb):
        d = half(h[105 * b + 104])
        for p in range(2):              # ggml's two halves of 128: ql += 64, qh += 32, sc += 8
            ql, qh = 210 * b + 64 * p, 210 * b + 128 + 32 * p
            sc, xo = 210 * b + 192 + 8 * p, QK_K * b + 128 * p
            # quarter i: ql (+32 for odd i), low nibbles for i < 2, qh bits 2i..2i+1, scales
            # sc[2i], sc[2i + 1] (ggml's is = l / 16)
            for i in range(4):
                _q6_quarter(acc, scl, w, ql + 32 * (i & 1), qh, 2 * i,
                            d * np.float32(sc8[sc + 2 * i]), d * np.float32(sc8[sc + 2 * i + 1]),
                            x, xo + 32 * i)
    return _sum(acc)


@kernel
def has_row_dot(kind):
    """Whether dot_rows reads storage kind `kind`."""
    return kind in DOT_KINDS


@_inline_kernel
def _row(kind, w, x):
    if kind == F16:
        return _row_f16(w, x)
    if kind == BF16:
        return _row_bf16(w, x)
    if kind == Q8_0:
        return _row_q8_0(w, x)
    if kind == Q4_0:
        return _row_q4_0(w, x)
    if kind == Q4_K:
        return _row_q4_k(w, x)
    return _row_q6_k(w, x)


@_inline_kernel
def _rows(kind, alpha, x, w, beta, out, n0, n1):
    a, bt = np.float32(alpha), np.float32(beta)
    for n in range(n0, n1):
        s = a * _row(kind, w[n], x)
        out[n] = s if beta == 0.0 else s + bt * out[n]


@_dot_kernel
def dot_rows(kind, alpha, x, w, beta, out, n0, n1):
    """out[n] = alpha x . W[n] + beta out[n] (beta 0: out not read) for W's rows n0..n1: x
    float32 [K], w uint8[rows, row_bytes] of a kind has_row_dot accepts (lengths checked by the
    caller). One loop over the rows per kind (_rows inlined with the kind a constant in each
    branch), compiled with reassociation as the row dots are inlined into it."""
    if kind == F16:
        _rows(F16, alpha, x, w, beta, out, n0, n1)
    elif kind == BF16:
        _rows(BF16, alpha, x, w, beta, out, n0, n1)
    elif kind == Q8_0:
        _rows(Q8_0, alpha, x, w, beta, out, n0, n1)
    elif kind == Q4_0:
        _rows(Q4_0, alpha, x, w, beta, out, n0, n1)
    elif kind == Q4_K:
        _rows(Q4_K, alpha, x, w, beta, out, n0, n1)
    else:
        _rows(Q6_K, alpha, x, w, beta, out, n0, n1)

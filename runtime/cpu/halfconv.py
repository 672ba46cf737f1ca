"""Scalar conversions between float32 and the half types (f16, bf16) as the CPU kernels hold
them: a half value is its 16 bits (numba has no float16 array), uint16.

f16_f32 / bf16_f32 read bits as float32 (exact); f32_f16 / f32_bf16 round a float32 to the
nearest half value, ties to even, and give its bits: f16 overflows to +-inf and keeps half's
subnormals (LLVM's fptrunc to half: F16C's vcvtps2ph), bf16 keeps a NaN a NaN (made quiet, as
ggml's GGML_FP32_TO_BF16 and jitgraph/half.py's reference). All inline into the generated loops
and vectorise (no branch, no libm call).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .approx import _bits, _from_bits
from .lib_qdot import HAS_F16C, half as f16_f32   # noqa: F401  (f16 bits -> float32)

_inline = njit(inline="always", error_model="numpy")


@_inline
def bf16_f32(h):
    """float32 value of the bf16 bits h: the high half of its bits."""
    return _from_bits(np.int32(np.uint32(h) << np.uint32(16)))


@_inline
def bf16_round_bits(n):
    """The bf16 bits nearest (ties to even) to the float32 of bits n (an int64 of the 32 bits);
    a NaN stays a quiet NaN (ggml's GGML_FP32_TO_BF16)."""
    n = (n & 0xFFFF0000) | 0x400000 if (n & 0x7FFFFFFF) > 0x7F800000 else n
    return np.uint16((n + 0x7FFF + ((n >> 16) & 1)) >> 16)


@_inline
def f32_bf16(x):
    """The bf16 bits of float32 x rounded to nearest even."""
    return bf16_round_bits(np.int64(_bits(np.float32(x))) & 0xFFFFFFFF)


@intrinsic
def _f32_f16_fptrunc(typingctx, x):
    """The f16 bits of float32 x by LLVM's fptrunc to half (round to nearest even)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(x), codegen


@_inline
def _f32_f16_bits(x):
    """The f16 bits of float32 x rounded to nearest even, in integer arithmetic (a CPU without
    F16C): numpy's npy_floatbits_to_halfbits."""
    f = np.int64(_bits(x)) & 0xFFFFFFFF
    sign = (f >> 16) & 0x8000
    e = f & 0x7F800000
    m = f & 0x007FFFFF
    if e >= 0x47800000:                       # overflow, inf or NaN
        if e == 0x7F800000 and m != 0:
            return np.uint16(sign | 0x7C00 | 0x0200 | (m >> 13))
        return np.uint16(sign | 0x7C00)
    if e <= 0x38000000:                       # subnormal half or zero
        if e < 0x33000000:
            return np.uint16(sign)
        ee = e >> 23
        m = m | 0x00800000
        shift = 126 - ee                      # 14..24
        r = m >> shift
        rem = m & ((np.int64(1) << shift) - 1)
        hb = np.int64(1) << (shift - 1)
        if rem > hb or (rem == hb and (r & 1)):
            r += 1
        return np.uint16(sign | r)
    h = ((e - 0x38000000) >> 13) | (m >> 13)
    rem = m & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (h & 1)):
        h += 1                                # may carry into the exponent, up to inf
    return np.uint16(sign | h)


f32_f16 = _f32_f16_fptrunc if HAS_F16C else _f32_f16_bits

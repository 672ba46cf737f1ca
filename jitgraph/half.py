"""Half-precision values (f16, bf16) as numpy arrays, and their reference rounding.

A value of type f16 is a float16 array; one of type bf16 is a uint16 array holding the high 16
bits of an f32 (numpy has no bfloat16). What a user passes for a half input or param: that
array, or any float array, which is rounded to the type (to nearest, ties to even; a bf16 NaN
stays NaN, made quiet, as ggml's GGML_FP32_TO_BF16). What a half output gives back: that array
(`to_f32(a, "bf16")` reads bf16 bits as float32). The value's bytes in another integer view
(uint8, as a file holds them) are taken as they are.

Every op's reference in half precision: its operands read as f32, the op computed in f32 (the
numpy reference; reductions and GEMMs accumulate in f32 or wider), the result rounded to the
output's type (`round_to`). A value of f64 cast to a half type is rounded to f32 first.
"""
from __future__ import annotations

import numpy as np

from .quant import as_storage, dequantize
from .types import HALF_DTYPES, ShapeError, TensorType


def to_f32(a, dtype: str) -> np.ndarray:
    """The float32 values of the half-typed array `a` (f16: float16; bf16: uint16 bits)."""
    a = np.asarray(a)
    return dequantize(a, TensorType(dtype, a.shape))


def round_to(x, dtype: str) -> np.ndarray:
    """float x rounded to nearest even in half type `dtype`, as that type's array; x rounded to
    float32 first (one rounding for f32 input)."""
    x = np.asarray(x, np.float32)
    if dtype == "f16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    if dtype != "bf16":
        raise ValueError(f"round_to: {dtype!r} is no half type; expected one of {HALF_DTYPES}")
    return bf16_bits(x)


_CHUNK = 1 << 20        # elements bf16_bits converts at once: its temporaries are a few MB


def bf16_bits(x, out=None) -> np.ndarray:
    """ggml's GGML_FP32_TO_BF16 of the float32 array x: round to nearest even, a NaN kept NaN
    and made quiet (its high bits, the quiet bit set), as uint16 bits of x's shape; written
    into `out` (a C-contiguous uint16 array of x's size) when given. Converted a chunk at a
    time, so what it allocates besides `out` is a few MB whatever x's size (a 1 GB weight
    converted at load or at save)."""
    x = np.asarray(x, np.float32)          # (ascontiguousarray would make a 0-d x 1-d)
    if out is None:
        out = np.empty(x.shape, np.uint16)
    if out.dtype != np.uint16 or out.size != x.size or not out.flags.c_contiguous:
        raise ValueError(f"bf16_bits: out must be a C-contiguous uint16 array of {x.size} "
                         f"elements, got {out.dtype}{list(out.shape)}")
    u, o = np.ascontiguousarray(x).reshape(-1).view(np.uint32), out.reshape(-1)
    for lo in range(0, u.size, _CHUNK):
        c = u[lo:lo + _CHUNK]
        r = (c >> 16) & 1           # the rounding bias: 0x7FFF, +1 when the kept part is odd
        r += 0x7FFF
        r += c                      # no overflow: below NaN, c <= 0xFF800000 (-inf)
        r >>= 16
        nan = (c & 0x7FFFFFFF) > 0x7F800000
        if nan.any():
            r[nan] = (c[nan] >> 16) | 0x40
        o[lo:lo + _CHUNK] = r
    return out


def as_value(a, t: TensorType, what: str) -> np.ndarray:
    """A user's array for a value of half type t: t's own array as is, a float array rounded
    to t; raises ShapeError naming `what` for another shape or dtype."""
    a = np.asarray(a)
    if a.dtype.kind in "ui" and a.dtype != t.np_dtype:
        try:                    # its bytes in another integer view (uint8: a file's tensor)
            return as_storage(a, t)
        except ShapeError:
            raise ShapeError(f"{what}: a {t.dtype} value is given as {t.np_dtype.name}"
                             f"{list(t.shape)} (its own array), its bytes or a float array, "
                             f"got {a.dtype}{list(a.shape)}") from None
    if a.shape != t.shape:
        raise ShapeError(f"{what}: expected shape {t}, got {list(a.shape)}")
    if a.dtype.kind == "f" and a.dtype != t.np_dtype:
        return round_to(a, t.dtype)
    if a.dtype != t.np_dtype:
        raise ShapeError(f"{what}: a {t.dtype} value is given as {t.np_dtype.name} "
                         f"(its own array), its bytes or a float array, got {a.dtype}")
    return a

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

from .quant import as_storage, dequantize, quantize
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
    return quantize(x.reshape(-1), "bf16").reshape(x.shape)


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

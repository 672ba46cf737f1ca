"""Storage types' values (types.STORAGE): a frozen weight as its GGUF file holds it, and the
reference meaning of one, its dequantization to f32 exactly as ggml does (ggml-quants.c, which
the `gguf` package ports to numpy). The interpreter reads a storage-typed operand through
`dequantize`; the backends' kernels must agree with it.

A value's array: f16 -> float16[shape], bf16 -> uint16[shape] (an f32's high 16 bits), a block
type -> uint8[rows, row bytes] (TensorType.storage_shape)."""
from __future__ import annotations

import numpy as np

from .types import STORAGE, ShapeError, TensorType


def ggml_type(dtype: str):
    """The gguf.GGMLQuantizationType of a storage type name."""
    import gguf
    return gguf.GGMLQuantizationType(STORAGE[dtype][0])


def storage_name(ggml_type_number: int) -> str | None:
    """The storage type named by a ggml type number (gguf tensor_type), or None."""
    for name, (num, *_) in STORAGE.items():
        if num == int(ggml_type_number):
            return name
    return None


def as_storage(a, t: TensorType) -> np.ndarray:
    """`a` as the array of a value of storage type t (its bytes reinterpreted when they are
    given as another view of the same bytes: uint8 for f16/bf16); raises ShapeError when its
    size does not match."""
    a = np.asarray(a)
    want = np.dtype(t.np_dtype)
    if a.dtype != want:
        if a.dtype.itemsize * a.size != t.nbytes or a.dtype.kind not in "uif":
            raise ShapeError(f"a {t} value is {want.name}{list(t.storage_shape)}; got "
                             f"{a.dtype.name}{list(a.shape)}")
        a = np.ascontiguousarray(a).view(want)
    if a.size != int(np.prod(t.storage_shape)):
        raise ShapeError(f"a {t} value is {want.name}{list(t.storage_shape)}; got "
                         f"{a.dtype.name}{list(a.shape)}")
    return a.reshape(t.storage_shape)


def dequantize(a, t: TensorType) -> np.ndarray:
    """The f32 values of storage value `a` of type t, shape t.shape (ggml's dequantization)."""
    a = as_storage(a, t)
    if t.dtype == "f16":
        return a.astype(np.float32)
    if t.dtype == "bf16":
        u = a.astype(np.uint32)
        u <<= 16                    # in place: no second temporary of the result's size
        return u.view(np.float32)
    import gguf
    return gguf.quants.dequantize(a, ggml_type(t.dtype)).astype(np.float32).reshape(t.shape)


QUANTIZE = ("f16", "bf16", "q8_0", "q4_0")   # the types `quantize` writes
WRITE_TYPES = ("f32", "f16", "bf16", "q8_0")  # what the model and adapter writers offer (--ftype)


def quantize(x, dtype: str) -> np.ndarray:
    """x (float) in storage type `dtype` as ggml's reference quantizers write it (f16: round to
    nearest even; bf16: ggml's GGML_FP32_TO_BF16; q8_0 and q4_0: quantize_row_*_ref)."""
    if dtype not in QUANTIZE:
        raise ValueError(f"cannot write {dtype!r}; jitgraph writes {', '.join(QUANTIZE)}")
    x = np.ascontiguousarray(x, np.float32)
    t = TensorType(dtype, x.shape)             # checks the block size
    if dtype == "f16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    import gguf
    q = gguf.quants.quantize(x, ggml_type(dtype))
    return as_storage(q, t)


XQ = {"q8_0": 32, "q8_k": 256, "f16": 1}   # x's types for a matmul's xq attribute: block sizes
# the type ggml's CPU backend converts x to before its dot with a weight of each type (its type
# traits' vec_dot_type), for the weight types whose dot jitgraph has in that form
VEC_DOT_TYPE = {"q8_0": "q8_0", "q4_k": "q8_k", "q6_k": "q8_k", "f16": "f16"}


def quantize_x(x, xq: str) -> np.ndarray:
    """x's values (float32, any shape, rows along the last axis) after conversion to `xq` as
    ggml does before a dot with a weight (then read back as float32): q8_0,
    quantize_row_q8_0_ref (d = amax / 127 stored as f16, quants roundf(x / d)); q8_k,
    quantize_row_q8_K_ref (per 256, d = -(the element of largest magnitude) / 127 in float32,
    quants nearest_int(x / d) ties to even, clamped to 127); f16, rounded to nearest even."""
    x = np.ascontiguousarray(x, np.float32)
    blk = XQ[xq]
    if x.shape[-1] % blk:
        raise ShapeError(f"quantize_x: rows of {x.shape[-1]} elements are not whole {xq} "
                         f"blocks of {blk}")
    if xq == "f16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if xq == "q8_0":
        return dequantize(quantize(x, "q8_0"), TensorType("q8_0", x.shape))
    b = x.reshape(-1, blk)
    a = np.abs(b)
    first = np.argmax(a, axis=1)                    # the first element of largest magnitude
    mx = b[np.arange(len(b)), first]
    zero = a[np.arange(len(b)), first] == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127.0) / mx).astype(np.float32)
        q = np.minimum(127, np.rint(iscale[:, None] * b)).astype(np.float32)
        d = np.where(zero, np.float32(0), np.float32(1.0) / iscale).astype(np.float32)
    return (d[:, None] * q).astype(np.float32).reshape(x.shape)

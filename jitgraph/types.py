"""Value types of the IR: a dtype and a static shape."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# f16 and bf16 values: every op computes in f32 and rounds its result to nearest even (the
# reference, jitgraph/half.py); an f16 value's array is float16, a bf16 value's uint16 (the high
# 16 bits of an f32: numpy has no bfloat16)
DTYPES = {"f32": np.float32, "f64": np.float64, "i32": np.int32, "f16": np.float16,
          "bf16": np.uint16}
FLOAT_DTYPES = ("f32", "f64", "f16", "bf16")
HALF_DTYPES = ("f16", "bf16")

# Storage types: a frozen weight kept as its GGUF file holds it (ggml's formats). name ->
# (ggml type number, elements per block, bytes per block, numpy dtype of a value's array).
# Blocks run along the last axis, so a [rows, k] weight is `rows` rows of k / block blocks; the
# kernels read any of them as bytes, uint8[rows, row_bytes]. Only matmul (as its second
# operand) and get_rows (as its table) read them, dequantizing as ggml does (ggml-quants.c);
# the interpreter's reference is that dequantization to f32, then the f32 op.
STORAGE = {
    "f16": (1, 1, 2, np.float16),
    "bf16": (30, 1, 2, np.uint16),      # the high 16 bits of an f32 (no numpy bfloat16)
    "q8_0": (8, 32, 34, np.uint8),
    "q4_0": (2, 32, 18, np.uint8),
    "q4_k": (12, 256, 144, np.uint8),
    "q5_k": (13, 256, 176, np.uint8),
    "q6_k": (14, 256, 210, np.uint8),
}


class ShapeError(ValueError):
    """An ill-typed graph: wrong shapes, dtypes, axes or attributes (raised at build time)."""


def dtype_name(dt) -> str:
    """Normalise 'f32' / np.float32 / np.dtype('float32') to the IR's dtype name."""
    if isinstance(dt, str) and (dt in DTYPES or dt in STORAGE):
        return dt
    try:
        npdt = np.dtype(dt)
    except TypeError:
        raise ShapeError(f"unknown dtype {dt!r}; expected one of {', '.join(DTYPES)}") from None
    for name, t in DTYPES.items():
        if npdt == np.dtype(t) and name != "bf16":      # uint16 is no float: bf16 by name only
            return name
    raise ShapeError(f"unsupported dtype {npdt}; expected one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple

    def __post_init__(self):
        if self.dtype not in DTYPES and self.dtype not in STORAGE:
            raise ShapeError(f"unknown dtype {self.dtype!r}; expected one of "
                             f"{', '.join((*DTYPES, *STORAGE))}")
        shape = tuple(self.shape)
        for d in shape:
            if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 0:
                raise ShapeError(f"bad shape {shape}: dimensions must be non-negative ints")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if self.is_block:
            block = STORAGE[self.dtype][1]
            if not shape or shape[-1] % block:
                raise ShapeError(f"{self.dtype}[{','.join(map(str, shape))}]: a {self.dtype} "
                                 f"tensor's last axis must be a multiple of its block, {block}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def np_dtype(self):
        """The numpy dtype of the value's array (for a storage type: of its bytes' array)."""
        if self.dtype in STORAGE:
            return np.dtype(STORAGE[self.dtype][3])
        return np.dtype(DTYPES[self.dtype])

    @property
    def is_storage(self) -> bool:
        """A storage type (STORAGE): a frozen weight's file type, read by matmul and get_rows
        (f16 and bf16 are value types too: `is_half`)."""
        return self.dtype in STORAGE

    @property
    def is_half(self) -> bool:
        """f16 or bf16: a value computed in f32 and rounded on store (also a storage type)."""
        return self.dtype in HALF_DTYPES

    @property
    def is_block(self) -> bool:
        """A block-quantized storage type (q8_0, ...): only a frozen weight has one."""
        return self.dtype in STORAGE and self.dtype not in DTYPES

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (along the last axis) as stored."""
        if self.is_block:
            _, block, nb, _ = STORAGE[self.dtype]
            return self.shape[-1] // block * nb if self.shape else nb
        return (self.shape[-1] if self.shape else 1) * self.np_dtype.itemsize

    @property
    def storage_shape(self) -> tuple:
        """The shape of the value's array: the shape, but a block type's last axis counts
        bytes (q8_0[4096, 2048] is uint8[4096, 2176])."""
        if self.is_block:
            return self.shape[:-1] + (self.row_bytes,)
        return self.shape

    @property
    def nbytes(self) -> int:
        if self.is_block:
            return (self.size // self.shape[-1] if self.shape[-1] else 0) * self.row_bytes
        return self.size * self.np_dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


def broadcast_shapes(*shapes) -> tuple:
    """numpy broadcasting; raises ValueError (callers turn it into a ShapeError with context)."""
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        dims = {s[len(s) - ndim + i] for s in shapes if len(s) - ndim + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ValueError(f"axis {i - ndim}: sizes {sorted(dims)} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)

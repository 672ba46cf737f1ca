"""Value types of the IR: a dtype and a static shape."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DTYPES = {"f32": np.float32, "f64": np.float64, "i32": np.int32}
FLOAT_DTYPES = ("f32", "f64")


class ShapeError(ValueError):
    """An ill-typed graph: wrong shapes, dtypes, axes or attributes (raised at build time)."""


def dtype_name(dt) -> str:
    """Normalise 'f32' / np.float32 / np.dtype('float32') to the IR's dtype name."""
    if isinstance(dt, str) and dt in DTYPES:
        return dt
    try:
        npdt = np.dtype(dt)
    except TypeError:
        raise ShapeError(f"unknown dtype {dt!r}; expected one of {', '.join(DTYPES)}") from None
    for name, t in DTYPES.items():
        if npdt == np.dtype(t):
            return name
    raise ShapeError(f"unsupported dtype {npdt}; expected one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ShapeError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        shape = tuple(self.shape)
        for d in shape:
            if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 0:
                raise ShapeError(f"bad shape {shape}: dimensions must be non-negative ints")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

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
        return np.dtype(DTYPES[self.dtype])

    @property
    def nbytes(self) -> int:
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

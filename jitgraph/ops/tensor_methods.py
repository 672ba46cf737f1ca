"""Tensor's operators and numpy-style methods (x + y, x @ w, x.T, x.reshape, x.sum, ...),
installed on jitgraph.ir.Tensor when the op library loads: the IR defines the symbolic value, the
ops define what its operators build, and ir.py imports no op module."""
from __future__ import annotations

from ..ir import Tensor
from .elementwise import add, div, mul, neg, pow, sub
from .reduce import mean, sum
from .shape import matmul, permute, reshape


def _T(self):
    return permute(self, tuple(reversed(range(self.ndim))))


def _reshape(self, *shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return reshape(self, shape)


def _sum(self, axis=None, keepdims=False):
    return sum(self, axis=axis, keepdims=keepdims)


def _mean(self, axis=None, keepdims=False):
    return mean(self, axis=axis, keepdims=keepdims)


def _transpose(self, *axes):
    if not axes:
        return _T(self)
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    return permute(self, axes)


METHODS = {
    "__add__": lambda self, o: add(self, o), "__radd__": lambda self, o: add(o, self),
    "__sub__": lambda self, o: sub(self, o), "__rsub__": lambda self, o: sub(o, self),
    "__mul__": lambda self, o: mul(self, o), "__rmul__": lambda self, o: mul(o, self),
    "__truediv__": lambda self, o: div(self, o), "__rtruediv__": lambda self, o: div(o, self),
    "__matmul__": lambda self, o: matmul(self, o), "__rmatmul__": lambda self, o: matmul(o, self),
    "__neg__": lambda self: neg(self), "__pow__": lambda self, p: pow(self, p),
    "T": property(_T), "reshape": _reshape, "sum": _sum, "mean": _mean, "transpose": _transpose,
}

for _name, _fn in METHODS.items():
    if callable(_fn):
        _fn.__name__, _fn.__qualname__ = _name, f"Tensor.{_name}"
    setattr(Tensor, _name, _fn)

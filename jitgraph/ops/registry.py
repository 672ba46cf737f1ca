"""The op registry: every op is declared once, here or in a sibling module, as an OpDef.

An OpDef holds the attribute schema, the shape/dtype rule, the reference numpy implementation
(the oracle for every backend), the vjp rule (used by passes/autodiff.py) and the kernel form the
backends lower from (an elementwise scalar expression, or a kind the runtime knows).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..types import DTYPES, ShapeError, TensorType

REQUIRED = object()


def _as_int(v, what):
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            import numpy as np
            if isinstance(v, np.integer):
                return int(v)
        except Exception:  # pragma: no cover
            pass
        raise ShapeError(f"{what}: expected an int, got {v!r}")
    return int(v)


def _as_float(v, what):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            import numpy as np
            if isinstance(v, (np.integer, np.floating)):
                return float(v)
        except Exception:  # pragma: no cover
            pass
        raise ShapeError(f"{what}: expected a number, got {v!r}")
    return float(v)


def _as_ints(v, what):
    if not isinstance(v, (tuple, list)):
        raise ShapeError(f"{what}: expected a sequence of ints, got {v!r}")
    return tuple(_as_int(x, what) for x in v)


def _as_int_pairs(v, what):
    if not isinstance(v, (tuple, list)):
        raise ShapeError(f"{what}: expected a sequence of pairs, got {v!r}")
    out = []
    for p in v:
        p = _as_ints(p, what)
        if len(p) != 2:
            raise ShapeError(f"{what}: expected pairs, got {v!r}")
        out.append(p)
    return tuple(out)


def _as_slices(v, what):
    """Tuple of (start, stop, step) triples, already normalised to non-negative ints."""
    if not isinstance(v, (tuple, list)):
        raise ShapeError(f"{what}: expected (start, stop, step) per axis, got {v!r}")
    out = []
    for p in v:
        p = _as_ints(p, what)
        if len(p) != 3:
            raise ShapeError(f"{what}: expected (start, stop, step) per axis, got {v!r}")
        out.append(p)
    return tuple(out)


def _as_bool(v, what):
    if not isinstance(v, bool):
        raise ShapeError(f"{what}: expected a bool, got {v!r}")
    return v


def _as_str(v, what):
    if not isinstance(v, str):
        raise ShapeError(f"{what}: expected a string, got {v!r}")
    return v


def _as_dtype(v, what):
    if v not in DTYPES:
        raise ShapeError(f"{what}: expected a dtype ({', '.join(DTYPES)}), got {v!r}")
    return v


ATTR_KINDS = {
    "int": _as_int, "float": _as_float, "ints": _as_ints, "int_pairs": _as_int_pairs,
    "slices": _as_slices, "bool": _as_bool, "str": _as_str, "dtype": _as_dtype,
}


@dataclass(frozen=True)
class Arg:
    """An operand as the shape rule sees it: its printable name and its type."""
    name: str
    type: TensorType

    @property
    def shape(self):
        return self.type.shape

    @property
    def dtype(self):
        return self.type.dtype

    @property
    def ndim(self):
        return self.type.ndim

    def __str__(self):
        return f"{self.name} {self.type}"


@dataclass
class OpDef:
    name: str
    infer: Callable            # (args: list[Arg], attrs: dict) -> TensorType; raises ShapeError(msg)
    ref: Callable              # (attrs: dict, *arrays) -> np.ndarray
    arity: int | tuple | None  # exact count, (min, max), or None for any number >= 1
    attrs: dict = field(default_factory=dict)   # name -> (kind, default or REQUIRED)
    vjp: Callable | None = None  # (g, out, inputs, attrs) -> [grad or None per input]
    kind: str = "opaque"       # elementwise | reduce | gemm | view | leaf | opaque
    expr: str | None = None    # elementwise: scalar expression over {0}, {1}, ... and {attr}
    doc: str = ""
    index: Callable | None = None  # (args, attrs) -> [(operand position, bound)]: integer
                                   # operands that index, each valid in [0, bound)

    def check_attrs(self, attrs: dict) -> dict:
        out = {}
        for k in attrs:
            if k not in self.attrs:
                raise ShapeError(f"{self.name}: unknown attribute {k!r}; expected one of "
                                 f"{sorted(self.attrs) or 'none'}")
        for k, (kind, default) in self.attrs.items():
            if k not in attrs or attrs[k] is None:
                if default is REQUIRED:
                    raise ShapeError(f"{self.name}: missing attribute {k!r}")
                out[k] = default
                continue
            out[k] = ATTR_KINDS[kind](attrs[k], f"{self.name}: attribute {k!r}")
        return out

    def check_arity(self, n: int):
        a = self.arity
        ok = (a is None and n >= 1) or (isinstance(a, int) and n == a) or \
             (isinstance(a, tuple) and a[0] <= n <= a[1])
        if not ok:
            raise ShapeError(f"{self.name}: expected {a if a is not None else 'one or more'} "
                             f"operands, got {n}")


OPS: dict[str, OpDef] = {}


def register(name, *, infer, ref, arity, attrs=None, vjp=None, kind="opaque", expr=None, doc="",
             index=None):
    if name in OPS:
        raise RuntimeError(f"op {name!r} registered twice")
    OPS[name] = OpDef(name, infer, ref, arity, dict(attrs or {}), vjp, kind, expr, doc, index)
    return OPS[name]


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise ShapeError(f"unknown op {name!r}") from None


def defvjp(name):
    """Decorator attaching a vjp rule to an already registered op."""
    def deco(fn):
        OPS[name].vjp = fn
        return fn
    return deco

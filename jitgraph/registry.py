"""The op registry: every op is declared once, by a module of jitgraph/ops/, as an OpDef.

This module is the registry's machinery only (OpDef, OPS, register, get_op, Arg, the attribute
kinds, cost), so that the IR (ir.py, interp.py, validate.py) reads op facts without loading the
op library; jitgraph/ops/ fills OPS when it is imported (jitgraph/__init__.py imports it).

An OpDef holds the attribute schema, the shape/dtype rule, the reference numpy implementation
(the oracle for every backend), the vjp rule (used by passes/autodiff.py) and the op's
backend-neutral facts, which passes ask instead of comparing op names:

  kind      what kind of computation it is (KINDS); elementwise ops also give their scalar
            expression `expr`, row ops their `rows` formula (RowFormula), from which every
            backend generates code
  fusion    the roles it can take in a fused kernel (FUSION_ROLES); `pairs_with`: the forward
            op whose kernel it joins
  cheap     whether recomputing it in the backward (passes/checkpoint.py) is cheap
  flops, bytes  cost rules (ins, out, attrs) -> int over the operand and result types (`cost`
            applies them, or the kind's default)
  inplace   the operand whose buffer its result may take (None: none): the op's kernel then
            writes only what differs from that operand (set_rows writes its rows); the memory
            plan uses it when the operand dies there, or is the param the result updates

How a backend runs each op is the backend's own table (runtime/cpu/table.py,
runtime/cuda/table.py), which renders `expr` and `rows` for the ops of those kinds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from .types import DTYPES, ShapeError, TensorType

REQUIRED = object()
OPTIONAL = object()    # an attribute a node holds only when it is given (n.attr.get: None)


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


KINDS = {
    "elementwise": "out[i] = expr(operands broadcast to out's shape, at i)",
    "reduction": "folds axes of its operand (sum, max, argmax, ...)",
    "rows": "maps each row along its `axis` attribute (default: the last axis) to a row of the "
            "same length, reading the whole row (softmax, norms and their *_back ops)",
    "contraction": "sums products over an inner dimension (matmul, conv2d)",
    "view": "aliases its operand's buffer: no kernel, no bytes (reshape, checkpoint marks)",
    "leaf": "an input or a param",
    "opaque": "anything else: data movement (permute, slice, get_rows, ...), rope, losses",
}

# How an op takes half-precision (f16, bf16) operands and results (OpDef.half); by default
# elementwise, rows and reduction ops compute, views move, other ops refuse them at build time
HALF = {
    "compute": "half operands read as f32, computed in f32, a half result rounded to nearest "
               "even on store (jitgraph/half.py)",
    "move": "moves elements unchanged (reshape, permute, slice, concat): no arithmetic",
    "convert": "the conversion itself (cast): the one op a backend's kernels compute with half "
               "operands or results; passes/half.py rewrites every other computing op to it",
}
_HALF_BY_KIND = {"elementwise": "compute", "rows": "compute", "reduction": "compute",
                 "view": "move"}

FUSION_ROLES = {
    "prologue": "the elementwise group computing its operands can run inside its kernel",
    "epilogue": "elementwise nodes over its result can run inside its kernel",
    "constant": "one value and no operands: inlined as a literal into the kernels reading it",
    "update": "part of the optimizer update: the update ops share one kernel",
    "accumulate": "a sum of its two operands: when both are GEMM products read by nothing "
                  "else, the second is accumulated into the first's output (beta = 1)",
}


@dataclass(frozen=True)
class RowPass:
    """One pass over a row: per element, `lets` (name, expression) then each accumulator of
    `accs` (name, "sum" | "max", the element's term) takes its term; once every element is in,
    the `after` lines (statements) run on the row's totals. `store`: a let written to the
    output row as it goes, read back by the final value as {out}."""
    accs: tuple = ()
    lets: tuple = ()
    after: tuple = ()
    store: str | None = None


@dataclass(frozen=True)
class RowFormula:
    """A row op (kind "rows") as every backend renders it: its `passes` over each row, then
    `final`, each element's value. Expressions are numba-Python as OpDef.expr, over the
    operands at the element {0}, {1}, the row length {D}, the element type {T} (np.float32 /
    np.float64), attributes {name} (float64 literals) and the names the passes bind. Sums
    accumulate in float64 from 0.0, maxima in {T} from -inf. `stored`: the same op with the
    last pass storing into the output row, which a backend may use where that row overlaps no
    operand (softmax: one exp per element). A backend may spell the math functions of the
    per-element expressions its own way (runtime/cpu/spelling.py)."""
    passes: tuple
    final: str
    stored: RowFormula | None = None


@dataclass
class OpDef:
    name: str
    infer: Callable            # (args: list[Arg], attrs: dict) -> TensorType; raises ShapeError(msg)
    ref: Callable              # (attrs: dict, *arrays) -> np.ndarray
    arity: int | tuple | None  # exact count, (min, max), or None for any number >= 1
    attrs: dict = field(default_factory=dict)   # name -> (kind, default, REQUIRED or OPTIONAL)
    vjp: Callable | None = None  # (g, out, inputs, attrs) -> [grad or None per input]
    kind: str = "opaque"       # KINDS
    expr: str | None = None    # elementwise: scalar expression over {0}, {1}, ... and {attr}
    doc: str = ""
    index: Callable | None = None  # (args, attrs) -> [(operand position, bound)]: integer
                                   # operands that index, each valid in [0, bound)
    fusion: frozenset = frozenset()  # FUSION_ROLES it can take
    pairs_with: str | None = None  # joins the kernel of this op reading the same first operands
                                   # (cross_entropy_back: cross_entropy, one pass for both)
    cheap: bool = True         # recomputing it costs about one pass over its data
    flops: Callable | None = None  # (ins, out, attrs) -> arithmetic operations; default: `cost`
    bytes: Callable | None = None  # (ins, out, attrs) -> bytes read and written run alone
    inplace: int | None = None  # operand position whose buffer the result may take (the kernel
                                # detects the aliasing and writes only what changes)
    storage: tuple = ()        # operand positions that may be of a storage type (types.STORAGE:
                               # a frozen weight in its file's type), read dequantized
    rows: RowFormula | None = None  # kind "rows": the formula every backend renders
    half: str | None = None    # HALF: how it takes f16 / bf16 operands and results (None: not)

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
                if default is not OPTIONAL:
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
             index=None, fusion=(), pairs_with=None, cheap=True, flops=None, bytes=None,
             inplace=None, storage=(), rows=None, half=""):
    if name in OPS:
        raise RuntimeError(f"op {name!r} registered twice")
    if kind not in KINDS or not set(fusion) <= set(FUSION_ROLES) or (kind == "elementwise") != \
            (expr is not None):
        raise RuntimeError(f"op {name!r}: kind {kind!r}, fusion {sorted(fusion)} or expr "
                           f"{expr!r} not as jitgraph/registry.py defines them")
    if (kind == "rows") != isinstance(rows, RowFormula):
        raise RuntimeError(f"op {name!r}: kind {kind!r} with rows={rows!r}: an op of kind "
                           f"'rows' gives its RowFormula (jitgraph/registry.py), no other op does")
    if inplace is not None and (kind in ("elementwise", "view", "leaf") or not
                                (isinstance(inplace, int) and inplace >= 0)):
        raise RuntimeError(f"op {name!r}: inplace={inplace!r} must be an operand position of a "
                           f"non-elementwise, non-view op")
    half = _HALF_BY_KIND.get(kind) if half == "" else half
    if half is not None and half not in HALF:
        raise RuntimeError(f"op {name!r}: half={half!r}; expected one of {sorted(HALF)} or None")
    OPS[name] = OpDef(name, infer, ref, arity, dict(attrs or {}), vjp, kind, expr, doc, index,
                      frozenset(fusion), pairs_with, cheap, flops, bytes, inplace, tuple(storage),
                      rows, half)
    return OPS[name]


class Cost(NamedTuple):
    flops: int
    bytes: int


def cost(graph, n) -> Cost:
    """What computing node n alone costs: its op's flops and bytes rules, else the defaults of
    its kind: a view costs nothing; an elementwise op one operation per element, any other op
    one per operand element; bytes are every distinct operand read once and the result written
    once."""
    d = get_op(n.op)
    ins, out = [graph.nodes[i].type for i in n.inputs], n.type
    if d.kind == "view":
        return Cost(0, 0)
    flops = d.flops(ins, out, n.attr) if d.flops else \
        out.size if d.kind == "elementwise" or not ins else sum(t.size for t in ins)
    nbytes = d.bytes(ins, out, n.attr) if d.bytes else \
        sum(graph.nodes[i].type.nbytes for i in dict.fromkeys(n.inputs)) + out.nbytes
    return Cost(flops, nbytes)


def row_axis(n) -> int:
    """The axis a node of kind "rows" maps along: its `axis` attribute, else the last axis."""
    return n.attr.get("axis", n.type.ndim - 1)


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

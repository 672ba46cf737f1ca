"""The kinds of rule in the CPU backend's lowering table (runtime/cpu/table.py).

A rule runs one op: `node(graph, n, slot_of)` -> [Call] runs node n as a kernel of its own (None:
this build has no kernel for it); `kernel(graph, kg, kernel, slot_of)` -> [Call] runs a fused
kernel of passes/fuse.py that the op anchors (its `anchor`). An elementwise op needs no entry:
ELEMENTWISE lowers every one from its scalar expression, this backend's spelling
(runtime/cpu/spelling.py) where it has one, else the op's portable one (OpDef.expr).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from jitgraph.plan import Kernel
from jitgraph.registry import row_axis

from ..kernelgen import literal
from . import fused, lower
from .lower import Call, Workspace


class Elementwise:
    """Any elementwise op: its expression (runtime/cpu/spelling.py) inside the loops of
    runtime/cpu/fused.py."""

    def node(self, graph, n, slot_of):
        return [fused.elementwise(graph, Kernel(0, (n.id,), "elementwise", (n.id,)), (),
                                  slot_of=slot_of)]


ELEMENTWISE = Elementwise()


def _library():
    try:
        from . import library
    except ImportError:
        return None
    return library


@dataclass(frozen=True)
class Library:
    """A hand-written kernel of runtime/cpu/library.py, called as
    `lib.<func>(operands..., out, [work], *params(n))`; `workspace(lib, shapes, n)`: scratch
    elements it needs (shapes: the operands' and the result's); `paired(graph, kernel, inlined,
    slot_of)`: the Call running the kernel this op anchors with its `pairs_with` op. `func` is a name,
    or a callable node -> name where an op's optional operand picks another kernel."""
    func: str | Callable
    params: Callable = lambda n: []
    workspace: Callable | None = None
    paired: Callable | None = None

    def node(self, graph, n, slot_of):
        lib = _library()
        func = self.func(n) if callable(self.func) else self.func
        if lib is None or not hasattr(lib, func):
            return None
        args = [(i, graph.nodes[i].type.shape) for i in n.inputs] + [(n.id, n.type.shape)]
        if self.workspace:
            size = self.workspace(_AsPython(lib), [s for _, s in args], n)
            args.append(Workspace(size, n.type.dtype))
        return [Call(f"lib.{func}", args + [literal(p) for p in self.params(n)])]

    def kernel(self, graph, kg, kernel, slot_of):
        return [self.paired(graph, kernel, kg.inlined, slot_of)]


@dataclass(frozen=True)
class Rows:
    """An op of kind rows, its formula (OpDef.rows) as runtime/cpu/spelling.py row_templates
    renders it (table.py rows_rule): `passes` over each row ((setup, per element, after)
    lines), then `final`, each element's value (runtime/cpu/fused.py rows); `stored`: the same
    as (passes, final) writing into the output row as it goes, used when that row shares no
    byte with an operand; `imports`: lines the kernel module needs. Over another axis than the
    last (or empty) the op runs `library`."""
    passes: tuple
    final: str
    library: Library | None = None
    stored: tuple | None = None
    imports: tuple = ()

    def node(self, graph, n, slot_of):
        last = n.type.ndim - 1
        if n.type.size and last >= 0 and row_axis(n) == last:
            return [fused.rows(graph, Kernel(0, (n.id,), "rows", (n.id,), n.id), (), slot_of,
                               self)]
        return self.library.node(graph, n, slot_of) if self.library else None

    def kernel(self, graph, kg, kernel, slot_of):
        return [fused.rows(graph, kernel, kg.inlined, slot_of, self)]


@dataclass(frozen=True)
class Reduction:
    """A reduction: `rows(nest)` its loop body with kept axes outer and `memory(nest)` (if it
    has one) in memory order (runtime/cpu/lower.py Nest); `axes(attrs)` the reduced axes;
    `cost` work per element; `fastmath`: its accumulation may be reassociated."""
    rows: Callable
    memory: Callable | None = None
    axes: Callable = lambda a: a["axes"]
    cost: int = 1
    fastmath: bool = True

    def node(self, graph, n, slot_of):
        return lower.reduction(graph, n, self)

    def kernel(self, graph, kg, kernel, slot_of):
        return fused.reduce(graph, kernel, kg.inlined, self)


class Gemm:
    """matmul: BLAS GEMM calls (runtime/cpu/lower.py), with a fused prologue and epilogue."""

    def node(self, graph, n, slot_of):
        return lower.matmul(graph, n)

    def kernel(self, graph, kg, kernel, slot_of):
        return [fused.gemm(graph, kernel, kg.inlined, slot_of)]


@dataclass(frozen=True)
class Own:
    """An op with a lowering function of its own: `lower(graph, n)` -> [Call]; `library`: the
    runtime/cpu/library.py kernel its calls need, if any."""
    lower: Callable
    library: str | None = None

    def node(self, graph, n, slot_of):
        if self.library and not hasattr(_library(), self.library):
            return None
        return self.lower(graph, n)


class _AsPython:
    """The library module with its numba kernels as their Python functions: code generation
    sizes scratch space with them (calling a kernel would load numba's compiled code first)."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        f = getattr(self._lib, name)
        return getattr(f, "py_func", f)

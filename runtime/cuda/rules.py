"""The kinds of rule in the CUDA backend's lowering table (runtime/cuda/table.py).

A rule runs one op: `node(ctx, n, note)` -> [Launch] runs node n as a kernel of its own;
`kernel(ctx, k, note)` -> [Launch] runs a fused kernel of passes/fuse.py that the op anchors
(a rule without one: the op anchors no fused kernel here). An elementwise op needs no entry:
ELEMENTWISE lowers every one from its scalar expression (runtime/cuda/spelling.py); nor does a
row op: ROWS renders its formula (OpDef.rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import fused


class Rule:
    def kernel(self, ctx, k, note):
        n = ctx.g.nodes[k.anchor if k.anchor is not None else k.root]
        raise ctx.unsupported(n, f" in a fused {k.kind} kernel")


class Elementwise(Rule):
    """Any elementwise op: grid-stride launches (runtime/cuda/fused.py elementwise)."""

    def node(self, ctx, n, note):
        return fused.elementwise(ctx, [n.id], [n.id], note)

    def kernel(self, ctx, k, note):
        return fused.elementwise(ctx, list(k.nodes), list(k.outputs), note)


class Rows(Rule):
    """Any row op over the last axis: one block per row, by its formula (fused.rows)."""

    def node(self, ctx, n, note):
        return fused.rows(ctx, n, note=note)

    def kernel(self, ctx, k, note):
        return fused.rows(ctx, ctx.g.nodes[k.anchor], list(k.nodes), list(k.outputs), note)


ELEMENTWISE, ROWS = Elementwise(), Rows()


@dataclass(frozen=True)
class Reduction(Rule):
    """A reduction (fused.reduction): `tree` the block tree's combine ("sum", "max"), `mean`
    its total divided by the count; or, `tree` None, one thread per output running `serial`
    (element, out, count, dtype) -> lines; `axes(attrs)` the reduced axes."""
    tree: str | None = "sum"
    mean: bool = False
    serial: Callable | None = None
    axes: Callable = lambda a: a["axes"]

    def node(self, ctx, n, note):
        return fused.reduction(ctx, n, self, note=note)

    def kernel(self, ctx, k, note):
        n = ctx.g.nodes[k.anchor]
        return fused.reduction(ctx, n, self, [m for m in k.nodes if m != n.id], k.outputs, note)


class Gemm(Rule):
    """matmul: the tiled GEMM (or cuBLASLt), with a fused prologue and epilogue."""

    def node(self, ctx, n, note):
        return fused.matmul_node(ctx, n, note)

    def kernel(self, ctx, k, note):
        return fused.gemm_kernel(ctx, k, note)


@dataclass(frozen=True)
class CrossEntropy(Rule):
    """cross_entropy (the loss) or, `back`, its gradient; the fused cross_entropy kernel runs
    both from one pass over the logits."""
    back: bool = False

    def node(self, ctx, n, note):
        return fused.cross_entropy(ctx, None, n, note) if self.back else \
            fused.cross_entropy(ctx, n, None, note)

    def kernel(self, ctx, k, note):
        fwd, back = (ctx.g.nodes[m] for m in k.nodes)
        return fused.cross_entropy(ctx, fwd, back, note)


@dataclass(frozen=True)
class Own(Rule):
    """An op with a writer of its own: `write(ctx, n, note, **params)` -> [Launch]
    (runtime/cuda/lower.py, conv.py, attention.py)."""
    write: Callable
    params: dict = field(default_factory=dict)

    def node(self, ctx, n, note):
        return self.write(ctx, n, note, **self.params)

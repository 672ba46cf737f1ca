"""Kernel grouping: which nodes run together in one kernel.

This pass only decides grouping; the backends lower each group. The grouping here is the trivial
one — one kernel per live node — and views (reshape) get no kernel at all: they alias their
operand's buffer (passes/memory.py). Real fusion is a later pass that returns the same structure.
"""
from __future__ import annotations

from dataclasses import dataclass

from jitgraph.ir import LEAF_OPS
from jitgraph.ops.registry import get_op

from .report import Report


@dataclass(frozen=True)
class Kernel:
    """A group of nodes lowered to one kernel; `nodes` in execution order, the last is the root
    whose value the kernel produces (the others stay in registers once fusion exists)."""
    id: int
    nodes: tuple

    @property
    def root(self) -> int:
        return self.nodes[-1]


@dataclass
class KernelGraph:
    graph: object          # the jitgraph.ir.Graph the kernels read
    kernels: list          # Kernel, in execution order
    live: frozenset        # node ids whose values are needed (outputs, updates and their inputs)

    def __str__(self) -> str:
        g = self.graph
        lines = [f"kernels {g.name} ({len(self.kernels)}):"]
        for k in self.kernels:
            members = ", ".join(f"%{i} {g.nodes[i].op}" for i in k.nodes)
            lines.append(f"  k{k.id}: {members} : {g.nodes[k.root].type}")
        return "\n".join(lines)


def op_kind(op: str) -> str:
    """The op's kernel form; "leaf" for inputs and params."""
    return "leaf" if op in LEAF_OPS else get_op(op).kind


def live_nodes(graph) -> frozenset:
    """Nodes reachable backwards from the outputs and the updates."""
    todo = list(graph.outputs.values()) + list(graph.updates.values())
    seen = set()
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo.extend(graph.nodes[i].inputs)
    return frozenset(seen)


def group_kernels(graph):
    """One kernel per live computing node (no fusion). Returns (KernelGraph, Report)."""
    live = live_nodes(graph)
    kernels = []
    for n in graph.nodes:
        if n.id in live and op_kind(n.op) not in ("leaf", "view"):
            kernels.append(Kernel(len(kernels), (n.id,)))
    rep = Report("fuse", {"kernels": len(kernels), "fused_nodes": 0,
                          "dead_nodes": len(graph.nodes) - len(live)})
    return KernelGraph(graph, kernels, live), rep

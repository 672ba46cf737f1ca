"""Kernel scheduling: reorder independent kernels so buffers die early (before memory planning).

A list scheduler over the KernelGraph. A kernel is ready when the kernels writing the values
it reads have run and, if it computes a param's update (written in place into the param's
slot), every other kernel reading that param has run. Among the ready kernels it takes the
first in the original order that frees at least as many bytes as it allocates; if none does,
the first ready one. A kernel frees the values it is the last reader of (never outputs or
update sources, which live to the end of the step); it allocates its outputs except update
sources (they live in the params' persistent slots) and scalars (a few bytes).
The effect: each param's update runs right after its gradient is complete, so the gradient
(or, with fusion, the activation its GEMM reads) dies there, not at the end of the step; and
scalars that only depend on the step counter (bias corrections) no longer wait for the whole
backward. Everything else keeps its order.
"""
from __future__ import annotations

from dataclasses import replace

from .fuse import KernelGraph
from .liveness import base, live_bytes
from .memory import arena_intervals
from .report import Report

SMALL = 64   # bytes: outputs this small are not worth delaying a kernel for


def schedule(kg):
    """Return (KernelGraph with the kernels reordered and renumbered, Report)."""
    out = reorder(kg)
    moved = sum(a.nodes != b.nodes for a, b in zip(kg.kernels, out.kernels))
    rep = Report("schedule", {"kernels_moved": moved, "peak_before": peak(kg),
                              "peak_after": peak(out)})
    return out, rep


def reorder(kg):
    """The KernelGraph with its kernels in the memory-aware order, renumbered."""
    order = _order(kg)
    return KernelGraph(kg.graph, [replace(kg.kernels[k], id=t) for t, k in enumerate(order)],
                       kg.live, kg.inlined)


def peak(kg) -> int:
    """Largest live arena bytes over the kernel order (the memory planner's lower bound when
    every update is written in place)."""
    ivs = arena_intervals(kg, persistent=set(kg.graph.updates.values()))
    return max(live_bytes(kg.graph, ivs, max(len(kg.kernels), 1)), default=0)


def _order(kg) -> list:
    """Kernel positions (indices into kg.kernels) in the new order."""
    g, ks = kg.graph, kg.kernels
    writer = {n: t for t, k in enumerate(ks) for n in kg.outputs_of(k)}
    reads = [{base(g, i) for i in kg.inputs_of(k)} for k in ks]
    deps = [{writer[b] for b in r if b in writer and writer[b] != t} for t, r in enumerate(reads)]
    readers = {}
    for t, r in enumerate(reads):
        for b in r:
            readers.setdefault(b, set()).add(t)
    updates = set(g.updates.values())
    for name, uid in g.updates.items():       # never against the original order (no cycles)
        if uid in writer:
            w = writer[uid]
            deps[w] |= {t for t in readers.get(g.params[name], ()) if t < w}
    kept = {base(g, i) for i in list(g.outputs.values()) + list(g.updates.values())}

    def frees(t):
        freed = sum(g.nodes[b].type.nbytes for b in reads[t]
                    if readers[b] == {t} and b not in kept and g.nodes[b].op != "param")
        made = sum(g.nodes[o].type.nbytes for o in kg.outputs_of(ks[t])
                   if o not in updates and g.nodes[o].type.nbytes > SMALL)
        return freed >= made

    pending, done, order = list(range(len(ks))), set(), []
    while pending:
        ready = [t for t in pending if deps[t] <= done]
        if not ready:
            raise ValueError(f"schedule: kernels {', '.join(f'k{ks[t].id}' for t in pending)} "
                             f"of graph {g.name} read each other's outputs (a cycle)")
        t = next((t for t in ready if frees(t)), ready[0])
        pending.remove(t)
        order.append(t)
        done.add(t)
        for b in reads[t]:
            readers[b].discard(t)
    return order

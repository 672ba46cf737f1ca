"""Kernel scheduling: reorder independent kernels so buffers die early (before memory planning).

A list scheduler over the KernelGraph. A kernel is ready when the kernels writing the values
it reads have run. A kernel frees the values it is the last reader of (never outputs or update
sources, which live to the end of the step); it allocates its outputs except update sources
(they live in the params' persistent slots) and scalars (a few bytes). Among the ready kernels
that free at least as many bytes as they allocate it takes the one allocating least, then
freeing most (free memory before the next allocation peaks), else the first ready one in the
original order. A kernel computing a param's update (written in place into the param's slot)
normally waits for every other kernel reading that param; it may run before them only when
that frees at least 3x the update's bytes: the update is then written out of place (an arena
buffer to the end of the step, copied into the param by passes/memory.py), e.g. a dW GEMM with
its update in the epilogue that frees a large activation before dX has read W.
The effect: each param's update runs right after its gradient is complete, so the gradient
(or, with fusion, the activation its GEMM reads) dies there, not at the end of the step; and
scalars that only depend on the step counter (bias corrections) no longer wait for the whole
backward. Everything else keeps its order. With an update boundary (passes/boundary.py) a
phase-2 kernel is ready only once every phase-1 kernel has run.
"""
from __future__ import annotations

from dataclasses import replace

from jitgraph.ir import LEAF_OPS, base
from jitgraph.plan import KernelGraph

from .liveness import live_bytes
from .memory import arena_intervals
from .report import Report

SMALL = 64   # bytes: values this small are not worth moving a kernel for


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
                       kg.live, kg.inlined, kg.boundary)


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
    early = [[] for _ in ks]      # per kernel: (update bytes, earlier readers of its param)
    for name, uid in g.updates.items():       # never against the original order (no cycles)
        if uid in writer:
            w = writer[uid]
            early[w].append((g.nodes[uid].type.nbytes,
                             {t for t in readers.get(g.params[name], ()) if t < w}))
    kept = {base(g, i) for i in list(g.outputs.values()) + list(g.updates.values())}

    def makes(t):
        return sum(g.nodes[o].type.nbytes for o in kg.outputs_of(ks[t])
                   if o not in updates and g.nodes[o].type.nbytes > SMALL)

    def passed_on(o, t):
        """Whether output o of kernel t dies in the next step: every reader of o becomes
        ready once t has run and allocates nothing (a bf16 master weight's f32 update, read
        by the stochastic rounding that writes it into the param)."""
        rs = readers.get(o, ())
        return bool(rs) and o not in kept and all(
            deps[r] <= done | {t} and makes(r) == 0 and
            all(rd <= done | {t} for _, rd in early[r]) for r in rs)

    def net(t, made=0):
        freed = sum(g.nodes[b].type.nbytes for b in reads[t]
                    if readers[b] == {t} and b not in kept and g.nodes[b].op not in LEAF_OPS and
                    g.nodes[b].type.nbytes > SMALL)
        made += sum(g.nodes[o].type.nbytes for o in kg.outputs_of(ks[t])
                    if o not in updates and g.nodes[o].type.nbytes > SMALL and
                    not passed_on(o, t))
        return freed - made, made

    pending, done, order = list(range(len(ks))), set(), []
    n1 = len(ks) if kg.boundary is None else kg.boundary      # kernels[:n1]: phase 1
    while pending:
        ready = [t for t in pending if deps[t] <= done and (t < n1 or len(order) >= n1)]
        if not ready:
            raise ValueError(f"schedule: kernels {', '.join(f'k{ks[t].id}' for t in pending)} "
                             f"of graph {g.name} read each other's outputs (a cycle)")
        # an update running before its param's last reader is written out of place (its
        # value takes an arena buffer to the end of the step, then is copied into the param)
        gain = {t: net(t, sum(b for b, r in early[t] if not r <= done)) for t in ready}
        good = [t for t in ready if gain[t][0] >= 0 and (gain[t][0] >= 3 * gain[t][1] or
                                                         all(r <= done for _, r in early[t]))]
        if good:      # free first: the kernel allocating least, then freeing most
            t = min(good, key=lambda t: (gain[t][1], -gain[t][0]))
        else:
            t = next(t for t in ready if all(r <= done for _, r in early[t]))
        pending.remove(t)
        order.append(t)
        done.add(t)
        for b in reads[t]:
            readers[b].discard(t)
    return order

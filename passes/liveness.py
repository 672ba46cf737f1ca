"""Liveness: when each buffer-owning value is live in an execution order, and the peak live bytes.

An order is a list of steps; a step is a node id, or a tuple of node ids run as one kernel (the
last is its root). A value is live from the step that writes it to the last step that reads it,
both inclusive, so at a step its operands and its result are live together (in-place reuse is
the planner's decision, not liveness's). Outputs and update sources live to the last step.
Views (op kind "view": reshape, checkpoint marks) own no buffer: a read of a view is a read of
its base, so views extend their base's interval. A kernel member that only its own kernel reads
stays in registers and gets no interval (or, given `outputs`, exactly the members each step
writes to memory get one); `inlined` constants are folded into their readers: no buffer, no
read. Inputs and params live outside the per-step arena and are left out unless `leaves=True`:
then params live the whole step, inputs until their last read.

The peak of the live bytes over the steps is the lower bound any arena plan for the order can
reach; passes/checkpoint.py minimises it and passes/memory.py measures its plan against it.
"""
from __future__ import annotations

from jitgraph.ir import LEAF_OPS, base, live_nodes, op_kind


def default_order(graph) -> list:
    """The live non-leaf nodes in topological (id) order."""
    live = live_nodes(graph)
    return [n.id for n in graph.nodes if n.id in live and n.op not in LEAF_OPS]


def intervals(graph, order=None, *, leaves=False, persistent=(), outputs=None,
              inlined=()) -> dict:
    """node id -> (first step, last step) for every value that needs an arena buffer in `order`.
    `persistent`: computed values that live outside the arena (e.g. update sources written in
    place into their params' buffers). `outputs`: per step, the values it writes to memory
    (jitgraph/plan.py's KernelGraph.outputs_of); `inlined`: constants with no kernel."""
    order = default_order(graph) if order is None else order
    steps = [tuple(s) if isinstance(s, (tuple, list)) else (s,) for s in order]
    pos = {nid: t for t, step in enumerate(steps) for nid in step}
    last = len(steps) - 1
    end = {}

    def read(nid, t):
        b = base(graph, nid)
        if b in inlined:
            return
        if graph.nodes[b].op not in LEAF_OPS and pos.get(b, last + 1) > t:
            raise ValueError(f"liveness: {graph.label(b)} ({graph.nodes[b].op}) is read at step "
                             f"{t} but not computed before it in the order")
        end[b] = max(end.get(b, t), t)

    for t, step in enumerate(steps):
        for nid in step:
            for i in graph.nodes[nid].inputs:
                read(i, t)
    kept = list(graph.outputs.values()) + list(graph.updates.values())
    for nid in kept:
        read(nid, last)
    kept = {base(graph, nid) for nid in kept}
    out = {}
    for nid, t in pos.items():
        n = graph.nodes[nid]
        if n.op in LEAF_OPS or op_kind(n.op) == "view" or nid in persistent:
            continue
        buffered = nid in outputs[t] if outputs is not None else \
            nid == steps[t][-1] or end.get(nid, t) > t or nid in kept
        if not buffered:
            continue                                   # fused intermediate: in registers
        out[nid] = (t, end.get(nid, t))
    if leaves:
        for nid in list(graph.inputs.values()) + list(graph.params.values()):
            if graph.nodes[nid].op == "param":
                out[nid] = (0, last)
            elif nid in end:
                out[nid] = (0, end[nid])
    return out


def live_bytes(graph, ivs: dict, n_steps: int) -> list:
    """Bytes live at each step, for intervals from `intervals`."""
    delta = [0] * (n_steps + 1)
    for nid, (s, e) in ivs.items():
        nbytes = graph.nodes[nid].type.nbytes
        delta[s] += nbytes
        delta[e + 1] -= nbytes
    out, acc = [], 0
    for d in delta[:n_steps]:
        acc += d
        out.append(acc)
    return out


def peak_bytes(graph, order=None, *, leaves=False, persistent=()) -> tuple:
    """(largest live bytes over the order, the first step where it is reached); the options
    are those of `intervals`."""
    order = default_order(graph) if order is None else order
    if not order:
        return 0, 0
    prof = live_bytes(graph, intervals(graph, order, leaves=leaves, persistent=persistent),
                      len(order))
    peak = max(prof)
    return peak, prof.index(peak)

"""The finite-step guard (compile(check_finite=True)): a step whose values are not all finite
changes nothing.

The pass runs after autodiff and before the optimizer. Every float output at that point (the
loss, the gradients `grad/<param>`, the user's other outputs) gets a flag `x * 0` summed over its
elements: 0 when every element is finite, NaN otherwise (NaN * 0 and Inf * 0 are NaN). The flags
are outputs `check/nonfinite/<output>`; their sum is the output `check/nonfinite`. Every update
of the graph, the user's and (through `gate`) the optimizer's, becomes `where(check/nonfinite,
old, new)`: on a non-finite step every param and optimizer state keeps its value, so the update
boundary is a data dependency and survives fusion and memory planning. The executor reads the
one scalar `check/nonfinite` after each step, and on a non-finite step names the first flagged
output and does not count the step (the learning-rate schedule and accumulation stay put).
Cost: one extra read of every checked value (the gradients: the size of the model) per step.
The gated updates' own computation (the optimizer's, `gated_nodes`) is fused apart from the
gradients' kernels (passes/fuse.py): the gradients reach memory anyway (their flags read them),
so each update reads its gradient once, after the flag, and writes its param and moments once,
where an update in a GEMM's epilogue would write new values for the gate to copy.
"""
from __future__ import annotations

from jitgraph.ir import live_nodes
from jitgraph.ops import cast, scale, sum as rsum, where

from .report import Report

FLAG = "check/nonfinite"


def guard(graph):
    """Return (graph with the flags as outputs and its updates gated, Report)."""
    g = graph.copy()
    n0 = len(g.nodes)
    total = None
    names = [k for k, i in graph.outputs.items() if graph.nodes[i].type.is_float]
    for k in names:
        t = g.tensor(g.outputs[k])
        f = scale(t, 0.0) if t.ndim == 0 else rsum(scale(t, 0.0))
        f = f if f.dtype == "f32" else cast(f, "f32")
        g.output(**{f"{FLAG}/{k}": f})
        total = f if total is None else total + f
    if total is None:
        return g, Report("guard", {"checked": 0}, ["no float outputs: nothing to check"])
    g.output(**{FLAG: total})
    g.update(**gate(g, {k: g.tensor(i) for k, i in g.updates.items()}))
    rep = Report("guard", {"checked": len(names), "gated_updates": len(g.updates),
                           "nodes": len(g.nodes) - n0})
    rep.lines.append("checked: " + ", ".join(names))
    return g.validate(), rep


def gate(g, new: dict) -> dict:
    """{param: where(check/nonfinite, old value, new value)} when the graph carries the guard's
    flag, else `new` as it is."""
    if FLAG not in g.outputs:
        return new
    flag = g.tensor(g.outputs[FLAG])
    return {k: where(flag, g.tensor(g.params[k]), t) for k, t in new.items()}


def gated_nodes(graph, live=None) -> frozenset:
    """With the guard's flag: the live nodes that only the gated updates need (the optimizer's
    update of each param and its state, and the gates); empty without the flag."""
    if FLAG not in graph.outputs:
        return frozenset()
    live = live_nodes(graph) if live is None else live
    return (live_nodes(graph, graph.updates.values()) & live) - \
        live_nodes(graph, graph.outputs.values())

"""Contiguous slices as views: a slice whose elements are one run of its operand's buffer
(C order) reads nothing and copies nothing; it becomes `window(x, offset, shape)`, a view
(op kind "view"), and the kernels reading it read the operand's bytes in place.

A slice is such a run when, counting from the last axis, every axis is taken whole up to one
axis sliced with step 1 and every axis before that one is a single index (a 1-D slice with
step 1, the rows a..b of a matrix, one batch entry of [B, ...]). The memory plan gives a
window its operand's slot moved by the window's offset (passes/memory.py, ir.view_offset);
liveness already treats a read of a view as a read of its base, so the base lives while any
window of it is read, and an elementwise kernel takes a dying operand's buffer in place only
when it reads the whole buffer (never through a window with an offset).

Only slices internal to the step: neither the slice nor a view of it is a graph output or an
update (an output owns its buffer and its pointer; a boundary gradient lies in its bucket),
and its operand's buffer is one a kernel writes in the arena (not a program input, a param
or a constant; the operand of a view of an output stays a copy too). Only on backends whose
kinds name "window" (runtime/backend.py: the CPU; the CUDA backend keeps its slice kernels).
The copies this removes in a stories260K finetuning step: attention_store's output (one a
layer) and attention_back's dq, dk, dv (three a layer), 20 kernels.
"""
from __future__ import annotations

from jitgraph.ir import LEAF_OPS, base, copy_node, live_nodes, op_kind, rebuild
from jitgraph.ops.shape import slice_len

from .fuse import roles
from .report import Report

KIND = "window"


def contiguous_run(shape, slices):
    """The element offset of the slice's first element when the slice of an array of `shape`
    (normalised (start, stop, step) per axis, jitgraph/ops/shape.py) is one contiguous run of
    its C-ordered elements and not empty, else None."""
    sizes = [slice_len(s, e, st) for s, e, st in slices]
    if not sizes or 0 in sizes:
        return None if sizes else 0
    k = len(shape) - 1
    while k >= 0 and slices[k] == (0, shape[k], 1):
        k -= 1
    if k >= 0 and sizes[k] > 1 and slices[k][2] != 1:
        return None
    if any(sizes[i] != 1 for i in range(k)):
        return None
    off, stride = 0, 1
    for i in range(len(shape) - 1, -1, -1):
        off += slices[i][0] * stride
        stride *= shape[i]
    return off


def window_slices(graph, kinds=None):
    """(graph, Report): the contiguous internal slices of `graph` made windows (see above)."""
    if kinds is not None and KIND not in kinds:
        return graph, Report("views", {"windows": 0})
    live = live_nodes(graph)
    kept = set()
    for nid in list(graph.outputs.values()) + list(graph.updates.values()):
        while True:                       # the output and every view it reads through
            kept.add(nid)
            if op_kind(graph.nodes[nid].op) != "view":
                break
            nid = graph.nodes[nid].inputs[0]
    chosen = {}
    for n in graph.nodes:
        if n.op != "slice" or n.id not in live or n.id in kept:
            continue
        src = graph.nodes[n.inputs[0]]
        b = graph.nodes[base(graph, src.id)]
        if b.op in LEAF_OPS or b.id in kept or "constant" in roles(graph, b.id):
            continue
        off = contiguous_run(src.type.shape, n.attr["slices"])
        if off is not None:
            chosen[n.id] = off
    if not chosen:
        return graph, Report("views", {"windows": 0})

    def rule(g, n, new):
        if n.id in chosen:
            return g.emit("window", [new[n.inputs[0]]],
                          {"offset": chosen[n.id], "shape": n.type.shape})
        return copy_node(g, n, new)
    g, _ = rebuild(graph, rule)
    saved = sum(graph.nodes[i].type.nbytes for i in chosen)
    rep = Report("views", {"windows": len(chosen), "bytes_not_copied": saved})
    rep.lines.append(f"{len(chosen)} contiguous slices read in place ({saved:,} bytes a step "
                     f"not copied)")
    return g.validate(), rep

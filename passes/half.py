"""The half types as the kernels compute them: every computing op over f16 / bf16 values becomes
the same op over f32, its half operands cast to f32 and its half result cast back, so `cast`
is the one op a backend computes with half operands or results (OpDef.half "convert"), and
fusion puts those casts inside the kernels (a GEMM's operands converted in its prologue, a row
op's row read and written as half). The meaning is unchanged: the reference (jitgraph/half.py)
computes each op in f32 and rounds its result, which is what the casts do.

Ops that move elements ("move": reshape, permute, slice, concat) keep their half types; an
operand at a storage position (OpDef.storage: matmul's weight, get_rows' table) stays half
where the op reads it so (the storage-type kernels convert it), else is cast too.
"""
from __future__ import annotations

from jitgraph.ir import LEAF_OPS, copy_node, rebuild
from jitgraph.registry import get_op
from jitgraph.types import ShapeError

from .report import Report


def _touches_half(graph, n) -> bool:
    return n.type.is_half or any(graph.nodes[i].type.is_half for i in n.inputs)


def compute_in_f32(graph):
    """(graph, Report): graph with its half-typed computing ops rewritten over f32."""
    count = {"ops": 0, "casts": 0}
    if not any(_touches_half(graph, n) for n in graph.nodes):
        return graph, Report("half", dict(count))

    read = {}                       # half value -> its f32 cast (one per value)

    def f32(g, i):
        if i not in read:
            count["casts"] += 1
            read[i] = g.emit("cast", (i,), {"dtype": "f32"})
        return read[i]

    def rule(g, n, new):
        if n.op in LEAF_OPS or get_op(n.op).half in ("move", "convert") or \
                not _touches_half(graph, n):
            return copy_node(g, n, new)
        d = get_op(n.op)
        count["ops"] += 1
        ins = [new[i] for i in n.inputs]
        attrs = {k: ("f32" if k == "dtype" and v in ("f16", "bf16") else v) for k, v in n.attrs}
        kept = [f32(g, i) if g.nodes[i].type.is_half and p not in d.storage else i
                for p, i in enumerate(ins)]
        try:
            nid = g.emit(n.op, kept, attrs)
        except ShapeError:          # a storage position the op cannot read in this form
            nid = g.emit(n.op, [f32(g, i) if g.nodes[i].type.is_half else i for i in kept],
                         attrs)
        if n.type.is_half:
            count["casts"] += 1
            nid = g.emit("cast", (nid,), {"dtype": n.type.dtype})
        return nid

    out, _ = rebuild(graph, rule)
    return out, Report("half", dict(count))

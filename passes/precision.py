"""Precision rewrites: a graph with every float value in another precision (f32 <-> f64,
`cast_graph`), mixed precision (`mixed`, jg.compile's precision="bf16" | "f16") and params
stored in another type (`stored_as`: bf16 master weights)."""
from __future__ import annotations

from dataclasses import replace

from jitgraph.ir import LEAF_OPS, copy_node, rebuild
from jitgraph.registry import get_op
from jitgraph.types import TensorType

from .report import Report

PRECISIONS = ("f32", "bf16", "f16")


def cast_graph(graph, dtype: str = "f64", src: str = "f32"):
    """Every `src` leaf, constant and cast target becomes `dtype`; shapes and structure stay."""
    def recast(g, n, new):
        if n.op in LEAF_OPS:
            t = TensorType(dtype, n.type.shape) if n.type.dtype == src else n.type
            return copy_node(g, replace(n, type=t), new)
        attrs = {k: (dtype if k == "dtype" and v == src else v) for k, v in n.attrs}
        return g.emit(n.op, [new[i] for i in n.inputs], attrs)

    return rebuild(graph, recast)[0]


def mixed(graph, dtype: str):
    """(graph, Report): each f32 GEMM (an op of kind "contraction" that computes half types:
    matmul) reads its operands cast to `dtype` and gives its product in `dtype`, cast back to
    f32 for its readers; everything else (norms, softmax, losses, the params: f32 master
    weights, and the optimizer, which a later stage adds) stays f32. Run before autodiff, so
    the backward's GEMMs are half too, the gradients reach the params through the casts' vjps
    in f32, and the values the backward keeps for the GEMMs are the half operands (half the
    bytes). Accumulation stays f32 (the half types' meaning: jitgraph/half.py)."""
    if dtype not in PRECISIONS:
        raise ValueError(f"precision {dtype!r}: expected one of {', '.join(PRECISIONS)}")
    count = {"gemms": 0}
    if dtype == "f32":
        return graph, Report("precision", count)
    halves = {}                 # f32 value -> its half cast (one per value)

    def half(g, i):
        if i not in halves:
            halves[i] = g.emit("cast", (i,), {"dtype": dtype})
        return halves[i]

    def rule(g, n, new):
        d = get_op(n.op) if n.op not in LEAF_OPS else None
        if d is None or d.kind != "contraction" or d.half != "compute" or n.type.dtype != "f32" \
                or any(graph.nodes[i].type.dtype != "f32" for i in n.inputs):
            return copy_node(g, n, new)
        count["gemms"] += 1
        out = g.emit(n.op, [half(g, new[i]) for i in n.inputs], dict(n.attrs))
        return g.emit("cast", (out,), {"dtype": "f32"})

    out, _ = rebuild(graph, rule)
    return out, Report("precision", {**count, "dtype": dtype})


def stored_as(graph, types: dict):
    """(graph, {param: its new leaf id}): each f32 param named in `types` (name -> "bf16")
    stored in that type, its readers reading it through one cast to f32 that takes the old
    leaf's place (so every value computed from it keeps its type). The optimizer pass stores
    bf16 master weights so; an evaluator of such a training program reads its params so."""
    stored = {}

    def rule(g, n, new):
        name = n.attr.get("name") if n.op == "param" else None
        if name not in types or n.type.dtype != "f32" or types[name] == "f32":
            return copy_node(g, n, new)
        leaf = copy_node(g, replace(n, type=TensorType(types[name], n.type.shape)), new)
        stored[name] = leaf
        return g.emit("cast", (leaf,), {"dtype": "f32"})

    g, _ = rebuild(graph, rule)
    return g, stored

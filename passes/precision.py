"""Rebuild a graph with every float value in another precision (f32 <-> f64)."""
from __future__ import annotations

from dataclasses import replace

from jitgraph.ir import LEAF_OPS, copy_node, rebuild
from jitgraph.types import TensorType


def cast_graph(graph, dtype: str = "f64", src: str = "f32"):
    """Every `src` leaf, constant and cast target becomes `dtype`; shapes and structure stay."""
    def recast(g, n, new):
        if n.op in LEAF_OPS:
            t = TensorType(dtype, n.type.shape) if n.type.dtype == src else n.type
            return copy_node(g, replace(n, type=t), new)
        attrs = {k: (dtype if k == "dtype" and v == src else v) for k, v in n.attrs}
        return g.emit(n.op, [new[i] for i in n.inputs], attrs)

    return rebuild(graph, recast)[0]

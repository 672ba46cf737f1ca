"""Rebuild a graph with every float value in another precision (f32 <-> f64)."""
from __future__ import annotations

from jitgraph.types import TensorType


def cast_graph(graph, dtype: str = "f64", src: str = "f32"):
    """Every `src` leaf, constant and cast target becomes `dtype`; shapes and structure stay."""
    from jitgraph.ir import Graph
    g = Graph(graph.name)
    g.inits = dict(graph.inits)
    for n in graph.nodes:
        if n.op in ("input", "param"):
            t = n.type
            if t.dtype == src:
                t = TensorType(dtype, t.shape)
            g._append(n.op, (), n.attr, t)
            (g.inputs if n.op == "input" else g.params)[n.attr["name"]] = n.id
            continue
        attrs = {k: (dtype if k == "dtype" and v == src else v) for k, v in n.attrs}
        g.nodes.append(g.make_node(n.op, n.inputs, attrs))
    g.outputs = dict(graph.outputs)
    g.updates = dict(graph.updates)
    return g

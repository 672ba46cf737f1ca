"""Graph rewrites that make a graph compute as ggml's CPU backend does (jitgraph.quant says what
its conversions are)."""
from __future__ import annotations

from dataclasses import replace

from .ir import copy_node, rebuild
from .quant import VEC_DOT_TYPE


def ggml_dots(graph):
    """`graph` with x converted before each dot with a stored weight as ggml's CPU backend
    computes x @ W^T: on every f32 matmul reading a q8_0, q4_k, q6_k or f16 weight as x @ W^T,
    the attribute xq = VEC_DOT_TYPE of the weight (x's rows quantized to 8 bits per block for
    the block types: integer dots per block; rounded to f16 for f16 weights: half x's bytes).
    Faster in decode than the exact float dots, with llama.cpp's rounding. Inference only (such
    a matmul has no gradient)."""

    def rule(g, n, new):
        if n.op == "matmul" and n.attr.get("xq") is None:
            x, w = (graph.nodes[i].type for i in n.inputs)
            a = n.attr
            if w.dtype in VEC_DOT_TYPE and x.dtype == "f32" and a["tb"] and not a["ta"]:
                a["xq"] = VEC_DOT_TYPE[w.dtype]
                n = replace(n, attrs=tuple(sorted(a.items())))
        return copy_node(g, n, new)
    return rebuild(graph, rule)[0]

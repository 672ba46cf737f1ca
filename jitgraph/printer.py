"""The IR printer: one typed node a line, attributes in brackets."""
from __future__ import annotations

import math


def format_attr(v) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, tuple):
        return "(" + ",".join(format_attr(x) for x in v) + (",)" if len(v) == 1 else ")")
    return str(v)


def format_node(graph, n, annotate=None) -> str:
    args = ", ".join(graph.label(i) for i in n.inputs)
    attrs = ", ".join(f"{k}={format_attr(v)}" for k, v in n.attrs)
    lhs = f"%{n.id} = {n.op}({args})" + (f" [{attrs}]" if attrs else "")
    line = f"  {lhs:<44} : {n.type}"
    if annotate:
        extra = annotate(n)
        if extra:
            line += f"   # {extra}"
    return line


def format_header(graph) -> str:
    def decl(nid):
        n = graph.nodes[nid]
        return f"{n.attr['name']}: {n.type}"
    ins = ", ".join(decl(i) for i in graph.inputs.values())
    train = [i for i in graph.params.values() if graph.nodes[i].attr["trainable"]]
    state = [i for i in graph.params.values() if not graph.nodes[i].attr["trainable"]]
    head = f"graph {graph.name}({ins})"
    head += f" params({', '.join(decl(i) for i in train)})"
    if state:
        head += f" state({', '.join(decl(i) for i in state)})"
    return head + " {"


def format_graph(graph, annotate=None) -> str:
    lines = [format_header(graph)]
    lines += [format_node(graph, n, annotate) for n in graph.nodes if n.op not in ("input", "param")]
    lines += [f"  update {k} <- {graph.label(i)}" for k, i in graph.updates.items()]
    outs = ", ".join(f"{k}={graph.label(i)}" for k, i in graph.outputs.items())
    lines += [f"  return {outs}", "}"]
    return "\n".join(lines)

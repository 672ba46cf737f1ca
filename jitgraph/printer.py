"""The IR printer: one typed node a line, attributes in brackets.

The header lists the params by role (`param_roles`): `params(...)` the trainable ones,
`frozen(...)` non-trainable weights nothing updates (a LoRA base model's, jg.lora), `state(...)`
non-trainable params a step updates (optimizer moments `opt/...`, accumulators, KV caches,
counters)."""
from __future__ import annotations

import math

ROLES = ("trainable", "frozen", "state")


def param_roles(graph) -> dict:
    """{param name: "trainable" | "frozen" | "state"}, in the graph's param order. A
    non-trainable param is state when the graph updates it or it is the optimizer's (named
    opt/..., passes/optimizer.py), frozen otherwise: a constant weight of the model."""
    out = {}
    for name, nid in graph.params.items():
        if graph.nodes[nid].attr["trainable"]:
            out[name] = "trainable"
        elif name in graph.updates or name.startswith("opt/"):
            out[name] = "state"
        else:
            out[name] = "frozen"
    return out


def role_sizes(graph) -> dict:
    """{role: (params, elements, bytes)} for each of ROLES: what a memory report shows (trainable
    parameters, frozen weights, optimizer state)."""
    out = {r: [0, 0, 0] for r in ROLES}
    for name, role in param_roles(graph).items():
        t = graph.nodes[graph.params[name]].type
        out[role][0] += 1
        out[role][1] += t.size
        out[role][2] += t.nbytes
    return {r: tuple(v) for r, v in out.items()}


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
    def decl(name):
        return f"{name}: {graph.nodes[graph.params[name]].type}"
    ins = ", ".join(f"{k}: {graph.nodes[i].type}" for k, i in graph.inputs.items())
    roles = param_roles(graph)
    by = {r: [k for k, v in roles.items() if v == r] for r in ROLES}
    head = f"graph {graph.name}({ins})"
    head += f" params({', '.join(decl(k) for k in by['trainable'])})"
    for role in ("frozen", "state"):
        if by[role]:
            head += f" {role}({', '.join(decl(k) for k in by[role])})"
    return head + " {"


def format_graph(graph, annotate=None) -> str:
    lines = [format_header(graph)]
    lines += [format_node(graph, n, annotate) for n in graph.nodes if n.op not in ("input", "param")]
    lines += [f"  update {k} <- {graph.label(i)}" for k, i in graph.updates.items()]
    outs = ", ".join(f"{k}={graph.label(i)}" for k, i in graph.outputs.items())
    lines += [f"  return {outs}", "}"]
    return "\n".join(lines)

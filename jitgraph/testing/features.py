"""Graph features: the shapes and op patterns a graph holds (`features(graph)`), so a CI run can
check it covered every one the compiler broke on before."""
from __future__ import annotations

from jitgraph.registry import OPS, get_op


def features(g):
    """Names of the bug-prone shapes a graph contains (computed from the IR)."""
    f = set()
    users = g.users()
    nodes = g.nodes
    elementwise = lambda n: n.op not in ("input", "param", "full") and \
        get_op(n.op).kind == "elementwise"
    for n in nodes:
        a = n.attr
        shape_in = nodes[n.inputs[0]].type.shape if n.inputs else ()
        kind = OPS[n.op].kind if n.op in OPS else "leaf"     # inputs and params: leaves
        if kind == "reduction" and "axes" in a:
            f.add("reduce")
            if a["axes"] == ():
                f.add("axis=()")
                if n.inputs and elementwise(nodes[n.inputs[0]]):
                    f.add("axis=() with prologue")
            elif all(shape_in[i] == 1 for i in a["axes"]):
                f.add("reduce over size-1 axes")
                if n.op == "mean":
                    f.add("mean over size-1 axes")
        if n.op == "argmax":
            f.add("argmax")
            if shape_in[a["axis"]] == 1:
                f.add("argmax over a size-1 axis")
        if n.op in ("reshape", "permute", "slice", "broadcast_to", "concat"):
            f.add(n.op)
        if n.op == "broadcast_to" and n.type.shape == shape_in:
            f.add("no-op broadcast_to")
        if n.op == "cast" and n.type.dtype == nodes[n.inputs[0]].type.dtype:
            f.add("no-op cast")
        if n.op == "cast" and n.type.dtype == "f64":
            f.add("cast f64")
        if n.type.is_half:
            f.add(f"{n.type.dtype} values")
        if n.op == "full":
            f.add("constant")
        if n.op not in ("input", "param") and len(users[n.id]) >= 2:
            f.add("several consumers")
        if n.op == "matmul":
            f.add("gemm")
            for i in n.inputs:                 # an operand's elementwise producer that an
                p = nodes[i]                   # elementwise reader of the result also reads
                if elementwise(p) and any(elementwise(nodes[u]) and i in nodes[u].inputs
                                          for u in users[n.id]):
                    f.add("gemm result and operand producer read together")
                if elementwise(p) and len(users[i]) >= 2:
                    f.add("gemm operand shared")
        if kind == "rows":
            f.add("row op")
        if n.op == "cross_entropy":
            f.add("cross_entropy")
    try:
        from jitgraph.passes.patterns import recognise_patterns
        pg, rep = recognise_patterns(g)
        if rep.stats.get("rewritten"):
            f.add("primitive row op")
            for n in pg.nodes:
                if n.op in OPS and OPS[n.op].kind == "rows":
                    f.add(f"primitive {n.op}")
                    if pg.nodes[n.inputs[0]].op == "full":
                        f.add("primitive row op on a constant")
    except Exception:   # noqa: BLE001 - the pass itself may be what is broken
        pass
    if any(n.op == "logsumexp" for n in nodes):
        f.add("logsumexp")
    outs = list(g.outputs.values())
    if len(outs) >= 2:
        f.add("several outputs")
    if len(set(outs)) < len(outs):
        f.add("one value, two outputs")
    if any(nodes[i].op == "param" for i in outs):
        f.add("param output")
    if any(nodes[i].op == "input" for i in outs):
        f.add("input output")
    if g.updates:
        f.add("update")
        if any(g.params[p] in outs for p in g.updates):
            f.add("updated param output")
    return f

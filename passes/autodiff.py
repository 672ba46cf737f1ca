"""Reverse-mode differentiation as a graph pass (ggml_build_backward_expand).

Appends the backward graph to a copy of the forward graph: one vjp rule per op (declared with the
op in jitgraph/ops), gradients of values used several times accumulate, integer values get none.
Gradients become outputs named `grad/<param>` (and `grad/<input>` for chosen inputs).
"""
from __future__ import annotations

from jitgraph.ops.common import const
from jitgraph.registry import get_op
from jitgraph.types import ShapeError

from .report import Report


def grad(graph, loss: str = "loss", wrt=None, inputs=()):
    """Return (graph with backward nodes and grad/* outputs, Report).

    wrt: param names to differentiate (default: every trainable param); inputs: float input
    names that also get gradients.
    """
    if loss not in graph.outputs:
        raise ShapeError(f"grad: graph {graph.name} has no output {loss!r}; outputs are "
                         f"{', '.join(graph.outputs) or 'none'}")
    lnode = graph.nodes[graph.outputs[loss]]
    if lnode.type.shape != () or not lnode.type.is_float:
        raise ShapeError(f"grad: loss {loss!r} must be a float scalar, got {lnode.type}")
    wrt = list(graph.trainable_params() if wrt is None else wrt)
    leaves = {}
    for name in wrt:
        if name not in graph.params:
            raise ShapeError(f"grad: {name!r} is not a param of graph {graph.name}")
        if not graph.nodes[graph.params[name]].type.is_float:
            raise ShapeError(f"grad: param {name!r} is not float and has no gradient")
        leaves[graph.params[name]] = name
    for name in inputs:
        if name not in graph.inputs:
            raise ShapeError(f"grad: {name!r} is not an input of graph {graph.name}")
        if not graph.nodes[graph.inputs[name]].type.is_float:
            raise ShapeError(f"grad: input {name!r} is not float and has no gradient")
        leaves[graph.inputs[name]] = name

    g = graph.copy()
    n_fwd = len(g.nodes)
    # values that depend on a differentiated leaf and are float: they carry gradients
    active = [False] * n_fwd
    for n in graph.nodes:
        active[n.id] = n.type.is_float and (n.id in leaves or any(active[i] for i in n.inputs))
    grads = {lnode.id: const(g, 1.0, lnode.type.dtype)}
    n_rules = 0
    for n in reversed(graph.nodes[: lnode.id + 1]):
        if n.id not in grads or n.op in ("input", "param") or not active[n.id]:
            continue
        opdef = get_op(n.op)
        if opdef.vjp is None:
            raise ShapeError(f"grad: op {n.op} (%{n.id}) has no vjp rule")
        xs = [g.tensor(i) for i in n.inputs]
        gis = opdef.vjp(grads[n.id], g.tensor(n.id), xs, n.attr)
        n_rules += 1
        if len(gis) != len(xs):
            raise AssertionError(f"vjp of {n.op} returned {len(gis)} grads for {len(xs)} inputs")
        for x, gi in zip(xs, gis):
            if gi is None or not active[x.id]:
                continue
            if gi.type != x.type:
                raise AssertionError(f"vjp of {n.op} (%{n.id}) gave {gi.type} for operand "
                                     f"{x.label} {x.type}")
            grads[x.id] = grads[x.id] + gi if x.id in grads else gi
    unused = []
    for nid, name in leaves.items():
        t = graph.nodes[nid].type
        if nid not in grads:
            unused.append(name)
            grads[nid] = const(g, 0.0, t.dtype, t.shape)
        g.outputs[f"grad/{name}"] = grads[nid].id
    rep = Report("autodiff", {"forward_nodes": n_fwd, "backward_nodes": len(g.nodes) - n_fwd,
                              "vjp_rules": n_rules, "grads": len(leaves)})
    if unused:
        rep.lines.append(f"loss does not depend on {', '.join(unused)}: gradient is zero")
    return g.validate(), rep

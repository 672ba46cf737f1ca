"""Reverse-mode differentiation as a graph pass (ggml_build_backward_expand).

Appends the backward graph to a copy of the forward graph: one vjp rule per op (declared with the
op in jitgraph/ops), gradients of values used several times accumulate, integer values get none.
Gradients become outputs named `grad/<param>` (and `grad/<input>` for chosen inputs).

Only what flows to a differentiated leaf is computed. A value is *active* when it depends on a
differentiated leaf; rules run only for active nodes, and a rule's result for an operand that is
not active (a frozen weight: a param with trainable=False, or one left out of `wrt`; an index;
a value computed from frozen params alone) is dropped with every node only it needed, before
the pass returns: the weight-gradient GEMM of a frozen W is never in the graph, while the
gradient w.r.t. the activations flowing through W to earlier trainable params is. The report
counts the frozen params and the backward's FLOPs against what the backward would cost with
every float param differentiated (`full_backward_flops`).
"""
from __future__ import annotations

from jitgraph.ir import copy_node, live_nodes, rebuild
from jitgraph.ops import cast
from jitgraph.ops.common import const
from jitgraph.printer import param_roles
from jitgraph.registry import cost, get_op
from jitgraph.types import ShapeError

from .report import Report


def grad(graph, loss: str = "loss", wrt=None, inputs=(), seed: str | None = None):
    """Return (graph with backward nodes and grad/* outputs, Report).

    wrt: param names to differentiate (default: every trainable param); inputs: float input
    names that also get gradients; seed: the name of a new f32 scalar input whose value is
    the loss's own gradient (default: the constant 1), so every grad/* is that value times
    the gradient: dynamic loss scaling (jg.compile's loss_scale) feeds its scale S there.
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

    if seed is not None and seed in graph.inputs:
        raise ShapeError(f"grad: seed input {seed!r} is already an input of graph {graph.name}")
    g, n_rules, unused = _backward(graph, lnode, leaves, seed)
    g, pruned, pruned_flops = _prune(g, len(graph.nodes))
    n_fwd = len(graph.nodes)
    flops = _flops(g, range(n_fwd, len(g.nodes)))
    roles = param_roles(graph)
    # frozen: float params that get no gradient and are not state (optimizer moments, caches)
    frozen = [k for k, r in roles.items() if r != "state" and k not in wrt
              and graph.nodes[graph.params[k]].type.is_float]
    full = flops
    if frozen:      # what the backward would cost with every float param differentiated
        every = dict(leaves)
        every.update({graph.params[k]: k for k in frozen})
        fg, _, _ = _backward(graph, lnode, every, seed)
        fg, _, _ = _prune(fg, n_fwd)
        full = _flops(fg, range(n_fwd, len(fg.nodes)))
    rep = Report("autodiff", {"forward_nodes": n_fwd, "backward_nodes": len(g.nodes) - n_fwd,
                              "vjp_rules": n_rules, "grads": len(leaves),
                              "frozen_params": len(frozen), "backward_flops": flops,
                              "full_backward_flops": full, "pruned_nodes": pruned,
                              "pruned_flops": pruned_flops})
    if frozen:
        size = sum(graph.nodes[graph.params[k]].type.size for k in frozen)
        saved = full - flops
        rep.lines.append(
            f"frozen: {len(frozen)} params ({size:,} elements) get no gradient: backward "
            f"{flops:,} FLOPs instead of {full:,} ({saved:,} saved, "
            f"{100.0 * saved / full if full else 0.0:.1f} %); {pruned} dead gradient nodes "
            f"({pruned_flops:,} FLOPs) left out")
    if unused:
        rep.lines.append(f"loss does not depend on {', '.join(unused)}: gradient is zero")
    if seed is not None:
        rep.lines.append(f"seed: the loss's gradient is input {seed!r} (grad/* scaled by it)")
    return g.validate(), rep


def _backward(graph, lnode, leaves, seed=None):
    """(graph copy with the backward appended and grad/* outputs for `leaves` {node id: name},
    vjp rules run, names whose gradient is zero). `seed`: the name of the f32 scalar input
    added as the loss's gradient (None: the constant 1)."""
    g = graph.copy()
    n_fwd = len(g.nodes)
    # values that depend on a differentiated leaf and are float: they carry gradients
    active = [False] * n_fwd
    for n in graph.nodes:
        active[n.id] = n.type.is_float and (n.id in leaves or any(active[i] for i in n.inputs))
    if seed is None:
        grads = {lnode.id: const(g, 1.0, lnode.type.dtype)}
    else:
        s = g.input(seed, ())
        grads = {lnode.id: s if lnode.type.dtype == "f32" else cast(s, lnode.type.dtype)}
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
                continue        # e.g. a frozen weight's gradient: _prune removes what it built
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
    return g, n_rules, unused


def _prune(g, n_fwd):
    """(g without the backward nodes no output or update reads, their count, their FLOPs); the
    forward nodes (ids < n_fwd) are all kept, at their ids."""
    live = live_nodes(g)
    dead = [i for i in range(n_fwd, len(g.nodes)) if i not in live]
    if not dead:
        return g, 0, 0
    dead_flops = _flops(g, dead)

    def keep(h, n, new):
        return copy_node(h, n, new) if n.id < n_fwd or n.id in live else None

    h, _ = rebuild(g, keep)
    return h, len(dead), dead_flops


def _flops(g, ids) -> int:
    return int(sum(cost(g, g.nodes[i]).flops for i in ids if g.nodes[i].op != "input"))

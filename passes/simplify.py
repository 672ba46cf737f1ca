"""The simplify pass: local rewrites, CSE, constant folding and dead-code elimination.

One walk in topological order rebuilds the graph: each node's operands are already simplified,
the rewrite rules below run on it until none applies (each rule returns an existing node, whose
type equals the node's, or one replacement node), then CSE merges it with a structurally equal
node. A final sweep drops what no output or update reads and renumbers ids densely. Leaves,
outputs, updates and initialisers are kept. Results change by float reassociation at most.

Outputs are the values before the updates. An output that is an updated param's buffer (the
param, a view of it, or a no-op of it that the rules removed) would be read after the update
writes that buffer, so it gets a copy of its own (`cast` to its dtype), computed with the other
values of the step ("output_copy" in the report).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from jitgraph.half import round_to, to_f32
from jitgraph.ir import LEAF_OPS, base, copy_node, live_nodes, rebuild
from jitgraph.registry import get_op
from jitgraph.types import ShapeError

from .report import Report

# ops that move or repeat elements without computing: a constant stays the same constant
_MOVES = ("reshape", "permute", "broadcast_to", "slice")


def simplify(graph):
    """Return (simplified graph, Report with the number of times each rule fired)."""
    counts, seen = Counter(), {}
    uses = Counter()      # new id -> readers in the original graph (outputs and updates count)
    readers = graph.users()
    for k in list(graph.outputs.values()) + list(graph.updates.values()):
        readers[k].append(None)

    def rewrite(g, n, new):
        if n.op in LEAF_OPS:
            nid = copy_node(g, n, new)
        else:
            nid = _emit(g, n.op, tuple(new[i] for i in n.inputs), n.attr, seen, counts, uses)
        uses[nid] += len(readers[n.id])
        return nid

    g, _ = rebuild(graph, rewrite)
    g, counts["dead"] = _sweep(g)
    _copy_updated_outputs(g, counts)
    return g.validate(), Report("simplify", {"nodes_before": len(graph.nodes),
                                             "nodes_after": len(g.nodes), **counts})


def _emit(g, op, inputs, attrs, seen, counts, uses) -> int:
    """Append op(inputs) after rewriting it, or return the id of an equal existing node."""
    node = g.make_node(op, inputs, attrs)
    while True:
        for name, rule in RULES:
            r = rule(node, [g.nodes[i] for i in node.inputs], uses)
            if r is not None:
                break
        else:
            break
        if isinstance(r, int):
            if g.nodes[r].type != node.type:
                raise AssertionError(f"simplify: rule {name} replaced {node.op} {node.type} "
                                     f"by %{r} {g.nodes[r].type}")
            counts[name] += 1
            return r
        try:
            node = g.make_node(*r)
        except ShapeError:      # ill-typed here (a storage-typed weight moved to the first
            break               # operand of a matmul): the node stays as it is
        counts[name] += 1
    if node.key in seen:
        counts["cse"] += 1
        return seen[node.key]
    g.nodes.append(node)        # the rewritten node, already type-checked by make_node
    seen[node.key] = node.id
    return node.id


def _sweep(g):
    """Drop nodes that no output or update reads (leaves stay); renumber densely."""
    live = live_nodes(g)
    out, _ = rebuild(g, lambda out, n, new: copy_node(out, n, new)
                     if n.id in live or n.op in LEAF_OPS else None)
    return out, len(g.nodes) - len(out.nodes)


def _copy_updated_outputs(g, counts):
    """Point every output whose buffer is an updated param's at a copy of its value."""
    updated = {g.params[k] for k, i in g.updates.items() if i != g.params[k]}
    copies = {}
    for name, i in g.outputs.items():
        if base(g, i) in updated:
            if i not in copies:
                copies[i] = g.emit("cast", (i,), {"dtype": g.nodes[i].type.dtype})
                counts["output_copy"] += 1
            g.outputs[name] = copies[i]


# ---- rules: (node, operand nodes, uses) -> None | existing id | (op, inputs, attrs) ---------
def _const(n):
    """The value of a `full` node in its dtype, or None."""
    if n.op != "full":
        return None
    if n.type.is_half:                 # its value rounded to the half type, read as f32
        return float(to_f32(round_to(n.attr["value"], n.type.dtype), n.type.dtype))
    return float(np.array(n.attr["value"], n.type.np_dtype))


def _fold(n, xs, uses):
    if not xs or any(x.op != "full" for x in xs):
        return None
    opdef = get_op(n.op)
    if n.op in _MOVES:
        v = xs[0].attr["value"]
    elif opdef.kind == "elementwise":      # uniform operands give a uniform result
        v = opdef.ref(n.attr, *[np.array(_const(x), np.float32 if x.type.is_half else
                                         x.type.np_dtype) for x in xs])
        if n.type.is_half:             # computed in f32, rounded (jitgraph/half.py)
            v = to_f32(round_to(v, n.type.dtype), n.type.dtype)
    else:
        return None
    return "full", (), {"value": float(np.asarray(v).reshape(-1)[0]), "shape": n.type.shape,
                        "dtype": n.type.dtype}


def _other_if(n, xs, value, sides):
    for side in sides:
        if _const(xs[side]) == value and xs[1 - side].type == n.type:
            return n.inputs[1 - side]
    return None


def _mul_one(n, xs, uses):
    return _other_if(n, xs, 1.0, (0, 1)) if n.op == "mul" else None


def _mul_const(n, xs, uses):
    """x * full(c) -> scale(x, c): no constant buffer, and bitwise the same product."""
    if n.op != "mul" or not n.type.is_float:
        return None
    for side in (0, 1):
        c = _const(xs[side])
        if c is not None and xs[1 - side].type == n.type:
            return "scale", (n.inputs[1 - side],), {"s": c}
    return None


def _add_zero(n, xs, uses):
    if n.op == "add":
        return _other_if(n, xs, 0.0, (0, 1))
    return _other_if(n, xs, 0.0, (1,)) if n.op == "sub" else None


def _noop(n, xs, uses):
    a = n.attr
    same = xs and xs[0].type == n.type
    if same and (n.op in ("reshape", "broadcast_to", "cast") or
                 (n.op == "permute" and a["axes"] == tuple(range(n.type.ndim))) or
                 (n.op == "slice" and all((s, e, st) == (0, d, 1) for (s, e, st), d in
                                          zip(a["slices"], n.type.shape))) or
                 (n.op == "scale" and a["s"] == 1.0) or (n.op == "pow" and a["p"] == 1.0)):
        return n.inputs[0]
    return None


def _neg_neg(n, xs, uses):
    return xs[0].inputs[0] if n.op == "neg" and xs[0].op == "neg" else None


def _scale_scale(n, xs, uses):
    if n.op == "scale" and xs[0].op == "scale":
        return "scale", xs[0].inputs, {"s": xs[0].attr["s"] * n.attr["s"]}
    return None


def _reshape_reshape(n, xs, uses):
    if n.op == "reshape" and xs[0].op == "reshape":
        return "reshape", xs[0].inputs, n.attr
    return None


def _permute_permute(n, xs, uses):
    if n.op == "permute" and xs[0].op == "permute":
        inner = xs[0].attr["axes"]
        return "permute", xs[0].inputs, {"axes": tuple(inner[i] for i in n.attr["axes"])}
    return None


def _is_swap_last2(x):
    k = x.type.ndim
    return x.op == "permute" and k >= 2 and \
        x.attr["axes"] == tuple(range(k - 2)) + (k - 1, k - 2)


def _matmul_transpose(n, xs, uses):
    """matmul(permute(x, [..,1,0]), w) -> matmul(x, w, ta=True): BLAS transposes, no copy."""
    if n.op != "matmul":
        return None
    for side, flag in ((0, "ta"), (1, "tb")):
        if _is_swap_last2(xs[side]) and n.attr.get("xq") is None:   # xq: x read as it is
            inputs = list(n.inputs)
            inputs[side] = xs[side].inputs[0]
            return "matmul", tuple(inputs), {**n.attr, flag: not n.attr[flag]}
    return None


def _transpose_matmul(n, xs, uses):
    """permute(matmul(a, b), [..,1,0]) -> matmul(b, a) with flipped flags ((AB)^T = B^T A^T),
    when the transpose is the product's only reader (no second GEMM)."""
    if _is_swap_last2(n) and xs[0].op == "matmul" and uses[n.inputs[0]] == 1 and \
            xs[0].attr.get("xq") is None:
        a = xs[0].attr
        return "matmul", xs[0].inputs[::-1], {"ta": not a["tb"], "tb": not a["ta"]}
    return None


RULES = [("fold", _fold), ("mul_one", _mul_one), ("mul_const", _mul_const),
         ("add_zero", _add_zero), ("noop", _noop),
         ("neg_neg", _neg_neg), ("scale_scale", _scale_scale),
         ("reshape_reshape", _reshape_reshape), ("permute_permute", _permute_permute),
         ("matmul_transpose", _matmul_transpose), ("transpose_matmul", _transpose_matmul)]

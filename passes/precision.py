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


# Ops that run in f32 under mixed precision whatever their operands (autocast's "f32 list"),
# beside every op of kind "rows" (softmax, log_softmax, the norms and their *_back ops) and
# "reduction" (sum, mean, max, logsumexp, ...: long accumulations whose results feed the
# losses and norms), and every op that takes no half operands (OpDef.half None: the losses,
# conv, pooling, get_rows, the updates). exp's and pow's results span ranges past f16's (exp
# overflows f16 above 11); log and softplus lose the relative precision of results near 0.
F32_OPS = frozenset({"exp", "log", "pow", "softplus"})


def mixed_role(op: str) -> str:
    """How mixed precision runs op: "gemm" (a contraction computing half types: its operands
    cast to the half type, its product kept in it), "f32" (its half operands cast to f32) or
    "follow" (elementwise, rope, attention, moves: in the half type when its float operands
    are, else in f32)."""
    d = get_op(op)
    if d.kind == "contraction" and d.half == "compute":
        return "gemm"
    if d.half not in ("compute", "move") or d.kind in ("rows", "reduction") or op in F32_OPS:
        return "f32"
    return "follow"


def mixed(graph, dtype: str):
    """(graph, Report): autocast-style mixed precision. Each f32 GEMM (mixed_role "gemm":
    matmul) reads its operands cast to `dtype` and gives its product in `dtype`; ops that
    follow their operands' type (elementwise, rope, attention, views, permute, slice, concat)
    stay in `dtype` when their float operands are in it, and run in f32 (the half operands cast
    to f32) when an operand is an f32 value computed or fed in (the residual add); an f32 param
    or constant read by an elementwise op beside half values is read in `dtype` (a GEMM's bias,
    as autocast's Linear reads its bias in the compute type). Ops of mixed_role "f32" (norms,
    softmax, reductions, losses, F32_OPS) read half operands cast to f32. Params (f32 master
    weights), graph outputs (cast back to f32) and the optimizer, which a later stage adds,
    stay f32. Run before autodiff: the backward computes in the types of the forward values
    it differentiates (a half value's gradient is half), and a param's gradient reaches it in
    f32 through its cast's vjp. Accumulation stays f32 (the half types' meaning:
    jitgraph/half.py)."""
    if dtype not in PRECISIONS:
        raise ValueError(f"precision {dtype!r}: expected one of {', '.join(PRECISIONS)}")
    count = {"gemms": 0, "half_ops": 0, "f32_ops": 0}
    if dtype == "f32":
        return graph, Report("precision", count)
    casts = {}                  # (new value, dtype) -> its cast (one per value and type)
    low = set()                 # new ids of the f32 graph's values now computed in `dtype`

    def cast(g, i, to):
        if g.nodes[i].type.dtype == to:
            return i
        if (i, to) not in casts:
            casts[(i, to)] = g.emit("cast", (i,), {"dtype": to})
        return casts[(i, to)]

    def weak(i):
        """A param or a constant of the f32 graph: read in the half type beside half values."""
        n = graph.nodes[i]
        return n.op == "param" or (n.op not in LEAF_OPS and not n.inputs)

    def rule(g, n, new):
        if n.op in LEAF_OPS:
            return copy_node(g, n, new)
        d = get_op(n.op)
        role = mixed_role(n.op)
        ins = [new[i] for i in n.inputs]
        floats = [p for p, i in enumerate(n.inputs) if graph.nodes[i].type.dtype == "f32"
                  and p not in d.storage]
        f32_in = all(graph.nodes[i].type.dtype == "f32" for i in n.inputs)
        if role == "gemm" and n.type.dtype == "f32" and f32_in:
            count["gemms"] += 1
            out = g.emit(n.op, [cast(g, x, dtype) for x in ins], dict(n.attrs))
            low.add(out)
            return out
        lowered = [p for p in range(len(ins)) if ins[p] in low]
        if not lowered:
            return copy_node(g, n, new)
        strong = [p for p in floats if ins[p] not in low and not
                  (d.kind == "elementwise" and weak(n.inputs[p]))]
        if role == "follow" and n.type.dtype == "f32" and not strong and \
                all(p in floats for p in lowered):
            count["half_ops"] += 1
            out = g.emit(n.op, [cast(g, x, dtype) if p in floats else x
                                for p, x in enumerate(ins)], dict(n.attrs))
            if g.nodes[out].type.dtype == dtype:
                low.add(out)
            return out
        count["f32_ops"] += 1           # the widest type: its half operands read as f32
        return g.emit(n.op, [cast(g, x, "f32") if x in low else x for x in ins],
                      dict(n.attrs))

    out, _ = rebuild(graph, rule)
    for k, i in out.outputs.items():    # graph outputs stay f32
        if i in low:
            out.outputs[k] = cast(out, i, "f32")
    for k, i in out.updates.items():
        if i in low:
            out.updates[k] = cast(out, i, "f32")
    return out, Report("precision", {**count, "dtype": dtype})


def sums_in_f32(graph):
    """(graph, count): a half sum (an op taking the "accumulate" fusion role: add) of half GEMM
    products (mixed_role "gemm" over half operands), or of such sums, each read by that sum
    alone, computes in f32: each product becomes the f32 GEMM of its operands' f32 casts
    (exact: a half value is an f32 value), the sums f32, and the whole sum is rounded to the
    half type once. So the backward's input gradients that sum several weights' products (x
    feeding q, k and v; the FFN's gate and up) accumulate in f32, as f32 training's do (fusion
    adds each GEMM into the first's output, beta = 1), instead of rounding each product and
    each partial sum: accumulation stays f32, the policy's rule. Run after autodiff (and on a
    forward graph: a LoRA projection's W x + B (A x))."""
    users = graph.users()
    kept = set(graph.outputs.values()) | set(graph.updates.values())

    def alone(i):
        return len(users[i]) == 1 and i not in kept

    def product(i, t):
        n = graph.nodes[i]
        return n.op not in LEAF_OPS and mixed_role(n.op) == "gemm" and n.type == t and \
            alone(i) and all(graph.nodes[j].type.dtype == t.dtype for j in n.inputs)

    sums = {}                       # sum node -> its leaves are products or sums

    def is_sum(i):
        if i not in sums:
            n = graph.nodes[i]
            sums[i] = n.op not in LEAF_OPS and "accumulate" in get_op(n.op).fusion and \
                n.type.is_half and len(set(n.inputs)) == 2 and all(
                    product(j, n.type) or (alone(j) and is_sum(j) and graph.nodes[j].type == n.type)
                    for j in n.inputs)
        return sums[i]

    roots = {n.id for n in graph.nodes if is_sum(n.id) and
             not (alone(n.id) and is_sum(users[n.id][0]))}
    if not roots:
        return graph, 0
    adds, products, todo = set(roots), set(), list(roots)    # the trees below the roots
    while todo:
        for j in graph.nodes[todo.pop()].inputs:
            if is_sum(j):
                adds.add(j)
                todo.append(j)
            else:
                products.add(j)

    def rule(g, n, new):
        if n.id in adds:
            out = g.emit(n.op, [new[i] for i in n.inputs], dict(n.attrs))
            return g.emit("cast", (out,), {"dtype": n.type.dtype}) if n.id in roots else out
        if n.id in products:            # the f32 GEMM of its operands' f32 casts
            return g.emit(n.op, [g.emit("cast", (new[i],), {"dtype": "f32"}) for i in n.inputs],
                          dict(n.attrs))
        return copy_node(g, n, new)

    return rebuild(graph, rule)[0], len(roots)


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

"""The half types as the kernels compute them: every computing op over f16 / bf16 values becomes
the same op over f32, its half operands cast to f32 and its half result cast back, so `cast`
is the one op a backend computes with half operands or results (OpDef.half "convert"), and
fusion puts those casts inside the kernels (a GEMM's operands converted in its prologue, a row
op's row read and written as half). The meaning is unchanged: the reference (jitgraph/half.py)
computes each op in f32 and rounds its result, which is what the casts do.

Ops that move elements ("move": reshape, permute, slice, concat) keep their half types, and
so does an f32 op reading a half operand at a storage position (OpDef.storage: an f32 matmul's
weight, get_rows' table: the storage-type kernels read it). A half GEMM converts both operands
to f32 (in its prologue) and runs sgemm, faster than lib.qgemm's tile-by-tile conversion.
"""
from __future__ import annotations

from jitgraph.ir import LEAF_OPS, copy_node, op_kind, rebuild
from jitgraph.registry import get_op

from .report import Report


def _touches_half(graph, n) -> bool:
    """Whether node n computes with half values: a half result, or a half operand at a
    position that is no storage position (OpDef.storage: there an f32 op reads a half weight
    as a frozen weight in its file's type, dequantized by the storage-type kernels)."""
    storage = get_op(n.op).storage if n.op not in LEAF_OPS else ()
    return n.type.is_half or any(graph.nodes[i].type.is_half and p not in storage
                                 for p, i in enumerate(n.inputs))


def leaf_casts_per_reader(graph):
    """(graph, count): each cast of a half leaf (a bf16 master weight, bf16 moments) or of a
    leaf to a half type (an f32 weight's bf16 copy in mixed precision) that several nodes read
    becomes one cast per reader, as the casts below are made: each joins its reader's kernel (a
    GEMM's prologue, an update's epilogue) or dies right after it, instead of writing a copy of
    the whole param that stays live from the forward to the backward. (Earlier passes made one
    per leaf: common subexpressions are merged there.)"""
    users = {}
    for n in graph.nodes:
        for i in dict.fromkeys(n.inputs):
            users[i] = users.get(i, 0) + 1
    shared = {n.id for n in graph.nodes if n.op == "cast" and users.get(n.id, 0) > 1 and
              graph.nodes[n.inputs[0]].op in LEAF_OPS and
              (graph.nodes[n.inputs[0]].type.is_half or n.type.is_half)}
    if not shared or any(i in shared for i in graph.outputs.values()):
        return graph, 0
    made = [0]

    def rule(g, n, new):
        if n.id in shared:
            return new[n.inputs[0]]         # a placeholder: every reader casts for itself
        mine = {i: g.emit("cast", (new[graph.nodes[i].inputs[0]],), dict(graph.nodes[i].attrs))
                for i in dict.fromkeys(n.inputs) if i in shared}
        made[0] += len(mine)
        return copy_node(g, n, {**new, **mine})

    return rebuild(graph, rule)[0], made[0]


# The backend kind (runtime/backend.py `kinds`) of a target whose GEMMs read a half weight tile
# by tile (weights_read_stored): the CPU's lib.qgemm.
KIND = "half_stored"


def compute_in_f32(graph, kinds=None):
    """(graph, Report): graph with its half-typed computing ops rewritten over f32. `kinds`:
    the target's kernel kinds (None: every kind); with KIND among them long GEMMs read half
    weights as stored (weights_read_stored)."""
    count = {"ops": 0, "casts": 0}
    graph, count["casts"] = leaf_casts_per_reader(graph)
    if not any(_touches_half(graph, n) for n in graph.nodes):
        return graph, Report("half", dict(count))

    # half value and reader -> the value's f32 cast: one per reader, so each cast joins its
    # reader's kernel (a GEMM's prologue, an elementwise or row kernel) or dies right after
    # it, and no f32 copy of a half value stays live from the forward to the backward
    read = {}

    def f32(g, i, reader):
        if (i, reader) not in read:
            count["casts"] += 1
            read[(i, reader)] = g.emit("cast", (i,), {"dtype": "f32"})
        return read[(i, reader)]

    def rule(g, n, new):
        if n.op in LEAF_OPS or get_op(n.op).half in ("move", "convert") or \
                not _touches_half(graph, n):
            return copy_node(g, n, new)
        count["ops"] += 1
        attrs = {k: ("f32" if k == "dtype" and v in ("f16", "bf16") else v) for k, v in n.attrs}
        nid = g.emit(n.op, [f32(g, new[i], n.id) if graph.nodes[i].type.is_half else new[i]
                            for i in n.inputs], attrs)
        if n.type.is_half:
            count["casts"] += 1
            nid = g.emit("cast", (nid,), {"dtype": n.type.dtype})
        return nid

    out, _ = rebuild(graph, rule)
    out, count["moved"] = casts_before_reshapes(out)
    if kinds is None or KIND in kinds:
        out, count["stored"] = weights_read_stored(out)
    return out, Report("half", dict(count))


def casts_before_reshapes(graph):
    """(graph, count): a cast of a reshape of a computed value (`cast(reshape(x))`: q's f32
    copy for rope, read from the GEMM product viewed as heads) becomes the reshape of x's cast
    (the same elements in the same order), unless a contraction reads it: the cast then joins
    the kernel computing x (a GEMM's epilogue writes the copy), where a cast of the view is a
    kernel of its own. A GEMM's operand keeps its cast next to it, for its prologue."""
    users = graph.users()
    moved = {n.id for n in graph.nodes if n.op == "cast" and
             graph.nodes[n.inputs[0]].op == "reshape" and
             op_kind(graph.nodes[graph.nodes[n.inputs[0]].inputs[0]].op) not in ("leaf", "view")
             and not any(op_kind(graph.nodes[u].op) == "contraction" for u in users[n.id])}
    if not moved:
        return graph, 0

    def rule(g, n, new):
        if n.id not in moved:
            return copy_node(g, n, new)
        x = graph.nodes[n.inputs[0]].inputs[0]
        c = g.emit("cast", (new[x],), dict(n.attrs))
        return g.emit("reshape", (c,), {"shape": n.type.shape})

    return rebuild(graph, rule)[0], len(moved)


# The contraction length and the output columns from which a GEMM reads a half weight tile by
# tile (lib.qgemm: each tile converted as it is used) as fast as OpenBLAS's sgemm reads its f32
# copy (bench/README.md, 2026-12-06, "the 1B full finetune with bf16 master weights and
# moments, after the memory fixes"); below them (MNIST's 784 x 500, a 128-wide llama's) the
# conversion of each tile costs more than the whole copy's.
STORED_MIN_K = 512
STORED_MIN_N = 1024


def weights_read_stored(graph):
    """(graph, count): a matmul whose weight operand (its storage position, OpDef.storage) is
    the f32 cast of a half value (a bf16 master weight, an f32 weight's bf16 copy in mixed
    precision), read by that matmul alone, with a contraction of STORED_MIN_K or more and
    STORED_MIN_N output columns or more, reads
    the half value itself, as it reads a frozen weight in its file's type: the GEMM converts
    tiles as it goes instead of writing an f32 copy of the whole operand first (scratch space
    the size of the largest such weight: 1 GB for a 1B model's tied embedding). The value is
    the same (the cast is exact). A GEMM whose other operand is a bf16 value's cast too keeps
    both casts: the CPU runs it on the bf16 values with AVX512-BF16 where it can
    (runtime/cpu/fused.py `_bf16_operands`), faster than either f32 path."""
    users = {}
    for n in graph.nodes:
        for i in dict.fromkeys(n.inputs):
            users[i] = users.get(i, 0) + 1
    outs = set(graph.outputs.values())

    def stored(n):
        if n.op != "matmul" or n.attr["ta"] or n.type.dtype != "f32":
            return None
        c = graph.nodes[n.inputs[1]]
        if c.op != "cast" or users.get(c.id) != 1 or c.id in outs or c.type.ndim != 2:
            return None
        src = graph.nodes[c.inputs[0]]
        x = graph.nodes[n.inputs[0]]
        if x.op == "cast" and graph.nodes[x.inputs[0]].type.dtype == src.type.dtype == "bf16":
            return None         # both operands bf16: the backend's bf16 GEMM takes the casts
        k, cols = c.type.shape[::-1] if n.attr["tb"] else c.type.shape
        ok = src.type.is_half and k >= STORED_MIN_K and cols >= STORED_MIN_N
        return src.id if ok else None

    made = {n.id: s for n in graph.nodes if (s := stored(n)) is not None}
    if not made:
        return graph, 0

    dropped = {graph.nodes[m].inputs[1] for m in made}       # the casts, read by nothing now

    def rule(g, n, new):
        if n.id in dropped:
            return None
        if n.id in made:
            return copy_node(g, n, {**new, n.inputs[1]: new[made[n.id]]})
        return copy_node(g, n, new)

    return rebuild(graph, rule)[0], len(made)

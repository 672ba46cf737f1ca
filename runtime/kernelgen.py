"""Backend-neutral helpers of kernel code generation, shared by runtime/cpu and runtime/cuda:
literals, scalar expressions, index arithmetic and the loop patterns of elementwise kernels and
reductions, all as numba source text."""
from __future__ import annotations

import math
import re

from jitgraph.ir import feeding as ir_feeding

NP_DTYPE = {"f32": "np.float32", "f64": "np.float64", "i32": "np.int32",
            "f16": "np.uint16", "bf16": "np.uint16",    # a half value's 16 bits
            "u8": "np.uint8"}          # u8: the bytes of a block-typed value (types.STORAGE)

# a float literal in an op's expression template (not part of a name or an attribute access)
FLOAT = re.compile(r"(?<![\w.])(\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)")


def literal(v) -> str:
    """A Python literal for an attribute value (floats keep full precision; inf/nan spelled)."""
    if isinstance(v, float):
        if math.isnan(v):
            return "math.nan"
        if math.isinf(v):
            return "math.inf" if v > 0 else "-math.inf"
        return repr(v)
    if isinstance(v, bool):
        return repr(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(literal(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


def typed_literal(v, dtype) -> str:
    lit = literal(v)
    return f"np.float32({lit})" if dtype == "f32" and isinstance(v, float) else lit


def scalar_expr(n, args, template, names=NP_DTYPE) -> str:
    """Node n's value from operand expressions `args` by its expression `template` (the op's
    portable OpDef.expr or a backend's own spelling), cast to its dtype (named as `names` says:
    NP_DTYPE, or a backend's own). Float literals are typed as the dtype: a bare `1.0` is a
    float64 that promotes an f32 expression."""
    dt = n.type.dtype
    if dt == "f32":
        template = FLOAT.sub(lambda m: f"np.float32({m.group(1)})", template)
    attrs = {a: typed_literal(v, dt) for a, v in n.attrs}
    return f"{names[dt]}({template.format(*args, **attrs)})"


def prod(shape) -> int:
    p = 1
    for d in shape:
        p *= d
    return p




def batch_index(name, out_batch, batch, tmp=("j", "r")) -> list:
    """Source lines binding `name`, the flat batch index into an operand of batch shape `batch`
    (right-aligned, broadcast over size-1 axes) for the flat output batch index `b` of batch
    shape `out_batch`; `tmp` names the two scratch variables the lines use."""
    if tuple(batch) == tuple(out_batch):
        return [f"{name} = b"]
    j, r = tmp
    lines, stride, lead = [f"{name} = 0", f"{r} = b"], 1, len(out_batch) - len(batch)
    for ax in reversed(range(len(out_batch))):
        d = out_batch[ax]
        lines += [f"{j} = {r} % {d}", f"{r} = {r} // {d}"]
        bax = ax - lead
        if bax >= 0 and batch[bax] != 1:
            lines.append(f"{name} += {j} * {stride}")
        if bax >= 0:
            stride *= batch[bax]
    return lines


def feeding(g, nid, members) -> set:
    """The members of a kernel that node `nid` reads, directly or through other members."""
    return ir_feeding(g, [nid], members)


# ---- elementwise --------------------------------------------------------------------------
def collapse(out_shape, in_shapes):
    """Merge adjacent axes with the same broadcast pattern and drop size-1 output axes.

    Returns (collapsed output shape, [per-input tuple of bools: True where the input is full]).
    Always at least one axis.
    """
    nd = len(out_shape)
    pats = []   # per kept axis: (size, tuple of full flags)
    for ax, d in enumerate(out_shape):
        if d == 1:
            continue
        flags = tuple(ax - (nd - len(s)) >= 0 and s[ax - (nd - len(s))] == d for s in in_shapes)
        if pats and pats[-1][1] == flags:
            pats[-1] = (pats[-1][0] * d, flags)
        else:
            pats.append((d, flags))
    if not pats:
        pats = [(1, tuple(True for _ in in_shapes))]
    shape = tuple(d for d, _ in pats)
    full = [tuple(f[j] for _, f in pats) for j in range(len(in_shapes))]
    return shape, full


def reduce_pattern(shape, axes, in_shapes=()):
    """Collapse to alternating kept ('K') / reduced ('R') axes; size-1 axes dropped. Adjacent
    axes also stay apart where an operand of a fused prologue (`in_shapes`, broadcasting into
    `shape`) is full on one and broadcast on the other. There is always a reduced axis: when
    nothing is reduced (no axes, or only size-1 ones) a trailing 'R' of size 1 stands for it,
    so every output element reduces one element and one loop nest serves every case.
    Returns (pats, full flags per operand)."""
    nd = len(shape)
    pats = []   # (size, kind, flags)
    for ax, d in enumerate(shape):
        if d == 1:
            continue
        flags = tuple(ax - (nd - len(s)) >= 0 and s[ax - (nd - len(s))] == d for s in in_shapes)
        kind = "R" if ax in axes else "K"
        if pats and pats[-1][1:] == (kind, flags):
            pats[-1] = (pats[-1][0] * d, kind, flags)
        else:
            pats.append((d, kind, flags))
    if all(kind != "R" for _, kind, _ in pats):
        pats.append((1, "R", tuple(True for _ in in_shapes)))
    return [(d, k) for d, k, _ in pats], [tuple(p[2][j] for p in pats)
                                          for j in range(len(in_shapes))]


def matmul_operands(graph, n):
    """(w node, x arg, output 2-D shape) of a matmul run as one 2-D GEMM (batched x folded
    into rows)."""
    x, w = (graph.nodes[i] for i in n.inputs)
    os_ = n.type.shape
    rows = n.type.size // os_[-1] if os_[-1] else prod(os_[:-1])
    return w, (x.id, x.type.shape if x.type.ndim == 2 else (rows, x.type.shape[-1])), \
        (rows, os_[-1])

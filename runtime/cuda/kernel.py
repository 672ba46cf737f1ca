"""The CUDA backend's kernel writing: what a kernel is made of (Source: parameters bound to
arguments, body lines; Launch: a kernel with its grid, block and arguments; Ref: where an
argument lies), the Context every writer reads (the graph, the plan, where values live), and
the index arithmetic, block reductions and copies the writers share.

Kernels are Python source (one module per program); equal kernels have equal text and are
compiled once (named by a hash of it). `Generated.launches` is the driver's whole step:
(kernel, grid, block, args, phase), each arg a `Ref` (base, byte offset, shape, dtype) the
driver binds to device arrays once, or an int.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from jitgraph.plan import CALLER
from jitgraph.printer import format_node
from jitgraph.types import TensorType

from .. import kernelgen
from ..kernelgen import typed_literal
from . import spelling

HEADER = '''"""jitgraph CUDA kernels (generated)."""
import math

import numpy as np
from numba import cuda

from jitgraph.runtime.cuda import halfconv

'''


@dataclass(frozen=True)
class Ref:
    """A kernel argument: `shape` elements of `dtype` at byte `offset` of `base` ("arena",
    "persist", or an int: the io table entry)."""
    base: object
    offset: int
    shape: tuple
    dtype: str      # numpy dtype name


@dataclass
class Launch:
    kernel: str
    grid: tuple
    block: tuple
    args: list
    phase: int = 1          # 1: before the update boundary (or no boundary), 2: after
    kg_kernel: int = -1     # the KernelGraph kernel it implements
    note: str = ""
    gemm: object = None     # GemmSpec: a GEMM a library may run instead (runtime/cuda/gemm.py)


@dataclass(frozen=True)
class GemmSpec:
    """args[2] = op(args[0]) @ op(args[1]) (op: transposed when ta / tb), M x N over K, the
    launch's arguments 2-D ([rows, cols] as stored) or, batched, 3-D with broadcast batches."""
    ta: bool
    tb: bool
    M: int
    N: int
    K: int
    dtype: str
    batched: bool
    # (half dtype, A's node, B's node) where both f32 operands are casts of values of one half
    # type (they hold half values exactly): what a library GEMM over half operands would read
    # (runtime/cuda/gemm.py half_operands, a hook only)
    half: tuple | None = None


@dataclass
class Generated:
    kernels: dict                       # name -> source text of the function
    launches: list                      # Launch, in order
    source: str                         # the module text (every kernel)
    workspace_bytes: int
    phases: int = 1
    tpb: int = 128                      # threads per block of 1-D kernels (shared arrays' size)
    tile: int = 16                      # GEMM tile
    plan_bytes: dict = field(default_factory=dict)   # arena, persist, outputs: what it needs
    inputs: dict = field(default_factory=dict)       # pointer -> (nbytes, dtype, shape)
    outputs: dict = field(default_factory=dict)      # pointer -> (nbytes, dtype, shape)


class Unsupported(NotImplementedError):
    pass


def scalar_expr(n, args, g) -> str:
    """Node n's value from operand expressions, by this backend's spelling of its op (a cast
    to or from a half type: its conversion, runtime/cuda/spelling.py)."""
    try:
        template = spelling.expr(n.op, n.type.dtype, [g.nodes[i].type.dtype for i in n.inputs])
    except NotImplementedError as e:
        raise Unsupported(f"{e} (node %{n.id})") from None
    if template is None:
        raise Unsupported(f"target cuda: op {n.op} has no scalar expression")
    return kernelgen.scalar_expr(n, args, template, spelling.DTYPE)


def np_name(dt: str) -> str:
    return TensorType(dt, ()).np_dtype.name


class Source:
    """A kernel being written: parameters bound to args (Ref or int), body lines."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.params, self.args, self.lines, self.names = [], [], [], {}

    def arg(self, ref, prefix="a") -> str:
        if ref in self.args:
            return self.params[self.args.index(ref)]
        self.params.append(f"{prefix}{len(self.params)}")
        self.args.append(ref)
        return self.params[-1]

    def local(self, nid, prefix="v") -> str:
        return f"{prefix}{self.names.setdefault((prefix, nid), len(self.names))}"

    def members(self, nodes, vals, pad="") -> list:
        g, lines = self.ctx.g, []
        for m in nodes:
            n = g.nodes[m]
            lines.append(pad + f"{self.local(m)} = {scalar_expr(n, [vals[i] for i in n.inputs], g)}"
                         f"  # {n.op}")
            vals[m] = self.local(m)
        return lines

    def finish(self, grid, block, note="") -> Launch:
        body = "".join("    " + ln + "\n" for ln in self.lines)
        text = f"def KERNEL({', '.join(self.params)}):\n{body}"
        name = "k" + hashlib.sha1(text.encode()).hexdigest()[:16]
        self.ctx.kernels[name] = text.replace("KERNEL", name, 1)
        return Launch(name, tuple(grid), tuple(block), list(self.args), note=note)


class Context:
    """What every lowering reads: the graph, the plan, the inlined constants, where values
    live (`place`: node id -> a scratch offset, overriding its slot), launch limits."""

    def __init__(self, kg, plan, tpb, tile, max_blocks):
        self.kg, self.g, self.plan = kg, kg.graph, plan
        self.inlined = kg.inlined
        self.tpb, self.tile, self.max_blocks = tpb, tile, max_blocks
        self.kernels = {}
        self.work_at = -(-plan.arena_bytes // ALIGN_WS) * ALIGN_WS
        self.work = 0
        self.place = {}

    def consts(self) -> dict:
        """The inlined constants' literals, as a kernel holds their dtype (a half constant:
        its value rounded, spelled as the half value a load would give)."""
        g = self.g
        out = {}
        for c in self.inlined:
            v, dt = g.nodes[c].attr["value"], g.nodes[c].type.dtype
            out[c] = half_literal(v, dt) if dt in ("f16", "bf16") else typed_literal(v, dt)
        return out

    def ref(self, nid, shape=None) -> Ref:
        """Where value nid lies, seen as `shape` (default its own, flattened to 1-D)."""
        t = self.g.nodes[nid].type
        shape = (t.size,) if shape is None else tuple(shape)
        if nid in self.place:
            return self.scratch(self.place[nid], shape, t.dtype)
        s = self.plan.slots[nid]
        base = s.pointer if s.region in CALLER else s.region
        return Ref(base, s.offset, shape, np_name(t.dtype))

    def scratch(self, offset, shape, dtype) -> Ref:
        """`shape` elements of `dtype` at `offset` bytes into the scratch space after the plan."""
        nbytes = int(prod(shape)) * TensorType(dtype, ()).np_dtype.itemsize
        self.work = max(self.work, offset + nbytes)
        return Ref("arena", self.work_at + offset, tuple(shape), np_name(dtype))

    def blocks(self, n, per=None) -> int:
        per = per or self.tpb
        return max(1, min(-(-n // per), self.max_blocks))

    def unsupported(self, n, why="") -> Unsupported:
        return Unsupported(f"target cuda: op {n.op} has no CUDA lowering yet{why} (node %{n.id}: "
                           f"{format_node(self.g, n).strip()}); compile for target='cpu'")


ALIGN_WS = 256


def half_literal(v, dt) -> str:
    """Float v rounded to half type dt (jitgraph/half.py), as a kernel holds it: f16 a float16,
    bf16 its bits."""
    from jitgraph.half import round_to
    r = round_to(float(v), dt)
    if dt == "f16":
        return f"np.float16({kernelgen.literal(float(r))})"
    return f"np.uint16({int(r)})"


def prod(shape):
    p = 1
    for d in shape:
        p *= d
    return p


def unravel(var, axes, sizes, pad="") -> list:
    """Lines binding i<ax> for `axes` (row-major over `sizes`) from the flat index `var`."""
    if not axes:
        return []
    if len(axes) == 1:
        return [pad + f"i{axes[0]} = {var}"]
    lines = [pad + f"r_ = {var}"]
    for j, ax in enumerate(reversed(axes)):
        if j == len(axes) - 1:
            lines.append(pad + f"i{ax} = r_")
        else:
            lines += [pad + f"i{ax} = r_ % {sizes[ax]}", pad + f"r_ = r_ // {sizes[ax]}"]
    return lines


def offset_expr(sizes, full) -> str:
    """The flat offset into an operand that is `full` on some axes of the domain `sizes`
    (broadcast on the others), from the bound i<ax>."""
    terms, stride = [], 1
    for ax in reversed(range(len(sizes))):
        if full[ax] and sizes[ax] != 1:
            terms.append(f"i{ax}" if stride == 1 else f"i{ax} * {stride}")
            stride *= sizes[ax]
    return " + ".join(reversed(terms)) or "0"


def block_reduce(var, op, dtype, sm, pad="") -> list:
    """Lines combining `var` across the block's threads (tid `t`) into every thread's `var`,
    through the shared array `sm` of TPB elements: a tree, then a barrier before reuse."""
    comb = {"sum": "{a} + {b}", "max": "max({a}, {b})"}[op]
    return [pad + ln for ln in [
        f"{sm}[t] = {var}", "cuda.syncthreads()", "s_ = TPB // 2", "while s_ > 0:",
        "    if t < s_:", f"        {sm}[t] = {comb.format(a=f'{sm}[t]', b=f'{sm}[t + s_]')}",
        "    cuda.syncthreads()", "    s_ = s_ // 2", f"{var} = {sm}[0]", "cuda.syncthreads()"]]


def externals(g, members, vals) -> list:
    mem, out = set(members), []
    for m in members:
        for i in g.nodes[m].inputs:
            if i not in mem and i not in vals and i not in out:
                out.append(i)
    return out


# ---- copies -----------------------------------------------------------------------------------
def copy_words(ctx, src_ref: Ref, dst_ref: Ref, note="") -> Launch:
    src = Source(ctx)
    a, o = src.arg(src_ref), src.arg(dst_ref, "o")
    n = dst_ref.shape[0]
    src.lines += ["i = cuda.grid(1)", "st = cuda.gridsize(1)", f"while i < {n}:",
                  f"    {o}[i] = {a}[i]", "    i += st"]
    return src.finish((ctx.blocks(n),), (ctx.tpb,), note)


def fill_words(ctx, ref: Ref, note="") -> Launch:
    src = Source(ctx)
    o = src.arg(ref, "o")
    n = ref.shape[0]
    src.lines += ["i = cuda.grid(1)", "st = cuda.gridsize(1)", f"while i < {n}:",
                  f"    {o}[i] = 0", "    i += st"]
    return src.finish((ctx.blocks(n),), (ctx.tpb,), note)


def words(base, offset, nbytes) -> Ref:
    """nbytes at offset of base as 32-bit words, or 16-bit ones where nbytes is no multiple of
    4 (a half value of an odd count)."""
    if nbytes % 4:
        return Ref(base, offset, (nbytes // 2,), "uint16")
    return Ref(base, offset, (nbytes // 4,), "uint32")


def gather(ctx, n, lines_for, note, extra=()) -> list:
    """One thread per output element (grid-stride): `lines_for(src, i)` -> lines binding `val`
    from the flat output index i."""
    src = Source(ctx)
    total = n.type.size
    if total == 0:
        return []
    o = src.arg(ctx.ref(n.id), "o")
    body = lines_for(src)
    src.lines += ["i = cuda.grid(1)", "st = cuda.gridsize(1)", f"while i < {total}:"]
    src.lines += ["    " + ln for ln in body] + [f"    {o}[i] = val", "    i += st"]
    return [src.finish((ctx.blocks(total),), (ctx.tpb,), note)]


def per_element(ctx, src, dims, names, body, note) -> Launch:
    total = prod(dims)
    src.lines += ["e = cuda.grid(1)", "st = cuda.gridsize(1)", f"while e < {total}:", "    r_ = e"]
    for name, d in reversed(list(zip(names, dims))):
        src.lines += [f"    {name} = r_ % {d}", f"    r_ = r_ // {d}"]
    src.lines += ["    " + ln for ln in body] + ["    e += st"]
    return src.finish((ctx.blocks(total),), (ctx.tpb,), note)


def strides(shape) -> list:
    out, st = [0] * len(shape), 1
    for ax in reversed(range(len(shape))):
        out[ax], st = st, st * shape[ax]
    return out


def fill(ctx, n, value, note="") -> Launch:
    """Every element of node n's buffer set to `value` (a literal of its dtype)."""
    src = Source(ctx)
    o = src.arg(ctx.ref(n.id), "o")
    total = n.type.size
    src.lines += ["i = cuda.grid(1)", "st = cuda.gridsize(1)", f"while i < {total}:",
                  f"    {o}[i] = {value}", "    i += st"]
    return src.finish((ctx.blocks(total),), (ctx.tpb,), note)


def words_of(ctx, node) -> Ref:
    """Node's buffer as 32-bit words, or 16-bit ones for an odd count of halves (copies)."""
    r = ctx.ref(node.id)
    return words(r.base, r.offset, node.type.nbytes)

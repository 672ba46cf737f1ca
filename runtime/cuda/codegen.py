"""CUDA code generation: numba-cuda kernels for a KernelGraph at its MemoryPlan's offsets.

The same kernel graph the CPU backend gets (passes/fuse.py), the same memory plan: every value
lives at its slot in the device arena, the device persistent region, or (inputs and outputs) at
an entry of the per-call io table. Each kernel of the graph becomes one or more launches:

  elementwise  one grid-stride kernel per domain (shape); the shape-() members are recomputed
               by every thread and stored by a last one-thread launch (so no store of a scalar
               can race a thread still reading the buffer it may share, planned in place)
  gemm         prologue (elementwise, into scratch space), a tiled GEMM (runtime/cuda/table.py
               GEMM: the seam for cuBLASLt), epilogue (elementwise over the GEMM's result)
  reduce       one block per output element, threads striding over the reduced elements
               (the fused prologue computed per element), a shared-memory tree reduction
  rows         one block per row (softmax, log_softmax, rms_norm, layer_norm and their backs,
               over the last axis), passes of strided accumulation + shared-memory trees, the
               fused prologue recomputed per pass, the epilogue in the last loop
  cross_entropy one block per row: max, sum of exponentials, loss term, gradient row; the
               row losses summed by a second one-block launch (deterministic)
  node         the op's rule in runtime/cuda/table.py; an op without one is a compile-time
               NotImplementedError naming the op and the node

Kernels are Python source (one module per program); equal kernels have equal text and are
compiled once. `Generated.launches` is the driver's whole step: (kernel, grid, block, args,
phase), each arg a `Ref` (base, byte offset, shape, dtype) the driver binds to device arrays
once, or an int.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from jitgraph.plan import CALLER
from jitgraph.printer import format_node
from jitgraph.registry import get_op
from jitgraph.types import TensorType

from .. import kernelgen
from ..kernelgen import (NP_DTYPE, batch_index, collapse, feeding, matmul_operands, reduce_pattern,
                         typed_literal)

HEADER = '''"""jitgraph CUDA kernels (generated)."""
import math

import numpy as np
from numba import cuda

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


def np_name(dt: str) -> str:
    return TensorType(dt, ()).np_dtype.name


# ---- scalar expressions ----------------------------------------------------------------------
def scalar_expr(n, args) -> str:
    """Node n's value from operand expressions, by its op's portable expression (OpDef.expr):
    numba-cuda lowers math.* to libdevice."""
    dt = n.type.dtype
    if n.op == "round_f16":         # the device's cvt.rn.f16 (ties to even, overflow to inf)
        return half(args[0], dt)
    template = get_op(n.op).expr
    if template is None:
        raise Unsupported(f"op {n.op} has no scalar expression")
    return kernelgen.scalar_expr(n, args, template)


def half(expr, dt) -> str:
    """`expr` rounded to the nearest float16, in dtype dt (round_f16, llama.cpp's F16 KV cache):
    one cvt.rn.f16.f32 / .f64 and back on the device, numpy's float16 cast on the simulator."""
    return f"{NP_DTYPE[dt]}(np.float16({expr}))"


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
            lines.append(pad + f"{self.local(m)} = {scalar_expr(n, [vals[i] for i in n.inputs])}"
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
        g = self.g
        return {c: typed_literal(g.nodes[c].attr["value"], g.nodes[c].type.dtype)
                for c in self.inlined}

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
        nbytes = int(_prod(shape)) * TensorType(dtype, ()).np_dtype.itemsize
        self.work = max(self.work, offset + nbytes)
        return Ref("arena", self.work_at + offset, tuple(shape), np_name(dtype))

    def blocks(self, n, per=None) -> int:
        per = per or self.tpb
        return max(1, min(-(-n // per), self.max_blocks))

    def unsupported(self, n, why="") -> Unsupported:
        return Unsupported(f"target cuda: op {n.op} has no CUDA lowering yet{why} (node %{n.id}: "
                           f"{format_node(self.g, n).strip()}); compile for target='cpu'")


ALIGN_WS = 256


def _prod(shape):
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


# ---- elementwise ------------------------------------------------------------------------------
def elementwise(ctx, nodes, outputs, note="") -> list:
    """Launches computing elementwise `nodes` (in order), storing `outputs`: one grid-stride
    launch per domain, then one single-thread launch storing the shape-() outputs."""
    g = ctx.g
    outs = set(outputs)
    scal = [m for m in nodes if g.nodes[m].type.shape == ()]
    domains = {}
    for m in nodes:
        if g.nodes[m].type.shape != ():
            domains.setdefault(g.nodes[m].type.shape, []).append(m)
    for shape, mems in domains.items():
        for m in mems:
            for i in g.nodes[m].inputs:
                if i in nodes and i not in mems and g.nodes[i].type.shape != ():
                    raise Unsupported(f"target cuda: elementwise kernel ({note}) reads %{i} "
                                      f"across domains; not lowered yet")
    launches = []
    for shape, mems in domains.items():
        src = Source(ctx)
        vals = ctx.consts()
        _scalars(src, scal, vals)
        ext = [i for i in _externals(g, mems, vals)]
        dims, full = collapse(shape, [g.nodes[i].type.shape for i in ext])
        total = _prod(dims)
        src.lines += ["i = cuda.grid(1)", "st = cuda.gridsize(1)", f"while i < {total}:"]
        src.lines += unravel("i", list(range(len(dims))), dims, "    ")
        for i, f in zip(ext, full):
            view = (_prod(d for d, ff in zip(dims, f) if ff),)
            at = offset_expr(dims, f) if len(dims) > 1 else "i" if all(f) else "0"
            src.lines.append(f"    {src.local(i, 'x')} = {src.arg(ctx.ref(i, view))}[{at}]")
            vals[i] = src.local(i, "x")
        src.lines += src.members(mems, vals, "    ")
        src.lines += [f"    {src.arg(ctx.ref(m, (total,)), 'o')}[i] = {vals[m]}" for m in mems
                      if m in outs]
        src.lines.append("    i += st")
        launches.append(src.finish((ctx.blocks(total),), (ctx.tpb,), note))
    if any(m in outs for m in scal):
        src = Source(ctx)
        vals = ctx.consts()
        src.lines.append("if cuda.grid(1) == 0:")
        body = _scalars(src, scal, vals, store=outs)
        src.lines += ["    " + ln for ln in body]
        launches.append(src.finish((1,), (1,), note + " scalars"))
    return launches


def _scalars(src, scal, vals, store=None):
    """Lines loading the shape-() operands and computing the shape-() members (appended to
    src.lines, or returned when `store` names the outputs to store)."""
    g = src.ctx.g
    lines = []
    for i in _externals(g, scal, vals):
        lines.append(f"{src.local(i, 'x')} = {src.arg(src.ctx.ref(i, (1,)))}[0]")
        vals[i] = src.local(i, "x")
    lines += src.members(scal, vals)
    if store is None:
        src.lines += lines
        return None
    return lines + [f"{src.arg(src.ctx.ref(m, (1,)), 'o')}[0] = {vals[m]}" for m in scal
                    if m in store]


def _externals(g, members, vals) -> list:
    mem, out = set(members), []
    for m in members:
        for i in g.nodes[m].inputs:
            if i not in mem and i not in vals and i not in out:
                out.append(i)
    return out


# ---- GEMM -------------------------------------------------------------------------------------
def gemm_launch(ctx, ta, tb, a_ref, b_ref, c_ref, dtype, note="", batch=None) -> Launch:
    """C = op(A) @ op(B) by the tiled shared-memory kernel (the seam for cuBLASLt: a backend
    with nvmath-python plans a Matmul here instead, runtime/cuda/table.py GEMM). `batch`:
    (output batch shape, A's, B's batch shapes): 3-D operands, blockIdx.z the output matrix,
    A's and B's matrix by broadcasting (right-aligned, size-1 axes repeat)."""
    src = Source(ctx)
    T = ctx.tile
    a, b, c = src.arg(a_ref), src.arg(b_ref), src.arg(c_ref, "o")
    M, N = c_ref.shape[-2:]
    K = a_ref.shape[-2] if ta else a_ref.shape[-1]
    npd = NP_DTYPE[dtype]
    pa = pb = pc = ""
    nb = 1
    if batch is not None:
        ob, xb, wb = batch
        nb = _prod(ob)
        src.lines += ["b = cuda.blockIdx.z"] + batch_index("ba", ob, xb, ("j_", "r_")) + \
            batch_index("bb", ob, wb, ("j_", "r_"))
        pa, pb, pc = "ba, ", "bb, ", "b, "
    at = f"{a}[{pa}kk, row]" if ta else f"{a}[{pa}row, kk]"
    bt = f"{b}[{pb}col, kk]" if tb else f"{b}[{pb}kk, col]"
    src.lines += [
        f"sa = cuda.shared.array(({T}, {T}), {npd})", f"sb = cuda.shared.array(({T}, {T}), {npd})",
        "tx = cuda.threadIdx.x", "ty = cuda.threadIdx.y",
        f"col = cuda.blockIdx.x * {T} + tx", f"row = cuda.blockIdx.y * {T} + ty",
        f"acc = {npd}(0.0)", f"for k0 in range(0, {K}, {T}):",
        "    kk = k0 + tx", f"    if row < {M} and kk < {K}:", f"        sa[ty, tx] = {at}",
        "    else:", f"        sa[ty, tx] = {npd}(0.0)",
        "    kk = k0 + ty", f"    if col < {N} and kk < {K}:", f"        sb[ty, tx] = {bt}",
        "    else:", f"        sb[ty, tx] = {npd}(0.0)",
        "    cuda.syncthreads()", f"    for j in range({T}):",
        "        acc += sa[ty, j] * sb[j, tx]",
        "    cuda.syncthreads()", f"if row < {M} and col < {N}:", f"    {c}[{pc}row, col] = acc"]
    grid = (-(-N // T), -(-M // T)) + ((nb,) if batch is not None else ())
    ln = src.finish(grid, (T, T), note)
    if ln.args == [a_ref, b_ref, c_ref]:        # (distinct operands: a library may run it)
        ln.gemm = GemmSpec(bool(ta), bool(tb), M, N, K, dtype, batch is not None)
    return ln


def matmul_node(ctx, n, note="") -> list:
    if n.type.size == 0:
        return []
    x, w = (ctx.g.nodes[i] for i in n.inputs)
    if w.type.ndim != 2 or not (x.type.ndim == 2 or not n.attr["ta"]):
        xs, ws, os_ = x.type.shape, w.type.shape, n.type.shape
        ob = os_[:-2]
        return [gemm_launch(ctx, n.attr["ta"], n.attr["tb"],
                            ctx.ref(x.id, (_prod(xs[:-2]),) + xs[-2:]),
                            ctx.ref(w.id, (_prod(ws[:-2]),) + ws[-2:]),
                            ctx.ref(n.id, (_prod(ob),) + os_[-2:]), n.type.dtype, note,
                            (ob, xs[:-2], ws[:-2]))]
    w, (xid, xshape), (rows, cols) = matmul_operands(ctx.g, n)
    return [gemm_launch(ctx, n.attr["ta"], n.attr["tb"], ctx.ref(xid, xshape),
                        ctx.ref(w.id, w.type.shape), ctx.ref(n.id, (rows, cols)), n.type.dtype,
                        note)]


def gemm_kernel(ctx, kernel, note) -> list:
    """A fused gemm kernel: prologue values the GEMM or the epilogue read go to scratch space
    (or their own buffers when read outside), the product to its own buffer when it overlaps
    no operand (else scratch), then the epilogue over it."""
    g = ctx.g
    n = g.nodes[kernel.anchor]
    if kernel.accumulate:     # not in this backend's kinds: the pipeline forms none for it
        raise ctx.unsupported(g.nodes[kernel.accumulate[0][0]], " as a GEMM accumulated into "
                              "another's output (gemm_accumulate)")
    pro = feeding(g, n.id, kernel.nodes)
    epi = [m for m in kernel.nodes if m != n.id and m not in pro]
    launches, at = [], 0
    saved = dict(ctx.place)
    for i in dict.fromkeys(i for m in (n.id, *epi) for i in g.nodes[m].inputs):
        if i in pro and i not in kernel.outputs:
            ctx.place[i] = at
            at += -(-g.nodes[i].type.nbytes // ALIGN_WS) * ALIGN_WS
    if pro:
        ordered = [m for m in kernel.nodes if m in pro]
        launches += elementwise(ctx, ordered, [m for m in ordered if m in kernel.outputs or
                                               m in ctx.place], note + " prologue")
    ins = [ctx.ref(i) for m in kernel.nodes for i in g.nodes[m].inputs
           if i not in kernel.nodes and i not in ctx.inlined]
    own = ctx.ref(n.id) if n.id in kernel.outputs else None
    if own is None or any(_overlap(own, r) for r in ins):
        ctx.place[n.id] = at
    launches += matmul_node(ctx, n, note)
    if epi:
        launches += elementwise(ctx, epi, [m for m in epi if m in kernel.outputs],
                                note + " epilogue")
    if own is not None and n.id in ctx.place:    # read outside, computed in scratch: copy it
        nbytes = n.type.nbytes
        launches.append(copy_words(ctx, ctx.scratch(ctx.place[n.id], (nbytes // 4,), "i32"),
                                   Ref(own.base, own.offset, (nbytes // 4,), "int32"),
                                   note + " product"))
    ctx.place = saved
    return launches


def _overlap(a: Ref, b: Ref) -> bool:
    if a.base != b.base:
        return False
    na = _prod(a.shape) * _itemsize(a.dtype)
    nb = _prod(b.shape) * _itemsize(b.dtype)
    return a.offset < b.offset + nb and b.offset < a.offset + na


def _itemsize(name):
    return np.dtype(name).itemsize


# ---- reductions -------------------------------------------------------------------------------
REDUCE = {"sum": "sum", "mean": "sum", "max": "max"}
SERIAL = ("argmax", "logsumexp")


def reduction(ctx, n, prologue=(), outputs=(), note="") -> list:
    """Reduction node n over its operand, computed by `prologue` members (elementwise, storing
    `outputs`) when fused: sum / mean / max one block per output element with a shared-memory
    tree; argmax / logsumexp one thread per output element."""
    g = ctx.g
    x = g.nodes[n.inputs[0]]
    axes = (n.attr["axis"] % max(x.type.ndim, 1),) if n.op == "argmax" else \
        tuple(a % max(x.type.ndim, 1) for a in n.attr["axes"])
    if n.op not in REDUCE and n.op not in SERIAL:
        raise ctx.unsupported(n)
    src = Source(ctx)
    vals = ctx.consts()
    pro = list(prologue)
    ext = _externals(g, pro, vals) if pro else [x.id]
    pats, full = reduce_pattern(x.type.shape, axes, [g.nodes[i].type.shape for i in ext])
    sizes = [d for d, _ in pats]
    kept = [ax for ax, (_, k) in enumerate(pats) if k == "K"]
    red = [ax for ax, (_, k) in enumerate(pats) if k == "R"]
    nout, nred = _prod(sizes[ax] for ax in kept), _prod(sizes[ax] for ax in red)
    T = NP_DTYPE[n.type.dtype]
    xt = NP_DTYPE[x.type.dtype]
    refs = [src.arg(ctx.ref(i, (_prod(d for d, f in zip(sizes, fl) if f),)))
            for i, fl in zip(ext, full)]
    stores = [(m, src.arg(ctx.ref(m, (x.type.size,)), "o")) for m in pro if m in outputs]
    out = src.arg(ctx.ref(n.id, (max(nout, 1),)), "o")
    allfull = tuple(True for _ in sizes)

    def element(pad):
        lines = unravel("q", red, sizes, pad)
        v = dict(vals)
        for i, fl, r in zip(ext, full, refs):
            lines.append(pad + f"{src.local(i, 'x')} = {r}[{offset_expr(sizes, fl)}]")
            v[i] = src.local(i, "x")
        lines += src.members(pro, v, pad)
        lines += [pad + f"{o}[{offset_expr(sizes, allfull)}] = {v[m]}" for m, o in stores]
        return lines, v[x.id]

    if n.op in REDUCE:
        op = REDUCE[n.op]
        acc_t = xt if x.type.is_float else "np.int64"
        init = f"{acc_t}(-math.inf)" if op == "max" else f"{acc_t}(0)"
        if op == "max" and not x.type.is_float:
            init = f"{acc_t}({-2**31})"
        src.lines += [f"sm = cuda.shared.array(TPB, {acc_t})", "t = cuda.threadIdx.x",
                      "o = cuda.blockIdx.x", f"while o < {nout}:"]
        src.lines += unravel("o", kept, sizes, "    ")
        src.lines += [f"    acc = {init}", "    q = t", f"    while q < {nred}:"]
        lines, e = element("        ")
        src.lines += lines
        src.lines += ["        acc = acc + " + e if op == "sum" else f"        acc = max(acc, {e})",
                      "        q += TPB"]
        src.lines += block_reduce("acc", op, T, "sm", "    ")
        res = f"acc / {nred}" if n.op == "mean" else "acc"
        src.lines += ["    if t == 0:", f"        {out}[o] = {T}({res})",
                      "    o += cuda.gridDim.x"]
        return [src.finish((ctx.blocks(nout, 1),), (ctx.tpb,), note)]
    src.lines += ["o = cuda.grid(1)", "st = cuda.gridsize(1)", f"while o < {nout}:"]
    src.lines += unravel("o", kept, sizes, "    ")
    src.lines += ["    q = 0"]
    lines, e = element("    ")
    src.lines += lines + [f"    best = {e}"]
    if n.op == "argmax":
        src.lines += ["    bi = 0", f"    for q in range(1, {nred}):"]
        lines, e = element("        ")
        src.lines += lines + [f"        v_ = {e}", "        if v_ > best:", "            best = v_",
                              "            bi = q", f"    {out}[o] = np.int32(bi)"]
    else:   # logsumexp
        src.lines += [f"    for q in range(1, {nred}):"]
        lines, e = element("        ")
        src.lines += lines + [f"        best = max(best, {e})",
                              "    m = np.float64(best)", "    if not math.isfinite(m):",
                              "        m = 0.0", "    s = 0.0", f"    for q in range({nred}):"]
        lines, e = element("        ")
        src.lines += lines + [f"        s += math.exp(np.float64({e}) - m)",
                              f"    {out}[o] = {T}(math.log(s) + m)"]
    src.lines.append("    o += st")
    return [src.finish((ctx.blocks(nout),), (ctx.tpb,), note)]


def count_equal(ctx, n, note="") -> list:
    x, y = (ctx.g.nodes[i] for i in n.inputs)
    src = Source(ctx)
    a, b = src.arg(ctx.ref(x.id)), src.arg(ctx.ref(y.id))
    out = src.arg(ctx.ref(n.id, (1,)), "o")
    src.lines += ["sm = cuda.shared.array(TPB, np.int32)", "t = cuda.threadIdx.x", "acc = 0",
                  "j = t", f"while j < {x.type.size}:", f"    if {a}[j] == {b}[j]:",
                  "        acc += 1", "    j += TPB"]
    src.lines += block_reduce("acc", "sum", "np.int32", "sm")
    src.lines += ["if t == 0:", f"    {out}[0] = np.int32(acc)"]
    return [src.finish((1,), (ctx.tpb,), note)]


# ---- cross entropy ----------------------------------------------------------------------------
def cross_entropy(ctx, fwd, back, note="") -> list:
    """Loss (node `fwd`, or None) and gradient (node `back`, or None) from one pass over each
    row of the logits: one block per row; the row losses into scratch, summed by a second
    one-block launch."""
    g = ctx.g
    first = fwd if fwd is not None else back
    lg, tg = (g.nodes[i] for i in first.inputs[:2])
    N, C = lg.type.shape
    T = NP_DTYPE[lg.type.dtype]
    labels = tg.type.dtype == "i32"
    src = Source(ctx)
    vals = ctx.consts()
    la = src.arg(ctx.ref(lg.id, (N, C)))
    ta = src.arg(ctx.ref(tg.id, (N,) if labels else (N, C)))
    rows = ctx.scratch(0, (N,), "f64") if fwd is not None else None
    ra = src.arg(rows, "w") if rows is not None else None
    go, gs = None, None
    if back is not None:
        gg = g.nodes[back.inputs[2]]
        gv = vals.get(gg.id) or f"{src.arg(ctx.ref(gg.id, (1,)))}[0]"
        go = src.arg(ctx.ref(back.id, (N, C)), "o")
        gs = f"{T}({gv} / {N})"
    L = src.lines
    L += [f"sm = cuda.shared.array(TPB, {T})", "sd = cuda.shared.array(TPB, np.float64)",
          "t = cuda.threadIdx.x", "r = cuda.blockIdx.x", f"while r < {N}:",
          f"    m = {T}(-math.inf)", "    j = t", f"    while j < {C}:",
          f"        m = max(m, {la}[r, j])", "        j += TPB"]
    L += block_reduce("m", "max", T, "sm", "    ")
    L += ["    if not math.isfinite(m):", f"        m = {T}(0.0)", "    s = 0.0", "    j = t",
          f"    while j < {C}:", f"        s += math.exp(np.float64({la}[r, j] - m))",
          "        j += TPB"]
    L += block_reduce("s", "sum", "np.float64", "sd", "    ")
    L += ["    lse = m + math.log(s)", f"    inv = {T}(1.0 / s)"]
    if labels:
        L += [f"    y = {ta}[r]", f"    bad = y < 0 or y >= {C}", "    y = 0 if bad else y"]
        if ra is not None:
            L += ["    if t == 0:",
                  f"        {ra}[r] = (math.nan if bad else 0.0) + (lse - {la}[r, y])"]
        L += ["    cuda.syncthreads()"]     # the label's logit read before the row is written
        if go is not None:
            L += ["    j = t", f"    while j < {C}:",
                  f"        p = {T}(math.exp({la}[r, j] - m)) * inv",
                  f"        {go}[r, j] = (p - ({T}(1.0) if j == y else {T}(0.0))) * {gs}",
                  "        j += TPB"]
    else:
        L += ["    ts = 0.0", "    tl = 0.0", "    j = t", f"    while j < {C}:",
              f"        tv = {ta}[r, j]", "        ts += tv",
              f"        tl += tv * (lse - {la}[r, j])", "        j += TPB"]
        L += block_reduce("ts", "sum", "np.float64", "sd", "    ")
        L += block_reduce("tl", "sum", "np.float64", "sd", "    ")
        if ra is not None:
            L += ["    if t == 0:", f"        {ra}[r] = tl"]
        L += ["    cuda.syncthreads()"]
        if go is not None:
            L += [f"    tt = {T}(ts)", "    j = t", f"    while j < {C}:",
                  f"        p = {T}(math.exp({la}[r, j] - m)) * inv",
                  f"        {go}[r, j] = (p * tt - {ta}[r, j]) * {gs}", "        j += TPB"]
    L += ["    r += cuda.gridDim.x"]
    launches = [src.finish((ctx.blocks(N, 1),), (ctx.tpb,), note)]
    if fwd is not None:
        s2 = Source(ctx)
        w, o = s2.arg(rows, "w"), s2.arg(ctx.ref(fwd.id, (1,)), "o")
        s2.lines += ["sd = cuda.shared.array(TPB, np.float64)", "t = cuda.threadIdx.x",
                     "acc = 0.0", "j = t", f"while j < {N}:", f"    acc += {w}[j]", "    j += TPB"]
        s2.lines += block_reduce("acc", "sum", "np.float64", "sd")
        s2.lines += ["if t == 0:", f"    {o}[0] = {T}(acc / {N})"]
        launches.append(s2.finish((1,), (ctx.tpb,), note + " total"))
    return launches


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
    return Ref(base, offset, (nbytes // 4,), "uint32")


# ---- row ops over the last axis -----------------------------------------------------------------
# op -> (passes, final): each pass is (accumulators [(name, combine "sum"|"max", update)], after
# lines); {0}, {1}: the operands at (r, j), {T} the dtype, {D} the row length, {eps} the op's
# attribute. Sums accumulate in float64, maxima in the dtype (as the CPU rows kernels).
_MAX = ([("m", "max", "max(m, {0})")], ["if not math.isfinite(m):", "    m = {T}(0.0)",
                                         "mt = m"])
_EXPSUM = ([("s", "sum", "s + math.exp(np.float64({0} - mt))")],
           ["inv = {T}(1.0 / s)", "lg = {T}(math.log(s))"])
_MEAN = ([("mu", "sum", "mu + {0}")], ["mu = mu / {D}", "mut = {T}(mu)"])
ROWS = {
    "softmax": ((_MAX, _EXPSUM), "{T}(math.exp({0} - mt)) * inv"),
    "log_softmax": ((_MAX, _EXPSUM), "({0} - mt) - lg"),
    "softmax_back": (([("dot", "sum", "dot + {1} * {0}")], ["dt = {T}(dot)"]),),
    "rms_norm": (([("ss", "sum", "ss + {0} * {0}")],
                  ["rs = {T}(1.0 / math.sqrt(ss / {D} + {eps}))"]),),
    "layer_norm": ((_MEAN, ([("var", "sum", "var + ({0} - mut) * ({0} - mut)")],
                            ["rs = {T}(1.0 / math.sqrt(var / {D} + {eps}))"])),
                   "({0} - mut) * rs"),
    "rms_norm_back": (([("ss", "sum", "ss + {0} * {0}"), ("gx", "sum", "gx + {1} * {0}")],
                       ["q = 1.0 / math.sqrt(ss / {D} + {eps})", "rs = {T}(q)",
                        "k = {T}(q * q * gx / {D})"]),),
    "layer_norm_back": ((_MEAN, ([("var", "sum", "var + ({0} - mut) * ({0} - mut)"),
                                  ("sg", "sum", "sg + {1}"),
                                  ("sgx", "sum", "sgx + {1} * ({0} - mut)")],
                                 ["q = 1.0 / math.sqrt(var / {D} + {eps})", "rs = {T}(q)",
                                  "mg = {T}(sg / {D})", "k = {T}(sgx * q * q / {D})"])),
                        "rs * ({1} - mg - ({0} - mut) * k)"),
}
ROWS["softmax_back"] = (ROWS["softmax_back"], "{0} * ({1} - dt)")
ROWS["rms_norm"] = (ROWS["rms_norm"], "{0} * rs")
ROWS["rms_norm_back"] = (ROWS["rms_norm_back"], "rs * ({1} - {0} * k)")


def rows(ctx, n, members=None, outputs=None, note="") -> list:
    """Row op n over the last axis, one block per row (grid-stride over rows): each pass has
    the threads stride over the row accumulating, then shared-memory tree reductions; the last
    loop computes the op's value and the fused epilogue and stores the outputs. `members`
    (fused: prologue, n, epilogue, in order; default n alone)."""
    from jitgraph.plan import rows_flags
    from jitgraph.registry import row_axis
    g = ctx.g
    if n.op not in ROWS:
        raise ctx.unsupported(n)
    shape = n.type.shape
    if not shape or row_axis(n) % len(shape) != len(shape) - 1 or n.type.size == 0:
        raise ctx.unsupported(n, " over another axis than the last")
    members = list(members or [n.id])
    outputs = set(outputs if outputs is not None else [n.id])
    D = shape[-1]
    R = n.type.size // D
    T = NP_DTYPE[n.type.dtype]
    fmt = {"T": T, "D": D, "eps": typed_literal(n.attr.get("eps", 0.0), "f64")}
    passes, final = ROWS[n.op]
    src = Source(ctx)
    consts = ctx.consts()
    before = [m for m in members if m < n.id]
    after = [m for m in members if m > n.id]
    pro = [m for m in before if m in feeding(g, n.id, members)]
    ext = _externals(g, members, consts)
    loads = []
    for i in ext:
        fl = rows_flags(shape, g.nodes[i].type.shape)
        if fl is None:
            raise ctx.unsupported(n, f" with operand %{i} broadcast over some leading axes")
        rf, cf = fl
        a = src.arg(ctx.ref(i, ((R if rf else 1) * (D if cf else 1),)))
        idx = " + ".join(([f"r * {D}" if cf else "r"] if rf else []) + (["j"] if cf else [])) \
            or "0"
        loads.append(f"{src.local(i, 'x')} = {a}[{idx}]")
    L = src.lines
    L += ["t = cuda.threadIdx.x", f"smt = cuda.shared.array(TPB, {T})",
          "smd = cuda.shared.array(TPB, np.float64)", "r = cuda.blockIdx.x", f"while r < {R}:"]

    def element(nodes, pad):
        vals = dict(consts)
        for i in ext:
            vals[i] = src.local(i, "x")
        return [pad + ln for ln in loads] + src.members(nodes, vals, pad), vals

    for accs, post in passes:
        for name, comb, _ in accs:
            L.append(f"    {name} = " + (f"{T}(-math.inf)" if comb == "max" else "0.0"))
        lines, vals = element(pro, "        ")
        ops = [vals[i] for i in n.inputs]
        L += ["    j = t", f"    while j < {D}:"] + lines
        L += [f"        {name} = {upd.format(*ops, **fmt)}" for name, _, upd in accs]
        L += ["        j += TPB"]
        for name, comb, _ in accs:
            L += block_reduce(name, comb, T, "smt" if comb == "max" else "smd", "    ")
        L += ["    " + ln.format(*ops, **fmt) for ln in post]
    lines, vals = element(before, "        ")
    ops = [vals[i] for i in n.inputs]
    L += ["    j = t", f"    while j < {D}:"] + lines
    L.append(f"        {src.local(n.id)} = {T}({final.format(*ops, **fmt)})  # {n.op}")
    vals[n.id] = src.local(n.id)
    L += src.members(after, vals, "        ")
    L += [f"        {src.arg(ctx.ref(m, (R * D,)), 'o')}[r * {D} + j] = {vals[m]}"
          for m in members if m in outputs]
    L += ["        j += TPB", "    cuda.syncthreads()", "    r += cuda.gridDim.x"]
    return [src.finish((ctx.blocks(R, 1),), (ctx.tpb,), note)]


# ---- data movement and the llama ops -------------------------------------------------------------
def _gather(ctx, n, lines_for, note, extra=()) -> list:
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


def permute(ctx, n, note="") -> list:
    x = ctx.g.nodes[n.inputs[0]]
    axes, xs, os_ = n.attr["axes"], x.type.shape, n.type.shape
    strides, st = [0] * len(xs), 1
    for ax in reversed(range(len(xs))):
        strides[ax], st = st, st * xs[ax]

    def lines(src):
        a = src.arg(ctx.ref(x.id))
        off = " + ".join(f"i{k} * {strides[axes[k]]}" for k in range(len(os_))
                         if os_[k] != 1) or "0"
        return unravel("i", list(range(len(os_))), os_) + [f"val = {a}[{off}]"]
    return _gather(ctx, n, lines, note)


def causal_mask(ctx, n, note="") -> list:
    x = ctx.g.nodes[n.inputs[0]]
    rows, cols = n.type.shape[-2:]
    val = typed_literal(float(n.attr["value"]), n.type.dtype)

    def lines(src):
        a = src.arg(ctx.ref(x.id))
        return [f"c_ = i % {cols}", f"r_ = (i // {cols}) % {rows}",
                f"val = {val} if c_ > r_ + {n.attr['n_past']} else {a}[i]"]
    return _gather(ctx, n, lines, note)


def get_rows(ctx, n, note="") -> list:
    table, idx = (ctx.g.nodes[i] for i in n.inputs)
    E = _prod(table.type.shape[1:])

    def lines(src):
        t, ix = src.arg(ctx.ref(table.id)), src.arg(ctx.ref(idx.id))
        return [f"val = {t}[{ix}[i // {E}] * {E} + i % {E}]"]
    return _gather(ctx, n, lines, note)


def get_rows_back(ctx, n, note="") -> list:
    """Zero the table's gradient, then scatter-add the rows (atomics: repeated indices add)."""
    g_, idx = (ctx.g.nodes[i] for i in n.inputs)
    E = _prod(n.type.shape[1:])
    s = ctx.plan.slots[n.id]
    base = s.pointer if s.region in CALLER else s.region
    launches = [fill_words(ctx, words(base, s.offset, n.type.nbytes), note + " zero")]
    src = Source(ctx)
    gv, ix = src.arg(ctx.ref(g_.id)), src.arg(ctx.ref(idx.id))
    o = src.arg(ctx.ref(n.id), "o")
    src.lines += ["i = cuda.grid(1)", "st = cuda.gridsize(1)", f"while i < {g_.type.size}:",
                  f"    cuda.atomic.add({o}, {ix}[i // {E}] * {E} + i % {E}, {gv}[i])",
                  "    i += st"]
    launches.append(src.finish((ctx.blocks(g_.type.size),), (ctx.tpb,), note))
    return launches


def rope(ctx, n, note="") -> list:
    """One thread per rotated pair; angles in float64, cos/sin rounded to the dtype (as the
    reference); rope_back rotates by the negated angle; a third operand divides each pair's
    frequency."""
    x, pos = (ctx.g.nodes[i] for i in n.inputs[:2])
    seq, heads, d = x.type.shape[-3:]
    half = d // 2
    T = NP_DTYPE[n.type.dtype]
    sign = "-" if n.op == "rope_back" else ""
    neox = n.attr["mode"] == "neox"
    theta = typed_literal(float(n.attr["theta"]), "f64")
    src = Source(ctx)
    a, p = src.arg(ctx.ref(x.id)), src.arg(ctx.ref(pos.id))
    fdiv = f" / np.float64({src.arg(ctx.ref(n.inputs[2]))}[k])" if len(n.inputs) == 3 else ""
    o = src.arg(ctx.ref(n.id), "o")
    total = n.type.size // 2
    if total == 0:
        return []
    lo, hi = ("base + k", f"base + k + {half}") if neox else ("base + 2 * k", "base + 2 * k + 1")
    src.lines += ["q = cuda.grid(1)", "st = cuda.gridsize(1)", f"while q < {total}:",
                  f"    k = q % {half}", f"    rest = q // {half}",
                  f"    s = (rest // {heads}) % {seq}", f"    base = rest * {d}",
                  f"    ang = np.float64({p}[s]) * {theta} ** (-2.0 * k / {d}){fdiv}",
                  f"    c = {T}(math.cos(ang))", f"    sn = {T}({sign}math.sin(ang))",
                  f"    xl = {a}[{lo}]", f"    xh = {a}[{hi}]",
                  f"    {o}[{lo}] = xl * c - xh * sn", f"    {o}[{hi}] = xl * sn + xh * c",
                  "    q += st"]
    return [src.finish((ctx.blocks(total),), (ctx.tpb,), note)]


# ---- convolution and pooling (direct, one thread per output element) ----------------------------
def _nchw(prefix, shape):
    return [f"{prefix}{k} = {v}" for k, v in zip("NCHW", shape)]


def _window_taps(hvar, wvar, a, kernel, dilation=(1, 1)):
    """Lines, per tap (i, j) of the window at output (oy, ox): ih, iw the input position and
    `ok` whether it lies inside the unpadded input (H, W)."""
    (sh, sw), (ph, pw), (dh, dw) = a["stride"], a["padding"], dilation
    return [f"for i in range({kernel[0]}):", f"    ih = oy * {sh} - {ph} + i * {dh}",
            f"    for j in range({kernel[1]}):", f"        iw = ox * {sw} - {pw} + j * {dw}",
            f"        ok = ih >= 0 and ih < {hvar} and iw >= 0 and iw < {wvar}"]


def _inverse_taps(a, kernel, OH, OW, dilation=(1, 1)):
    """Lines, per tap (i, j), finding the output (oy, ox) whose window reads input (h, w) at
    that tap, `ok` when there is one."""
    (sh, sw), (ph, pw), (dh, dw) = a["stride"], a["padding"], dilation
    return [f"for i in range({kernel[0]}):", f"    ty = h + {ph} - i * {dh}",
            f"    oy = ty // {sh}", f"    for j in range({kernel[1]}):",
            f"        tx = w + {pw} - j * {dw}", f"        ox = tx // {sw}",
            f"        ok = ty >= 0 and tx >= 0 and ty % {sh} == 0 and tx % {sw} == 0 and "
            f"oy < {OH} and ox < {OW}"]


def conv2d(ctx, n, note="") -> list:
    g = ctx.g
    a = n.attr
    T = NP_DTYPE[n.type.dtype]
    src = Source(ctx)
    if n.op == "conv2d":
        x, w = (g.nodes[i] for i in n.inputs)
        N, C, H, W = x.type.shape
        O, _, KH, KW = w.type.shape
        OH, OW = n.type.shape[2:]
        xa, wa = src.arg(ctx.ref(x.id, x.type.shape)), src.arg(ctx.ref(w.id, w.type.shape))
        o = src.arg(ctx.ref(n.id, n.type.shape), "o")
        body = [f"acc = {T}(0.0)", f"for c in range({C}):"] + \
            ["    " + ln for ln in _window_taps(H, W, a, (KH, KW), a["dilation"])] + \
            ["            if ok:",
             f"                acc += {xa}[nn, c, ih, iw] * {wa}[oo, c, i, j]",
             f"{o}[nn, oo, oy, ox] = acc"]
        dims, names = (N, O, OH, OW), ("nn", "oo", "oy", "ox")
    elif n.op == "conv2d_back_input":
        w, gg = (g.nodes[i] for i in n.inputs)
        N, C, H, W = n.type.shape
        O, _, KH, KW = w.type.shape
        OH, OW = gg.type.shape[2:]
        wa, ga = src.arg(ctx.ref(w.id, w.type.shape)), src.arg(ctx.ref(gg.id, gg.type.shape))
        o = src.arg(ctx.ref(n.id, n.type.shape), "o")
        body = [f"acc = {T}(0.0)", f"for oo in range({O}):"] + \
            ["    " + ln for ln in _inverse_taps(a, (KH, KW), OH, OW, a["dilation"])] + \
            ["            if ok:",
             f"                acc += {ga}[nn, oo, oy, ox] * {wa}[oo, c, i, j]",
             f"{o}[nn, c, h, w] = acc"]
        dims, names = (N, C, H, W), ("nn", "c", "h", "w")
    else:       # conv2d_back_weight: one block per weight, threads over (n, oy, ox)
        x, gg = (g.nodes[i] for i in n.inputs)
        N, C, H, W = x.type.shape
        O, _, KH, KW = n.type.shape
        OH, OW = gg.type.shape[2:]
        (sh, sw), (ph, pw), (dh, dw) = a["stride"], a["padding"], a["dilation"]
        xa, ga = src.arg(ctx.ref(x.id, x.type.shape)), src.arg(ctx.ref(gg.id, gg.type.shape))
        o = src.arg(ctx.ref(n.id, n.type.shape), "o")
        total = O * C * KH * KW
        src.lines += ["sd = cuda.shared.array(TPB, np.float64)", "t = cuda.threadIdx.x",
                      "e = cuda.blockIdx.x", f"while e < {total}:"]
        src.lines += unravel("e", [0, 1, 2, 3], (O, C, KH, KW), "    ")
        src.lines += ["    acc = 0.0", "    q = t", f"    while q < {N * OH * OW}:"]
        src.lines += unravel("q", [4, 5, 6], {4: N, 5: OH, 6: OW}, "        ")
        src.lines += [f"        ih = i5 * {sh} - {ph} + i2 * {dh}",
                      f"        iw = i6 * {sw} - {pw} + i3 * {dw}",
                      f"        if ih >= 0 and ih < {H} and iw >= 0 and iw < {W}:",
                      f"            acc += np.float64({ga}[i4, i0, i5, i6] * {xa}[i4, i1, ih, iw])",
                      "        q += TPB"]
        src.lines += block_reduce("acc", "sum", "np.float64", "sd", "    ")
        src.lines += ["    if t == 0:", f"        {o}[i0, i1, i2, i3] = {T}(acc)",
                      "    e += cuda.gridDim.x"]
        return [src.finish((ctx.blocks(total, 1),), (ctx.tpb,), note)]
    return [_per_element(ctx, src, dims, names, body, note)]


def _per_element(ctx, src, dims, names, body, note) -> Launch:
    total = _prod(dims)
    src.lines += ["e = cuda.grid(1)", "st = cuda.gridsize(1)", f"while e < {total}:", "    r_ = e"]
    for name, d in reversed(list(zip(names, dims))):
        src.lines += [f"    {name} = r_ % {d}", f"    r_ = r_ // {d}"]
    src.lines += ["    " + ln for ln in body] + ["    e += st"]
    return src.finish((ctx.blocks(total),), (ctx.tpb,), note)


def pool2d(ctx, n, note="") -> list:
    g = ctx.g
    a = n.attr
    T = NP_DTYPE[n.type.dtype]
    KH, KW = a["kernel"]
    src = Source(ctx)
    o = src.arg(ctx.ref(n.id, n.type.shape), "o")
    if n.op in ("max_pool2d", "avg_pool2d"):
        x = g.nodes[n.inputs[0]]
        N, C, H, W = x.type.shape
        OH, OW = n.type.shape[2:]
        xa = src.arg(ctx.ref(x.id, x.type.shape))
        mx = n.op == "max_pool2d"
        body = [f"acc = {T}(-math.inf)" if mx else f"acc = {T}(0.0)"] + \
            _window_taps(H, W, a, (KH, KW)) + \
            ["        if ok:", f"            acc = max(acc, {xa}[nn, c, ih, iw])" if mx else
             f"            acc += {xa}[nn, c, ih, iw]",
             f"{o}[nn, c, oy, ox] = acc" if mx else f"{o}[nn, c, oy, ox] = acc / {T}({KH * KW})"]
        return [_per_element(ctx, src, (N, C, OH, OW), ("nn", "c", "oy", "ox"), body, note)]
    N, C, H, W = n.type.shape
    if n.op == "avg_pool2d_back":
        gg = g.nodes[n.inputs[0]]
        OH, OW = gg.type.shape[2:]
        ga = src.arg(ctx.ref(gg.id, gg.type.shape))
        body = [f"acc = {T}(0.0)"] + _inverse_taps(a, (KH, KW), OH, OW) + \
            ["        if ok:", f"            acc += {ga}[nn, c, oy, ox]",
             f"{o}[nn, c, h, w] = acc / {T}({KH * KW})"]
    else:       # max_pool2d_back: each window's gradient to its first maximum
        x, gg = (g.nodes[i] for i in n.inputs)
        OH, OW = gg.type.shape[2:]
        xa, ga = src.arg(ctx.ref(x.id, x.type.shape)), src.arg(ctx.ref(gg.id, gg.type.shape))
        (sh, sw), (ph, pw) = a["stride"], a["padding"]
        body = [f"acc = {T}(0.0)"] + _inverse_taps(a, (KH, KW), OH, OW) + [
            "        if ok:", f"            best = {T}(-math.inf)", "            bh = -1",
            "            bw = -1", f"            for u in range({KH}):",
            f"                uh = oy * {sh} - {ph} + u", f"                for v in range({KW}):",
            f"                    uw = ox * {sw} - {pw} + v",
            f"                    xv = {T}(-math.inf)",
            f"                    if uh >= 0 and uh < {H} and uw >= 0 and uw < {W}:",
            f"                        xv = {xa}[nn, c, uh, uw]",
            "                    if bh < 0 or xv > best:", "                        best = xv",
            "                        bh = uh", "                        bw = uw",
            "            if bh == h and bw == w:", f"                acc += {ga}[nn, c, oy, ox]",
            f"{o}[nn, c, h, w] = acc"]
    return [_per_element(ctx, src, (N, C, H, W), ("nn", "c", "h", "w"), body, note)]


# ---- shapes: concat, slice, slice_back, pad -------------------------------------------------------
def _strides(shape) -> list:
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


def concat(ctx, n, note="") -> list:
    """One launch per operand, one thread per operand element, copied to its place along the
    axis (operands [outer, m_k, inner] into the output [outer, M, inner] at offset sum m_<k)."""
    g = ctx.g
    ax = n.attr["axis"] % max(n.type.ndim, 1)
    shape = n.type.shape
    inner, M = _prod(shape[ax + 1:]), shape[ax]
    launches, at = [], 0
    for i in n.inputs:
        x = g.nodes[i]
        m = x.type.shape[ax] if x.type.shape else 1
        total = x.type.size
        if total:
            src = Source(ctx)
            a, o = src.arg(ctx.ref(i)), src.arg(ctx.ref(n.id), "o")
            src.lines += ["i = cuda.grid(1)", "st = cuda.gridsize(1)", f"while i < {total}:",
                          f"    q = i // {inner}", f"    u = q // {m}",
                          f"    {o}[(u * {M} + {at} + q % {m}) * {inner} + i % {inner}] = {a}[i]",
                          "    i += st"]
            launches.append(src.finish((ctx.blocks(total),), (ctx.tpb,), f"{note} part"))
        at += m
    return launches


def slice_(ctx, n, note="") -> list:
    """slice: out[i] = x[start + i * step] per axis (steps may be negative)."""
    x = ctx.g.nodes[n.inputs[0]]
    sl, os_ = n.attr["slices"], n.type.shape
    xst = _strides(x.type.shape)

    def lines(src):
        a = src.arg(ctx.ref(x.id))
        base = sum(s * st for (s, _, _), st in zip(sl, xst))
        terms = [f"i{k} * {sl[k][2] * xst[k]}" for k in range(len(os_)) if os_[k] != 1]
        return unravel("i", list(range(len(os_))), os_) + \
            [f"val = {a}[{' + '.join([str(base)] + terms)}]"]
    return _gather(ctx, n, lines, note)


def slice_back(ctx, n, note="") -> list:
    """slice_back: zeros, then each gradient element stored at its slice position (distinct
    positions: plain stores)."""
    gg = ctx.g.nodes[n.inputs[0]]
    sl, gs = n.attr["slices"], gg.type.shape
    ost = _strides(n.type.shape)
    launches = [fill(ctx, n, typed_literal(0.0 if n.type.is_float else 0, n.type.dtype),
                     note + " zero")] if n.type.size else []
    total = gg.type.size
    if total:
        src = Source(ctx)
        a, o = src.arg(ctx.ref(gg.id)), src.arg(ctx.ref(n.id), "o")
        base = sum(s * st for (s, _, _), st in zip(sl, ost))
        terms = [f"i{k} * {sl[k][2] * ost[k]}" for k in range(len(gs)) if gs[k] != 1]
        src.lines += ["e = cuda.grid(1)", "st = cuda.gridsize(1)", f"while e < {total}:"]
        src.lines += unravel("e", list(range(len(gs))), gs, "    ")
        src.lines += [f"    {o}[{' + '.join([str(base)] + terms)}] = {a}[e]", "    e += st"]
        launches.append(src.finish((ctx.blocks(total),), (ctx.tpb,), note))
    return launches


def pad(ctx, n, note="") -> list:
    """pad: one thread per output element, the operand's element or the pad value."""
    x = ctx.g.nodes[n.inputs[0]]
    pads, xs, os_ = n.attr["pads"], x.type.shape, n.type.shape
    xst = _strides(xs)
    val = typed_literal(float(n.attr["value"]) if n.type.is_float else int(n.attr["value"]),
                        n.type.dtype)

    def lines(src):
        a = src.arg(ctx.ref(x.id))
        if not os_:
            return [f"val = {a}[0]"]
        out = unravel("i", list(range(len(os_))), os_)
        out += [f"j{k} = i{k} - {b}" for k, (b, _) in enumerate(pads)]
        inside = " and ".join(f"j{k} >= 0 and j{k} < {xs[k]}" for k in range(len(xs)))
        at = " + ".join(f"j{k} * {xst[k]}" for k in range(len(xs)))
        return out + [f"val = {a}[{at}] if {inside} else {val}"]
    return _gather(ctx, n, lines, note)


# ---- KV cache: set_rows, kv_attention ------------------------------------------------------------
def set_rows(ctx, n, note="") -> list:
    """set_rows: the table copied to the output unless the plan put them in one buffer (a KV
    cache param updated in place), then one thread per row element; a repeated index keeps its
    last row (a thread skips its row when a later one has the same index); an index outside
    the table writes nothing (the program range-checks index inputs before the step)."""
    g = ctx.g
    table, idx, rows_ = (g.nodes[i] for i in n.inputs)
    ax = n.attr["axis"]
    shape = table.type.shape
    N, inner = shape[ax], _prod(shape[ax + 1:])
    m = idx.type.shape[0]
    launches = []
    if ctx.ref(n.id) != ctx.ref(table.id):
        launches.append(copy_words(ctx, _words_of(ctx, table), _words_of(ctx, n), note + " copy"))
    total = rows_.type.size
    if total:
        src = Source(ctx)
        r, ix, o = src.arg(ctx.ref(rows_.id)), src.arg(ctx.ref(idx.id)), \
            src.arg(ctx.ref(n.id), "o")
        v = half(f"{r}[e]", n.type.dtype) if n.attr["f16"] else f"{r}[e]"
        src.lines += ["e = cuda.grid(1)", "st = cuda.gridsize(1)", f"while e < {total}:",
                      f"    q = e // {inner}", f"    s = q % {m}", f"    u = q // {m}",
                      f"    k = {ix}[s]", f"    ok = k >= 0 and k < {N}",
                      f"    for s2 in range(s + 1, {m}):", f"        if {ix}[s2] == k:",
                      "            ok = False", "    if ok:",
                      f"        {o}[(u * {N} + k) * {inner} + e % {inner}] = {v}", "    e += st"]
        launches.append(src.finish((ctx.blocks(total),), (ctx.tpb,), note))
    return launches


def _words_of(ctx, node) -> Ref:
    """Node's buffer as 32-bit words (copies)."""
    r = ctx.ref(node.id)
    return Ref(r.base, r.offset, (node.type.nbytes // 4,), "uint32")


def kv_attention(ctx, n, note="") -> list:
    """kv_attention: one block per (query, head): the threads stride over the cache rows
    j <= pos[s] for the scores (into scratch) and their maximum, then the exponentials and
    their sum (float64), then over head_dim for the weighted sum of the values; f16: the
    query and the probabilities rounded to float16, as llama.cpp's F16 cache."""
    g = ctx.g
    q, kt, vt, pos = (g.nodes[i] for i in n.inputs)
    S, H, D = q.type.shape
    Hkv, _, R = kt.type.shape
    rep = H // Hkv
    dt = n.type.dtype
    T = NP_DTYPE[dt]
    f16 = n.attr["f16"]
    scale = typed_literal(float(n.attr["scale"]), dt)
    if n.type.size == 0:
        return []
    src = Source(ctx)
    qa = src.arg(ctx.ref(q.id, (S, H, D)))
    ka, va = src.arg(ctx.ref(kt.id, (Hkv, D, R))), src.arg(ctx.ref(vt.id, (Hkv, D, R)))
    pa = src.arg(ctx.ref(pos.id, (S,)))
    w = src.arg(ctx.scratch(0, (S * H, R), dt), "w")
    o = src.arg(ctx.ref(n.id, (S, H, D)), "o")
    qd = half(f"{qa}[s, h, d]", dt) if f16 else f"{qa}[s, h, d]"
    pr = half("w_ * inv", dt) if f16 else "w_ * inv"
    L = src.lines
    L += [f"sm = cuda.shared.array(TPB, {T})", "sd = cuda.shared.array(TPB, np.float64)",
          "t = cuda.threadIdx.x", "b = cuda.blockIdx.x", f"while b < {S * H}:",
          f"    s = b // {H}", f"    h = b % {H}", f"    gk = h // {rep}", f"    n = {pa}[s] + 1",
          f"    if n > {R}:", f"        n = {R}",
          f"    m = {T}(-math.inf)", "    j = t", "    while j < n:", f"        acc = {T}(0.0)",
          f"        for d in range({D}):", f"            acc += {qd} * {ka}[gk, d, j]",
          f"        acc = acc * {scale}", f"        {w}[b, j] = acc", "        m = max(m, acc)",
          "        j += TPB"]
    L += block_reduce("m", "max", T, "sm", "    ")
    L += ["    tot = 0.0", "    j = t", "    while j < n:",
          f"        e_ = {T}(math.exp(np.float64({w}[b, j] - m)))", f"        {w}[b, j] = e_",
          "        tot += np.float64(e_)", "        j += TPB"]
    L += block_reduce("tot", "sum", "np.float64", "sd", "    ")
    L += [f"    inv = {T}(1.0 / tot) if tot > 0.0 else {T}(0.0)", "    j = t", "    while j < n:", f"        w_ = {w}[b, j]",
          f"        {w}[b, j] = {pr}", "        j += TPB", "    cuda.syncthreads()",
          "    d = t", f"    while d < {D}:", f"        acc = {T}(0.0)", "        for j in range(n):",
          f"            acc += {w}[b, j] * {va}[gk, d, j]", f"        {o}[s, h, d] = acc",
          "        d += TPB", "    cuda.syncthreads()", "    b += cuda.gridDim.x"]
    return [src.finish((ctx.blocks(S * H, 1),), (ctx.tpb,), note)]


# ---- causal self-attention (ops/attention.py) ---------------------------------------------------
def _attention_args(ctx, src, n):
    q, k, v = (ctx.g.nodes[i] for i in n.inputs[:3])
    B, S, H, D = q.type.shape
    Hkv = k.type.shape[2]
    return (B, S, H, Hkv, D, src.arg(ctx.ref(q.id, (B, S, H, D))),
            src.arg(ctx.ref(k.id, (B, S, Hkv, D))), src.arg(ctx.ref(v.id, (B, S, Hkv, D))))


def attention(ctx, n, note="") -> list:
    """attention: one thread per query row (b, i, h), online softmax over keys j <= i (running
    maximum and sum, the accumulator rescaled as the maximum grows: flash attention's forward),
    the output row in a local array."""
    dt = n.type.dtype
    T = NP_DTYPE[dt]
    src = Source(ctx)
    B, S, H, Hkv, D, qa, ka, va = _attention_args(ctx, src, n)
    if n.type.size == 0:
        return []
    o = src.arg(ctx.ref(n.id, (B, S, H, D)), "o")
    scale = typed_literal(float(n.attr["scale"]), dt)
    body = [f"g = h // {H // Hkv}", f"acc = cuda.local.array({D}, {T})",
            f"for d in range({D}):", f"    acc[d] = {T}(0.0)",
            f"m = {T}(-math.inf)", "l = 0.0", "for j in range(i + 1):",
            f"    s = {T}(0.0)", f"    for d in range({D}):",
            f"        s += {qa}[b, i, h, d] * {ka}[b, j, g, d]",
            f"    s = s * {scale}", "    mn = max(m, s)",
            f"    c = {T}(math.exp(np.float64(m - mn))) if m > -math.inf else {T}(0.0)",
            f"    pj = {T}(math.exp(np.float64(s - mn)))", "    l = l * c + pj",
            f"    for d in range({D}):", f"        acc[d] = acc[d] * c + pj * {va}[b, j, g, d]",
            "    m = mn", f"inv = {T}(1.0 / l)",
            f"for d in range({D}):", f"    {o}[b, i, h, d] = acc[d] * inv"]
    return [_per_element(ctx, src, (B, S, H), ("b", "i", "h"), body, note)]


def attention_back(ctx, n, note="") -> list:
    """attention_back: the dk and dv parts zeroed, then one thread per query row (b, i, h):
    the row's maximum and sum, dout . out, then per key j <= i the probability p, ds = scale p
    (dout . v_j - dout . out), dq accumulated locally, dk and dv added with atomics (the query
    heads of a kv head and every later row add into the same key)."""
    dt = n.type.dtype
    T = NP_DTYPE[dt]
    src = Source(ctx)
    B, S, H, Hkv, D, qa, ka, va = _attention_args(ctx, src, n)
    out, dout = (ctx.g.nodes[i] for i in n.inputs[3:])
    oa, ga = src.arg(ctx.ref(out.id, (B, S, H, D))), src.arg(ctx.ref(dout.id, (B, S, H, D)))
    nq, nk = B * S * H * D, B * S * Hkv * D
    s_ = ctx.plan.slots[n.id]
    base = s_.pointer if s_.region in CALLER else s_.region
    itemsize = n.type.nbytes // max(n.type.size, 1)
    launches = [fill_words(ctx, words(base, s_.offset + nq * itemsize, 2 * nk * itemsize),
                           note + " zero dk dv")]
    r = src.arg(ctx.ref(n.id), "o")
    scale = typed_literal(float(n.attr["scale"]), dt)
    dot = f"        s += {qa}[b, i, h, d] * {ka}[b, j, g, d]"   # s: q_i . k_j, in a j loop
    row = ["for j in range(i + 1):", f"    s = {T}(0.0)", f"    for d in range({D}):", dot]
    body = [f"g = h // {H // Hkv}", f"dq = cuda.local.array({D}, {T})",
            f"for d in range({D}):", f"    dq[d] = {T}(0.0)",
            f"m = {T}(-math.inf)", *row, f"    m = max(m, s * {scale})",
            "l = 0.0", *row, "    l += math.exp(np.float64(s * " + scale + " - m))",
            f"di = {T}(0.0)", f"for d in range({D}):",
            f"    di += {ga}[b, i, h, d] * {oa}[b, i, h, d]",
            *row[:2], f"    dp = {T}(0.0)", row[2], dot,
            f"        dp += {ga}[b, i, h, d] * {va}[b, j, g, d]",
            f"    p = {T}(math.exp(np.float64(s * {scale} - m)) / l)",
            f"    ds = p * (dp - di) * {scale}",
            f"    kb = {nq} + ((b * {S} + j) * {Hkv} + g) * {D}",
            f"    for d in range({D}):", f"        dq[d] += ds * {ka}[b, j, g, d]",
            f"        cuda.atomic.add({r}, kb + d, ds * {qa}[b, i, h, d])",
            f"        cuda.atomic.add({r}, kb + {nk} + d, p * {ga}[b, i, h, d])",
            f"qb = ((b * {S} + i) * {H} + h) * {D}",
            f"for d in range({D}):", f"    {r}[qb + d] = dq[d]"]
    launches.append(_per_element(ctx, src, (B, S, H), ("b", "i", "h"), body, note))
    return launches

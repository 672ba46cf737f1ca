"""The CUDA backend's writers of the fused kinds of passes/fuse.py (and of a lone node of them):

  elementwise  one grid-stride kernel per domain (shape); the shape-() members are recomputed
               by every thread and stored by a last one-thread launch (so no store of a scalar
               can race a thread still reading the buffer it may share, planned in place)
  gemm         prologue (elementwise, into scratch space), a tiled GEMM (gemm_launch: the
               seam for cuBLASLt, runtime/cuda/gemm.py), epilogue (elementwise over the result)
  reduce       a tree reduction: one block per output element, threads striding over the
               reduced elements (the fused prologue computed per element), a shared-memory
               tree; a serial one (argmax, logsumexp): one thread per output element
  rows         one block per row over the last axis, by the op's formula (OpDef.rows):
               passes of strided accumulation + shared-memory trees, the fused prologue
               recomputed per pass, the epilogue in the last loop
  cross_entropy one block per row: max, sum of exponentials, loss term, gradient row; the
               row losses summed by a second one-block launch (deterministic)

Which writer runs a kernel, and with what parameters, is the anchoring op's rule
(runtime/cuda/rules.py, runtime/cuda/table.py).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from jitgraph.plan import rows_flags
from jitgraph.registry import get_op, row_axis

from ..kernelgen import (NP_DTYPE, batch_index, collapse, feeding, matmul_operands,
                         reduce_pattern, typed_literal)
from .kernel import (ALIGN_WS, GemmSpec, Launch, Ref, Source, Unsupported, block_reduce,
                     copy_words, externals, offset_expr, prod, unravel)
from .spelling import from_half, is_conversion


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
        ext = [i for i in externals(g, mems, vals)]
        dims, full = collapse(shape, [g.nodes[i].type.shape for i in ext])
        total = prod(dims)
        src.lines += ["i = cuda.grid(1)", "st = cuda.gridsize(1)", f"while i < {total}:"]
        src.lines += unravel("i", list(range(len(dims))), dims, "    ")
        for i, f in zip(ext, full):
            view = (prod(d for d, ff in zip(dims, f) if ff),)
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
    for i in externals(g, scal, vals):
        lines.append(f"{src.local(i, 'x')} = {src.arg(src.ctx.ref(i, (1,)))}[0]")
        vals[i] = src.local(i, "x")
    lines += src.members(scal, vals)
    if store is None:
        src.lines += lines
        return None
    return lines + [f"{src.arg(src.ctx.ref(m, (1,)), 'o')}[0] = {vals[m]}" for m in scal
                    if m in store]


# the half type of an array a kernel reads (its numpy dtype name: f16 float16, bf16 its bits)
HALF_OF = {"float16": "f16", "uint16": "bf16"}


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
        nb = prod(ob)
        src.lines += ["b = cuda.blockIdx.z"] + batch_index("ba", ob, xb, ("j_", "r_")) + \
            batch_index("bb", ob, wb, ("j_", "r_"))
        pa, pb, pc = "ba, ", "bb, ", "b, "
    # a half operand (an f32 matmul's weight at its storage position: a frozen f16 / bf16
    # weight) is read as float32 into the shared tile: the product is the f32 GEMM's
    adt, bdt = HALF_OF.get(a_ref.dtype), HALF_OF.get(b_ref.dtype)
    at = from_half(f"{a}[{pa}kk, row]" if ta else f"{a}[{pa}row, kk]", adt)
    bt = from_half(f"{b}[{pb}col, kk]" if tb else f"{b}[{pb}kk, col]", bdt)
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
    if ln.args == [a_ref, b_ref, c_ref] and adt is None and bdt is None:
        # distinct f32 operands: a library may run it (runtime/cuda/gemm.py)
        ln.gemm = GemmSpec(bool(ta), bool(tb), M, N, K, dtype, batch is not None)
    return ln


def matmul_node(ctx, n, note="") -> list:
    """Matmul n's GEMM launch, its GemmSpec naming half operands where it has them."""
    launches = _matmul_launches(ctx, n, note)
    half = _half_operands(ctx.g, n)
    for ln in launches:
        if half is not None and ln.gemm is not None:
            ln.gemm = replace(ln.gemm, half=half)
    return launches


def _matmul_launches(ctx, n, note):
    if n.type.size == 0:
        return []
    x, w = (ctx.g.nodes[i] for i in n.inputs)
    if w.type.ndim != 2 or not (x.type.ndim == 2 or not n.attr["ta"]):
        xs, ws, os_ = x.type.shape, w.type.shape, n.type.shape
        ob = os_[:-2]
        return [gemm_launch(ctx, n.attr["ta"], n.attr["tb"],
                            ctx.ref(x.id, (prod(xs[:-2]),) + xs[-2:]),
                            ctx.ref(w.id, (prod(ws[:-2]),) + ws[-2:]),
                            ctx.ref(n.id, (prod(ob),) + os_[-2:]), n.type.dtype, note,
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


def _half_operands(g, n):
    """(half dtype, A's node, B's node) when both of matmul n's f32 operands are casts of
    values of one half type (passes/half.py's GEMM over half operands: f32 arrays holding half
    values exactly, converted in the fused prologue or by the kernel that computed them), else
    None."""
    src = []
    for i in n.inputs:
        c = g.nodes[i]
        if not c.inputs or not is_conversion(c.op) or c.type.dtype != "f32":
            return None
        src.append(g.nodes[c.inputs[0]])
    if not src[0].type.is_half or src[0].type.dtype != src[1].type.dtype:
        return None
    return src[0].type.dtype, src[0].id, src[1].id


def _overlap(a: Ref, b: Ref) -> bool:
    if a.base != b.base:
        return False
    na = prod(a.shape) * _itemsize(a.dtype)
    nb = prod(b.shape) * _itemsize(b.dtype)
    return a.offset < b.offset + nb and b.offset < a.offset + na


def _itemsize(name):
    return np.dtype(name).itemsize


# ---- reductions -------------------------------------------------------------------------------
def reduction(ctx, n, rule, prologue=(), outputs=(), note="") -> list:
    """Reduction node n over its operand by its rule (runtime/cuda/rules.py Reduction: the
    reduced axes, the tree's combine or the serial tail), computed by `prologue` members
    (elementwise, storing `outputs`) when fused: a tree one block per output element with a
    shared-memory tree; a serial one one thread per output element."""
    g = ctx.g
    x = g.nodes[n.inputs[0]]
    axes = tuple(a % max(x.type.ndim, 1) for a in rule.axes(n.attr))
    src = Source(ctx)
    vals = ctx.consts()
    pro = list(prologue)
    ext = externals(g, pro, vals) if pro else [x.id]
    pats, full = reduce_pattern(x.type.shape, axes, [g.nodes[i].type.shape for i in ext])
    sizes = [d for d, _ in pats]
    kept = [ax for ax, (_, k) in enumerate(pats) if k == "K"]
    red = [ax for ax, (_, k) in enumerate(pats) if k == "R"]
    nout, nred = prod(sizes[ax] for ax in kept), prod(sizes[ax] for ax in red)
    T = NP_DTYPE[n.type.dtype]
    xt = NP_DTYPE[x.type.dtype]
    refs = [src.arg(ctx.ref(i, (prod(d for d, f in zip(sizes, fl) if f),)))
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

    if rule.tree:
        op = rule.tree
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
        res = f"acc / {nred}" if rule.mean else "acc"
        src.lines += ["    if t == 0:", f"        {out}[o] = {T}({res})",
                      "    o += cuda.gridDim.x"]
        return [src.finish((ctx.blocks(nout, 1),), (ctx.tpb,), note)]
    src.lines += ["o = cuda.grid(1)", "st = cuda.gridsize(1)", f"while o < {nout}:"]
    src.lines += unravel("o", kept, sizes, "    ")
    src.lines += ["    q = 0"]
    lines, e = element("    ")
    src.lines += lines + [f"    best = {e}"]
    src.lines += rule.serial(element, out, nred, T)
    src.lines.append("    o += st")
    return [src.finish((ctx.blocks(nout),), (ctx.tpb,), note)]


def argmax_tail(element, out, nred, T) -> list:
    """argmax's serial loop after `best` holds the first element: the first maximum's index."""
    lines, e = element("        ")
    return ["    bi = 0", f"    for q in range(1, {nred}):"] + lines + [
        f"        v_ = {e}", "        if v_ > best:", "            best = v_", "            bi = q",
        f"    {out}[o] = np.int32(bi)"]


def logsumexp_tail(element, out, nred, T) -> list:
    """logsumexp's serial loops after `best` holds the first element: the maximum (0 when not
    finite), then the sum of exponentials in float64."""
    lines, e = element("        ")
    head = [f"    for q in range(1, {nred}):"] + lines + [
        f"        best = max(best, {e})", "    m = np.float64(best)",
        "    if not math.isfinite(m):", "        m = 0.0", "    s = 0.0",
        f"    for q in range({nred}):"]
    lines, e = element("        ")
    return head + lines + [f"        s += math.exp(np.float64({e}) - m)",
                           f"    {out}[o] = {T}(math.log(s) + m)"]


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


# ---- row ops over the last axis -----------------------------------------------------------------
# how an accumulator of a row formula (OpDef.rows) takes an element's term, and its shared array
# in the block's tree: sums in float64 (smd), maxima in the dtype (smt)
_TAKE = {"sum": "{0} = {0} + {1}", "max": "{0} = max({0}, {1})"}


def rows(ctx, n, members=None, outputs=None, note="") -> list:
    """Row op n over the last axis, one block per row (grid-stride over rows): each pass has
    the threads stride over the row accumulating, then shared-memory tree reductions; the last
    loop computes the op's value and the fused epilogue and stores the outputs, all by the
    op's formula (OpDef.rows; its `stored` variant is not used). `members` (fused: prologue,
    n, epilogue, in order; default n alone)."""
    g = ctx.g
    shape = n.type.shape
    if not shape or row_axis(n) % len(shape) != len(shape) - 1 or n.type.size == 0:
        raise ctx.unsupported(n, " over another axis than the last")
    members = list(members or [n.id])
    outputs = set(outputs if outputs is not None else [n.id])
    D = shape[-1]
    R = n.type.size // D
    T = NP_DTYPE[n.type.dtype]
    fmt = {"T": T, "D": D, **{k: typed_literal(v, "f64") for k, v in n.attrs}}
    formula = get_op(n.op).rows
    src = Source(ctx)
    consts = ctx.consts()
    before = [m for m in members if m < n.id]
    after = [m for m in members if m > n.id]
    pro = [m for m in before if m in feeding(g, n.id, members)]
    ext = externals(g, members, consts)
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

    for p in formula.passes:
        for name, comb, _ in p.accs:
            L.append(f"    {name} = " + (f"{T}(-math.inf)" if comb == "max" else "0.0"))
        lines, vals = element(pro, "        ")
        ops = [vals[i] for i in n.inputs]
        L += ["    j = t", f"    while j < {D}:"] + lines
        L += [f"        {name} = {e.format(*ops, **fmt)}" for name, e in p.lets]
        L += ["        " + _TAKE[comb].format(name, term.format(*ops, **fmt))
              for name, comb, term in p.accs]
        L += ["        j += TPB"]
        for name, comb, _ in p.accs:
            L += block_reduce(name, comb, T, "smt" if comb == "max" else "smd", "    ")
        L += ["    " + ln.format(*ops, **fmt) for ln in p.after]
    lines, vals = element(before, "        ")
    ops = [vals[i] for i in n.inputs]
    L += ["    j = t", f"    while j < {D}:"] + lines
    L.append(f"        {src.local(n.id)} = {T}({formula.final.format(*ops, **fmt)})  # {n.op}")
    vals[n.id] = src.local(n.id)
    L += src.members(after, vals, "        ")
    L += [f"        {src.arg(ctx.ref(m, (R * D,)), 'o')}[r * {D} + j] = {vals[m]}"
          for m in members if m in outputs]
    L += ["        j += TPB", "    cuda.syncthreads()", "    r += cuda.gridDim.x"]
    return [src.finish((ctx.blocks(R, 1),), (ctx.tpb,), note)]

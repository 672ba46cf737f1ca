"""The CUDA backend's writers of ops that run as a node of their own (passes/fuse.py kind
"node"): data movement (permute, concat, slice, pad, get_rows), masks, rope, the KV cache's
set_rows and count_equal, each one thread per element (grid-stride) unless its docstring says
otherwise. Convolution and pooling: runtime/cuda/conv.py; attention: runtime/cuda/attention.py.
"""
from __future__ import annotations

from jitgraph.ops.update import SR_K
from jitgraph.plan import CALLER

from ..kernelgen import NP_DTYPE, typed_literal
from .kernel import (Source, block_reduce, copy_words, fill, fill_words, gather, half_literal,
                     prod, strides, unravel, words, words_of)
from .spelling import from_half, half


def value_literal(v, dtype) -> str:
    """A literal of `dtype` as a kernel stores it (a half value: rounded, as a load gives it)."""
    return half_literal(v, dtype) if dtype in ("f16", "bf16") else typed_literal(v, dtype)


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
    return gather(ctx, n, lines, note)


def causal_mask(ctx, n, note="") -> list:
    x = ctx.g.nodes[n.inputs[0]]
    rows, cols = n.type.shape[-2:]
    val = value_literal(float(n.attr["value"]), n.type.dtype)

    def lines(src):
        a = src.arg(ctx.ref(x.id))
        return [f"c_ = i % {cols}", f"r_ = (i // {cols}) % {rows}",
                f"val = {val} if c_ > r_ + {n.attr['n_past']} else {a}[i]"]
    return gather(ctx, n, lines, note)


def get_rows(ctx, n, note="") -> list:
    table, idx = (ctx.g.nodes[i] for i in n.inputs)
    E = prod(table.type.shape[1:])

    # a half table read into f32 rows (its storage position: a frozen f16 / bf16 embedding)
    conv = table.type.dtype if table.type.is_half and not n.type.is_half else None

    def lines(src):
        t, ix = src.arg(ctx.ref(table.id)), src.arg(ctx.ref(idx.id))
        return [f"val = {from_half(f'{t}[{ix}[i // {E}] * {E} + i % {E}]', conv)}"]
    return gather(ctx, n, lines, note)


def get_rows_back(ctx, n, note="") -> list:
    """Zero the table's gradient, then scatter-add the rows (atomics: repeated indices add)."""
    g_, idx = (ctx.g.nodes[i] for i in n.inputs)
    E = prod(n.type.shape[1:])
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


def rope(ctx, n, note="", back=False) -> list:
    """One thread per rotated pair; angles in float64, cos/sin rounded to the dtype (as the
    reference); `back` (rope_back) rotates by the negated angle; a third operand divides each
    pair's frequency."""
    x, pos = (ctx.g.nodes[i] for i in n.inputs[:2])
    seq, heads, d = x.type.shape[-3:]
    hd = d // 2
    T = NP_DTYPE[n.type.dtype]
    sign = "-" if back else ""
    neox = n.attr["mode"] == "neox"
    theta = typed_literal(float(n.attr["theta"]), "f64")
    src = Source(ctx)
    a, p = src.arg(ctx.ref(x.id)), src.arg(ctx.ref(pos.id))
    fdiv = f" / np.float64({src.arg(ctx.ref(n.inputs[2]))}[k])" if len(n.inputs) == 3 else ""
    o = src.arg(ctx.ref(n.id), "o")
    total = n.type.size // 2
    if total == 0:
        return []
    lo, hi = ("base + k", f"base + k + {hd}") if neox else ("base + 2 * k", "base + 2 * k + 1")
    src.lines += ["q = cuda.grid(1)", "st = cuda.gridsize(1)", f"while q < {total}:",
                  f"    k = q % {hd}", f"    rest = q // {hd}",
                  f"    s = (rest // {heads}) % {seq}", f"    base = rest * {d}",
                  f"    ang = np.float64({p}[s]) * {theta} ** (-2.0 * k / {d}){fdiv}",
                  f"    c = {T}(math.cos(ang))", f"    sn = {T}({sign}math.sin(ang))",
                  f"    xl = {a}[{lo}]", f"    xh = {a}[{hi}]",
                  f"    {o}[{lo}] = xl * c - xh * sn", f"    {o}[{hi}] = xl * sn + xh * c",
                  "    q += st"]
    return [src.finish((ctx.blocks(total),), (ctx.tpb,), note)]


def concat(ctx, n, note="") -> list:
    """One launch per operand, one thread per operand element, copied to its place along the
    axis (operands [outer, m_k, inner] into the output [outer, M, inner] at offset sum m_<k)."""
    g = ctx.g
    ax = n.attr["axis"] % max(n.type.ndim, 1)
    shape = n.type.shape
    inner, M = prod(shape[ax + 1:]), shape[ax]
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
    xst = strides(x.type.shape)

    def lines(src):
        a = src.arg(ctx.ref(x.id))
        base = sum(s * st for (s, _, _), st in zip(sl, xst))
        terms = [f"i{k} * {sl[k][2] * xst[k]}" for k in range(len(os_)) if os_[k] != 1]
        return unravel("i", list(range(len(os_))), os_) + \
            [f"val = {a}[{' + '.join([str(base)] + terms)}]"]
    return gather(ctx, n, lines, note)


def slice_back(ctx, n, note="") -> list:
    """slice_back: zeros, then each gradient element stored at its slice position (distinct
    positions: plain stores)."""
    gg = ctx.g.nodes[n.inputs[0]]
    sl, gs = n.attr["slices"], gg.type.shape
    ost = strides(n.type.shape)
    launches = [fill(ctx, n, value_literal(0.0 if n.type.is_float else 0, n.type.dtype),
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
    xst = strides(xs)
    val = value_literal(float(n.attr["value"]) if n.type.is_float else int(n.attr["value"]),
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
    return gather(ctx, n, lines, note)


# ---- KV cache: set_rows --------------------------------------------------------------------------
def set_rows(ctx, n, note="") -> list:
    """set_rows: the table copied to the output unless the plan put them in one buffer (a KV
    cache param updated in place), then one thread per row element; a repeated index keeps its
    last row (a thread skips its row when a later one has the same index); an index outside
    the table writes nothing (the program range-checks index inputs before the step)."""
    g = ctx.g
    table, idx, rows_ = (g.nodes[i] for i in n.inputs)
    ax = n.attr["axis"]
    shape = table.type.shape
    N, inner = shape[ax], prod(shape[ax + 1:])
    m = idx.type.shape[0]
    launches = []
    if ctx.ref(n.id) != ctx.ref(table.id):
        launches.append(copy_words(ctx, words_of(ctx, table), words_of(ctx, n), note + " copy"))
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


# ---- bf16 master weights: sround_bf16 ----------------------------------------------------------
def sround_bf16(ctx, n, note="") -> list:
    """sround_bf16(x, step): one thread per element, the bf16 bits of x[i] rounded
    stochastically with the random bits of flat element i (runtime/cuda/halfconv.py
    sround_bits: the integers of the reference and of the CPU's lib_round.py)."""
    x, step = n.inputs
    K0, K1, _ = SR_K
    base = (n.attr["seed"] % 2 ** 64 * K0 + n.attr["salt"] % 2 ** 64 * K1) % 2 ** 64

    def lines(src):
        a, s = src.arg(ctx.ref(x)), src.arg(ctx.ref(step, (1,)))
        return [f"val = halfconv.sround_bits({a}[i], {s}[0], np.uint64({base}), i)"]
    return gather(ctx, n, lines, note)

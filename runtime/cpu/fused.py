"""Lowering of the kernels passes/fuse.py forms (elementwise, gemm, rows, cross_entropy) to
numba source.

Members compute into locals (`v<k>`, commented with their op; the driver lists each kernel's IR
nodes); only a kernel's outputs are stored. Operands are loaded once per index (`x<k>`), hoisted
to the loop level where they vary; inlined constants are literals. Locals are numbered by first
use, not by node id, so equal kernels have equal source and compile once. Float literals are typed as the kernel's dtype
(np.float32(1.0)), because a bare `1.0` is a float64 that promotes the whole expression and
stops LLVM from vectorising f32 loops.
"""
from __future__ import annotations

from jitgraph.ir import feeding, op_kind
from jitgraph.plan import rows_flags
from jitgraph.registry import get_op

from .. import kernelgen
from ..kernelgen import (NP_DTYPE, collapse, literal, matmul_operands, reduce_pattern,
                         typed_literal)
from . import spelling
from .lower import FMAX_IMPORTS, PARALLEL_MIN_WORK, Call, Workspace, aligned, gemm_text, \
    reduction, stored_weight, transposed_weight


def scalar_expr(g, n, args) -> str:
    """Node n of graph g's value from operand expressions `args`, cast to its dtype: the op's
    expression as this backend spells it (runtime/cpu/spelling.py)."""
    src = tuple(g.nodes[i].type.dtype for i in n.inputs)
    return kernelgen.scalar_expr(n, args, spelling.expr(n.op, n.type.dtype, src))


def cost(n) -> int:
    """Relative cost of one element of node n: 1 + its math calls and divisions."""
    e = get_op(n.op).expr or ""
    return 1 + e.count("math.") + e.count("/")



class Builder:
    """Accumulates a generated kernel's parameters (bound to Call args) and body lines."""

    def __init__(self, graph, inlined, slot_of=None):
        self.g = graph
        self.slot_of = slot_of
        self.params, self.args, self.lines, self.names = [], [], [], {}
        self.vals = {c: typed_literal(graph.nodes[c].attr["value"], graph.nodes[c].type.dtype)
                     for c in inlined}

    def local(self, nid, prefix="v") -> str:
        """A node's local variable: numbered by first use, so equal kernels get equal source
        (and compile once) whatever their node ids; the driver names the nodes."""
        return f"{prefix}{self.names.setdefault(nid, len(self.names))}"

    def arg(self, a, prefix="a") -> str:
        if a in self.args and not isinstance(a, Workspace):
            return self.params[self.args.index(a)]
        same = self._same_buffer(a)
        if same is not None:
            return same
        self.params.append(f"{prefix}{len(self.params)}")
        self.args.append(a)
        return self.params[-1]

    def _same_buffer(self, a):
        """The parameter of an earlier argument with exactly a's buffer and view (the memory
        plan put an output in place of an input): one array for both, so LLVM sees one
        pointer. With a second pointer to the same bytes a serial in-place loop stayed scalar
        (its alias checks over many arrays exceed LLVM's limit; bench/README.md: "Figures
        behind the code", fused kernels)."""
        if self.slot_of is None or not isinstance(a, tuple):     # a Workspace is no tuple
            return None
        slot = self.slot_of(a[0])
        if slot is None:
            return None
        for p, other in zip(self.params, self.args):
            if isinstance(other, tuple) and other[1] == a[1] and self.slot_of(other[0]) == slot:
                return p
        return None

    def members(self, nodes, pad, vals=None) -> list:
        """Lines computing `nodes` in order into v<id> from `vals` (operand expressions)."""
        vals = self.vals if vals is None else vals
        lines = []
        for m in nodes:
            n = self.g.nodes[m]
            lines.append(pad + f"{self.local(m)} = {scalar_expr(self.g, n, [vals[i] for i in n.inputs])}"
                         f"  # {n.op}")
            vals[m] = self.local(m)
        return lines

    def call(self, parallel, imports=()) -> Call:
        return Call("KERNEL", self.args, (tuple(self.params), tuple(self.lines)), parallel,
                    tuple(imports))


def externals(g, members, vals) -> list:
    mem = set(members)
    out = []
    for m in members:
        for i in g.nodes[m].inputs:
            if i not in mem and i not in vals and i not in out:
                out.append(i)
    return out


def _work(g, members):
    return sum(g.nodes[m].type.size * cost(g.nodes[m]) for m in members)


# ---- elementwise (one or several domains, scalars first) ----------------------------------------
def elementwise(g, kernel, inlined, b=None, preloaded=None, slot_of=None, spill=None) -> Call:
    """Elementwise kernel: shape-() members once, then one loop nest per domain (shape), in
    order; a flat domain of a parallel kernel with enough work is a prange of its own.
    `b`/`preloaded`: a builder that already holds some values as arrays (node id -> array
    param; the GEMM result). `spill`: values kept in scratch space instead of a buffer of
    their own (node id -> the Workspace for a view shape; a GEMM prologue's values that the
    GEMM or its epilogue reads): stored there by the members computing them, loaded from
    there by the others."""
    b = b or Builder(g, inlined, slot_of)
    outs = set(kernel.outputs)
    scal = [m for m in kernel.nodes if g.nodes[m].type.shape == ()]
    for i in externals(g, scal, b.vals):
        b.lines.append(f"{b.local(i, 'x')} = {b.arg((i, (1,)))}[0]")
        b.vals[i] = b.local(i, "x")
    b.lines += b.members(scal, "")
    b.lines += [f"{b.arg((m, (1,)), 'o')}[0] = {b.local(m)}" for m in scal if m in outs]
    domains = {}
    for m in kernel.nodes:
        if g.nodes[m].type.shape != ():
            domains.setdefault(g.nodes[m].type.shape, []).append(m)
    par = _work(g, kernel.nodes) >= PARALLEL_MIN_WORK
    for shape, mems in domains.items():
        # in order: a domain's hoisted loads define the scalars later domains read
        seg = _segment(b, shape, mems, outs, preloaded or {}, spill or {})
        # a flat domain of a parallel kernel gets its own prange when it has the work for one
        # (an eighth of PARALLEL_MIN_WORK: its flat loop needs no nest)
        if seg[0] == 1 and par and seg[2][0] > 1 and \
                _work(g, mems) >= PARALLEL_MIN_WORK // 8:
            b.lines += _flat(seg)
        else:
            b.lines += seg[1] + _nest(seg, par and _work(g, mems) >= PARALLEL_MIN_WORK)
    return b.call(any("prange(" in ln for ln in b.lines))


def _segment(b, domain, members, outs, preloaded, spill):
    """(axes, hoisted lines, shape, loads per loop level, member and store lines) of one
    domain, collapsed to the fewest axes its operands' broadcasts allow."""
    g = b.g
    ext = externals(g, members, b.vals)
    shape, full = collapse(domain, [g.nodes[i].type.shape for i in ext])
    k = len(shape)
    idx = [f"i{ax}" for ax in range(k)]
    levels = {}
    for i, f in zip(ext, full):
        level = max([ax + 1 for ax in range(k) if f[ax]], default=0)
        sub = ", ".join(idx[ax] if f[ax] else "0" for ax in range(k))
        view = tuple(d if f[ax] else 1 for ax, d in enumerate(shape))
        src = preloaded[i] if i in preloaded else \
            b.arg(spill[i](view), "w") if i in spill else b.arg((i, view))
        levels.setdefault(level, []).append(f"{b.local(i, 'x')} = {src}[{sub}]")
        b.vals[i] = b.local(i, "x")
    at = ", ".join(idx)
    body = b.members(members, "")
    body += [f"{b.arg(spill[m](shape), 'w') if m in spill else b.arg((m, shape), 'o')}[{at}] = "
             f"{b.local(m)}" for m in members if m in outs]
    body += [f"{b.arg((i, shape), 'o')}[{at}] = {b.local(i, 'x')}" for i in preloaded if i in outs]
    return k, levels.pop(0, []), shape, levels, body


def _nest(seg, par):
    k, _, shape, levels, body = seg
    lines = []
    for ax in range(k):
        rng = "prange" if par and ax == 0 and shape[0] > 1 else "range"
        lines.append("    " * ax + f"for i{ax} in {rng}({shape[ax]}):")
        lines += ["    " * (ax + 1) + ln for ln in levels.get(ax + 1, [])]
    return lines + ["    " * k + ln for ln in body]


def _flat(seg):
    """A flat domain as one prange over its elements. A prange whose body is itself an inner
    loop over a chunk (`for c in prange(..): for i in range(lo, hi)`) stayed scalar in LLVM."""
    _, pre, (n,), levels, body = seg
    return pre + [f"for i0 in prange({n}):"] + ["    " + ln for ln in levels.get(1, []) + body]


def _overlap(a, b):
    """Whether two (region, offset, nbytes) buffers share a byte (None: no buffer)."""
    return a is not None and b is not None and a[0] == b[0] and \
        a[1] < b[1] + b[2] and b[1] < a[1] + a[2]


# ---- GEMM + epilogue -----------------------------------------------------------------------------


def gemm(g, kernel, inlined, slot_of) -> Call:
    """A prologue (the members the GEMM reads) computes operands, and the values the epilogue
    reads, into scratch space (or their own buffers when read outside too); the GEMM writes
    into a carrier buffer (the product's own output buffer when it shares no bytes with an
    operand, else scratch space after the prologue's), the accumulated GEMMs
    (kernel.accumulate: `add(product, matmul)`, in order) add theirs into it (beta = 1), then
    the epilogue runs over it while it is hot."""
    n = g.nodes[kernel.anchor]
    w, xv, (rows, ncols) = matmul_operands(g, n)
    ins = [slot_of(i) for m in kernel.nodes for i in g.nodes[m].inputs if i not in kernel.nodes]
    gemms = (n.id, *(m for m, _ in kernel.accumulate))
    pro = feeding(g, gemms, kernel.nodes)     # the prologue: what the GEMMs' operands need
    acc = {x for pair in kernel.accumulate for x in pair}
    prod = kernel.product
    epi = tuple(m for m in kernel.nodes if m != n.id and m not in pro and m not in acc)
    half = _bf16_operands(g, n, kernel, pro, slot_of)
    if half is not None:               # the GEMM reads the bf16 values: no f32 copies
        pro = pro - {n.inputs[0], n.inputs[1]}
    b = Builder(g, inlined, slot_of)
    scratch, at = {}, 0            # prologue value read after the prologue -> scratch offset
    for i in dict.fromkeys(i for m in (*gemms, *epi) for i in g.nodes[m].inputs):
        if i in pro and i not in kernel.outputs:
            scratch[i] = at
            at += aligned(g.nodes[i].type.nbytes)

    def spilled(i, shp):
        t = g.nodes[i].type
        return Workspace(t.size, t.dtype, shp, scratch[i])
    spill = {i: (lambda shp, i=i: spilled(i, shp)) for i in scratch}
    if pro:
        ordered = tuple(m for m in kernel.nodes if m in pro)
        elementwise(g, type(kernel)(kernel.id, ordered, "elementwise", tuple(
            m for m in ordered if m in kernel.outputs or m in scratch)), inlined, b, spill=spill)
        b.vals = {c: v for c, v in b.vals.items() if c in inlined}   # its loop-local names
    # The product goes into its own output buffer when it is one, else into scratch space: the
    # epilogue then reads one buffer and writes others. Writing it into an epilogue output and
    # updating that in place was no faster.
    carrier = prod if prod in kernel.outputs and \
        not any(_overlap(slot_of(prod), s) for s in ins) else None
    # the memory plan put an add of the product in a dying operand's slot (MemoryPlan.sums):
    # the GEMMs accumulate into that buffer (beta = 1) and the epilogue reads the sum there
    total, beta = _sum_in_place(g, kernel, epi, slot_of), "0.0"
    if total is not None:
        carrier, beta, epi, prod = total, "1.0", tuple(m for m in epi if m != total), total
    outs = tuple(m for m in kernel.outputs if (m != prod or carrier != prod) and m not in pro)
    shape, _ = collapse(n.type.shape, [g.nodes[i].type.shape for i in externals(g, epi, b.vals)
                                       if i != prod])

    def view(shp):
        return (carrier, shp) if carrier is not None else \
            Workspace(rows * ncols, n.type.dtype, shp, at)

    def operand(i, shp):
        return b.arg(spilled(i, shp), "w") if i in scratch else b.arg((i, shp))
    xa, wa = (None, None) if half is not None else \
        (operand(xv[0], xv[1]), operand(w.id, w.type.shape))
    ca = b.arg(view((rows, ncols)), "c")
    dt = n.type.dtype
    wt = None if w.type.is_storage else \
        transposed_weight(n, w.type.shape, rows, ncols, at if carrier is not None else
                          at + aligned(rows * ncols * n.type.np_dtype.itemsize))
    # a weight in a storage type: its dequantized tiles after the carrier's bytes, shared by
    # the kernel's GEMMs (they run one after another)
    qat = at if carrier is not None else at + aligned(rows * ncols * n.type.np_dtype.itemsize)
    qwork = [stored_weight(g, g.nodes[m], rows, ncols, qat)
             for m in (n.id, *(m for m, _ in kernel.accumulate))]
    qwork = max((q for q in qwork if q is not None), key=lambda q: q.size, default=None)
    qname = b.arg(qwork, "w") if qwork is not None else None
    if half is not None:           # its packed operands after the carrier's bytes
        xs, ws = half
        m_, k_ = xv[1] if not n.attr["ta"] else xv[1][::-1]
        from .bf16gemm import work_size
        from .blas import bt_copies
        parts = bt_copies()
        work = Workspace(work_size(rows, ncols, k_, parts), "f32", (), qat)
        b.lines += [f"gemm_bf16_work({literal(n.attr['ta'])}, {literal(n.attr['tb'])}, 1.0, "
                    f"{b.arg((xs, xv[1]))}, {b.arg((ws, w.type.shape))}, {beta}, {ca}, "
                    f"{b.arg(work, 'w')}, {parts})"]
    elif wt is not None:                             # w's transpose after the carrier's bytes
        b.lines += [f"gemm_bt_{dt}(1.0, {xa}, {wa}, {beta}, {ca}, {b.arg(wt, 'w')})"]
    else:
        b.lines += [gemm_text(g, n, xa, wa, beta, ca, qname)]
    for m, _ in kernel.accumulate:
        mn = g.nodes[m]
        w2, xv2, dims = matmul_operands(g, mn)
        assert dims == (rows, ncols), (kernel, m, dims)
        b.lines += [gemm_text(g, mn, operand(xv2[0], xv2[1]), operand(w2.id, w2.type.shape),
                              "1.0", ca, qname)]
    cflat = ca if shape == (rows, ncols) else b.arg(view(shape), "c")
    if not epi and prod in outs:       # nothing after the GEMMs, and the product in scratch
        size = rows * ncols
        src, dst = b.arg(view((size,)), "c"), b.arg((prod, (size,)), "o")
        loop = "prange" if size >= PARALLEL_MIN_WORK else "range"
        b.lines += [f"for i0 in {loop}({size}):", f"    {dst}[i0] = {src}[i0]"]
        outs = tuple(m for m in outs if m != prod)
    call = elementwise(g, type(kernel)(kernel.id, epi, "elementwise", outs), inlined, b,
                       {prod: cflat}, spill=spill)
    call.imports = (f"from jitgraph.runtime.cpu.blas import gemm_{dt}, gemm_bt_{dt}",) + \
        (("from jitgraph.runtime.cpu import library as lib",) if qwork is not None else ()) + \
        (("from jitgraph.runtime.cpu.bf16gemm import gemm_bf16_work",) if half is not None
         else ())
    return call


def _bf16_operands(g, n, kernel, pro, slot_of):
    """(x's bf16 source, w's bf16 source) when GEMM n reads both operands as casts to f32 of
    bf16 values (passes/half.py's conversions, in n's prologue, read by n alone and no output
    of the kernel) held in buffers outside the kernel, and bf16 GEMMs run on AVX512-BF16
    (bf16gemm.enabled(): the CPU has vdpbf16ps, measured faster than the conversion and
    sgemm on every GEMM of the llama steps: bench/README.md, "bf16 GEMM"); else None."""
    from . import bf16gemm
    if n.type.dtype != "f32" or not bf16gemm.enabled():
        return None
    srcs = []
    users = None
    for i in n.inputs:
        c = g.nodes[i]
        if i not in pro or not _is_conversion(c.op) or i in kernel.outputs or \
                c.type.dtype != "f32":
            return None
        src = c.inputs[0]
        if g.nodes[src].type.dtype != "bf16" or src in kernel.nodes or slot_of(src) is None:
            return None
        users = users or g.users()
        if users[i] != [n.id]:
            return None
        srcs.append(src)
    if n.inputs[0] == n.inputs[1]:
        return None
    return tuple(srcs)


def _is_conversion(op) -> bool:
    """Whether op is an elementwise conversion between float types (OpDef.half "convert":
    cast, which passes/half.py puts around every op over half values)."""
    return op_kind(op) == "elementwise" and get_op(op).half == "convert"


def _sum_in_place(g, kernel, epi, slot_of):
    """The epilogue member, no output of the kernel, that the memory plan placed in the slot
    of its other operand (an add of the product and a value dying here: passes/memory.py
    `_gemm_sum`), or None."""
    for m in epi:
        ins = g.nodes[m].inputs
        if kernel.product in ins and len(ins) == 2 and m not in kernel.outputs and \
                slot_of(m) is not None:         # a member in registers has no slot but this
            x = ins[1] if ins[0] == kernel.product else ins[0]
            if x != kernel.product and slot_of(x) == slot_of(m):
                return m
    return None


# ---- reduction with an elementwise prologue -------------------------------------------------------
def reduce(g, kernel, inlined, rule):
    """A reduction (its table entry `rule`, runtime/cpu/rules.py Reduction) computing its
    operand with the kernel's other members, a prologue."""
    n = g.nodes[kernel.anchor]
    x = g.nodes[n.inputs[0]]
    pro = [m for m in kernel.nodes if m != n.id]
    b = Builder(g, inlined)
    ext = externals(g, pro, b.vals)
    pats, full = reduce_pattern(x.type.shape, rule.axes(n.attr),
                                [g.nodes[i].type.shape for i in ext])
    xshape = tuple(d for d, _ in pats)
    names = [b.arg((i, tuple(d if f[ax] else 1 for ax, d in enumerate(xshape))))
             for i, f in zip(ext, full)]
    stores = [(m, b.arg((m, xshape), "o")) for m in pro if m in kernel.outputs]

    def element(subs, store):
        vals = dict(b.vals)
        lines = []
        for i, f, name in zip(ext, full, names):
            sub = ", ".join(s if f[ax] else "0" for ax, s in enumerate(subs))
            lines.append(f"{b.local(i, 'x')} = {name}[{sub}]")
            vals[i] = b.local(i, "x")
        lines += b.members(pro, "", vals)
        if store:
            lines += [f"{o}[{', '.join(subs)}] = {b.local(m)}" for m, o in stores]
        return lines, vals[x.id]
    return reduction(g, n, rule, pats, element, (b.params, b.args))


# ---- row ops over the last axis with prologue and epilogue ------------------------------------------
def _ancestors(g, members, roots):
    mem, out, todo = set(members), set(), list(roots)
    while todo:
        i = todo.pop()
        if i in mem and i not in out:
            out.add(i)
            todo.extend(g.nodes[i].inputs)
    return [m for m in members if m in out]


def rows(g, kernel, inlined, slot_of, rule):
    """Row op over [R, D] (D the last axis), by its table entry `rule` (runtime/cpu/rules.py
    Rows): its passes over each row recompute the prologue from the loaded operands; the last
    pass computes the row op's value and the epilogue and stores the outputs."""
    n = g.nodes[kernel.anchor]
    shape, D = n.type.shape, n.type.shape[-1]
    R = n.type.size // D
    b = Builder(g, inlined)
    passes, final = rule.passes, rule.final
    ins = [slot_of(i) for i in externals(g, kernel.nodes, b.vals)]
    fmt = {"T": NP_DTYPE[n.type.dtype], "D": D, "exp": spelling.approx("exp", n.type.dtype),
           **{k: typed_literal(v, "f64") for k, v in n.attrs}}
    if rule.stored and n.id in kernel.outputs and not any(_overlap(slot_of(n.id), s) for s in ins):
        passes, final = rule.stored
        fmt["buf"] = b.arg((n.id, (R, D)), "o")
    ext = externals(g, kernel.nodes, b.vals)
    levels = {0: [], 1: [], 2: []}
    for i in ext:
        rf, cf = rows_flags(shape, g.nodes[i].type.shape)
        a = b.arg((i, (R if rf else 1, D if cf else 1)))
        levels[2 if cf else 1 if rf else 0].append(f"{b.local(i, 'x')} = {a}[{'r' if rf else 0}, "
                                                   f"{'j' if cf else 0}]")
        b.vals[i] = b.local(i, "x")
    before = [m for m in kernel.nodes if m < n.id]
    pro = _ancestors(g, before, n.inputs)
    lines = []
    for setup, per, after in passes:
        vals = dict(b.vals)
        body = b.members(pro, "", vals)
        ops = [vals[i] for i in n.inputs]
        lines += [ln.format(*ops, **fmt) for ln in setup] + ["for j in range(D):"]
        lines += ["    " + ln for ln in levels[2] + body + [p.format(*ops, **fmt) for p in per]]
        lines += [ln.format(*ops, **fmt) for ln in after]
    vals = dict(b.vals)
    body = b.members(before, "", vals)
    body.append(f"{b.local(n.id)} = {fmt['T']}({final.format(*[vals[i] for i in n.inputs], **fmt)})"
                f"  # {n.op}")
    vals[n.id] = b.local(n.id)
    body += b.members([m for m in kernel.nodes if m > n.id], "", vals)
    body += [f"{b.arg((m, (R, D)), 'o')}[r, j] = {b.local(m)}" for m in kernel.nodes
             if m in kernel.outputs]
    lines += ["for j in range(D):"] + ["    " + ln for ln in levels[2] + body]
    work = n.type.size * (len(passes) + 1) * (1 + sum(cost(g.nodes[m]) for m in before))
    par = work >= PARALLEL_MIN_WORK and R > 1
    b.lines = levels[0] + [f"D = {D}", f"for r in {'prange' if par else 'range'}({R}):"] + \
        ["    " + ln for ln in levels[1] + lines]
    call = b.call(par, rule.imports)
    call.fastmath = True    # the row sums vectorise; NaN/inf semantics kept (no nnan/ninf)
    return call


# ---- cross_entropy with its backward --------------------------------------------------------------
def cross_entropy(g, kernel, inlined, slot_of=None):
    """Loss and gradient in one pass over the logits: per row max, sum of exponentials, then the
    loss term and softmax * sum(target) - target, times g / N. The gradient planned into the
    logits' buffer (passes/memory.py) is the logits' own array (one pointer: LLVM vectorises
    the row loops without alias checks)."""
    fwd, back = (g.nodes[m] for m in kernel.nodes)
    b = Builder(g, inlined, slot_of)
    lg, tg, gg = (g.nodes[i] for i in back.inputs)
    N, C = lg.type.shape
    T = NP_DTYPE[lg.type.dtype]
    ex = spelling.approx("exp", lg.type.dtype)
    labels = tg.type.dtype == "i32"
    la = b.arg((lg.id, (N, C)))
    ta = b.arg((tg.id, (N,) if labels else (N, C)))
    gv = b.vals.get(gg.id) or f"{b.arg((gg.id, (1,)))}[0]"
    lo, go = b.arg((fwd.id, (1,)), "o"), b.arg((back.id, (N, C)), "o")
    par = N * C * 24 >= PARALLEL_MIN_WORK and N > 1
    lines = [f"gs = {T}({gv} / {N})", "total = 0.0",
             f"for r in {'prange' if par else 'range'}({N}):",
             f"    m = {T}(-math.inf)", f"    for j in range({C}):",
             f"        m = fmaximum(m, {la}[r, j])",     # vectorises; Python's max does not
             "    if not math.isfinite(m):", f"        m = {T}(0.0)", "    s = 0.0"]
    if labels:
        # exp(x - m) is computed once and kept in the gradient's row; the label's logit is
        # read first, as that row may be the logits' own buffer (planned in place)
        lines += [f"    y = {ta}[r]", f"    bad = y < 0 or y >= {C}", "    y = 0 if bad else y",
                  f"    xy = {la}[r, y]", f"    for j in range({C}):",
                  f"        e = {ex}({la}[r, j] - m)", f"        {go}[r, j] = e",
                  "        s += e", "    lse = m + math.log(s)", f"    inv = {T}(1.0 / s)",
                  "    total += (math.nan if bad else 0.0) + (lse - xy)",
                  f"    for j in range({C}):",
                  f"        {go}[r, j] = ({go}[r, j] * inv - ({T}(1.0) if j == y else {T}(0.0))) * gs"]
    else:
        lines += [f"    for j in range({C}):", f"        s += {ex}({la}[r, j] - m)",
                  "    lse = m + math.log(s)", f"    inv = {T}(1.0 / s)",
                  "    ts = 0.0", f"    for j in range({C}):", f"        t = {ta}[r, j]",
                  "        ts += t", f"        total += t * (lse - {la}[r, j])", f"    tt = {T}(ts)",
                  f"    for j in range({C}):", f"        p = {ex}({la}[r, j] - m) * inv",
                  f"        {go}[r, j] = (p * tt - {ta}[r, j]) * gs"]
    lines += [f"{lo}[0] = {T}(total / {N})"]
    b.lines = lines
    call = b.call(par, FMAX_IMPORTS)
    call.fastmath = True    # the row sums vectorise; NaN/inf semantics kept (no nnan/ninf)
    return call

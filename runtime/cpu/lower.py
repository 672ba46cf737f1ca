"""Lowering of one IR node to numba source (or to a call of an existing kernel).

Each lowering returns `Call`s: the callee, its arguments as (node id, shape) views or literals,
and — for generated kernels — the kernel's source with the placeholder name KERNEL. Generated
kernels read their sizes from the arrays, so equal code (same op, pattern and dtypes) is one
kernel whatever the shapes; only the parallel decision depends on the size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jitgraph.plan import ALIGN
from jitgraph.types import STORAGE

from ..kernelgen import (NP_DTYPE, batch_index, literal, matmul_operands, prod as _prod,
                         reduce_pattern)
# a kernel runs its outer loop with prange when elements * cost >= PARALLEL_MIN_WORK, cost being
# 1 + the math calls and divisions of its expression
from .thresholds import PARALLEL_MIN_WORK

# the import line of kernels whose row max uses fmaximum (NaN-propagating, and it vectorises:
# Python's max compiles to a compare and branch that LLVM leaves scalar)
FMAX_IMPORTS = ("from jitgraph.runtime.cpu.minmax import fmaximum",)

# fastmath flags of kernels whose reductions may be reassociated (rows kernels): LLVM then
# vectorises their sums and maxima; no nnan/ninf, so NaN and inf behave as without them
FASTMATH = '{"reassoc", "nsz", "contract"}'

@dataclass
class Call:
    func: str                       # callee in the driver: "KERNEL" (the generated one) or a name
    args: list                      # (node id, shape) views, Workspace, or literal strings
    source: tuple | None = None     # generated kernel: (parameter names, body lines); the
                                    # parameters bind to `args` in order
    parallel: bool = False
    imports: tuple = field(default_factory=tuple)   # extra import lines for the kernel module
    fastmath: bool = False          # reassociation and contraction allowed (FASTMATH)


@dataclass(frozen=True)
class Workspace:
    """A scratch-buffer argument: `size` elements of `dtype`, contents undefined on entry, seen
    as an array of `shape` (default 1-D), `offset` bytes into the kernel's scratch space."""
    size: int
    dtype: str
    shape: tuple = ()
    offset: int = 0


def _kernel(params, lines):
    return tuple(params), tuple(lines)


def _range(parallel):
    return "prange" if parallel else "range"


# ---- reductions ---------------------------------------------------------------------------
def plain_element(subs, store):
    """The reduction operand itself at index `subs` (no prologue)."""
    return [], "x[" + ", ".join(subs) + "]"


def reduction(graph, n, rule, pats=None, element=plain_element, args=None):
    """Reduction node n by its table entry `rule` (runtime/cpu/rules.py Reduction). A fused
    prologue passes its collapsed pattern `pats`, an `element` function (index subscripts,
    store?) -> (lines, expression) and its array args; without one the kernel reads its
    operand x."""
    x = graph.nodes[n.inputs[0]]
    pats = pats or reduce_pattern(x.type.shape, rule.axes(n.attr))[0]
    xshape = tuple(d for d, _ in pats)
    kept = [ax for ax, (_, kd) in enumerate(pats) if kd == "K"]
    red = [ax for ax, (_, kd) in enumerate(pats) if kd == "R"]
    oshape = tuple(pats[ax][0] for ax in kept) or (1,)
    # parallel over the outermost kept axis (each iteration owns its output elements), also
    # where reduced axes come before it: the CNN's bias and relu-backward sums over [100, 8,
    # 784] (axes 0 and 2) ran on one thread, and fused with their prologue lost to the
    # unfused parallel elementwise kernels; the memory-order nest (last axis
    # kept) accumulates along every axis, so its all-axes loop is parallel only when axis 0 is kept
    par = x.type.size * rule.cost >= PARALLEL_MIN_WORK and bool(kept) and xshape[kept[0]] > 1
    if pats[-1][1] == "K" and rule.memory is not None:
        lines = rule.memory(_memory_nest(n, xshape, kept, red, par, element))
    else:
        r = _rows_nest(n, xshape, kept, red, par, element)
        lines = r.loops + rule.rows(r)
    head = [", ".join(f"n{ax}" for ax in range(len(xshape))) + f", = {literal(xshape)}"]
    # reassociation lets LLVM split a float accumulator into vector lanes (the sum vectorises);
    # NaN/inf kept (no nnan/ninf)
    fast = x.type.is_float and rule.fastmath
    if args is None:
        return [Call("KERNEL", [(x.id, xshape), (n.id, oshape)], _kernel(["x", "out"], head + lines),
                     par, fastmath=fast)]
    names, vals = args
    return [Call("KERNEL", vals + [(n.id, oshape)], _kernel(names + ["out"], head + lines), par,
                 fastmath=fast)]


def _loops(axes, par, depth):
    """Nested loops over `axes`; the outermost a prange when `par` (the caller's guarantee:
    no two of its iterations write the same element)."""
    lines = []
    for j, ax in enumerate(axes):
        rng = _range(par) if (j == 0 and depth == 0) else "range"
        lines.append("    " * (depth + j) + f"for i{ax} in {rng}(n{ax}):")
    return lines


class Nest:
    """A reduction's loop nest, as a reduction rule (runtime/cpu/table.py) sees it: `n` the
    node, `O` the output element, `at` / `at0` the subscripts of the current / the first reduced
    element, `count` the reduced element count, `element(subs, store)` -> (lines, expression)
    the operand (with a fused prologue: computed; `store` at the first visit of each element).
    Rows order (kept axes outer, reduced axes inner, scalar accumulator): `loops` the kept
    loops, `pad` / `ipad` the indent inside them / inside the reduced loops, `inner` the reduced
    loops, `first` the first pass over them binding `v` (a prologue stores there),
    `elem(subs, store, pad, var)` lines binding `var`. Memory order (every axis in memory order,
    accumulating into `out`): `kept_loops` / `all_loops`, `kpad` / `apad` their indents."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _nest(n, xshape, kept, red, element):
    nd = len(xshape)
    return dict(n=n, element=element, at=[f"i{ax}" for ax in range(nd)],
                at0=["0" if ax in red else f"i{ax}" for ax in range(nd)],
                O="out[" + (", ".join(f"i{ax}" for ax in kept) if kept else "0") + "]",
                cast=NP_DTYPE[n.type.dtype], count=" * ".join(f"n{ax}" for ax in red), red=red)


def _rows_nest(n, xshape, kept, red, par, element):
    """Kept axes outer, reduced axes inner, scalar accumulator (best when the last axis is
    reduced). The first inner loop visits every element once (a prologue stores there)."""
    r = Nest(**_nest(n, xshape, kept, red, element), loops=_loops(kept, par, 0))
    d = len(kept)
    r.pad, r.inner, r.ipad = "    " * d, _loops(red, False, d), "    " * (d + len(red))

    def elem(subs, store, p=r.ipad, var="v"):
        pre, e = element(subs, store)
        return [p + ln for ln in pre] + [p + f"{var} = {e}"]
    r.elem = elem
    r.first = r.inner + elem(r.at, True)
    return r


def _memory_nest(n, xshape, kept, red, par, element):
    """Loops in memory order accumulating into `out` (best when the last axis is kept)."""
    return Nest(**_nest(n, xshape, kept, red, element), kept_loops=_loops(kept, par, 0),
                all_loops=_loops(list(range(len(xshape))), par and kept[0] == 0, 0),
                kpad="    " * len(kept),
                apad="    " * len(xshape))


# ---- the reduction rules of runtime/cpu/table.py: (rows order, memory order) per op ----------
def sum_rows(r):
    return [r.pad + ("acc = 0.0" if r.n.type.is_float else "acc = 0")] + r.first + \
        [r.ipad + "acc += v", r.pad + f"{r.O} = {r.cast}(acc)"]


def mean_rows(r):
    return sum_rows(r)[:-1] + [r.pad + f"{r.O} = {r.cast}(acc / ({r.count}))"]


def max_rows(r):
    return r.elem(r.at0, False, r.pad, "acc") + r.first + \
        [r.ipad + "if v > acc:", r.ipad + "    acc = v", r.pad + f"{r.O} = acc"]


def argmax_rows(r):
    (red,) = r.red
    return r.elem(r.at0, False, r.pad, "best") + [r.pad + "bi = 0"] + r.first + \
        [r.ipad + "if v > best:", r.ipad + "    best = v", r.ipad + f"    bi = i{red}",
         r.pad + f"{r.O} = bi"]


def logsumexp_rows(r):
    # m unifies to float64 (`m = 0.0`): the exponentials are float64 whatever the dtype, by
    # runtime/cpu/approx.py's dexp, which vectorises where math.exp, a libm call, did not
    return r.elem(r.at0, False, r.pad, "m") + r.first + \
        [r.ipad + "if v > m:", r.ipad + "    m = v", r.pad + "if not math.isfinite(m):",
         r.pad + "    m = 0.0", r.pad + "s = 0.0"] + r.inner + r.elem(r.at, False) + \
        [r.ipad + "s += approx.dexp(v - m)", r.pad + f"{r.O} = {r.cast}(math.log(s) + m)"]


def sum_memory(m):
    pre, e = m.element(m.at, True)
    return m.kept_loops + [m.kpad + f"{m.O} = 0"] + m.all_loops + [m.apad + ln for ln in pre] + \
        [m.apad + f"v = {e}", m.apad + f"{m.O} += v"]


def mean_memory(m):
    return sum_memory(m) + m.kept_loops + [m.kpad + f"{m.O} = {m.O} / ({m.count})"]


def max_memory(m):
    pre0, e0 = m.element(m.at0, False)
    pre, e = m.element(m.at, True)
    return m.kept_loops + [m.kpad + ln for ln in pre0] + [m.kpad + f"{m.O} = {e0}"] + \
        m.all_loops + [m.apad + ln for ln in pre] + \
        [m.apad + f"v = {e}", m.apad + f"if v > {m.O}:", m.apad + f"    {m.O} = v"]


def count_equal(graph, n):
    x, y = (graph.nodes[i] for i in n.inputs)
    flat = (x.type.size,)
    lines = ["c = 0", "for i in range(x.shape[0]):", "    if x[i] == y[i]:", "        c += 1",
             "out[0] = c"]
    return [Call("KERNEL", [(x.id, flat), (y.id, flat), (n.id, (1,))],
                 _kernel(["x", "y", "out"], lines))]


def get_rows(graph, n):
    """lib.get_rows, or lib.get_rows_q dequantizing the chosen rows of a table in a storage
    type (types.STORAGE)."""
    w, idx = (graph.nodes[i] for i in n.inputs)
    args = [(w.id, w.type.shape), (idx.id, idx.type.shape), (n.id, n.type.shape)]
    if not w.type.is_storage:
        return [Call("lib.get_rows", args)]
    flat = (idx.type.size,)
    return [Call("lib.get_rows_q", [args[0], literal(storage_kind(w.type)), (idx.id, flat),
                                    (n.id, flat + w.type.shape[1:])])]


def sround_bf16(graph, n):
    """lib.sround_bf16 over the flat value (its element index is the random bits' counter)."""
    x, step = n.inputs
    flat = (n.type.size,)
    return [Call("lib.sround_bf16", [(x, flat), (step, (1,)), (n.id, flat),
                                     literal(n.attr["seed"]), literal(n.attr["salt"])])]


def concat(graph, n):
    """One library call per operand, each writing its slab of the output (lib.embed)."""
    ax, off, calls = n.attr["axis"], 0, []
    for i in n.inputs:
        starts = tuple(off if a == ax else 0 for a in range(n.type.ndim))
        calls.append(Call("lib.embed", [(i, graph.nodes[i].type.shape), (n.id, n.type.shape),
                                        literal(starts)]))
        off += graph.nodes[i].type.shape[ax]
    return calls


# ---- matmul -------------------------------------------------------------------------------
# c = a b^T with a small B runs faster as B copied into its transpose, then c = a (b^T) (blas.py
# gemm_bt, with the measurements): where K is small, B small and c tall.
BT_MAX_K, BT_MAX_ELEMENTS, BT_MIN_M = 256, 1 << 17, 256


def aligned(nbytes: int) -> int:
    """nbytes rounded up to a cache line (the runtime's ALIGN, as the memory plan's slots):
    where scratch buffers placed one after another start."""
    return -(-nbytes // ALIGN) * ALIGN


def transpose_pays(ta, tb, m, n, k) -> bool:
    """Whether c[m, n] = op(a) b^T (inner dimension k) runs as gemm_bt."""
    return bool(tb and not ta and 0 < k <= BT_MAX_K and n * k <= BT_MAX_ELEMENTS and
                m >= BT_MIN_M)


def transposed_weight(n, ws, rows, ncols, at=0):
    """The scratch buffer for w's transposes (shape ws as stored; one copy per pool thread,
    blas.bt_copies) when matmul node n, writing c[rows, ncols], runs as gemm_bt
    (transpose_pays), at byte `at`; else None."""
    from .blas import bt_copies
    ta, tb = n.attr["ta"], n.attr["tb"]
    k = ws[1] if tb else ws[0]
    if not transpose_pays(ta, tb, rows, ncols, k):
        return None
    copies = bt_copies()
    return Workspace(copies * k * ncols, n.type.dtype, (copies, k, ncols), at)


def stored_weight(graph, n, rows, ncols, at=0):
    """The scratch buffer lib.qgemm needs (tiles of w dequantized, one per pool thread) when
    matmul node n, writing c[rows, ncols], reads w in a storage type (types.STORAGE); else
    None."""
    w = graph.nodes[n.inputs[1]]
    if not w.type.is_storage:
        return None
    from .blas import bt_copies
    from .lib_quant import qgemm_workspace
    k = w.type.shape[1] if n.attr["tb"] else w.type.shape[0]
    size = int(qgemm_workspace(storage_kind(w.type), rows, ncols, k, bt_copies()))
    return Workspace(max(size, 1), "f32", (), at)


def storage_kind(t) -> int:
    """The ggml type number the quantized kernels (lib_quant.py) take as `kind`."""
    return STORAGE[t.dtype][0]


def gemm_text(graph, n, x, w, beta, c, work=None) -> str:
    """The GEMM line c = op(x) op(w) + beta c of matmul node n over the argument names given:
    lib.qgemm when w is in a storage type (work: its scratch's name), else gemm_<dtype>."""
    ta, tb = literal(n.attr["ta"]), literal(n.attr["tb"])
    if graph.nodes[n.inputs[1]].type.is_storage:
        kind = storage_kind(graph.nodes[n.inputs[1]].type)
        if n.attr.get("xq") is not None:
            return f"lib.qgemm8(1.0, {x}, {w}, {beta}, {c}, {kind}, {work})"
        return f"lib.qgemm({ta}, {tb}, 1.0, {x}, {w}, {beta}, {c}, {kind}, {work})"
    return f"gemm_{n.type.dtype}({ta}, {tb}, 1.0, {x}, {w}, {beta}, {c})"


def gemm_call(n, xv, wv, out, graph=None) -> Call:
    """The direct GEMM call writing out = op(x) op(w) for matmul node n: gemm_<dtype>, or
    gemm_bt_<dtype> with w's transpose in scratch space when that pays, or lib.qgemm when w is
    in a storage type (graph: n's graph, to know)."""
    dt = n.type.dtype
    work = stored_weight(graph, n, *out[1]) if graph is not None else None
    if work is not None:
        kind = literal(storage_kind(graph.nodes[wv[0]].type))
        if n.attr.get("xq") is not None:
            return Call("lib.qgemm8", ["1.0", xv, wv, "0.0", out, kind, work])
        return Call("lib.qgemm", [literal(n.attr["ta"]), literal(n.attr["tb"]), "1.0", xv, wv,
                                  "0.0", out, kind, work])
    wt = transposed_weight(n, wv[1], *out[1])
    if wt is not None:
        return Call(f"gemm_bt_{dt}", ["1.0", xv, wv, "0.0", out, wt])
    return Call(f"gemm_{dt}", [literal(n.attr["ta"]), literal(n.attr["tb"]), "1.0", xv, wv,
                               "0.0", out])


def matmul(graph, n):
    """2-D (or batched x with a 2-D w folded into rows): one direct GEMM call from the driver;
    otherwise a generated loop over the broadcast batch calling GEMM per matrix."""
    x, w = (graph.nodes[i] for i in n.inputs)
    ta, tb = n.attr["ta"], n.attr["tb"]
    gemm = "gemm_" + n.type.dtype
    xs, ws, os_ = x.type.shape, w.type.shape, n.type.shape
    if len(ws) == 2 and (len(xs) == 2 or not ta):
        w, xv, out = matmul_operands(graph, n)
        return [gemm_call(n, xv, (w.id, ws), (n.id, out), graph)]
    ob = os_[:-2]
    nb = _prod(ob)
    lines = [f"for b in range({nb}):"]
    for nm, shape in (("bx", xs), ("bw", ws)):
        lines += ["    " + ln for ln in batch_index(nm, ob, shape[:-2])]
    lines += ["    " + f"{gemm}(ta, tb, 1.0, x[bx], w[bw], 0.0, out[b])"]
    src = _kernel(["ta", "tb", "x", "w", "out"], lines)
    args = [literal(ta), literal(tb), (x.id, (_prod(xs[:-2]),) + xs[-2:]),
            (w.id, (_prod(ws[:-2]),) + ws[-2:]), (n.id, (nb,) + os_[-2:])]
    imp = (f"from jitgraph.runtime.cpu.blas import {gemm}",)
    return [Call("KERNEL", args, src, False, imp)]

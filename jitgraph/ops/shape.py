"""Shape ops: reshape, permute, broadcast_to, concat, slice, pad, get_rows; and matmul.
slice_back and get_rows_back are the scatters their vjps need (ggml style)."""
from __future__ import annotations

import builtins

import numpy as np

from ..types import ShapeError, TensorType, broadcast_shapes
from .common import apply, norm_axis, same_dtype, unbroadcast
from ..registry import OPTIONAL, REQUIRED, Arg, defvjp, register


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ---- reshape / permute / broadcast_to ------------------------------------------------------
def _reshape_infer(args, a):
    x, shape = args[0], a["shape"]
    if any(d < 0 for d in shape):
        raise ShapeError(f"target shape {shape} has negative dimensions (resolve -1 first)")
    if _prod(shape) != x.type.size:
        raise ShapeError(f"cannot reshape {x} ({x.type.size} elements) to {list(shape)} "
                         f"({_prod(shape)} elements)")
    return TensorType(x.dtype, shape)


register("reshape", arity=1, kind="view", attrs={"shape": ("ints", ())}, infer=_reshape_infer,
         ref=lambda a, x: x.reshape(a["shape"]))


def _permute_infer(args, a):
    x, axes = args[0], a["axes"]
    if sorted(axes) != list(range(x.ndim)):
        raise ShapeError(f"axes {list(axes)} are not a permutation of {x.ndim} axes of {x}")
    return TensorType(x.dtype, tuple(x.shape[i] for i in axes))


register("permute", half="move", arity=1, kind="opaque", attrs={"axes": ("ints", ())}, infer=_permute_infer,
         ref=lambda a, x: np.array(np.transpose(x, a["axes"]), order="C"))  # 0-d stays 0-d


def _broadcast_to_infer(args, a):
    x, shape = args[0], a["shape"]
    try:
        out = broadcast_shapes(x.shape, shape)
    except ValueError:
        out = None
    if out != tuple(shape):
        raise ShapeError(f"cannot broadcast {x} to {list(shape)}")
    return TensorType(x.dtype, shape)


register("broadcast_to", arity=1, kind="elementwise", expr="{0}", attrs={"shape": ("ints", ())},
         infer=_broadcast_to_infer, ref=lambda a, x: np.broadcast_to(x, a["shape"]).copy())


# ---- concat / slice / pad ---------------------------------------------------------------------
def _concat_infer(args, a):
    dt = same_dtype(args, "concat")
    x0, ax = args[0], a["axis"]
    if not 0 <= ax < x0.ndim:
        raise ShapeError(f"axis {ax} out of range for {x0}")
    for x in args[1:]:
        if x.ndim != x0.ndim or any(x.shape[i] != x0.shape[i] for i in range(x0.ndim) if i != ax):
            raise ShapeError(f"operands differ outside axis {ax}: {', '.join(map(str, args))}")
    shape = list(x0.shape)
    shape[ax] = sum(x.shape[ax] for x in args)
    return TensorType(dt, tuple(shape))


register("concat", half="move", arity=None, kind="opaque", attrs={"axis": ("int", 0)}, infer=_concat_infer,
         ref=lambda a, *xs: np.concatenate(xs, axis=a["axis"]))


def slice_len(start, stop, step):
    return len(range(start, stop, step))


def _slice_infer(args, a):
    x, sl = args[0], a["slices"]
    if len(sl) != x.ndim:
        raise ShapeError(f"expected one (start, stop, step) per axis of {x}, got {len(sl)}")
    shape = []
    for ax, ((start, stop, step), d) in enumerate(zip(sl, x.shape)):
        if step == 0:
            raise ShapeError(f"axis {ax}: step must not be 0")
        lo, hi = (0, d) if step > 0 else (-1, d - 1)
        if not (lo <= start <= hi and lo <= stop <= hi):
            raise ShapeError(f"axis {ax}: start/stop ({start}, {stop}) not normalised for size {d}")
        shape.append(slice_len(start, stop, step))
    return TensorType(x.dtype, tuple(shape))


def _np_index(slices):
    return tuple(builtins.slice(s, None if e < 0 else e, st) for s, e, st in slices)


register("slice", half="move", arity=1, kind="opaque", attrs={"slices": ("slices", ())}, infer=_slice_infer,
         ref=lambda a, x: np.array(x[_np_index(a["slices"])], order="C"),
         doc="slices=((start, stop, step), ...) per axis, normalised (stop=-1: "
             "before index 0 with a negative step)")


def _window_infer(args, a):
    x, off, shape = args[0], a["offset"], a["shape"]
    n = _prod(shape)
    if off < 0 or any(d < 0 for d in shape) or off + n > x.type.size:
        raise ShapeError(f"window of {list(shape)} ({n} elements) at element {off} of {x} "
                         f"({x.type.size} elements): expected a range inside the operand")
    return TensorType(x.dtype, tuple(shape))


def _window_ref(a, x):
    n = _prod(a["shape"])
    return x.reshape(-1)[a["offset"]:a["offset"] + n].reshape(a["shape"])


register("window", arity=1, kind="view", attrs={"offset": ("int", 0), "shape": ("ints", ())},
         infer=_window_infer, ref=_window_ref,
         doc="window(x) [offset, shape]: elements offset.. of x (C order) as `shape`, a view of "
             "x's buffer (passes/views.py makes contiguous slices windows)")


@defvjp("window")
def _window_vjp(g, out, xs, a):
    x, n = xs[0], g.type.size
    flat = pad(reshape(g, (n,)), [(a["offset"], x.type.size - a["offset"] - n)])
    return [reshape(flat, x.shape)]


def _slice_back_infer(args, a):
    g = args[0]
    x = Arg("x", TensorType(g.dtype, a["shape"]))
    sliced = _slice_infer([x], a)
    if sliced.shape != g.shape:
        raise ShapeError(f"gradient {g} does not match slice {list(a['slices'])} of {x} "
                         f"(expected {sliced})")
    return x.type


def _slice_back_ref(a, g):
    out = np.zeros(a["shape"], g.dtype)
    out[_np_index(a["slices"])] = g
    return out


register("slice_back", half="compute", arity=1, kind="opaque", infer=_slice_back_infer, ref=_slice_back_ref,
         attrs={"shape": ("ints", ()), "slices": ("slices", ())},
         doc="slice_back(g) [shape, slices]: zeros of `shape` with g scattered into the slice")


def _pad_infer(args, a):
    x, pads = args[0], a["pads"]
    if len(pads) != x.ndim:
        raise ShapeError(f"expected one (before, after) pair per axis of {x}, got {len(pads)}")
    if any(p < 0 for pr in pads for p in pr):
        raise ShapeError(f"pads must be non-negative, got {pads}")
    return TensorType(x.dtype, tuple(d + b + e for d, (b, e) in zip(x.shape, pads)))


register("pad", half="compute", arity=1, kind="opaque", attrs={"pads": ("int_pairs", ()), "value": ("float", 0.0)},
         infer=_pad_infer,
         ref=lambda a, x: np.pad(x, a["pads"], constant_values=np.asarray(a["value"], x.dtype)))


# ---- get_rows (embedding lookup) ---------------------------------------------------------------
def _get_rows_infer(args, a):
    w, idx = args
    if w.ndim < 1:
        raise ShapeError(f"table must be at least 1-D, got {w}")
    if idx.dtype != "i32":
        raise ShapeError(f"indices must be i32, got {idx}")
    if w.type.is_storage and w.ndim != 2:
        raise ShapeError(f"a {w.dtype} table must be 2-D, got {w}")
    # a table in a storage type gives f32 rows (dequantized)
    return TensorType("f32" if w.type.is_storage else w.dtype, idx.shape + w.shape[1:])


def _check_rows(op, idx, n_rows):
    if idx.size and (idx.min() < 0 or idx.max() >= n_rows):
        raise IndexError(f"{op}: index out of range [0, {n_rows})")


def _get_rows_ref(a, w, idx):
    _check_rows("get_rows", idx, w.shape[0])
    return w[idx]      # the interpreter hands a storage-typed table in dequantized (f32)


register("get_rows", arity=2, kind="opaque", infer=_get_rows_infer, ref=_get_rows_ref,
         index=lambda args, a: [(1, args[0].shape[0])], storage=(0,),
         doc="get_rows(table[V, ...], idx i32[...]) -> [..., ...]: rows of table by index")


def _get_rows_back_infer(args, a):
    g, idx = args
    if idx.dtype != "i32":
        raise ShapeError(f"indices must be i32, got {idx}")
    if not g.type.is_float:
        raise ShapeError(f"gradient must be f32 or f64, got {g}")
    if g.shape[:idx.ndim] != idx.shape:
        raise ShapeError(f"gradient {g} does not start with the index shape of {idx}")
    if a["n_rows"] < 0:
        raise ShapeError(f"n_rows must be non-negative, got {a['n_rows']}")
    return TensorType(g.dtype, (a["n_rows"],) + g.shape[idx.ndim:])


def _get_rows_back_ref(a, g, idx):
    _check_rows("get_rows_back", idx, a["n_rows"])
    out = np.zeros((a["n_rows"],) + g.shape[idx.ndim:], g.dtype)
    np.add.at(out, idx, g)
    return out


register("get_rows_back", arity=2, kind="opaque", infer=_get_rows_back_infer,
         ref=_get_rows_back_ref, attrs={"n_rows": ("int", REQUIRED)},
         index=lambda args, a: [(1, a["n_rows"])],
         doc="get_rows_back(g, idx) [n_rows]: scatter-add of g's rows into a zero table "
             "(ggml_get_rows_back); repeated indices accumulate")


# ---- matmul ------------------------------------------------------------------------------------
def _matmul_infer(args, a):
    x, w = args
    if a.get("xq") is not None:
        _xq_check(x, w, a)
    if w.type.is_block or w.type.is_half and x.dtype != w.dtype:
        # a weight in a storage type (a frozen one in its file's type) read by an f32 matmul,
        # dequantized to f32
        if x.dtype != "f32" or w.ndim != 2 or a["ta"]:
            raise ShapeError(f"a {w.dtype} weight is read as the 2-D second operand of an f32 "
                             f"matmul without ta: got {x}{'^T' if a['ta'] else ''} @ {w}")
    else:
        same_dtype(args, "matmul")
    if not x.type.is_float:
        raise ShapeError(f"operands must be f32 or f64: {x} @ {w}")
    if x.ndim < 2 or w.ndim < 2:
        raise ShapeError(f"operands must be at least 2-D: {x} @ {w}")
    xs, ws = _mm_shape(x.shape, a["ta"]), _mm_shape(w.shape, a["tb"])
    if xs[-1] != ws[-2]:
        tx, tw = ("^T" if a["ta"] else ""), ("^T" if a["tb"] else "")
        raise ShapeError(f"inner dimensions differ: {x}{tx} @ {w}{tw} ({xs[-1]} != {ws[-2]})")
    try:
        batch = broadcast_shapes(x.shape[:-2], w.shape[:-2])
    except ValueError:
        raise ShapeError(f"batch dimensions do not broadcast: {x} @ {w}") from None
    return TensorType(x.dtype, batch + (xs[-2], ws[-1]))


def _xq_check(x, w, a):
    """xq: x converted to W's vec_dot_type before its dot with W's rows (ggml's CPU dot, see
    jitgraph/quant.py quantize_x), for an f32 x and a stored W read as x @ W^T."""
    from ..quant import VEC_DOT_TYPE
    want = VEC_DOT_TYPE.get(w.dtype)
    if want is None or x.dtype != "f32" or a["ta"] or not a["tb"]:
        raise ShapeError(f"matmul xq={a['xq']!r} reads an f32 x as x @ W^T with W in "
                         f"{', '.join(VEC_DOT_TYPE)}: got {x}{'^T' if a['ta'] else ''} @ "
                         f"{w}{'^T' if a['tb'] else ''}")
    if a["xq"] != want:
        raise ShapeError(f"matmul xq={a['xq']!r}: a {w.dtype} weight is dotted with x in "
                         f"{want} (ggml's vec_dot_type); got {x} @ {w}^T")


def _mm_shape(shape, t):
    return shape[:-2] + (shape[-1], shape[-2]) if t else shape


def _mm_ref(a, x, w):
    if a.get("xq") is not None:
        from ..quant import quantize_x
        x = quantize_x(x, a["xq"])
    if a["ta"]:
        x = np.swapaxes(x, -1, -2)
    if a["tb"]:
        w = np.swapaxes(w, -1, -2)
    return np.matmul(x, w)


def _mm_flops(ins, out, a):
    """2MNK: a multiply and an add per inner-dimension element of every output."""
    return 2 * out.size * ins[0].shape[-2 if a["ta"] else -1]


register("matmul", arity=2, half="compute", kind="contraction", fusion=("prologue", "epilogue"), cheap=False,
         flops=_mm_flops, infer=_matmul_infer, ref=_mm_ref, storage=(1,),
         attrs={"ta": ("bool", False), "tb": ("bool", False), "xq": ("str", OPTIONAL)},
         doc="numpy matmul semantics for 2-D and batched operands; ta/tb transpose the last two "
             "axes of x / w first (BLAS transpose flags, set by the simplify pass); xq "
             "(q8_0, q8_k or f16, with a stored W read as x @ W^T): x's rows converted to that "
             "type first, as ggml's CPU dot does (jitgraph.dots.ggml_dots)")


# ---- user-facing functions ---------------------------------------------------------------------
def reshape(x, shape):
    shape = tuple(int(d) for d in shape)
    if shape.count(-1) > 1:
        raise ShapeError(f"reshape: at most one -1 in {list(shape)} for {x}")
    if -1 in shape:
        known = _prod(d for d in shape if d != -1)
        if known == 0 or x.type.size % known:
            raise ShapeError(f"reshape: cannot infer -1 in {list(shape)} for {x}")
        shape = tuple(x.type.size // known if d == -1 else d for d in shape)
    return apply("reshape", x, shape=shape)


def permute(x, axes):
    return apply("permute", x, axes=tuple(norm_axis(int(i), x.ndim, "permute") for i in axes))


def transpose(x, axes=None):
    return permute(x, tuple(reversed(range(x.ndim))) if axes is None else axes)


def broadcast_to(x, shape): return apply("broadcast_to", x, shape=tuple(shape))
def concat(xs, axis=0):
    xs = list(xs)
    if not xs:
        raise ShapeError("concat: needs at least one operand")
    return apply("concat", *xs, axis=norm_axis(axis, xs[0].ndim, "concat"))


def slice(x, *specs):
    """slice(x, (start, stop, step), ...) per leading axis, or Python slices; missing axes and
    None: the whole axis."""
    if len(specs) > x.ndim:
        raise ShapeError(f"slice: {len(specs)} slices for {x.ndim}-D {x.label} {x.type}")
    out = []
    for ax, d in enumerate(x.shape):
        s = specs[ax] if ax < len(specs) and specs[ax] is not None else builtins.slice(None)
        if isinstance(s, (tuple, list)):
            s = builtins.slice(*s)
        if not isinstance(s, builtins.slice):
            raise ShapeError(f"slice: axis {ax}: expected a slice or (start, stop, step), got {s!r}")
        if s.step == 0:
            raise ShapeError(f"slice: axis {ax}: step must not be 0")
        start, stop, step = s.indices(d)
        out.append((start, stop, step))
    return apply("slice", x, slices=tuple(out))


def pad(x, pads, value=0.0):
    pads = [tuple(p) for p in pads]
    pads = [(0, 0)] * (x.ndim - len(pads)) + pads if len(pads) < x.ndim else pads
    return apply("pad", x, pads=tuple(pads), value=value)


def get_rows(table, idx): return apply("get_rows", table, idx)
def matmul(x, w, ta=False, tb=False): return apply("matmul", x, w, ta=ta, tb=tb)


# ---- vjp rules ---------------------------------------------------------------------------------
@defvjp("reshape")
def _reshape_vjp(g, out, xs, a):
    return [reshape(g, xs[0].shape)]


@defvjp("permute")
def _permute_vjp(g, out, xs, a):
    inv = [0] * len(a["axes"])
    for i, ax in enumerate(a["axes"]):
        inv[ax] = i
    return [permute(g, inv)]


@defvjp("broadcast_to")
def _broadcast_to_vjp(g, out, xs, a):
    return [unbroadcast(g, xs[0].shape)]


@defvjp("matmul")
def _matmul_vjp(g, out, xs, a):
    x, w = xs
    ta, tb = a["ta"], a["tb"]
    if a.get("xq") is not None:
        raise ShapeError(f"matmul xq={a['xq']!r} (x converted as ggml's dot does) has no "
                         f"gradient: {x} @ {w}^T is for inference; differentiate the graph "
                         f"without jitgraph.dots.ggml_dots")
    # d/dX of op(X) @ op(W): dop(X) = g @ op(W)^T; dX = dop(X) or its transpose
    gx = apply("matmul", w, g, ta=tb, tb=True) if ta else apply("matmul", g, w, ta=False, tb=not tb)
    if w.type.is_block:         # a frozen weight in its file's type: no gradient
        return [unbroadcast(gx, x.shape), None]
    if w.type.dtype != x.dtype:     # a half weight read by an f32 matmul: f32 gradient, rounded
        gw = apply("matmul", g, x, ta=True, tb=ta) if tb else \
            apply("matmul", x, g, ta=not ta, tb=False)
        return [unbroadcast(gx, x.shape), apply("cast", unbroadcast(gw, w.shape), dtype=w.dtype)]
    gw = apply("matmul", g, x, ta=True, tb=ta) if tb else apply("matmul", x, g, ta=not ta, tb=False)
    return [unbroadcast(gx, x.shape), unbroadcast(gw, w.shape)]


@defvjp("concat")
def _concat_vjp(g, out, xs, a):
    ax, off, grads = a["axis"], 0, []
    for x in xs:
        n = x.shape[ax]
        grads.append(apply("slice", g, slices=tuple((off, off + n, 1) if i == ax else (0, d, 1)
                                                   for i, d in enumerate(g.shape))))
        off += n
    return grads


@defvjp("slice")
def _slice_vjp(g, out, xs, a):
    """Unit steps: pad g back with zeros; other steps (strided, reversed): scatter (slice_back)."""
    x, sl = xs[0], a["slices"]
    if all(st == 1 for _, _, st in sl):
        return [pad(g, [(s, d - s - n) for (s, _, _), d, n in zip(sl, x.shape, g.shape)])]
    return [apply("slice_back", g, shape=x.shape, slices=sl)]


@defvjp("slice_back")
def _slice_back_vjp(g, out, xs, a):
    return [apply("slice", g, slices=a["slices"])]


@defvjp("pad")
def _pad_vjp(g, out, xs, a):
    inner = tuple((b, b + d, 1) for (b, _), d in zip(a["pads"], xs[0].shape))
    return [apply("slice", g, slices=inner)]


@defvjp("get_rows")
def _get_rows_vjp(g, out, xs, a):
    w, idx = xs
    gw = apply("get_rows_back", g, idx, n_rows=w.shape[0])
    # a half table gives f32 rows (read as a storage type): its gradient rounded to its type
    return [apply("cast", gw, dtype=w.dtype) if w.type.is_half else gw, None]


@defvjp("get_rows_back")
def _get_rows_back_vjp(g, out, xs, a):
    return [get_rows(g, xs[1]), None]

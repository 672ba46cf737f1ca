"""Reductions over given axes (keepdims optional), and count_equal."""
from __future__ import annotations

import numpy as np

from ..types import ShapeError, TensorType
from .common import apply, need_float, norm_axes, norm_axis, same_dtype
from ..registry import defvjp, register

_AX = {"axes": ("ints", ()), "keepdims": ("bool", False)}


def reduced_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reduce_infer(float_only, allow_empty=True):
    def infer(args, a):
        x = args[0]
        if float_only:
            need_float(x)
        axes = a["axes"]
        for ax in axes:
            if not 0 <= ax < x.ndim:
                raise ShapeError(f"axis {ax} out of range for {x}")
        if list(axes) != sorted(set(axes)):
            raise ShapeError(f"axes must be sorted and unique, got {axes}")
        if not allow_empty and any(x.shape[ax] == 0 for ax in axes):
            raise ShapeError(f"cannot reduce over an empty axis of {x}")
        return TensorType(x.dtype, reduced_shape(x.shape, axes, a["keepdims"]))
    return infer


def _np_axes(a):
    return tuple(a["axes"])


def _lse_ref(a, x):
    ax = _np_axes(a)
    if not ax:
        return x.copy()
    m = np.max(x, axis=ax, keepdims=True)
    m = np.where(np.isfinite(m), m, np.zeros((), x.dtype))
    with np.errstate(divide="ignore"):        # an all -inf slice gives -inf, as it should
        r = np.log(np.sum(np.exp(x - m), axis=ax, keepdims=True)) + m
    return r if a["keepdims"] else np.squeeze(r, axis=ax)


_RED = dict(kind="reduction", fusion=("prologue",))   # an elementwise operand: in its loops
register("sum", arity=1, **_RED, attrs=dict(_AX), infer=_reduce_infer(False),
         ref=lambda a, x: np.sum(x, axis=_np_axes(a), keepdims=a["keepdims"], dtype=x.dtype))
register("mean", arity=1, **_RED, attrs=dict(_AX), infer=_reduce_infer(True, False),
         ref=lambda a, x: np.mean(x, axis=_np_axes(a), keepdims=a["keepdims"], dtype=x.dtype))
register("max", arity=1, **_RED, attrs=dict(_AX), infer=_reduce_infer(False, False),
         ref=lambda a, x: np.max(x, axis=_np_axes(a), keepdims=a["keepdims"]) if a["axes"] else x.copy())
register("logsumexp", arity=1, **_RED, attrs=dict(_AX), infer=_reduce_infer(True, False),
         ref=_lse_ref)


def _argmax_infer(args, a):
    x = args[0]
    ax = a["axis"]
    if not 0 <= ax < x.ndim:
        raise ShapeError(f"axis {ax} out of range for {x}")
    if x.shape[ax] == 0:
        raise ShapeError(f"cannot take argmax over an empty axis of {x}")
    return TensorType("i32", reduced_shape(x.shape, (ax,), a["keepdims"]))


register("argmax", arity=1, **_RED, attrs={"axis": ("int", -1), "keepdims": ("bool", False)},
         infer=_argmax_infer,
         ref=lambda a, x: np.argmax(x, axis=a["axis"], keepdims=a["keepdims"]).astype(np.int32),
         doc="index of the first maximum along one axis, as i32")


def _count_equal_infer(args, a):
    same_dtype(args, "count_equal")
    if args[0].shape != args[1].shape:
        raise ShapeError(f"shapes differ: {args[0]} vs {args[1]}")
    return TensorType("i32", ())


register("count_equal", arity=2, kind="reduction", infer=_count_equal_infer,
         ref=lambda a, x, y: np.asarray(np.sum(x == y), dtype=np.int32),
         doc="number of equal elements, as an i32 scalar (ggml_count_equal)")


# ---- user-facing functions ---------------------------------------------------------------
def _r(op, x, axis, keepdims):
    return apply(op, x, axes=norm_axes(axis, x.ndim, op), keepdims=bool(keepdims))


def sum(x, axis=None, keepdims=False): return _r("sum", x, axis, keepdims)
def mean(x, axis=None, keepdims=False): return _r("mean", x, axis, keepdims)
def max(x, axis=None, keepdims=False): return _r("max", x, axis, keepdims)
def logsumexp(x, axis=None, keepdims=False): return _r("logsumexp", x, axis, keepdims)
def argmax(x, axis=-1, keepdims=False):
    return apply("argmax", x, axis=norm_axis(axis, x.ndim, "argmax"), keepdims=bool(keepdims))
def count_equal(a, b): return apply("count_equal", a, b)


# ---- vjp rules ---------------------------------------------------------------------------
def _keep(t, x, a):
    """A reduced value reshaped to keepdims form, so it broadcasts against x."""
    from .shape import reshape
    kshape = reduced_shape(x.shape, a["axes"], True)
    return reshape(t, kshape) if t.shape != kshape else t


def _expand_back(g, x, a):
    """Broadcast a reduced gradient back over the reduced axes of x."""
    from .shape import broadcast_to
    g = _keep(g, x, a)
    return broadcast_to(g, x.shape) if g.shape != x.shape else g


def _sum_vjp(g, out, xs, a):
    return [_expand_back(g, xs[0], a)] if xs[0].type.is_float else [None]


def _mean_vjp(g, out, xs, a):
    n = 1
    for ax in a["axes"]:
        n *= xs[0].shape[ax]
    return [_expand_back(g, xs[0], a) * (1.0 / n)]


def _max_vjp(g, out, xs, a):
    """The gradient is split evenly among tied maxima (numpy amax / torch.amax convention), so
    it is symmetric in the tied elements and sums to g."""
    from .elementwise import step
    x = xs[0]
    if not x.type.is_float:
        return [None]
    if not a["axes"]:
        return [g]
    hit = 1.0 - step(_keep(out, x, a) - x)            # 1 where x equals its maximum
    n = apply("sum", hit, axes=a["axes"], keepdims=True)
    return [hit * (_keep(g, x, a) / n)]


def _logsumexp_vjp(g, out, xs, a):
    from .elementwise import exp
    x = xs[0]
    if not a["axes"]:
        return [g]
    return [exp(x - _keep(out, x, a)) * _keep(g, x, a)]   # softmax(x) * g


defvjp("sum")(_sum_vjp)
defvjp("mean")(_mean_vjp)
defvjp("max")(_max_vjp)
defvjp("logsumexp")(_logsumexp_vjp)
defvjp("argmax")(lambda g, out, xs, a: [None])
defvjp("count_equal")(lambda g, out, xs, a: [None, None])

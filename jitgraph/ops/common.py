"""Helpers shared by the op modules: applying an op, shape-rule building blocks, vjp helpers."""
from __future__ import annotations

import numpy as np

from ..types import ShapeError, TensorType, broadcast_shapes


def apply(op: str, *operands, **attrs):
    """Append `op(operands, attrs)` to the operands' graph. Python numbers become constants of the
    dtype of the first tensor operand."""
    from ..ir import Tensor, _graph_of
    g = _graph_of(*operands)
    like = next(x for x in operands if isinstance(x, Tensor))
    dt = "f32" if like.type.is_block else like.dtype     # the op then refuses the block type
    ts = [x if isinstance(x, Tensor) else const(g, x, dt) for x in operands]
    return g.add(op, ts, attrs)


def const(graph, value, dtype="f32", shape=()):
    """A constant filled with `value` (a `full` node)."""
    if isinstance(value, (np.ndarray, list)) and np.ndim(value) > 0:
        raise ShapeError("full: only scalar constants can be embedded in a graph; "
                         "pass arrays as inputs or params")
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
        raise ShapeError(f"expected a tensor or a number, got {value!r}")
    if dtype == "i32" and float(value) != int(value):
        raise ShapeError(f"full: constant {value!r} is not a whole number and cannot be i32; "
                         f"cast the tensor to a float dtype first")
    return graph.add("full", [], {"value": float(value), "shape": tuple(shape), "dtype": dtype})


def norm_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise ShapeError(f"{what}: axis {axis} out of range for {ndim}-D operand")
    return axis % ndim if ndim else 0


def norm_axes(axes, ndim: int, what: str) -> tuple:
    """None -> all axes; int or sequence -> sorted unique non-negative axes."""
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, (int, np.integer)):
        axes = (int(axes),)
    out = sorted({norm_axis(int(a), ndim, what) for a in axes})
    if len(out) != len(tuple(axes)):
        raise ShapeError(f"{what}: repeated axis in {tuple(axes)}")
    return tuple(out)


def same_dtype(args, what):
    dts = {a.dtype for a in args}
    if len(dts) > 1:
        raise ShapeError(f"dtypes differ: {', '.join(map(str, args))}; cast one operand "
                         f"(jg.cast) so they match")
    return args[0].dtype


def need_float(arg, what="operand"):
    if not arg.type.is_float:
        raise ShapeError(f"{what} must be a float (f32, f64, f16, bf16), got {arg}")


def broadcast(args) -> tuple:
    try:
        return broadcast_shapes(*[a.shape for a in args])
    except ValueError as e:
        raise ShapeError(f"shapes do not broadcast: {', '.join(map(str, args))} ({e})") from None


def elementwise_type(args, attrs, float_only=True) -> TensorType:
    dt = same_dtype(args, "")
    if float_only:
        for a in args:
            need_float(a)
    return TensorType(dt, broadcast(args))


def unbroadcast(g, shape):
    """Sum a gradient of a broadcast result back to an operand's shape (vjp helper)."""
    from . import reshape, sum as rsum
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape)
                                      if d == 1 and g.shape[lead + i] != 1)
    r = rsum(g, axis=axes, keepdims=False) if axes else g
    return reshape(r, tuple(shape)) if r.shape != tuple(shape) else r

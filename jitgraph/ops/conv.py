"""Convolution and pooling over NCHW images, and their backward ops.

conv2d weights are [O, C, kh, kw] (cross-correlation, zero padding). Its backward is two ops:
conv2d_back_input (a transposed convolution, col2im) and conv2d_back_weight (the im2col matrix
times the output gradient); backends lower all three to im2col + GEMM. max_pool2d pads with -inf
and routes each window's gradient to its first maximum; avg_pool2d pads with zeros that count in
the average (every window divides by kh*kw).
"""
from __future__ import annotations

import numpy as np

from ..types import ShapeError, TensorType
from .common import apply, need_float, same_dtype
from ..registry import REQUIRED, Arg, register

__all__ = ["conv2d", "max_pool2d", "avg_pool2d"]


# ---- shared window helpers -------------------------------------------------------------------
def _check_pairs(a, lows):
    for k, lo in lows.items():
        if len(a[k]) != 2 or min(a[k]) < lo:
            raise ShapeError(f"attribute {k} must be two ints >= {lo}, got {a[k]}")


def _out_hw(x, hw, kernel, a, dilation=(1, 1)):
    """Output height/width of a window op over spatial size hw; ShapeError if it is empty."""
    out = tuple((n + 2 * p - d * (k - 1) - 1) // s + 1
                for n, k, s, p, d in zip(hw, kernel, a["stride"], a["padding"], dilation))
    if min(out) < 1:
        raise ShapeError(f"window {tuple(kernel)} (dilation {tuple(dilation)}) is larger than the "
                         f"padded input {x} (padding {a['padding']})")
    return out


def _taps(kernel, stride, dilation, out_hw):
    """(i, j, index) per kernel tap: index selects, from the padded input, the input element
    that tap (i, j) reads for every output position."""
    (kh, kw), (sh, sw), (dh, dw), (oh, ow) = kernel, stride, dilation, out_hw
    for i in range(kh):
        for j in range(kw):
            yield i, j, (Ellipsis, slice(i * dh, i * dh + sh * (oh - 1) + 1, sh),
                         slice(j * dw, j * dw + sw * (ow - 1) + 1, sw))


def _pad_hw(x, padding, value=0.0):
    (ph, pw) = padding
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)),
                  constant_values=np.asarray(value, x.dtype))


def _crop_hw(xp, padding, hw):
    (ph, pw), (h, w) = padding, hw
    return np.ascontiguousarray(xp[:, :, ph:ph + h, pw:pw + w])


_CONV = {"stride": ("ints", (1, 1)), "padding": ("ints", (0, 0)), "dilation": ("ints", (1, 1))}


def _need_4d(*args):
    if any(x.ndim != 4 for x in args):
        raise ShapeError(f"expected 4-D operands (images [N,C,H,W], weights [O,C,kh,kw], "
                         f"gradients [N,O,oh,ow]): {', '.join(map(str, args))}")


def _conv_check(a, x, w):
    """Validate an image/weight pair of Args; returns the output shape [N, O, oh, ow]."""
    _check_pairs(a, {"stride": 1, "padding": 0, "dilation": 1})
    same_dtype([x, w], "")
    need_float(x)
    _need_4d(x, w)
    if x.shape[1] != w.shape[1]:
        raise ShapeError(f"channels differ: {x}, {w} (expected C == w.shape[1]: "
                         f"{x.shape[1]} != {w.shape[1]})")
    return (x.shape[0], w.shape[0]) + _out_hw(x, x.shape[2:], w.shape[2:], a, a["dilation"])


def _check_out_grad(g, want):
    if g.shape != tuple(want):
        raise ShapeError(f"gradient {g} does not match the forward output (expected "
                         f"[{','.join(map(str, want))}])")


def _conv2d_infer(args, a):
    return TensorType(args[0].dtype, _conv_check(a, *args))


def _conv2d_ref(a, x, w):
    out_hw = _out_hw(x, x.shape[2:], w.shape[2:], a, a["dilation"])
    xp = _pad_hw(x, a["padding"])
    out = np.zeros((x.shape[0], w.shape[0]) + out_hw, x.dtype)
    for i, j, win in _taps(w.shape[2:], a["stride"], a["dilation"], out_hw):
        out += np.einsum("nchw,oc->nohw", xp[win], w[:, :, i, j])
    return out


def _conv2d_back_input_infer(args, a):
    w, g = args
    _check_pairs(a, {"in_hw": 1})
    same_dtype(args, "")
    _need_4d(w, g)
    x = Arg("x", TensorType(w.dtype, (g.shape[0], w.shape[1]) + a["in_hw"]))
    _check_out_grad(g, _conv_check(a, x, w))
    return x.type


def _conv2d_back_input_ref(a, w, g):
    (ph, pw), (h, wd) = a["padding"], a["in_hw"]
    gxp = np.zeros((g.shape[0], w.shape[1], h + 2 * ph, wd + 2 * pw), g.dtype)
    for i, j, win in _taps(w.shape[2:], a["stride"], a["dilation"], g.shape[2:]):
        gxp[win] += np.einsum("nohw,oc->nchw", g, w[:, :, i, j])
    return _crop_hw(gxp, a["padding"], a["in_hw"])


def _conv2d_back_weight_infer(args, a):
    x, g = args
    _check_pairs(a, {"kernel": 1})
    same_dtype(args, "")
    _need_4d(x, g)
    w = Arg("w", TensorType(x.dtype, (g.shape[1], x.shape[1]) + a["kernel"]))
    _check_out_grad(g, _conv_check(a, x, w))
    return w.type


def _conv2d_back_weight_ref(a, x, g):
    xp = _pad_hw(x, a["padding"])
    gw = np.empty((g.shape[1], x.shape[1]) + tuple(a["kernel"]), x.dtype)
    for i, j, win in _taps(a["kernel"], a["stride"], a["dilation"], g.shape[2:]):
        gw[:, :, i, j] = np.einsum("nohw,nchw->oc", g, xp[win])
    return gw


def _conv_attrs(a):
    return {k: a[k] for k in _CONV}


def _conv2d_vjp(g, out, xs, a):
    x, w = xs
    return [apply("conv2d_back_input", w, g, in_hw=x.shape[2:], **_conv_attrs(a)),
            apply("conv2d_back_weight", x, g, kernel=w.shape[2:], **_conv_attrs(a))]


def _conv2d_back_input_vjp(gz, out, xs, a):
    w, g = xs      # out = A_w^T g, linear in w and in g
    return [apply("conv2d_back_weight", gz, g, kernel=w.shape[2:], **_conv_attrs(a)),
            apply("conv2d", gz, w, **_conv_attrs(a))]


def _conv2d_back_weight_vjp(gz, out, xs, a):
    x, g = xs      # out[o, c, i, j] = sum g[n, o, p] * x[n, c, p + tap(i, j)], bilinear
    return [apply("conv2d_back_input", gz, g, in_hw=x.shape[2:], **_conv_attrs(a)),
            apply("conv2d", x, gz, **_conv_attrs(a))]


def _conv_flops(y_at, w_at):
    """2 * (output elements of the forward conv) * (taps per output: C * kh * kw); y_at / w_at:
    where the forward's output and kernel are among (operands..., result)."""
    def rule(ins, out, a):
        y, w = (ins + [out])[y_at], (ins + [out])[w_at]
        return 2 * y.size * (w.size // w.shape[0])
    return rule


_CONTRACTION = dict(kind="contraction", cheap=False)
register("conv2d", **_CONTRACTION, flops=_conv_flops(2, 1), arity=2, attrs=_CONV,
         infer=_conv2d_infer, ref=_conv2d_ref, vjp=_conv2d_vjp,
         doc="conv2d(x [N,C,H,W], w [O,C,kh,kw]) -> [N,O,oh,ow]; cross-correlation, zero padding")
register("conv2d_back_input", **_CONTRACTION, flops=_conv_flops(1, 0), arity=2,
         attrs={**_CONV, "in_hw": ("ints", REQUIRED)},
         infer=_conv2d_back_input_infer, ref=_conv2d_back_input_ref, vjp=_conv2d_back_input_vjp,
         doc="conv2d_back_input(w, grad_out) -> grad of x [N,C,*in_hw] (col2im)")
register("conv2d_back_weight", **_CONTRACTION, flops=_conv_flops(1, 2), arity=2,
         attrs={**_CONV, "kernel": ("ints", REQUIRED)},
         infer=_conv2d_back_weight_infer, ref=_conv2d_back_weight_ref, vjp=_conv2d_back_weight_vjp,
         doc="conv2d_back_weight(x, grad_out) -> grad of w [O,C,*kernel]")


# ---- max_pool2d / avg_pool2d ---------------------------------------------------------------------
def _pool_check(a, x):
    """Validate a pooled image (an Arg); returns the output shape [N, C, oh, ow]."""
    _check_pairs(a, {"kernel": 1, "stride": 1, "padding": 0})
    need_float(x)
    _need_4d(x)
    if any(p > k // 2 for p, k in zip(a["padding"], a["kernel"])):
        raise ShapeError(f"padding {a['padding']} must be at most half the kernel {a['kernel']}")
    return x.shape[:2] + _out_hw(x, x.shape[2:], a["kernel"], a)


def _pool_infer(args, a):
    return TensorType(args[0].dtype, _pool_check(a, args[0]))


def _max_pool2d_back_infer(args, a):
    x, g = args
    same_dtype(args, "")
    _check_out_grad(g, _pool_check(a, x))
    return x.type


def _avg_pool2d_back_infer(args, a):
    g = args[0]
    _check_pairs(a, {"in_hw": 1})
    _need_4d(g)
    x = Arg("x", TensorType(g.dtype, g.shape[:2] + a["in_hw"]))
    _check_out_grad(g, _pool_check(a, x))
    return x.type


def _pool_windows(a, x, fill):
    """The input padded with `fill`, and one index per kernel tap (row-major window order)."""
    out_hw = _out_hw(x, x.shape[2:], a["kernel"], a)
    taps = _taps(a["kernel"], a["stride"], (1, 1), out_hw)
    return _pad_hw(x, a["padding"], fill), [win for _, _, win in taps]


def _max_pool2d_ref(a, x):
    xp, wins = _pool_windows(a, x, -np.inf)
    return np.max([xp[w] for w in wins], axis=0)


def _max_pool2d_back_ref(a, x, g):
    xp, wins = _pool_windows(a, x, -np.inf)
    first = np.argmax([xp[w] for w in wins], axis=0)
    gxp = np.zeros_like(xp)
    for k, w in enumerate(wins):
        gxp[w] += np.where(first == k, g, np.zeros((), g.dtype))
    return _crop_hw(gxp, a["padding"], x.shape[2:])


def _avg_pool2d_ref(a, x):
    xp, wins = _pool_windows(a, x, 0.0)
    return np.sum([xp[w] for w in wins], axis=0, dtype=x.dtype) / len(wins)


def _avg_pool2d_back_ref(a, g):
    (ph, pw), (h, w) = a["padding"], a["in_hw"]
    gxp = np.zeros(g.shape[:2] + (h + 2 * ph, w + 2 * pw), g.dtype)
    for _, _, win in _taps(a["kernel"], a["stride"], (1, 1), g.shape[2:]):
        gxp[win] += g
    return _crop_hw(gxp, a["padding"], a["in_hw"]) / (a["kernel"][0] * a["kernel"][1])


_POOL = {"kernel": ("ints", REQUIRED), "stride": ("ints", REQUIRED), "padding": ("ints", (0, 0))}
register("max_pool2d", kind="opaque", arity=1, attrs=_POOL, infer=_pool_infer, ref=_max_pool2d_ref,
         vjp=lambda g, out, xs, a: [apply("max_pool2d_back", xs[0], g, **a)],
         doc="max over [N,C,H,W] windows; padding counts as -inf")
register("max_pool2d_back", kind="opaque", arity=2, attrs=_POOL, infer=_max_pool2d_back_infer,
         ref=_max_pool2d_back_ref,
         doc="max_pool2d_back(x, grad_out): each window's gradient goes to its first maximum "
             "(row-major within the window); overlapping windows accumulate")
register("avg_pool2d", kind="opaque", arity=1, attrs=_POOL, infer=_pool_infer, ref=_avg_pool2d_ref,
         vjp=lambda g, out, xs, a: [apply("avg_pool2d_back", g, in_hw=xs[0].shape[2:], **a)],
         doc="mean over [N,C,H,W] windows; padding counts as zeros and is included in the divisor "
             "(kh*kw for every window)")
register("avg_pool2d_back", kind="opaque", arity=1, attrs={**_POOL, "in_hw": ("ints", REQUIRED)},
         infer=_avg_pool2d_back_infer, ref=_avg_pool2d_back_ref,
         vjp=lambda g, out, xs, a: [apply("avg_pool2d", g, **{k: a[k] for k in _POOL})],
         doc="avg_pool2d_back(grad_out) -> grad of x [N,C,*in_hw]")


# ---- user-facing functions ---------------------------------------------------------------------
def _pair(v, what):
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return (int(v), int(v))
    if isinstance(v, (tuple, list)) and len(v) == 2:
        return tuple(v)
    raise ShapeError(f"{what}: expected an int or a pair of ints, got {v!r}")


def conv2d(x, w, bias=None, stride=1, padding=0, dilation=1):
    """NCHW convolution with weights [O, C, kh, kw] and an optional bias [O]."""
    y = apply("conv2d", x, w, stride=_pair(stride, "conv2d: stride"),
              padding=_pair(padding, "conv2d: padding"),
              dilation=_pair(dilation, "conv2d: dilation"))
    return y if bias is None else y + bias.reshape(-1, 1, 1)


def _pool(op, x, kernel, stride, padding):
    kernel = _pair(kernel, f"{op}: kernel")
    stride = kernel if stride is None else _pair(stride, f"{op}: stride")
    return apply(op, x, kernel=kernel, stride=stride, padding=_pair(padding, f"{op}: padding"))


def max_pool2d(x, kernel, stride=None, padding=0):
    """Max over kernel windows (stride defaults to the kernel); padding counts as -inf."""
    return _pool("max_pool2d", x, kernel, stride, padding)


def avg_pool2d(x, kernel, stride=None, padding=0):
    """Mean over kernel windows (stride defaults to the kernel); zero padding is included in the
    average (every window divides by kh*kw, PyTorch's count_include_pad=True)."""
    return _pool("avg_pool2d", x, kernel, stride, padding)

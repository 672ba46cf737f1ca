"""Neural-network ops: softmax, log_softmax, rms_norm, layer_norm, rope, causal_mask, and their
dedicated backward ops (ggml's *_back ops); conv2d and pooling live in conv.py.

Norms, softmax and rope work along the last axis (rope: x is [..., seq, heads, head_dim]).
"""
from __future__ import annotations

import numpy as np

from ..types import ShapeError, TensorType
from .common import apply, need_float, norm_axis, same_dtype
from .conv import avg_pool2d, conv2d, max_pool2d  # noqa: F401  (re-exported)
from ..registry import RowFormula, RowPass, register

__all__ = ["softmax", "log_softmax", "rms_norm", "layer_norm", "rope", "causal_mask", "conv2d",
           "max_pool2d", "avg_pool2d", "linear"]


# ---- shape-rule helpers ------------------------------------------------------------------------
def _float_like(args):
    """All operands float, same dtype and shape (backward ops: (value, grad) pairs)."""
    for x in args:
        need_float(x)
    dt = same_dtype(args, "")
    if len({x.shape for x in args}) > 1:
        raise ShapeError(f"shapes differ: {', '.join(map(str, args))} (expected equal shapes)")
    return TensorType(dt, args[0].shape)


def _need_ndim(x, n, what):
    if x.ndim < n:
        raise ShapeError(f"{what} must be at least {n}-D, got {x}")


def _check_axis(x, axis):
    if not 0 <= axis < x.ndim:
        raise ShapeError(f"axis {axis} out of range for {x}")


def _check_eps(a):
    if not a["eps"] >= 0:
        raise ShapeError(f"eps must be >= 0, got {a['eps']}")


# ---- softmax / log_softmax ---------------------------------------------------------------------
def log_softmax_ref(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    s = x - np.where(np.isfinite(m), m, np.zeros((), x.dtype))
    return s - np.log(np.sum(np.exp(s), axis=axis, keepdims=True))


def _softmax_ref(a, x):
    return np.exp(log_softmax_ref(x, a["axis"]))


def _softmax_infer(args, a):
    x = args[0]
    need_float(x)
    _check_axis(x, a["axis"])
    return x.type


def _softmax_back_infer(args, a):
    _check_axis(args[0], a["axis"])
    return _float_like(args)


_AXIS = {"axis": ("int", -1)}
_ROWS = dict(kind="rows", fusion=("prologue", "epilogue"))

# Row formulas (jitgraph/registry.py RowFormula): each backend renders these.
# the row's maximum, 0 when it is not finite (a row of -inf, or holding inf or nan)
_MAX = RowPass(accs=(("m", "max", "{0}"),),
               after=("if not math.isfinite(m):", "    m = {T}(0.0)", "mt = m"))
_EXPSUM = RowPass(accs=(("s", "sum", "math.exp({0} - mt)"),),
                  after=("inv = {T}(1.0 / s)", "lg = {T}(math.log(s))"))
# softmax keeping exp(x - m) in its output row: one exp per element
_SOFTMAX_STORED = RowFormula((_MAX, RowPass(lets=(("e", "math.exp({0} - mt)"),),
                                            accs=(("s", "sum", "e"),), store="e",
                                            after=("inv = {T}(1.0 / s)",))), "{out} * inv")
_MEAN = RowPass(accs=(("mu", "sum", "{0}"),), after=("mu = mu / {D}", "mut = {T}(mu)"))

register("softmax", **_ROWS, arity=1, attrs=_AXIS, infer=_softmax_infer, ref=_softmax_ref,
         rows=RowFormula((_MAX, _EXPSUM), "math.exp({0} - mt) * inv", stored=_SOFTMAX_STORED),
         vjp=lambda g, out, xs, a: [apply("softmax_back", out, g, axis=a["axis"])])
register("softmax_back", **_ROWS, arity=2, attrs=_AXIS, infer=_softmax_back_infer,
         rows=RowFormula((RowPass(accs=(("dot", "sum", "{1} * {0}"),),
                                  after=("dt = {T}(dot)",)),), "{0} * ({1} - dt)"),
         ref=lambda a, y, g: y * (g - np.sum(g * y, axis=a["axis"], keepdims=True)),
         doc="softmax_back(y = softmax(x), grad_out) = y * (g - sum(g * y))  (ggml soft_max_back)")


def _log_softmax_vjp(g, out, xs, a):
    from . import exp, sum as rsum
    return [g - exp(out) * rsum(g, axis=a["axis"], keepdims=True)]


register("log_softmax", **_ROWS, arity=1, attrs=_AXIS, infer=_softmax_infer,
         rows=RowFormula((_MAX, _EXPSUM), "({0} - mt) - lg"),
         ref=lambda a, x: log_softmax_ref(x, a["axis"]), vjp=_log_softmax_vjp)


# ---- rms_norm / layer_norm (last axis, no affine part) -----------------------------------------
def _rms(x, eps):
    """1 / sqrt(mean(x^2) + eps) over the last axis, keepdims."""
    return 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.asarray(eps, x.dtype))


def _rms_norm_back_ref(a, x, g):
    r = _rms(x, a["eps"])
    return r * (g - x * (r * r) * np.mean(g * x, axis=-1, keepdims=True))


def _layer_norm_parts(x, eps):
    xc = x - np.mean(x, axis=-1, keepdims=True)
    return xc, _rms(xc, eps)


def _layer_norm_ref(a, x):
    xc, r = _layer_norm_parts(x, a["eps"])
    return xc * r


def _layer_norm_back_ref(a, x, g):
    xc, r = _layer_norm_parts(x, a["eps"])
    y = xc * r
    return r * (g - np.mean(g, axis=-1, keepdims=True) - y * np.mean(g * y, axis=-1, keepdims=True))


def _norm_infer(args, a):
    _check_eps(a)
    _need_ndim(args[0], 1, "operand")
    return _float_like(args)


def _norm(name, eps, ref, back_ref, rows, back_rows):
    attrs = {"eps": ("float", eps)}
    register(name, **_ROWS, arity=1, attrs=attrs, infer=_norm_infer, ref=ref, rows=rows,
             vjp=lambda g, out, xs, a: [apply(f"{name}_back", xs[0], g, eps=a["eps"])])
    register(f"{name}_back", **_ROWS, arity=2, attrs=attrs, infer=_norm_infer, ref=back_ref,
             rows=back_rows, doc=f"{name}_back(x, grad_out)")


# rs: 1 / sqrt(mean(x^2) + eps); the backs: rs * (g - x * rs^2 * mean(g x)) and, centred,
# rs * (g - mean(g) - xc * rs^2 * mean(g xc))
_RSQRT = "q = 1.0 / math.sqrt({} / {{D}} + {{eps}})"
_norm("rms_norm", 1e-6, lambda a, x: x * _rms(x, a["eps"]), _rms_norm_back_ref,
      RowFormula((RowPass(accs=(("ss", "sum", "{0} * {0}"),),
                          after=("rs = {T}(1.0 / math.sqrt(ss / {D} + {eps}))",)),), "{0} * rs"),
      RowFormula((RowPass(accs=(("ss", "sum", "{0} * {0}"), ("gx", "sum", "{1} * {0}")),
                          after=(_RSQRT.format("ss"), "rs = {T}(q)",
                                 "k = {T}(q * q * gx / {D})")),),
                 "rs * ({1} - {0} * k)"))
_norm("layer_norm", 1e-5, _layer_norm_ref, _layer_norm_back_ref,
      RowFormula((_MEAN, RowPass(lets=(("xc", "{0} - mut"),), accs=(("var", "sum", "xc * xc"),),
                                 after=("rs = {T}(1.0 / math.sqrt(var / {D} + {eps}))",))),
                 "({0} - mut) * rs"),
      RowFormula((_MEAN, RowPass(lets=(("xc", "{0} - mut"),),
                                 accs=(("var", "sum", "xc * xc"), ("sg", "sum", "{1}"),
                                       ("sgx", "sum", "{1} * xc")),
                                 after=(_RSQRT.format("var"), "rs = {T}(q)",
                                        "mg = {T}(sg / {D})", "k = {T}(sgx * q * q / {D})"))),
                 "rs * ({1} - mg - ({0} - mut) * k)"))


# ---- rope --------------------------------------------------------------------------------------
ROPE_MODES = ("normal", "neox")


def _rope_infer(args, a):
    x, pos = args[:2]
    need_float(x)
    _need_ndim(x, 3, "x ([..., seq, heads, head_dim])")
    if x.shape[-1] % 2:
        raise ShapeError(f"head_dim must be even: {x}")
    if pos.dtype != "i32" or pos.shape != (x.shape[-3],):
        raise ShapeError(f"positions {pos} do not fit {x} (expected i32[{x.shape[-3]}], one per "
                         f"sequence position)")
    if a["mode"] not in ROPE_MODES:
        raise ShapeError(f"mode must be one of {ROPE_MODES}, got {a['mode']!r}")
    if not a["theta"] > 0:
        raise ShapeError(f"theta must be > 0, got {a['theta']}")
    if len(args) == 3 and (args[2].shape != (x.shape[-1] // 2,) or args[2].dtype != x.dtype):
        raise ShapeError(f"frequency factors {args[2]} do not fit {x} (expected "
                         f"{x.dtype}[{x.shape[-1] // 2}], one per rotated pair)")
    return x.type


def _rope_ref(a, x, pos, factors=None, sign=1.0):
    """Rotate pairs by angle pos * theta^(-2i/head_dim) / factors[i] (sign=-1: the inverse
    rotation). Angles are computed in float64, then cos/sin are rounded to x's dtype."""
    d = x.shape[-1]
    half = d // 2
    freq = a["theta"] ** (-2.0 * np.arange(half) / d)
    if factors is not None:
        freq = freq / factors.astype(np.float64)
    ang = pos.astype(np.float64)[:, None] * freq
    cos = np.cos(ang).astype(x.dtype)[:, None, :]            # [seq, 1, half]
    sin = (sign * np.sin(ang)).astype(x.dtype)[:, None, :]
    lo, hi = (np.s_[..., 0::2], np.s_[..., 1::2]) if a["mode"] == "normal" else \
        (np.s_[..., :half], np.s_[..., half:])
    out = np.empty_like(x)
    out[lo] = x[lo] * cos - x[hi] * sin
    out[hi] = x[lo] * sin + x[hi] * cos
    return out


_ROPE = {"theta": ("float", 10000.0), "mode": ("str", "normal")}
register("rope", kind="opaque", half="compute", arity=(2, 3), attrs=_ROPE, infer=_rope_infer,
         ref=lambda a, x, pos, f=None: _rope_ref(a, x, pos, f),
         vjp=lambda g, out, xs, a: [apply("rope_back", g, *xs[1:], **a)] + [None] * (len(xs) - 1),
         doc='rope(x[..., seq, heads, head_dim], pos i32[seq][, factors[head_dim/2]]); mode '
             '"normal" rotates (x[2i], x[2i+1]) (ggml mode 0), "neox" rotates (x[i], '
             'x[i + head_dim/2]); factors divide the frequencies (ggml_rope_ext freq_factors)')
register("rope_back", kind="opaque", half="compute", arity=(2, 3), attrs=_ROPE, infer=_rope_infer,
         ref=lambda a, g, pos, f=None: _rope_ref(a, g, pos, f, -1.0),
         vjp=lambda g, out, xs, a: [apply("rope", g, *xs[1:], **a)] + [None] * (len(xs) - 1),
         doc="rope_back(grad_out, pos[, factors]): the inverse rotation")


# ---- causal_mask -------------------------------------------------------------------------------
def _causal_mask_infer(args, a):
    x = args[0]
    need_float(x)
    _need_ndim(x, 2, "operand ([..., rows, cols])")
    if a["n_past"] < 0:
        raise ShapeError(f"n_past must be >= 0, got {a['n_past']}")
    return x.type


def _causal_mask_ref(a, x):
    rows, cols = x.shape[-2:]
    keep = np.arange(cols)[None, :] <= np.arange(rows)[:, None] + a["n_past"]
    return np.where(keep, x, np.asarray(a["value"], x.dtype))


register("causal_mask", kind="opaque", half="compute", arity=1,
         attrs={"n_past": ("int", 0), "value": ("float", -np.inf)},
         infer=_causal_mask_infer, ref=_causal_mask_ref,
         vjp=lambda g, out, xs, a: [apply("causal_mask", g, n_past=a["n_past"], value=0.0)],
         doc="entries [.., i, j] with j > i + n_past become `value` (ggml diag_mask_inf)")


# ---- user-facing functions ---------------------------------------------------------------------
def softmax(x, axis=-1):
    return apply("softmax", x, axis=norm_axis(axis, x.ndim, "softmax"))


def log_softmax(x, axis=-1):
    return apply("log_softmax", x, axis=norm_axis(axis, x.ndim, "log_softmax"))


def rms_norm(x, weight=None, eps=1e-6):
    """x / sqrt(mean(x^2) + eps) over the last axis, times `weight` if given (ggml_rms_norm)."""
    y = apply("rms_norm", x, eps=eps)
    return y if weight is None else y * weight


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """(x - mean) / sqrt(var + eps) over the last axis, then * weight + bias if given."""
    y = apply("layer_norm", x, eps=eps)
    y = y if weight is None else y * weight
    return y if bias is None else y + bias


def rope(x, pos, theta=10000.0, mode="normal", factors=None):
    """Rotary embedding of x [..., seq, heads, head_dim] at positions pos; `factors`
    [head_dim/2] divides each pair's frequency (LLaMA 3.x rope_freqs)."""
    if factors is None:
        return apply("rope", x, pos, theta=theta, mode=mode)
    return apply("rope", x, pos, factors, theta=theta, mode=mode)


def causal_mask(x, n_past=0):
    return apply("causal_mask", x, n_past=n_past)


def linear(x, w, b=None):
    """x @ w (+ b): w is [in, out]."""
    y = x @ w
    return y if b is None else y + b

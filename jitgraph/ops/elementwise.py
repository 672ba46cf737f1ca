"""Elementwise ops: numpy broadcasting, one scalar expression each for the code generators.

`expr` is a numba-Python expression over operands {0}, {1}, ... and attributes {name}; the
backends format attribute values as literals and cast the result to the node's dtype. It is the
portable spelling (math and numpy only, checked against `ref` by tests/test_ops_elementwise.py);
a backend may spell an op its own way (the CPU backend: runtime/cpu/rules.py EXPR).
"""
from __future__ import annotations

import numpy as np

from ..types import ShapeError, TensorType
from .common import apply, broadcast, elementwise_type, same_dtype, unbroadcast
from ..registry import register

SQRT_2_OVER_PI = 0.7978845608028654
GELU_COEF_A = 0.044715


def _unary(name, ref, expr, vjp=None, float_only=True, attrs=None, doc=""):
    register(name, arity=1, kind="elementwise", expr=expr, ref=ref, vjp=vjp, attrs=attrs,
             infer=lambda args, a: elementwise_type(args, a, float_only), doc=doc)


def _binary(name, ref, expr, vjp=None, float_only=True, doc="", fusion=()):
    register(name, arity=2, kind="elementwise", expr=expr, ref=ref, vjp=vjp, fusion=fusion,
             infer=lambda args, a: elementwise_type(args, a, float_only), doc=doc)


# ---- constants ---------------------------------------------------------------------------
def _full_infer(args, a):
    return TensorType(a["dtype"], a["shape"])


register("full", arity=0, kind="elementwise", expr="{value}", fusion=("constant",),
         attrs={"value": ("float", 0.0), "shape": ("ints", ()), "dtype": ("dtype", "f32")},
         infer=_full_infer,
         ref=lambda a: np.full(a["shape"], a["value"], dtype=_computed(a["dtype"])))


def _computed(dtype):
    """The numpy dtype a reference computes a `dtype` result in: f32 for the half types (the
    interpreter rounds it to the type, jitgraph/half.py)."""
    t = TensorType(dtype, ())
    return np.float32 if t.is_half else t.np_dtype

# ---- arithmetic --------------------------------------------------------------------------
_binary("add", lambda a, x, y: x + y, "{0} + {1}", float_only=False, fusion=("accumulate",),
        vjp=lambda g, out, xs, a: [unbroadcast(g, xs[0].shape), unbroadcast(g, xs[1].shape)])
_binary("sub", lambda a, x, y: x - y, "{0} - {1}", float_only=False,
        vjp=lambda g, out, xs, a: [unbroadcast(g, xs[0].shape), unbroadcast(-g, xs[1].shape)])
_binary("mul", lambda a, x, y: x * y, "{0} * {1}", float_only=False,
        vjp=lambda g, out, xs, a: [unbroadcast(g * xs[1], xs[0].shape),
                                   unbroadcast(g * xs[0], xs[1].shape)])
_binary("div", lambda a, x, y: x / y, "{0} / {1}",
        vjp=lambda g, out, xs, a: [unbroadcast(g / xs[1], xs[0].shape),
                                   unbroadcast(-(g * out) / xs[1], xs[1].shape)])
_binary("maximum", lambda a, x, y: np.maximum(x, y), "max({0}, {1})", float_only=False,
        vjp=lambda g, out, xs, a: _minmax_vjp(g, xs, 1.0))
_binary("minimum", lambda a, x, y: np.minimum(x, y), "min({0}, {1})", float_only=False,
        vjp=lambda g, out, xs, a: _minmax_vjp(g, xs, -1.0))


def _minmax_vjp(g, xs, sign):
    if not xs[0].type.is_float:
        return [None, None]
    m = step((xs[0] - xs[1]) * sign)          # 1 where x wins strictly; ties go to y
    return [unbroadcast(g * m, xs[0].shape), unbroadcast(g * (1.0 - m), xs[1].shape)]


_unary("neg", lambda a, x: -x, "-{0}", float_only=False,
       vjp=lambda g, out, xs, a: [-g])
_unary("scale", lambda a, x: x * np.asarray(a["s"], x.dtype), "{0} * {s}",
       attrs={"s": ("float", 1.0)},
       vjp=lambda g, out, xs, a: [scale(g, a["s"])])
_unary("pow", lambda a, x: np.power(x, np.asarray(a["p"], x.dtype)), "{0} ** {p}",
       attrs={"p": ("float", 1.0)},
       vjp=lambda g, out, xs, a: [g * scale(pow(xs[0], a["p"] - 1.0), a["p"])])
_unary("sqr", lambda a, x: x * x, "{0} * {0}",
       vjp=lambda g, out, xs, a: [scale(g * xs[0], 2.0)])
_unary("sqrt", lambda a, x: np.sqrt(x), "math.sqrt({0})",
       vjp=lambda g, out, xs, a: [scale(g / out, 0.5)])
_unary("exp", lambda a, x: np.exp(x), "math.exp({0})",
       vjp=lambda g, out, xs, a: [g * out])
_unary("log", lambda a, x: np.log(x), "math.log({0})",
       vjp=lambda g, out, xs, a: [g / xs[0]])
_unary("abs", lambda a, x: np.abs(x), "abs({0})", float_only=False,
       vjp=lambda g, out, xs, a: [g * sgn(xs[0])] if xs[0].type.is_float else [None])
_unary("sgn", lambda a, x: np.sign(x), "(1.0 if {0} > 0 else (-1.0 if {0} < 0 else 0.0))",
       float_only=False, vjp=lambda g, out, xs, a: [None])
_unary("step", lambda a, x: (x > 0).astype(x.dtype), "(1.0 if {0} > 0 else 0.0)",
       float_only=False, vjp=lambda g, out, xs, a: [None])

# ---- activations -------------------------------------------------------------------------
# relu's mask from its output (relu(x) > 0 exactly where x > 0, NaN and -0 included): the
# backward then needs no pre-activation, so a fused bias + relu kernel does not write it and
# the plan does not keep it for the backward
_unary("relu", lambda a, x: np.maximum(x, np.zeros((), x.dtype)), "max({0}, 0.0)",
       vjp=lambda g, out, xs, a: [g * step(out)])
_unary("leaky_relu",
       lambda a, x: np.where(x > 0, x, x * np.asarray(a["slope"], x.dtype)),
       "({0} if {0} > 0 else {0} * {slope})", attrs={"slope": ("float", 0.01)},
       vjp=lambda g, out, xs, a: [g * (scale(step(xs[0]), 1.0 - a["slope"]) + a["slope"])])


def _sigmoid_ref(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


def _gelu_sig(x):
    """sigmoid(2u) for gelu's tanh argument u; 0.5 * (1 + tanh(u)) without its f32 cancellation."""
    c, k = np.asarray(2 * SQRT_2_OVER_PI, x.dtype), np.asarray(GELU_COEF_A, x.dtype)
    return _sigmoid_ref(c * (x + k * x * x * x))


def _gelu_back_ref(x, g):
    s = _gelu_sig(x)
    c, k = np.asarray(SQRT_2_OVER_PI, x.dtype), np.asarray(GELU_COEF_A, x.dtype)
    return g * s * (1 + 2 * x * (1 - s) * c * (1 + 3 * k * x * x))


# gelu(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
_GELU_SIG = (f"(1.0 / (1.0 + math.exp(-{2 * SQRT_2_OVER_PI!r} * "
             f"({{0}} + {GELU_COEF_A} * {{0}} * {{0}} * {{0}}))))")


_unary("sigmoid", lambda a, x: _sigmoid_ref(x), "1.0 / (1.0 + math.exp(-{0}))",
       vjp=lambda g, out, xs, a: [g * (out * (1.0 - out))])
_unary("tanh", lambda a, x: np.tanh(x), "math.tanh({0})",
       vjp=lambda g, out, xs, a: [g * (1.0 - sqr(out))])
_unary("softplus", lambda a, x: np.logaddexp(np.zeros((), x.dtype), x),
       "(max({0}, 0.0) + math.log1p(math.exp(-abs({0}))))",
       vjp=lambda g, out, xs, a: [g * sigmoid(xs[0])])
_unary("gelu", lambda a, x: x * _gelu_sig(x), f"{{0}} * {_GELU_SIG}",
       vjp=lambda g, out, xs, a: [apply("gelu_back", xs[0], g)], doc="tanh approximation")
_unary("silu", lambda a, x: x * _sigmoid_ref(x), "{0} / (1.0 + math.exp(-{0}))",
       vjp=lambda g, out, xs, a: [apply("silu_back", xs[0], g)])
_unary("clamp", lambda a, x: np.clip(x, np.asarray(a["lo"], x.dtype), np.asarray(a["hi"], x.dtype)),
       "min(max({0}, {lo}), {hi})", attrs={"lo": ("float", -np.inf), "hi": ("float", np.inf)},
       vjp=lambda g, out, xs, a: [apply("clamp_back", xs[0], g, lo=a["lo"], hi=a["hi"])])


def _cast_infer(args, a):
    return TensorType(a["dtype"], args[0].shape)


register("cast", arity=1, kind="elementwise", expr="{0}", half="convert", attrs={"dtype": ("dtype", "f32")},
         infer=_cast_infer, ref=lambda a, x: x.astype(_computed(a["dtype"])),
         vjp=lambda g, out, xs, a: [cast(g, xs[0].dtype) if xs[0].type.is_float else None])


def _where_infer(args, a):
    c, x, y = args
    dt = same_dtype([x, y], "where")
    return TensorType(dt, broadcast(args))


def _where_vjp(g, out, xs, a):
    c, x, y = xs
    gx = where(c, g, 0.0) if x.type.is_float else None
    gy = where(c, 0.0, g) if y.type.is_float else None
    return [None, None if gx is None else unbroadcast(gx, x.shape),
            None if gy is None else unbroadcast(gy, y.shape)]


register("where", arity=3, kind="elementwise", expr="({1} if {0} != 0 else {2})",
         infer=_where_infer, ref=lambda a, c, x, y: np.where(c != 0, x, y), vjp=_where_vjp,
         doc="where(cond, a, b): a where cond != 0, else b")

# ---- backward helpers (ggml's *_back ops) ------------------------------------------------
def _back_infer(args, a):
    x, g = args
    t = elementwise_type(args, a)
    if t.shape != x.shape:
        raise ShapeError(f"gradient {g} does not match input {x}")
    return t


def _back(name, ref, expr, attrs=None, vjp=None):
    register(name, arity=2, kind="elementwise", expr=expr, ref=ref, attrs=attrs, infer=_back_infer,
             vjp=vjp, doc=f"{name}(x, grad_out)")


_back("silu_back", lambda a, x, g: g * (_sigmoid_ref(x) * (1 + x * (1 - _sigmoid_ref(x)))),
      "{1} * (1.0 / (1.0 + math.exp(-{0}))) * (1.0 + {0} * (1.0 - 1.0 / (1.0 + math.exp(-{0}))))")
_back("gelu_back", lambda a, x, g: _gelu_back_ref(x, g),
      f"{{1}} * {_GELU_SIG} * (1.0 + 2.0 * {{0}} * (1.0 - {_GELU_SIG}) * {SQRT_2_OVER_PI}"
      f" * (1.0 + 3.0 * {GELU_COEF_A} * {{0}} * {{0}}))")
_back("clamp_back", lambda a, x, g: np.where((x >= a["lo"]) & (x <= a["hi"]), g, np.zeros((), g.dtype)),
      "({1} if ({0} >= {lo} and {0} <= {hi}) else 0.0)",
      attrs={"lo": ("float", -np.inf), "hi": ("float", np.inf)},
      vjp=lambda g, out, xs, a: [None, apply("clamp_back", xs[0], g, lo=a["lo"], hi=a["hi"])])


# ---- user-facing functions ---------------------------------------------------------------
def add(a, b): return apply("add", a, b)
def sub(a, b): return apply("sub", a, b)
def mul(a, b):
    from ..ir import Tensor
    if isinstance(b, (int, float)) and isinstance(a, Tensor) and a.type.is_float:
        return scale(a, b)
    if isinstance(a, (int, float)) and isinstance(b, Tensor) and b.type.is_float:
        return scale(b, a)
    return apply("mul", a, b)
def div(a, b):
    from ..ir import Tensor
    if isinstance(b, (int, float)) and isinstance(a, Tensor) and a.type.is_float and b != 0:
        return scale(a, 1.0 / b)
    return apply("div", a, b)
def maximum(a, b): return apply("maximum", a, b)
def minimum(a, b): return apply("minimum", a, b)
def neg(x): return apply("neg", x)
def scale(x, s): return apply("scale", x, s=s)
def pow(x, p):
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        raise ShapeError(f"pow: exponent must be a Python number, got {p!r}")
    return apply("pow", x, p=p)
def sqr(x): return apply("sqr", x)
def sqrt(x): return apply("sqrt", x)
def exp(x): return apply("exp", x)
def log(x): return apply("log", x)
def abs(x): return apply("abs", x)
def sgn(x): return apply("sgn", x)
def step(x): return apply("step", x)
def relu(x): return apply("relu", x)
def leaky_relu(x, slope=0.01): return apply("leaky_relu", x, slope=slope)
def gelu(x): return apply("gelu", x)
def silu(x): return apply("silu", x)
def sigmoid(x): return apply("sigmoid", x)
def tanh(x): return apply("tanh", x)
def softplus(x): return apply("softplus", x)
def clamp(x, lo=-np.inf, hi=np.inf): return apply("clamp", x, lo=lo, hi=hi)
def where(cond, a, b):
    from ..ir import Tensor
    like = a if isinstance(a, Tensor) else b
    from .common import const
    if not isinstance(a, Tensor):
        a = const(like.graph, a, like.dtype)
    if not isinstance(b, Tensor):
        b = const(like.graph, b, like.dtype)
    return apply("where", cond, a, b)
def cast(x, dtype):
    from ..types import dtype_name
    return apply("cast", x, dtype=dtype_name(dtype))
def full_like(x, value): 
    from .common import const
    return const(x.graph, value, x.dtype, x.shape)

"""Half-precision rounding, which llama.cpp compatibility needs.

round_f16(x): x rounded to the nearest IEEE half (ties to even, half's subnormals, overflow to
+-inf, NaN kept), in x's own dtype: x.astype(float16).astype(x.dtype). llama.cpp keeps its KV
cache in F16 by default and ggml converts the other operand of a matmul with an F16 tensor to F16
too (the queries for K^T q, the softmax probabilities for V p), so emulating those roundings is
what makes jitgraph's logits agree with llama.cpp's to ~1e-6 instead of ~2e-3. jitgraph has no
f16 dtype, hence an f32 -> f32 op. The kernel expression uses frexp / ldexp / rint (numba has no
scalar float16), which no fastmath reassociation can fold away. The vjp is the straight-through
estimator (the gradient passes unchanged), as usual for quantisation in training.
"""
from __future__ import annotations

import numpy as np

from .common import apply, elementwise_type
from ..registry import register

# quantum exponent: 2^(e - 11) for |x| in [2^(e-1), 2^e), never below half's 2^-24
_Q = "(max(math.frexp({0})[1], -13) - 11)"
_R = f"math.ldexp(np.rint(math.ldexp({{0}}, -{_Q})), {_Q})"
ROUND_F16_EXPR = f"({_R} if not abs({_R}) >= 65520.0 else math.copysign(math.inf, {{0}}))"


def _round_f16_ref(a, x):
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(x.dtype)


register("round_f16", arity=1, kind="elementwise", expr=ROUND_F16_EXPR, ref=_round_f16_ref,
         infer=lambda args, a: elementwise_type(args, a, True), vjp=lambda g, out, xs, a: [g],
         doc="x rounded to the nearest float16 value, in x's dtype (straight-through vjp)")


def round_f16(x):
    """x.astype(float16).astype(x.dtype) as a graph op (llama.cpp's F16 KV cache)."""
    return apply("round_f16", x)

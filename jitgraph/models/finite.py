"""NaN / Inf logits, said instead of printed: generate checks the row it samples from, perplexity
its running sum of negative log-likelihoods; on a failure the weights (and the LoRA adapter) are
scanned once to name the likely cause in a NonFiniteError."""
from __future__ import annotations

import math

import numpy as np

from ..errors import NonFiniteError


def finite_row(x) -> bool:
    """Whether every value of the float32 row `x` is finite. x . x is one vectorised pass (half
    the cost of isfinite(x).all()); it is NaN/Inf whenever an element is, and otherwise only on
    overflow (|x| beyond ~1e19), which the exact check then settles."""
    return math.isfinite(float(np.dot(x, x))) or bool(np.isfinite(x).all())


def _holds(a) -> str | None:
    if np.isnan(a).any():
        return "NaN"
    if np.isinf(a).any():
        return "Inf"
    return None


def cause(weights, adapter=None) -> str:
    """The likely cause of non-finite logits. weights: (name, f32 array or FileTensor) pairs of
    the model (one pass; a program's params read one at a time); adapter: None or load_lora's (adapter params,
    alpha, scale)."""
    big, top = None, 0.0
    for name, a in weights:
        a = a.f32() if hasattr(a, "f32") else a      # a tensor of a file, in its type
        bad = _holds(a)
        if bad:
            return f"the model's weight {name} holds {bad}"
        m = float(np.abs(a).max(initial=0.0))
        if m >= top:
            big, top = name, m
    if adapter is not None:
        params, _, scale = adapter
        for name, a in params.items():
            bad = _holds(a)
            if bad:
                return f"the LoRA adapter's {name} holds {bad}"
        return (f"the weights and the LoRA adapter are finite: the adapter at scale {scale:g} "
                f"overflows (try a smaller --lora-scale)")
    where = "" if big is None else f" (the largest |weight| is {top:.3g}, in {big})"
    return f"the weights are finite but too large for the computation{where}"


def fail(what: str, weights, adapter=None):
    """Raise NonFiniteError "<what>: <cause>" (see cause)."""
    raise NonFiniteError(f"{what}: {cause(weights, adapter)}")

"""Losses: cross_entropy (class labels or probability targets), mse."""
from __future__ import annotations

import numpy as np

from ..types import ShapeError, TensorType
from .common import apply, need_float, same_dtype
from .nn import log_softmax_ref
from ..registry import register

__all__ = ["cross_entropy", "mse"]


def _ce_check(logits, target):
    need_float(logits, "logits")
    if logits.ndim != 2 or 0 in logits.shape:
        raise ShapeError(f"logits must be [N, C] with N, C >= 1, got {logits}")
    n, c = logits.shape
    labels = target.dtype == "i32" and target.shape == (n,)
    probs = target.dtype == logits.dtype and target.shape == (n, c)
    if not (labels or probs):
        raise ShapeError(f"target {target} does not fit logits {logits} (expected i32[{n}] class "
                         f"labels or {logits.dtype}[{n},{c}] probabilities)")


def _ce_infer(args, a):
    _ce_check(*args)
    return TensorType(args[0].dtype, ())


def _target_matrix(logits, target):
    """Probability targets as given; class labels as one-hot rows."""
    if target.dtype.kind == "f":
        return target
    n, c = logits.shape
    if target.size and (target.min() < 0 or target.max() >= c):
        raise IndexError(f"cross_entropy: label out of range [0, {c})")
    onehot = np.zeros_like(logits)
    onehot[np.arange(n), target] = 1
    return onehot


def _ce_ref(a, logits, target):
    t = _target_matrix(logits, target)
    return -np.sum(t * log_softmax_ref(logits, -1), dtype=logits.dtype) / len(logits)


def _ce_back_infer(args, a):
    logits, target, g = args
    _ce_check(logits, target)
    same_dtype([logits, g], "")
    if g.shape != ():
        raise ShapeError(f"gradient {g} must be a scalar (the loss gradient)")
    return logits.type


def _ce_back_ref(a, logits, target, g):
    t = _target_matrix(logits, target)
    sm = np.exp(log_softmax_ref(logits, -1))
    return (sm * np.sum(t, axis=-1, keepdims=True) - t) * (g / len(logits))


def _ce_vjp(g, out, xs, a):
    from . import log_softmax
    logits, target = xs
    gt = log_softmax(logits) * (g * (-1.0 / logits.shape[0])) if target.type.is_float else None
    return [apply("cross_entropy_back", logits, target, g), gt]


def _ce_labels(args, a):
    """Class labels index the logits' columns; probability targets index nothing."""
    return [(1, args[0].shape[1])] if args[1].dtype == "i32" else []


register("cross_entropy", kind="opaque", arity=2, infer=_ce_infer, ref=_ce_ref, vjp=_ce_vjp,
         index=_ce_labels,
         doc="cross_entropy(logits [N,C], target i32[N] labels or [N,C] probabilities): "
             "mean over N of -sum(target * log_softmax(logits)), via log-sum-exp")
register("cross_entropy_back", kind="opaque", arity=3, infer=_ce_back_infer, ref=_ce_back_ref,
         index=_ce_labels, pairs_with="cross_entropy",
         doc="cross_entropy_back(logits, target, g) = (softmax * sum(target) - target) / N * g; "
             "sum(target) is 1 for labels and normalised probabilities")


# ---- user-facing functions ---------------------------------------------------------------------
def cross_entropy(logits, target):
    return apply("cross_entropy", logits, target)


def mse(a, b):
    """mean((a - b)^2) over every element; a and b must have the same shape."""
    if a.shape != b.shape:
        raise ShapeError(f"mse: shapes differ: {a.label} {a.type} vs {b.label} {b.type} "
                         f"(expected equal shapes)")
    from . import mean, sqr
    return mean(sqr(a - b))

"""Fused optimizer-update ops (appended by passes/optimizer.py; ggml_opt_step_adamw).

Each is one elementwise kernel instead of several, and has no vjp: nothing differentiates
through an update.
"""
from __future__ import annotations

import numpy as np

from .common import elementwise_type
from ..registry import register


def _ema_ref(a, old, x):
    b = np.asarray(a["beta"], old.dtype)
    return b * old + (1 - b) * x


def _adam_step_ref(a, p, m, v, lr, c1, c2):
    dt = p.dtype
    keep = 1 - lr * np.asarray(a["wd"], dt)
    return p * keep - lr * (m * c1) / (np.sqrt(v * c2) + np.asarray(a["eps"], dt))


def _infer(args, a):
    return elementwise_type(args, a)


_UPDATE = dict(kind="elementwise", fusion=("update",))
register("ema", arity=2, **_UPDATE, attrs={"beta": ("float", 0.9)}, infer=_infer,
         ref=_ema_ref, expr="{beta} * {0} + (1.0 - {beta}) * {1}",
         doc="ema(old, x): beta * old + (1 - beta) * x (Adam's first moment)")
register("ema_sq", arity=2, **_UPDATE, attrs={"beta": ("float", 0.999)}, infer=_infer,
         ref=lambda a, old, x: _ema_ref(a, old, x * x),
         expr="{beta} * {0} + (1.0 - {beta}) * ({1} * {1})",
         doc="ema_sq(old, x): beta * old + (1 - beta) * x^2 (Adam's second moment)")
register("adam_step", arity=6, **_UPDATE,
         attrs={"eps": ("float", 1e-8), "wd": ("float", 0.0)}, infer=_infer, ref=_adam_step_ref,
         expr="{0} * (1.0 - {3} * {wd}) - {3} * ({1} * {4}) / (math.sqrt({2} * {5}) + {eps})",
         doc="adam_step(p, m, v, lr, c1, c2): p * (1 - lr*wd) - lr * m*c1 / (sqrt(v*c2) + eps) "
             "with bias corrections c1 = 1/(1-beta1^t), c2 = 1/(1-beta2^t) (ggml's adamw)")

"""Fused optimizer-update ops (appended by passes/optimizer.py; ggml_opt_step_adamw).

Each is one elementwise kernel instead of several, and has no vjp: nothing differentiates
through an update.
"""
from __future__ import annotations

import numpy as np

from .common import elementwise_type
from ..types import ShapeError, TensorType
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


# ---- stochastic rounding to bf16 (bf16 master weights: Adam/SGD(master="bf16")) ---------------
# The random 16 bits of element i of a tensor at optimizer step t: splitmix64's finaliser over
# seed*K0 + salt*K1 + t*K2 + i (wrapping uint64 arithmetic), its top 16 bits. Counter-based: no
# random state besides (seed, t), which a checkpoint already holds, so a resumed run draws the
# same bits. runtime/cpu/lib_round.py computes the same integers.
SR_K = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def sround_noise(seed: int, salt: int, step: int, n: int) -> np.ndarray:
    """The uint64 random 16-bit integers of elements 0..n-1 at step `step` (see SR_K)."""
    k0, k1, k2 = (np.uint64(k) for k in SR_K)
    base = np.array([seed % 2 ** 64], np.uint64) * k0 + np.array([salt % 2 ** 64], np.uint64) \
        * k1 + np.array([step % 2 ** 64], np.uint64) * k2
    z = base + np.arange(n, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * k1
    z = (z ^ (z >> np.uint64(27))) * k2
    z = z ^ (z >> np.uint64(31))
    return z >> np.uint64(48)


def sround_bf16_bits(x, step: int, seed: int, salt: int) -> np.ndarray:
    """The bf16 bits (uint16, x's shape) of float32 x rounded stochastically: the top 16 bits of
    (x's 32 bits + a random 16-bit integer), so x rounds up to the next bf16 value with
    probability (its distance from the lower one) / (their spacing): unbiased. inf stays inf,
    a NaN a quiet NaN (as round to nearest, jitgraph/half.py)."""
    x = np.ascontiguousarray(x, np.float32)
    bits = x.reshape(-1).view(np.uint32).astype(np.uint64)
    out = ((bits + sround_noise(seed, salt, step, x.size)) >> np.uint64(16)).astype(np.uint16)
    special = (bits & np.uint64(0x7F800000)) == np.uint64(0x7F800000)
    nan = special & ((bits & np.uint64(0x7FFFFF)) != 0)
    out[special] = (bits[special] >> np.uint64(16)).astype(np.uint16)
    out[nan] |= np.uint16(0x40)
    return out.reshape(x.shape)


def _sround_infer(args, a):
    x, step = args
    if x.dtype != "f32" or step.dtype != "f32" or step.shape != ():
        raise ShapeError(f"sround_bf16: expected an f32 value and the f32 scalar step, got "
                         f"{x} and {step}")
    return TensorType("bf16", x.shape)


def _sround_ref(a, x, step):
    bits = sround_bf16_bits(x, int(step), a["seed"], a["salt"])
    # the f32 value of those bits (exact in bf16: the interpreter's rounding keeps it)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


register("sround_bf16", arity=2, kind="opaque", half="convert", infer=_sround_infer,
         ref=_sround_ref, attrs={"seed": ("int", 0), "salt": ("int", 0)}, cheap=True,
         doc="sround_bf16(x, step): f32 x rounded to bf16 stochastically (unbiased), the random "
             "16 bits of element i a hash of (seed, salt, int(step), i): bf16 master weights' "
             "update")

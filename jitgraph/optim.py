"""Optimizers as plain data: hyper-parameters, and the scalars each training call is fed.

passes/optimizer.py builds the update into the graph; an optimizer object only describes it.
Runtime contract of a training graph (the executor and `jitgraph.interp.run` callers rely on it):
f32 scalar inputs `opt/lr` (this step's learning rate), `opt/step` (the 1-based optimizer step t,
for Adam's bias correction) and, when accumulate > 1, `opt/apply` (1.0 on the micro-step that
applies the update, else 0.0). `runtime_inputs(call)` gives them for the call-th execution.

`lr` is a float or a schedule `lr(t) -> float` called with the same 1-based step t, so a
schedule never rebuilds the graph. With accumulate=k, call c belongs to optimizer step
t = c // k + 1 and applies the update when c % k == k - 1 (ggml's opt_period).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, ClassVar

import numpy as np

LR, STEP, APPLY = "opt/lr", "opt/step", "opt/apply"
LOSS_SCALE = "opt/loss_scale"      # f32 scalar input: dynamic loss scaling's S (LossScale)


@dataclass(frozen=True)
class Optimizer:
    """Common fields (declared by each subclass): lr, weight_decay, clip_norm, accumulate,
    master, seed.

    master: the type the trainable f32 params are stored in, "f32" or "bf16" (bf16 master
    weights: half the params' bytes). With "bf16" each step reads a param as f32, computes its
    update in f32 and stores the new value rounded to bf16 stochastically (op sround_bf16:
    unbiased, so updates smaller than a bf16 unit still move the weight on average); the random
    bits are a hash of (seed, the param, the optimizer step t, the element), no state beyond
    the step, so a resumed run rounds as the unbroken one."""

    def __post_init__(self):
        name = type(self).__name__
        if self.master not in ("f32", "bf16"):
            raise ValueError(f"{name}: master must be 'f32' or 'bf16', got {self.master!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or self.seed < 0:
            raise ValueError(f"{name}: seed must be an int >= 0, got {self.seed!r}")
        if not callable(self.lr) and not _is_nonneg(self.lr):
            raise ValueError(f"{name}: lr must be a non-negative number or a callable "
                             f"lr(step) -> float, got {self.lr!r}")
        if not _is_nonneg(self.weight_decay):
            raise ValueError(f"{name}: weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.clip_norm is not None and not (_is_nonneg(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"{name}: clip_norm must be None or > 0, got {self.clip_norm!r}")
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) \
                or self.accumulate < 1:
            raise ValueError(f"{name}: accumulate must be an int >= 1, got {self.accumulate!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate of 1-based optimizer step `step`."""
        if not callable(self.lr):
            return float(self.lr)
        v = self.lr(step)
        if not _is_nonneg(v):
            raise ValueError(f"{type(self).__name__}: lr schedule returned {v!r} at step {step}; "
                             f"expected a finite number >= 0")
        return float(v)

    def runtime_inputs(self, call: int) -> dict:
        """Scalar inputs for the call-th (0-based) execution of the training graph."""
        k = self.accumulate
        t = call // k + 1
        out = {LR: np.float32(self.lr_at(t)), STEP: np.float32(t)}
        if k > 1:
            out[APPLY] = np.float32(call % k == k - 1)
        return {name: np.asarray(v) for name, v in out.items()}

    def spec(self) -> dict:
        """Plain-data description (a callable lr is recorded by name)."""
        out = {"kind": type(self).__name__}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = f"schedule:{getattr(v, '__qualname__', repr(v))}" if callable(v) else v
        return out


def _is_nonneg(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) \
        and math.isfinite(v) and v >= 0


def _check_unit(opt, name):
    v = getattr(opt, name)
    if not _is_nonneg(v) or v >= 1:
        raise ValueError(f"{type(opt).__name__}: {name} must be in [0, 1), got {v!r}")


@dataclass(frozen=True)
class SGD(Optimizer):
    """p <- p - lr * d with d = g + wd * p (L2), or with momentum: buf = momentum * buf + d,
    d = buf (PyTorch's SGD without dampening/nesterov). The buffer is state `opt/m/<param>`."""
    lr: float | Callable
    momentum: float = 0.0
    weight_decay: float = 0.0
    clip_norm: float | None = None
    accumulate: int = 1
    master: str = "f32"
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        _check_unit(self, "momentum")


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam with ggml's formulas: m = b1*m + (1-b1)*g, v = b2*v + (1-b2)*g^2,
    p <- p - lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps); weight_decay is L2 (added to g).
    moments: the type m and v are stored in, "f32" or "bf16" (half the optimizer state's
    bytes): each step reads them as f32, computes the update in f32 from the unrounded new
    moments and stores those rounded to nearest even. With beta2 = 0.999 a bf16 v (8 bits of
    mantissa) stops moving once its step's change is below half a bf16 unit (after some
    hundreds of steps of steady gradients): fine for short finetunes, a drift for long runs."""
    lr: float | Callable = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float | None = None
    accumulate: int = 1
    moments: str = "f32"
    master: str = "f32"
    seed: int = 0
    decoupled: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        if self.moments not in ("f32", "bf16"):
            raise ValueError(f"{type(self).__name__}: moments must be 'f32' or 'bf16', got "
                             f"{self.moments!r}")
        _check_unit(self, "beta1")
        _check_unit(self, "beta2")
        if not (_is_nonneg(self.eps) and self.eps > 0):
            raise ValueError(f"{type(self).__name__}: eps must be > 0, got {self.eps!r}")


@dataclass(frozen=True)
class AdamW(Adam):
    """Adam with decoupled weight decay (ggml_opt_step_adamw): p <- p * (1 - lr*wd) - lr * ..."""
    weight_decay: float = 0.01
    decoupled: ClassVar[bool] = True


@dataclass(frozen=True)
class EpochDecay:
    """llama.cpp's learning-rate schedule (common/common.cpp lr_opt): constant within an epoch;
    epoch e (0-based) runs at lr0 * 0.5^(e * log2(lr0 / lr_min) / E), i.e. lr0 * (lr_min /
    lr0)^(e / E), and at lr_min from epoch E on, where E = decay_epochs when 0 < decay_epochs <
    epochs, else epochs. Computed in float32 as llama.cpp does. Called with the 1-based
    optimizer step t (an Optimizer's lr): epoch (t - 1) // steps_per_epoch."""
    lr0: float
    lr_min: float
    epochs: int
    steps_per_epoch: int
    decay_epochs: float = -1.0

    def __post_init__(self):
        if not (_is_nonneg(self.lr0) and self.lr0 > 0):
            raise ValueError(f"EpochDecay: lr0 must be > 0, got {self.lr0!r}")
        if not (_is_nonneg(self.lr_min) and 0 < self.lr_min < self.lr0):
            raise ValueError(f"EpochDecay: lr_min must be in (0, lr0 = {self.lr0}), got "
                             f"{self.lr_min!r}")
        if self.epochs < 1 or self.steps_per_epoch < 1:
            raise ValueError(f"EpochDecay: epochs {self.epochs} and steps_per_epoch "
                             f"{self.steps_per_epoch} must be >= 1")

    @property
    def span(self) -> float:
        """E: the epochs over which the rate decays."""
        d = self.decay_epochs
        return float(np.float32(d)) if 0 < d < self.epochs else float(self.epochs)

    def at_epoch(self, epoch) -> float:
        f = np.float32
        if epoch >= self.span:
            return float(f(self.lr_min))
        nhalf = f(np.log(f(self.lr0) / f(self.lr_min))) / f(np.log(f(2.0)))
        scale = nhalf / f(self.span)
        return float(f(self.lr0) * np.power(f(0.5), f(epoch) * scale))

    def __call__(self, step: int) -> float:
        return self.at_epoch((int(step) - 1) // self.steps_per_epoch)


@dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling (PyTorch's GradScaler), jg.compile(..., loss_scale=): the backward
    starts from S instead of 1 (every gradient is S times the loss's), and the optimizer
    multiplies the gradients by 1/S before it uses them; S is the f32 scalar input
    `opt/loss_scale`, fed at each step like the learning rate (changing it rebuilds nothing).
    A step whose loss or gradients are not finite changes nothing (the finite-step guard in
    its "skip" mode), is counted in Program.skipped and halves S (`backoff`); after
    `interval` optimizer steps in a row that applied their update S doubles (`growth`).
    S starts at `init`. A step still not finite once S would fall below `min_scale` raises
    FloatingPointError: no scale makes it finite (a NaN of the model, not of f16's range)."""
    init: float = 2.0 ** 16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000
    min_scale: float = 2.0 ** -24

    def __post_init__(self):
        for name in ("init", "min_scale"):
            v = getattr(self, name)
            if not (_is_nonneg(v) and 0 < v < 3e38):
                raise ValueError(f"LossScale: {name} must be a finite f32 number > 0, got {v!r}")
        if not (_is_nonneg(self.growth) and self.growth > 1):
            raise ValueError(f"LossScale: growth must be > 1, got {self.growth!r}")
        if not (_is_nonneg(self.backoff) and 0 < self.backoff < 1):
            raise ValueError(f"LossScale: backoff must be in (0, 1), got {self.backoff!r}")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) \
                or self.interval < 1:
            raise ValueError(f"LossScale: interval must be an int >= 1, got {self.interval!r}")
        if self.min_scale > self.init:
            raise ValueError(f"LossScale: min_scale {self.min_scale} exceeds init {self.init}")


class Scaler:
    """A LossScale's running state: the scale S (an f32 value), the optimizer steps applied
    since S last changed (`good`). `update` follows each step; `state()` / `load()` are what a
    checkpoint keeps (plain JSON numbers: S is restored bit for bit)."""

    def __init__(self, config: LossScale):
        self.config = config
        self.scale = float(np.float32(config.init))
        self.good = 0

    def update(self, finite: bool, applied: bool = True) -> None:
        """After a step: not finite halves S and restarts the count; a finite step that
        applied the update counts, and the interval-th in a row doubles S."""
        c = self.config
        if not finite:
            new = float(np.float32(self.scale * c.backoff))
            if new < c.min_scale:
                raise FloatingPointError(
                    f"loss scaling: the step is not finite at every scale down to {self.scale:g} "
                    f"(min_scale {c.min_scale:g}): a NaN or Inf that no loss scale removes")
            self.scale, self.good = new, 0
        elif applied:
            self.good += 1
            if self.good >= c.interval:
                new = float(np.float32(self.scale * c.growth))
                if math.isfinite(new) and new < 3e38:
                    self.scale = new
                self.good = 0

    def state(self) -> dict:
        return {"scale": self.scale, "good": self.good}

    def load(self, state: dict) -> None:
        scale, good = state.get("scale"), state.get("good")
        if not _is_nonneg(scale) or scale <= 0 or isinstance(good, bool) \
                or not isinstance(good, int) or good < 0:
            raise ValueError(f"loss scale state {state!r}: expected {{'scale': a number > 0, "
                             f"'good': an int >= 0}}")
        self.scale, self.good = float(np.float32(scale)), good

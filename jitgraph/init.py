"""Parameter initialisers. Each is a small serialisable object: init(shape, rng) -> ndarray."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


def _fans(shape):
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:                 # matmul weights are [in, out]
        return shape[0], shape[1]
    rf = math.prod(shape[2:])           # conv kernels are [out, in, kh, kw]
    return shape[1] * rf, shape[0] * rf


@dataclass(frozen=True)
class Initializer:
    zero = False            # all zeros: a param in zeroed memory needs nothing written

    def spec(self) -> dict:
        return {"kind": type(self).__name__, **asdict(self)}


@dataclass(frozen=True)
class Zeros(Initializer):
    zero = True

    def __call__(self, shape, rng):
        return np.zeros(shape)


@dataclass(frozen=True)
class Constant(Initializer):
    value: float = 0.0

    def __call__(self, shape, rng):
        return np.full(shape, self.value)


@dataclass(frozen=True)
class Normal(Initializer):
    mean: float = 0.0
    std: float = 1.0

    def __call__(self, shape, rng):
        return rng.normal(self.mean, self.std, size=shape)


@dataclass(frozen=True)
class Uniform(Initializer):
    low: float = -1.0
    high: float = 1.0

    def __call__(self, shape, rng):
        return rng.uniform(self.low, self.high, size=shape)


@dataclass(frozen=True)
class GlorotUniform(Initializer):
    gain: float = 1.0

    def __call__(self, shape, rng):
        fi, fo = _fans(shape)
        a = self.gain * math.sqrt(6.0 / (fi + fo))
        return rng.uniform(-a, a, size=shape)


@dataclass(frozen=True)
class HeNormal(Initializer):
    gain: float = math.sqrt(2.0)

    def __call__(self, shape, rng):
        fi, _ = _fans(shape)
        return rng.normal(0.0, self.gain / math.sqrt(fi), size=shape)


@dataclass(frozen=True)
class HeUniform(Initializer):
    """PyTorch's default for Linear/Conv weights (kaiming_uniform with a=sqrt(5))."""
    gain: float = 1.0

    def __call__(self, shape, rng):
        fi, _ = _fans(shape)
        a = self.gain / math.sqrt(fi)
        return rng.uniform(-a, a, size=shape)


@dataclass(frozen=True)
class LoraA(Initializer):
    """jg.lora's A init (PEFT's lora_A): U(-bound, bound) with bound = 1/sqrt(in) (kaiming_uniform_, a=sqrt(5)),
    drawn from a stream that depends on the compile seed's stream for the param (the `rng` given)
    and on `seed` (jg.lora's)."""
    bound: float = 1.0
    seed: float = 0.0

    def __call__(self, shape, rng):
        mix = [int(v) for v in rng.integers(0, 2 ** 32, 2)]
        sub = np.random.default_rng([int(self.seed), *mix])
        return sub.uniform(-self.bound, self.bound, size=shape)


KINDS = {c.__name__: c for c in (Zeros, Constant, Normal, Uniform, GlorotUniform, HeNormal, HeUniform,
                                   LoraA)}


def from_spec(spec) -> Initializer:
    if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
        raise ValueError(f"unknown initializer {spec!r}; expected kind in {sorted(KINDS)}")
    cls = KINDS[spec["kind"]]
    kw = {k: v for k, v in spec.items() if k != "kind"}
    fields = cls.__dataclass_fields__
    if set(kw) - set(fields) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                        for v in kw.values()):
        raise ValueError(f"bad initializer arguments {kw!r} for {spec['kind']}")
    return cls(**{k: float(v) for k, v in kw.items()})


def zeros(): return Zeros()
def ones(): return Constant(1.0)
def constant(value): return Constant(float(value))
def normal(mean=0.0, std=1.0): return Normal(float(mean), float(std))
def uniform(low=-1.0, high=1.0): return Uniform(float(low), float(high))
def glorot_uniform(gain=1.0): return GlorotUniform(float(gain))
def he_normal(gain=math.sqrt(2.0)): return HeNormal(float(gain))
def he_uniform(gain=1.0): return HeUniform(float(gain))
xavier_uniform = glorot_uniform
kaiming_normal = he_normal

"""sround_bf16: float32 rounded to bf16 stochastically (bf16 master weights, passes/optimizer.py).

The same integers as the op's reference (jitgraph/ops/update.py sround_bf16_bits): the random
16 bits of flat element i at step t are the top 16 bits of splitmix64's finaliser over
seed*K0 + salt*K1 + t*K2 + i (uint64, wrapping), added to x's 32 bits; the bf16 value is the top
16 bits of the sum. inf stays inf, a NaN becomes a quiet NaN. Elements are independent, so the
loop runs in a prange when there is enough work.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from .approx import _bits
from .lib_common import PAR_MIN_WORK, kernel, pkernel

_K0 = np.uint64(0x9E3779B97F4A7C15)
_K1 = np.uint64(0xBF58476D1CE4E5B9)
_K2 = np.uint64(0x94D049BB133111EB)


@kernel
def _one(x, base, i):
    """The bf16 bits of float32 x rounded with the random bits of counter base + i."""
    b = np.uint64(np.int64(_bits(x)) & 0xFFFFFFFF)
    if (b & np.uint64(0x7F800000)) == np.uint64(0x7F800000):          # inf or NaN
        h = b >> np.uint64(16)
        if (b & np.uint64(0x7FFFFF)) != np.uint64(0):
            h = h | np.uint64(0x40)
        return np.uint16(h)
    z = base + np.uint64(i)
    z = (z ^ (z >> np.uint64(30))) * _K1
    z = (z ^ (z >> np.uint64(27))) * _K2
    z = z ^ (z >> np.uint64(31))
    return np.uint16((b + (z >> np.uint64(48))) >> np.uint64(16))


@pkernel
def sround_bf16(x, step, out, seed, salt):
    """sround_bf16: x float32[n], step float32[1] (the optimizer step t), out uint16[n] (bf16
    bits); seed, salt: ints (salt tells tensors apart)."""
    n = x.size
    base = np.uint64(seed) * _K0 + np.uint64(salt) * _K1 + np.uint64(np.int64(step[0])) * _K2
    if n < PAR_MIN_WORK:
        for i in range(n):
            out[i] = _one(x[i], base, i)
    else:
        for i in prange(n):
            out[i] = _one(x[i], base, i)

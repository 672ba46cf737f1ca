"""Scalar conversions between float32 and the half types as the CUDA kernels hold them, and
sround_bf16's per-element rounding; the generated kernels call these device functions
(runtime/cuda/spelling.py spells the conversions through them).

A half value in a CUDA kernel: f16 is numba-cuda's float16 (a float16 array element:
`np.float32(h)` is cvt.f32.f16, `np.float16(x)` cvt.rn.f16.f32 on the device: round to nearest
even, overflow to inf, half's subnormals kept; numpy's float16 conversion on the simulator, the
reference's own), bf16 its 16 bits in a uint16 array (the high half of a float32's bits), as on
the CPU (runtime/cpu/halfconv.py). bf16 conversions are integer arithmetic on the float32's
bits: `bf16_f32` shifts the bits up; `f32_bf16` rounds to nearest even and keeps a NaN a
(quiet) NaN, ggml's GGML_FP32_TO_BF16 and jitgraph/half.py's reference. The bits of a float32
are libdevice's __nv_float_as_int / __nv_int_as_float on the device (a register move); the
simulator, which has no libdevice, reads them through numpy views.

`sround_bits(x, step, base, i)`: the bf16 bits of float32 x rounded stochastically with the
random 16 bits of flat element i at step `step`, the integers of jitgraph/ops/update.py
sround_bf16_bits and runtime/cpu/lib_round.py (splitmix64's finaliser over
base + int(step) * K2 + i, wrapping in uint64, with base = seed * K0 + salt * K1 computed when
the kernel is written), so the CUDA and CPU results are equal bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import config, cuda

_K1 = np.uint64(0xBF58476D1CE4E5B9)
_K2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1

if config.ENABLE_CUDASIM:
    # the simulator runs kernels as Python: numpy views for the bits, Python integers for the
    # wrapping uint64 arithmetic (numpy's uint64 scalars warn on overflow)
    def f32_bits(x):
        return int(np.float32(x).view(np.uint32))

    def bits_f32(n):
        return np.uint32(n & 0xFFFFFFFF).view(np.float32)

    def _mix(z):
        z = ((z ^ (z >> 30)) * int(_K1)) & _MASK
        z = ((z ^ (z >> 27)) * int(_K2)) & _MASK
        return z ^ (z >> 31)

    def _counter(step, base, i):
        return (int(base) + int(np.int64(step)) * int(_K2) + int(i)) & _MASK
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def f32_bits(x):
        return np.int64(libdevice.float_as_int(np.float32(x))) & 0xFFFFFFFF

    @cuda.jit(device=True, inline=True)
    def bits_f32(n):
        return libdevice.int_as_float(np.int32(np.uint32(n & 0xFFFFFFFF)))

    @cuda.jit(device=True, inline=True)
    def _mix(z):
        z = (z ^ (z >> np.uint64(30))) * _K1
        z = (z ^ (z >> np.uint64(27))) * _K2
        return z ^ (z >> np.uint64(31))

    @cuda.jit(device=True, inline=True)
    def _counter(step, base, i):
        return np.uint64(base) + np.uint64(np.int64(step)) * _K2 + np.uint64(i)


@cuda.jit(device=True, inline=True)
def bf16_f32(h):
    """The float32 value of the bf16 bits h."""
    return bits_f32(np.int64(h) << 16)


@cuda.jit(device=True, inline=True)
def f32_bf16(x):
    """The bf16 bits (uint16) of float32 x rounded to nearest even; a NaN stays a quiet NaN."""
    n = f32_bits(x)
    if (n & 0x7FFFFFFF) > 0x7F800000:
        n = (n & 0xFFFF0000) | 0x400000
    return np.uint16((n + 0x7FFF + ((n >> 16) & 1)) >> 16)


@cuda.jit(device=True, inline=True)
def sround_bits(x, step, base, i):
    """The bf16 bits of float32 x rounded stochastically (sround_bf16, see the module text)."""
    b = f32_bits(x)
    if (b & 0x7F800000) == 0x7F800000:          # inf stays inf, a NaN a quiet NaN
        h = b >> 16
        if (b & 0x7FFFFF) != 0:
            h = h | 0x40
        return np.uint16(h)
    r = _mix(_counter(step, base, i)) >> 48
    return np.uint16((b + np.int64(r)) >> 16)

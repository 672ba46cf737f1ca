"""Decorators and index helpers shared by the hand-written CPU kernels (runtime/cpu/lib_*.py).

Every kernel writes into a preallocated `out` and allocates nothing. Kernels that pay for a
parallel region (`pkernel`) branch on their amount of work: below `PAR_MIN_WORK` scalar operations
they run the serial loop (runtime/cpu/thresholds.py says why it is that bound).
"""
from __future__ import annotations

from numba import njit

from .cache import install_runtime_locator
from .thresholds import PAR_MIN_WORK  # noqa: F401  (the lib_*.py kernels' prange bound)

install_runtime_locator()


def cpu_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with `feature` (LLVM's name: "avx2", "f16c",
    "avx512bf16"): the features NUMBA_CPU_FEATURES gives where NUMBA_CPU_NAME names a CPU, else
    the host's. Numba's cache keys compiled code by CPU name and features, so a kernel chosen by
    this travels with the code compiled for it."""
    from numba.core import config
    if (config.CPU_NAME or "host") != "host":
        feats = config.CPU_FEATURES or ""
        return f"+{feature}" in feats and f"-{feature}" not in feats
    import llvmlite.binding as llvm
    try:
        return bool(llvm.get_host_cpu_features().get(feature, False))
    except RuntimeError:                   # the host's features cannot be read
        return False
_OPTS = dict(cache=True, error_model="numpy", fastmath=False, nogil=True)
kernel = njit(**_OPTS)
pkernel = njit(parallel=True, **_OPTS)


@kernel
def row_base(r, shape, big, starts, steps, unit):
    """Flat offset in C-contiguous `big` of row `r` (an index over shape[:-1]) of a strided box:
    box index i_k maps to big index starts[k] + i_k * steps[k] (steps all 1 when `unit`)."""
    off = 0
    for k in range(len(shape) - 2, -1, -1):
        i = r % shape[k]
        r //= shape[k]
        st = 1 if unit else steps[k]
        off += (starts[k] + i * st) * (big.strides[k] // big.itemsize)
    return off + starts[len(shape) - 1]

"""Decorators and index helpers shared by the hand-written CPU kernels (runtime/cpu/lib_*.py).

Every kernel writes into a preallocated `out` and allocates nothing. Kernels that pay for a
parallel region (`pkernel`) branch on their amount of work: below `PAR_MIN_WORK` scalar operations
they run the serial loop, because a prange launch costs ~2 us with numba's default OpenMP layer
but ~60-70 us with OMP_WAIT_POLICY=PASSIVE or the workqueue layer (measured on the 2-core box),
and the runtime may pick either (PASSIVE was jitgraph's default when PAR_MIN_WORK was set;
since session 9 libgomp spins a moment after each region, ~2 us a launch, and the bound was
not re-tuned: rope's prange over 35 us of work still took 66 us).
"""
from __future__ import annotations

from numba import njit

from ..cache import install_runtime_locator

install_runtime_locator()
_OPTS = dict(cache=True, error_model="numpy", fastmath=False, nogil=True)
kernel = njit(**_OPTS)
pkernel = njit(parallel=True, **_OPTS)

# serial work (inner-loop iterations, an exp counting ~4) above which a prange region pays off:
# ~150 us of serial work at ~1 ns per simple iteration, twice the passive-policy launch cost
PAR_MIN_WORK = 1 << 17


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

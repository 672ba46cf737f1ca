"""Thread settings for numba's parallel kernels and the GEMMs (one pool: numba's; blas.py).

Must run before numba starts its thread pool (jitgraph imports numba only when compiling, and
calls `configure()` first). Every setting respects a value the user already exported:

  JITGRAPH_NUM_THREADS   threads for parallel kernels and BLAS (default: all cores); copied
                         into NUMBA_NUM_THREADS and OPENBLAS_NUM_THREADS when those are unset
  NUMBA_THREADING_LAYER  default "omp" (GNU OpenMP): its parallel launches cost a fraction of
                         "workqueue"'s
  OMP_WAIT_POLICY        left to libgomp (its threads spin a moment after each parallel
                         region, then sleep): numba's pool is the only pool a step uses, as
                         OpenBLAS runs on one thread in every jitgraph call and big GEMMs are
                         split over numba's threads (blas.py). PASSIVE would make each
                         parallel launch wake a sleeping thread; a user's PASSIVE is still
                         respected.
  OPENBLAS_THREAD_TIMEOUT default "4": OpenBLAS's threads spin for 2**N cycles after each GEMM
                         before sleeping (N=28 by default). Spinning, they take the cores from
                         the parallel kernel that follows (bench/README.md: "Figures behind
                         the code", threads). Read when OpenBLAS loads, so
                         jitgraph sets it at import (before numpy and scipy load their OpenBLAS
                         when jitgraph is imported first); the GEMM library (blas.py, numpy's
                         OpenBLAS by default) is told again when numpy was imported first.
  JITGRAPH_BLAS_SERIAL_MAX GEMMs with m*n*k up to this bound (default: 2**21 on a quiet
                         machine, 2**26 while other processes hold the cores) run on the calling
                         thread, bigger ones in bands over the pool (blas.py): each split GEMM
                         must wait for its second thread to be scheduled, which on a busy
                         machine costs far more than the split saves (bench/llama_threads.py).
                         0 splits every GEMM.
  JITGRAPH_BLAS_SMALL_MNK one-thread GEMMs above this m*n*k are cut into tiles under it, for
                         OpenBLAS's small-matrix kernels (default 10^6 with its SkylakeX-class
                         kernels, else 0: never; blas.py)
"""
from __future__ import annotations

import os
import sys

DEFAULTS = {"NUMBA_THREADING_LAYER": "omp", "OPENBLAS_THREAD_TIMEOUT": "4"}


def set_blas_defaults() -> None:
    """Environment OpenBLAS reads when it loads (called by `import jitgraph`, before numpy)."""
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", DEFAULTS["OPENBLAS_THREAD_TIMEOUT"])


def max_threads() -> int:
    """The most threads jitgraph accepts: 4x the cores (more only oversubscribes them, and a
    huge count makes OpenMP's runtime fail while it starts its pool)."""
    return 4 * (os.cpu_count() or 1)


def requested_threads() -> int | None:
    """JITGRAPH_NUM_THREADS as an int (None when unset or empty); a ValueError naming it when it
    is not an integer in [1, max_threads()]."""
    n = os.environ.get("JITGRAPH_NUM_THREADS", "").strip()
    if not n:
        return None
    top = max_threads()
    if not n.isdigit() or not 1 <= int(n) <= top:
        raise ValueError(f"JITGRAPH_NUM_THREADS={n}: expected an integer from 1 to {top} (4x "
                         f"this machine's {top // 4} cores)")
    return int(n)


def configure() -> dict:
    """Set the defaults above for variables the user left unset; returns the effective values.
    An invalid JITGRAPH_NUM_THREADS is a ValueError (requested_threads)."""
    env = os.environ
    n = requested_threads()
    if n:
        n = str(n)
        env.setdefault("NUMBA_NUM_THREADS", n)
        env.setdefault("OPENBLAS_NUM_THREADS", n)
    if "numba" in sys.modules and "NUMBA_THREADING_LAYER" not in env:
        sys.modules["numba"].config.THREADING_LAYER = DEFAULTS["NUMBA_THREADING_LAYER"]
    for k, v in DEFAULTS.items():
        env.setdefault(k, v)
    keys = ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS",
            "OPENBLAS_THREAD_TIMEOUT")
    return {k: env.get(k) for k in keys}

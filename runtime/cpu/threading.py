"""Thread settings for numba's parallel kernels next to OpenBLAS's GEMM threads.

Must run before numba starts its thread pool (jitgraph imports numba only when compiling, and
calls `configure()` first; libgomp reads OMP_WAIT_POLICY when the pool starts). Every setting respects a value the user already exported:

  JITGRAPH_NUM_THREADS   threads for parallel kernels and BLAS (default: all cores); copied
                         into NUMBA_NUM_THREADS and OPENBLAS_NUM_THREADS when those are unset
  NUMBA_THREADING_LAYER  default "omp" (GNU OpenMP): ~1-2 us per parallel launch, against
                         ~75 us for "workqueue"
  OMP_WAIT_POLICY        default "PASSIVE": with the OpenMP default (active spinning) idle
                         OpenMP threads spin after each parallel kernel and starve OpenBLAS's
                         threads (a GEMM after a prange kernel ran 3x slower; whole MLP steps
                         10-16x slower, DESIGN.md). Passive makes each launch costlier, which
                         is why small kernels run serially (lower.PARALLEL_MIN_WORK). libgomp
                         reads it once, when it loads, and one libgomp serves the whole process
                         (numba's pool uses the copy another library, such as torch, loaded
                         first): so it is set at `import jitgraph`, and a libgomp loaded
                         before that with the variable unset gets a warning when jitgraph
                         first compiles (a 2-thread llama step: 197 ms after `import torch`
                         first, 122 ms with PASSIVE).
  OPENBLAS_THREAD_TIMEOUT default "4": OpenBLAS's threads spin for 2**N cycles after each GEMM
                         before sleeping (N=28 by default). Spinning, they take the cores from
                         the parallel kernel that follows: a dW GEMM + fused Adam update ran in
                         3.06 ms, against 1.10 ms with 4 (bench: MLP step at batch 100 3.0 ->
                         2.3 ms, batch 1000 16.2 -> 11.8 ms). Read when OpenBLAS loads, so
                         jitgraph sets it at import (before numpy and scipy load their OpenBLAS
                         when jitgraph is imported first); the GEMM library (blas.py, numpy's
                         OpenBLAS by default) is told again when numpy was imported first.
  JITGRAPH_BLAS_SERIAL_MAX GEMMs with m*n*k up to this bound (default: 2**22 on a quiet
                         machine, 2**26 while other processes hold the cores) run on one
                         OpenBLAS thread (blas.py): each GEMM OpenBLAS splits must wait for its
                         second thread to be scheduled, which on a busy machine cost 10-80 ms
                         per small GEMM (a 2-thread stories260K step 0.7-4.8 s against 0.1-0.6 s
                         with one thread; bench/llama_threads.py). 0 leaves every GEMM to
                         OpenBLAS's own choice.
  JITGRAPH_BLAS_SMALL_MNK one-thread GEMMs above this m*n*k are cut into tiles under it, for
                         OpenBLAS's small-matrix kernels (default 10^6 with its SkylakeX-class
                         kernels, else 0: never; blas.py)
"""
from __future__ import annotations

import os
import sys
import warnings

DEFAULTS = {"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "PASSIVE",
            "OPENBLAS_THREAD_TIMEOUT": "4"}


_EARLY_GOMP = []     # libgomp already loaded at `import jitgraph`, OMP_WAIT_POLICY unset then


def _loaded_libgomp() -> str | None:
    """Path of a libgomp mapped into this process (Linux: /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libgomp" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def set_blas_defaults() -> None:
    """Environment OpenBLAS and libgomp read when they load (called by `import jitgraph`, before
    numpy)."""
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", DEFAULTS["OPENBLAS_THREAD_TIMEOUT"])
    if "OMP_WAIT_POLICY" not in os.environ:
        early = _loaded_libgomp()
        if early:
            _EARLY_GOMP.append(early)
        os.environ["OMP_WAIT_POLICY"] = DEFAULTS["OMP_WAIT_POLICY"]


def configure() -> dict:
    """Set the defaults above for variables the user left unset; returns the effective values."""
    env = os.environ
    n = env.get("JITGRAPH_NUM_THREADS")
    if n:
        env.setdefault("NUMBA_NUM_THREADS", n)
        env.setdefault("OPENBLAS_NUM_THREADS", n)
    pool = sys.modules.get("numba.np.ufunc.parallel")
    if pool is not None and pool._is_initialized and env.get("OMP_WAIT_POLICY") is None:
        warnings.warn("jitgraph: numba's thread pool started before jitgraph configured "
                      "threading; set OMP_WAIT_POLICY=PASSIVE yourself to keep BLAS threads "
                      "from starving", RuntimeWarning, stacklevel=3)
    if _EARLY_GOMP and env.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        warnings.warn(f"jitgraph: an OpenMP runtime ({_EARLY_GOMP.pop()}) was loaded before "
                      "jitgraph, with OMP_WAIT_POLICY unset; numba's parallel kernels share it, "
                      "and its idle threads spin and starve OpenBLAS's (a 2-thread llama step "
                      "1.6x slower): import jitgraph before torch, or export "
                      "OMP_WAIT_POLICY=PASSIVE", RuntimeWarning, stacklevel=3)
    if "numba" in sys.modules and "NUMBA_THREADING_LAYER" not in env:
        sys.modules["numba"].config.THREADING_LAYER = DEFAULTS["NUMBA_THREADING_LAYER"]
    for k, v in DEFAULTS.items():
        env.setdefault(k, v)
    keys = ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS",
            "OPENBLAS_THREAD_TIMEOUT")
    return {k: env.get(k) for k in keys}

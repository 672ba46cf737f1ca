"""What every `jitgraph bench` report shares: the environment the figures depend on and the text
tables (used by cli/bench.py and cli/roofline.py)."""
from __future__ import annotations

import os
import platform
import sys


def environment() -> dict:
    """What the figures depend on: versions, cores, thread settings, the thread pools (BLAS
    kernels, OpenMP) threadpoolctl sees."""
    import numba
    import numpy
    from threadpoolctl import threadpool_info
    keys = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_WAIT_POLICY", "NUMBA_THREADING_LAYER",
            "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "JITGRAPH_NUM_THREADS")
    from jitgraph.runtime.cpu import blas
    return {"argv": sys.argv, "python": platform.python_version(), "numpy": numpy.__version__,
            "gemm": {"backend": blas.BACKEND, "library": blas.LIBRARY},
            "numba": numba.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
            "env": {k: os.environ.get(k) for k in keys},
            "threadpools": [{k: i.get(k) for k in ("internal_api", "version", "architecture",
                                                    "num_threads", "filepath")}
                            for i in threadpool_info()]}


def describe_environment(env) -> str:
    pools = ", ".join(" ".join(str(b[k]) for k in ("internal_api", "version", "architecture")
                               if b[k]) + f" x{b['num_threads']}" for b in env["threadpools"])
    line = f"# {env['cpus']} cpus, numba {env['numba']}, numpy {env['numpy']}; " \
           f"GEMMs: {env['gemm']['backend']}'s OpenBLAS; thread pools: {pools or 'none loaded'}"
    if env["env"]["OPENBLAS_CORETYPE"] or env["env"]["OPENBLAS_L2_SIZE"]:
        line += ("\n# note: OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE are set (slower sgemm); "
                 "run with `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE` as on a user's machine")
    return line


def table(header, lines) -> str:
    """Rows as text columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [header, *lines])

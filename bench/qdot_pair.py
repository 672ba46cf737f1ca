"""Decode's row dots (runtime/cpu/lib_qdot.py dot_rows) against another copy of lib_qdot.py
(another commit's, e.g. main's), side by side in one process: one thread, thread CPU time.

    python bench/qdot_pair.py --base /path/to/old/runtime/cpu/lib_qdot.py [--kinds q8_0,q4_k]
        [--n 8192] [--k 2048] [--repeat 9]

For each storage kind: W [N, K] random valid blocks (bench/quant_kernels.py stored_weight), one
row x; the median of `repeat` calls of each copy's dot_rows over all N rows, as elements/s
(N K over the time) and GB/s of weight read, the speed-up, and the largest difference between
the two results relative to the largest output. The base copy may take the older signature
with an accumulator scratch (acc float32[32] before n0, n1).
"""
import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time

os.environ["NUMBA_NUM_THREADS"] = os.environ["JITGRAPH_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402

from jitgraph.runtime.cpu import lib_qdot as D, lib_quant as L  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_kernels import stored_weight  # noqa: E402


def median_s(f, repeat):
    f()
    ts = []
    for _ in range(repeat):
        t = time.thread_time()
        f()
        ts.append(time.thread_time() - t)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--kinds", default="f16,bf16,q8_0,q4_0,q4_k,q6_k")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=9)
    a = ap.parse_args()
    # a copy in a temporary folder (numba caches its compiled code beside the file, never beside
    # the base's checkout), loaded as a sibling module of lib_qdot so its relative imports resolve
    tmp = tempfile.mkdtemp(prefix="qdot_base_")
    path = shutil.copy(a.base, os.path.join(tmp, "qdot_base.py"))
    spec = importlib.util.spec_from_file_location("jitgraph.runtime.cpu._qdot_base", path)
    base = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = base
    spec.loader.exec_module(base)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(a.k).astype(np.float32)
    print(f"N {a.n}, K {a.k}, one thread, load {os.getloadavg()[0]:.1f}")
    for name in a.kinds.split(","):
        w, kind = stored_weight(name, a.n, a.k), L.KINDS[name]
        ref, out = np.zeros(a.n, np.float32), np.zeros(a.n, np.float32)
        acc = np.zeros(32, np.float32)
        try:
            base.dot_rows(kind, 1.0, x, w[:1], 0.0, ref, 0, 1)
            old = lambda: base.dot_rows(kind, 1.0, x, w, 0.0, ref, 0, a.n)  # noqa: E731
        except TypeError:
            old = lambda: base.dot_rows(kind, 1.0, x, w, 0.0, ref, acc, 0, a.n)  # noqa: E731
        s0 = median_s(old, a.repeat)
        s1 = median_s(lambda: D.dot_rows(kind, 1.0, x, w, 0.0, out, 0, a.n), a.repeat)
        el = a.n * a.k
        print(f"{name:5s} base {el / s0 / 1e9:6.2f} Gel/s ({w.nbytes / s0 / 1e9:5.1f} GB/s)  "
              f"now {el / s1 / 1e9:6.2f} Gel/s ({w.nbytes / s1 / 1e9:5.1f} GB/s)  "
              f"x{s0 / s1:.2f}  diff {np.abs(out - ref).max() / np.abs(ref).max():.1e}",
              flush=True)


if __name__ == "__main__":
    main()

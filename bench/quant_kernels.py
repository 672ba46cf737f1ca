"""Quantized matmul (runtime/cpu/lib_quant.py qgemm) against float32 sgemm, side by side:
`python bench/quant_kernels.py [--paths] [--cpu] [--kinds q8_0,q4_k] [--repeat 15]`.

For each shape out [M, N] = x [M, K] @ W^T (a linear layer's forward, W [N, K]): jitgraph's f32
GEMM (runtime/cpu/blas.py gemm), numpy's matmul (OpenBLAS on its own threads) and qgemm for each
storage kind, as median milliseconds, GB/s of weight read (the weight's bytes as stored over the
time) and GFLOP/s (2 M N K over the time). Decode shapes (M = 1, N = 2048..8192, K = 2048) and
prefill shapes (M = 512). --cpu runs one thread and times it by the thread's CPU time (the
kernel's own cost on a busy shared machine), else wall time over all of numba's threads. --paths
times qgemm's two paths (W a row at a time in L1, "fused", against tiles on sgemm) for M = 1..32:
what FUSED_MAX_M rests on. Also runs under pytest-benchmark (`pytest bench/quant_kernels.py`:
qgemm q8_0 at a decode shape). Run with the OpenBLAS overrides unset (bench/README.md).
"""
import argparse
import os
import sys
import time

if "--cpu" in sys.argv:        # one thread throughout, set before numba loads
    os.environ["JITGRAPH_NUM_THREADS"] = os.environ["NUMBA_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402

from jitgraph.cli.roofline import host_header  # noqa: E402
from jitgraph.runtime.cpu import blas, lib_quant as L  # noqa: E402

CLOCK = time.thread_time if "--cpu" in sys.argv else time.perf_counter

RNG = np.random.default_rng(0)
DECODE = [(1, n, 2048) for n in (2048, 4096, 8192)]
PREFILL = [(512, n, 2048) for n in (2048, 8192)]
KINDS = ("f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
# byte offsets of each block's f16 scales (the rest of a block is random bytes)
SCALES = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def stored_weight(name, rows, k):
    """A random valid weight uint8[rows, row_bytes] of storage type `name`, sane scales."""
    kind = L.KINDS[name]
    if name in ("f16", "bf16"):
        return L.quantize_rows(kind, RNG.standard_normal((rows, k), dtype=np.float32))
    blk, nb = L.geometry(kind)
    w = RNG.integers(0, 256, (rows, k // blk, nb), dtype=np.uint8)
    for o in SCALES[name]:
        d = (RNG.uniform(0.5, 1.5, (rows, k // blk)) / 64).astype(np.float16)
        w[:, :, o:o + 2] = d.view(np.uint8).reshape(rows, k // blk, 2)
    return w.reshape(rows, -1)


def median_ms(f, repeat):
    f()
    ts = []
    for _ in range(repeat):
        t = CLOCK()
        f()
        ts.append(CLOCK() - t)
    return float(np.median(ts)) * 1e3


def row(label, ms, nbytes, flops):
    return (f"  {label:<14} {ms:9.3f} ms {nbytes / ms / 1e6:8.1f} GB/s "
            f"{flops / ms / 1e6:8.1f} GFLOP/s")


def compare(shapes, kinds, repeat):
    print(host_header())
    print(f"# numba threads {blas._POOL.value}; FUSED_MAX_M {L.FUSED_MAX_M}; out = x @ W^T; "
          f"{'thread CPU' if CLOCK is time.thread_time else 'wall'} time, median of {repeat}")
    for m, n, k in shapes:
        x = RNG.standard_normal((m, k), dtype=np.float32)
        out = np.empty((m, n), np.float32)
        w32 = RNG.standard_normal((n, k), dtype=np.float32)
        flops = 2.0 * m * n * k
        print(f"M={m} N={n} K={k}")
        print(row("f32 gemm", median_ms(lambda: blas.gemm(False, True, 1.0, x, w32, 0.0, out),
                                        repeat), w32.nbytes, flops))
        print(row("f32 numpy", median_ms(lambda: np.matmul(x, w32.T, out=out), repeat),
                  w32.nbytes, flops))
        for name in kinds:
            kind = L.KINDS[name]
            w = stored_weight(name, n, k)
            work = np.empty(L.qgemm_workspace(kind, m, n, k, blas._POOL.value), np.float32)
            ms = median_ms(lambda: L.qgemm(False, True, 1.0, x, w, 0.0, out, kind, work), repeat)
            print(row(name, ms, w.nbytes, flops))


def paths(kinds, repeat, n=4096, k=2048):
    print(host_header())
    print(f"# qgemm's paths, out [M, {n}] = x @ W^T, W [{n}, {k}]: ms (fused / tiles)")
    for name in kinds:
        kind = L.KINDS[name]
        w = stored_weight(name, n, k)
        cells = []
        for m in (1, 2, 4, 8, 16, 32):
            x = RNG.standard_normal((m, k), dtype=np.float32)
            out = np.empty((m, n), np.float32)
            work = np.empty(L.qgemm_workspace(kind, 64, n, k, blas._POOL.value), np.float32)
            f, t = (median_ms(lambda: L.qgemm_path(False, True, 1.0, x, w, 0.0, out, kind, work,
                                                   fused), repeat) for fused in (True, False))
            cells.append(f"M={m}: {f:.2f}/{t:.2f}")
        print(f"  {name:<6} " + "  ".join(cells))


def test_qgemm_q8_0(benchmark):
    """pytest-benchmark: qgemm q8_0 at a decode shape."""
    kind, (m, n, k) = L.KINDS["q8_0"], DECODE[1]
    x, out = RNG.standard_normal((m, k), dtype=np.float32), np.empty((m, n), np.float32)
    w = stored_weight("q8_0", n, k)
    work = np.empty(L.qgemm_workspace(kind, m, n, k, blas._POOL.value), np.float32)
    benchmark(L.qgemm, False, True, 1.0, x, w, 0.0, out, kind, work)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", action="store_true", help="time qgemm's fused and tile paths")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--cpu", action="store_true", help="one thread, timed by its CPU time")
    ap.add_argument("--only", choices=("decode", "prefill"), default=None)
    a = ap.parse_args(argv)
    kinds = [s for s in a.kinds.split(",") if s]
    bad = [s for s in kinds if s not in L.KINDS]
    if bad:
        sys.exit(f"--kinds: unknown storage types {bad}; expected some of {', '.join(KINDS)}")
    if a.paths:
        paths(kinds, a.repeat)
        return
    shapes = {"decode": DECODE, "prefill": PREFILL}.get(a.only, DECODE + PREFILL)
    compare(shapes, kinds, a.repeat)


if __name__ == "__main__":
    main()

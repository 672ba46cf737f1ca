"""bf16 GEMM with AVX512-BF16 (runtime/cpu/bf16gemm.py) against the conversion path a bf16
program's GEMM runs today (both operands cast to f32, then OpenBLAS sgemm in blas.gemm's
bands) and against sgemm alone on the f32 values, on one thread and two, on the GEMMs of the
128-wide llama step and the 1B's: the forward product and its backward ones (dX = dY W^T,
dW = X^T dY). GFLOP/s (2 m n k over the best of --repeat), each against sgemm alone.

    python bench/bf16_gemm.py [--repeat 7] [--threads 1 2] [--only llama|1b]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

# (model, forward m, n, k): x [m, k] times w [k, n]
FORWARD = [("llama128", 2048, 128, 128), ("llama128", 2048, 352, 128),
           ("llama128", 2048, 128, 352), ("1b", 512, 2048, 2048), ("1b", 512, 8192, 2048),
           ("1b", 512, 2048, 8192)]


def products(m, n, k):
    """(name, ta, tb, M, N, K) of forward x[m,k] w[k,n] and its two backward GEMMs."""
    return [("y=xw", False, False, m, n, k), ("dx=dy w^T", False, True, m, k, n),
            ("dw=x^T dy", True, False, k, n, m)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--only", choices=("llama", "1b"))
    args = p.parse_args(argv)

    from jitgraph.cli.roofline import host_header
    from jitgraph.runtime.cpu.threading import configure
    configure()
    import numba
    from numba import njit, prange
    from jitgraph.runtime.cpu import bf16gemm, blas

    print(host_header())
    if not bf16gemm.available():
        print("# this CPU has no AVX512-BF16: nothing to measure")
        return

    @njit(parallel=True, nogil=True, cache=True)
    def widen(h, out):
        """f32 of bf16 bits, as a GEMM prologue converts an operand."""
        hf, of = h.reshape(-1), out.reshape(-1)
        for i in prange(hf.shape[0]):
            of[i] = (np.uint32(hf[i]) << np.uint32(16))
        return out

    rng = np.random.default_rng(0)

    def bf16(shape):
        u = rng.standard_normal(shape, dtype=np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    def best(fn):
        fn()
        ts = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    pool = blas._POOL.value
    print(f"# bf16gemm: MR={bf16gemm.MR} NR={bf16gemm.NR} KC={bf16gemm.KC} (k-pairs) "
          f"MC={bf16gemm.MC}; numba pool {numba.config.NUMBA_NUM_THREADS} threads")
    print(f"{'model':9} {'gemm':10} {'ta':>2} {'tb':>2} {'M':>5} {'N':>5} {'K':>5} {'thr':>3} "
          f"{'sgemm':>7} {'cvt+sg':>7} {'bf16':>7} {'bf16/sg':>7} {'bf16/cvt':>8}")
    for model, m0, n0, k0 in FORWARD:
        if args.only and not model.startswith(args.only):
            continue
        for name, ta, tb, m, n, k in products(m0, n0, k0):
            a = bf16((k, m) if ta else (m, k))
            b = bf16((n, k) if tb else (k, n))
            af, bf = widen(a, np.empty(a.shape, np.uint32)).view(np.float32), \
                widen(b, np.empty(b.shape, np.uint32)).view(np.float32)
            ca, cb = np.empty(a.shape, np.uint32), np.empty(b.shape, np.uint32)
            c = np.zeros((m, n), np.float32)
            flop = 2.0 * m * n * k
            for t in args.threads:
                t = min(t, numba.config.NUMBA_NUM_THREADS)
                numba.set_num_threads(t)
                blas._POOL.value = t
                ws = bf16gemm.workspace(m, n, k, t)
                s = best(lambda: blas.gemm(ta, tb, 1.0, af, bf, 0.0, c))

                def convert():
                    blas.gemm(ta, tb, 1.0, widen(a, ca).view(np.float32),
                              widen(b, cb).view(np.float32), 0.0, c)
                cv = best(convert)
                h = best(lambda: bf16gemm.gemm_bf16(ta, tb, 1.0, a, b, 0.0, c, *ws))
                g = [flop / x / 1e9 for x in (s, cv, h)]
                print(f"{model:9} {name:10} {int(ta):>2} {int(tb):>2} {m:>5} {n:>5} {k:>5} "
                      f"{t:>3} {g[0]:7.1f} {g[1]:7.1f} {g[2]:7.1f} {g[2] / g[0]:7.2f}x "
                      f"{g[2] / g[1]:7.2f}x", flush=True)
    blas._POOL.value = pool


if __name__ == "__main__":
    main()

"""Per-kernel timing and the roofline of a compiled program (`jitgraph bench --roofline`,
bench/profile_kernels.py).

`time_kernels` calls each kernel's C entry point on the program's own buffers, in step order
(one pass over the kernels per round, after feeding the inputs, as the driver runs them: each
kernel finds the caches as the kernels before it left them) or kernel by kernel (each one
`repeat` times in a row, its data hot in cache; sound only without memory planning, as a
kernel may overwrite what it reads). `roofline` sets each kernel's time against the machine's
peaks, measured at the start (`peaks`): sgemm 1024^3 (numpy's BLAS, every thread) for
arithmetic, a parallel stream copy (numba prange over 64 MB, from DRAM) for memory. A kernel's
flops are its nodes' op costs (jitgraph/registry.py `cost`: one per element of an elementwise
op, exp and tanh included; 2mnk per GEMM), its bytes what crosses its boundary (passes/fuse.py
`bytes_of`); its bound is the larger of flops / peak GFLOP/s and bytes / peak GB/s, and `roof`
is that bound over the measured time: 100% runs at the machine's limit, 5% far from it.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import NamedTuple

import numpy as np

from .report import describe_environment, environment, table


class KernelTime(NamedTuple):
    kernel: object         # passes/fuse.py Kernel
    seconds: float         # median over the rounds, all of the kernel's calls together


def _calls(prog, fed):
    """(kernel, C entry point, addresses) of each call of the program's step, in order; `fed`:
    what prog._feed returned (keeps the inputs the io table points at alive)."""
    kernels = {k.root: k for k in prog._products.kernels.kernels}
    out = []
    for nid, name, addrs, dims in prog._products.module.calls:
        fn = getattr(sys.modules[f"jitgraph_cache.{name}"], name).ctypes
        out.append((kernels[nid], fn, [prog._address(b, off) for b, off in addrs] + list(dims)))
    return out


def time_kernels(prog, inputs, repeat=20, in_order=True) -> list:
    """[KernelTime] of prog's kernels in step order (see the module docstring)."""
    prog.step(**inputs)
    fed = prog._feed(inputs)
    calls = _calls(prog, fed)
    times = np.zeros((repeat, len(calls)))
    order = [(r, c) for r in range(repeat) for c in range(len(calls))] if in_order else \
        [(r, c) for c in range(len(calls)) for r in range(repeat)]
    for r, c in order:
        if in_order and c == 0:
            fed = prog._feed(inputs)
        _, fn, args = calls[c]
        t = time.perf_counter()
        fn(*args)
        times[r, c] = time.perf_counter() - t
    per = {}
    for (k, _, _), s in zip(calls, np.median(times, axis=0)):
        per[k.id] = (k, per.get(k.id, (k, 0.0))[1] + float(s))
    return [KernelTime(k, s) for k, s in per.values()]


def describe(graph, kernel, width=60) -> str:
    """`k<id> kind: %<node> op ...` shortened to `width` characters, and the root's type."""
    ops = " ".join(f"%{i} {graph.nodes[i].op}" for i in kernel.nodes)
    head = f"k{kernel.id} {kernel.kind}: "
    if len(head) + len(ops) > width:
        ops = ops[:max(0, width - len(head) - 3)] + "..."
    return f"{head}{ops} : {graph.nodes[kernel.root].type}"


# ---- the machine's peaks -------------------------------------------------------------------
def sgemm_gflops(n=1024, repeat=7, best=False) -> float:
    """float32 GEMM n^3 through numpy's BLAS (every thread), GFLOP/s: the median of `repeat`,
    or (`best`) the fastest."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    b, c = a.copy(), np.empty_like(a)
    np.dot(a, b, out=c)
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        np.dot(a, b, out=c)
        ts.append(time.perf_counter() - t)
    return 2 * n ** 3 / (min(ts) if best else statistics.median(ts)) / 1e9


def host_header() -> str:
    """The lines every bench table starts with: the environment and the host's sgemm rate."""
    lines = []
    try:
        lines.append(describe_environment(environment()))
    except Exception as e:          # noqa: BLE001 - the header is informative only
        lines.append(f"# environment: unavailable ({type(e).__name__}: {e})")
    lines.append(f"# host sgemm (numpy, 1024^3, median of 7): {sgemm_gflops():.0f} GFLOP/s")
    return "\n".join(lines)


def stream_gbps(nbytes=64 << 20, repeat=7) -> float:
    """A parallel copy of `nbytes` (numba prange, the kernels' threads; 2 x 64 MB: from DRAM,
    beyond the L3 of the machines here): GB/s read + written, the fastest of `repeat`."""
    from jitgraph.runtime.cpu.threading import configure
    configure()                     # the kernels' thread settings, before numba's pool starts
    from numba import njit, prange

    @njit(parallel=True, nogil=True)
    def copy(src, dst):
        for i in prange(src.shape[0]):
            dst[i] = src[i]
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    copy(src, dst)
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        copy(src, dst)
        ts.append(time.perf_counter() - t)
    return 2 * nbytes / min(ts) / 1e9


def peaks() -> dict:
    """The machine's peaks: the fastest of 7 sgemm 1024^3 and of 7 parallel copies. A kernel
    whose data stays in cache can beat the copy's DRAM rate (a roof above 100%)."""
    return {"sgemm_gflops": sgemm_gflops(best=True), "stream_gbps": stream_gbps()}


# ---- the roofline -------------------------------------------------------------------------
def roofline(prog, inputs, peak, repeat=20) -> dict:
    """The step's median time and, per kernel in step order: seconds, flops, bytes, achieved
    GFLOP/s and GB/s, the bound ("compute" or "memory") and `roof` (bound time / time)."""
    kg, g = prog._products.kernels, prog.graph
    steps = []
    for _ in range(repeat):
        t = time.perf_counter()
        prog.step(**inputs)
        steps.append(time.perf_counter() - t)
    rows = []
    for kt in time_kernels(prog, inputs, repeat):
        k, s = kt
        flops, nbytes = kg.flops_of(k), kg.bytes_of(k)
        tf, tb = flops / (peak["sgemm_gflops"] * 1e9), nbytes / (peak["stream_gbps"] * 1e9)
        rows.append({"kernel": describe(g, k), "id": k.id, "kind": k.kind, "seconds": s,
                     "flops": flops, "bytes": nbytes, "gflops": flops / s / 1e9,
                     "gbps": nbytes / s / 1e9, "bound": "compute" if tf >= tb else "memory",
                     "roof": max(tf, tb) / s})
    return {"step_s": statistics.median(steps), "kernels": rows}


def format_roofline(name, result, peak) -> str:
    rows = result["kernels"]
    total = sum(r["seconds"] for r in rows)
    lines = [[r["kernel"], f"{r['seconds'] * 1e6:.1f}", f"{100 * r['seconds'] / total:.0f}%",
              f"{r['gflops']:.1f}", f"{r['gbps']:.1f}",
              f"{r['flops'] / r['bytes']:.2f}" if r["bytes"] else "-", r["bound"],
              f"{100 * r['roof']:.0f}%"] for r in rows]
    head = f"{name}: step {result['step_s'] * 1e3:.3f} ms, kernels {total * 1e3:.3f} ms " \
           f"(peaks: sgemm {peak['sgemm_gflops']:.0f} GFLOP/s, copy {peak['stream_gbps']:.1f} GB/s)"
    return head + "\n" + table(["kernel", "us", "share", "GFLOP/s", "GB/s", "flop/B", "bound",
                                 "roof"], lines)

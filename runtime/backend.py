"""The backend interface: what a target gives the compiler and the executor.

jitgraph/compiler.py runs the pipeline of passes (passes/, which knows no backend), then calls
the target's backend; runtime/executor.py's Program runs what the backend built. A new target
(runtime/cuda) is one more class with these members in BACKENDS, and no change to passes/:

  kinds         what it can fuse: the kernel kinds of passes/fuse.py it lowers, "node" (one op
                alone) and the fused kinds; the compiler refuses a kernel graph with another.
  generate(kernels, plan) -> (module, source)
                lowering: every kernel of the KernelGraph, in order, reading and writing values
                where the MemoryPlan puts them (a region and offset; inputs and outputs through
                the per-call pointer table); a fused kernel by its kind, a lone node
                through the lowering table (op -> code; CPU: runtime/cpu/codegen.lower_node),
                then the driver calling them in order. `source`: the text
                `Program.ir("kernels")` shows; `module.workspace_bytes`: scratch bytes the
                arena needs after the plan's values.
  build(module) -> (driver, stats)
                module build: compile it, or load it from the kernel cache (runtime/cache.py);
                `stats`: what the build did (kernels compiled and loaded, seconds, BLAS).
  allocate(nbytes) -> region,  view(region, slot, type) -> array
                buffer allocation: the two regions, allocated once per program (the arena:
                plan.arena_bytes + workspace; the persistent region: params and optimizer
                state) and the program's own output buffers, and the value at a plan Slot as an
                array of its type, through which the Program reads outputs and params (numpy
                arrays: on the CPU the regions are host memory).
  address(array) -> int
                where a numpy array (exactly np.ndarray, no subclass) lies: an array of
                `allocate`, or a caller's input or output array (its entry in the io table).
  driver(arena, persist, io)
                program run: one whole step (forward, backward, update), one call. `io`: the
                per-call pointer table (int64 addresses, plan.pointers entries): entry
                `slot.pointer` of every "input" slot is where the caller's array (or the
                program's converted copy) lies, of every "output" slot where the output is to be
                written (the program's own buffer or the caller's array).
  driver(arena, persist, io, phase)
                with an update boundary (`kernels.boundary` is not None, passes/boundary.py):
                phase 1 runs `kernels.kernels[:boundary]` (forward, backward, accumulation) and
                zeroes `plan.pads`; phase 2 the rest (clipping, optimizer, guard) and the copies
                into params; phase 0 both. Between the two the Program calls the user's hook
                with views of `plan.gradients` / `plan.buckets` (arena bytes the hook may change
                in place: an MPI all-reduce, a non-finite check), so a backend must leave the
                gradients in host-visible (or hook-visible) memory at the end of phase 1 and
                read them back in phase 2. The passes guarantee the rest: no kernel spans the
                boundary (no update in a GEMM epilogue), every gradient is in memory, in one
                contiguous bucket per dtype. Without a hook none of this changes a program.

Not built yet, written down for the CUDA backend: capture of a whole step for replay (CUDA
graphs). The products make a step capturable: a fixed kernel sequence over fixed addresses
(arena and persistent region allocated once; `plan.pointers` the only per-call addresses) with
no host decision inside a phase. A CUDA backend would capture `driver` once per distinct `io`
table (the inputs staged into fixed device buffers, so one capture serves every call) and
replay it; the per-step scalars (`opt/lr`, `opt/step`, `opt/apply`) already live in buffers of
the program's own whose addresses never change. With an update boundary it captures phase 1
and phase 2 as two graphs and runs the hook between the replays (an NCCL or CUDA-aware MPI
all-reduce on the device bucket could itself be captured into the phase-1 graph when the hook
is known to be one). What stays outside a capture: the index-range check and the guard's flag
read (host reads after the replay), and changing `io` (a caller's output array): a new
capture, or a copy from the program's buffer.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from . import cache

ALIGN = 64   # bytes: regions start on a cache line


class CPU:
    """numba on the host (runtime/cpu): C-callable kernels and one @njit driver per program."""
    name = "cpu"
    kinds = frozenset(("node", "elementwise", "gemm", "rows", "reduce", "cross_entropy"))

    def __init__(self):
        from .cpu.threading import configure
        configure()           # before numba starts its thread pool
        from .cpu.pointers import address
        self.address = address      # a numba function: ~0.2 us a call (every input, every step)

    def generate(self, kernels, plan):
        from .cpu.codegen import generate
        gen = generate(kernels, plan, cache.module_name)
        return gen, gen.driver_source + "\n\n" + "\n\n".join(gen.kernels.values())

    def build(self, gen):
        t0 = time.perf_counter()
        before = dict(cache.COUNTS)
        reused = sum(f"jitgraph_cache.{k}" in sys.modules for k in gen.kernels)
        try:
            driver = _compile_driver(gen)
        except Exception:
            # A corrupt or stale numba cache entry: drop the machine code, rebuild from source once.
            for name in [gen.driver, *gen.kernels]:
                cache.purge(cache.cache_dir() / f"{name}.py")
            driver = _compile_driver(gen, fresh=True)
        counts = {k: cache.COUNTS[k] - before.get(k, 0) for k in ("compiled", "loaded")}
        from .cpu import blas
        return driver, {
            "kernel_functions": len(gen.kernels), "calls_per_step": gen.n_calls,
            "kernels_compiled": counts["compiled"], "kernels_loaded": counts["loaded"],
            "kernels_reused": reused, "driver_cached": bool(sum(driver.stats.cache_hits.values())),
            "numba_seconds": time.perf_counter() - t0, "workspace_bytes": gen.workspace_bytes,
            "cache_dir": str(cache.cache_dir()), "gemm_library": f"{blas.BACKEND}: {blas.LIBRARY}"}

    def allocate(self, nbytes):
        buf = np.zeros(nbytes + ALIGN, np.uint8)
        off = (-buf.ctypes.data) % ALIGN
        return buf[off:off + nbytes]

    def view(self, region, slot, t):
        return region[slot.offset:slot.offset + slot.nbytes].view(t.np_dtype).reshape(t.shape)


def _compile_driver(gen, fresh=False):
    """Write the modules, import the driver (which loads or compiles every kernel) and compile
    or load the driver itself; returns the driver dispatcher."""
    from numba import types
    for name, text in gen.kernels.items():
        path, _ = cache.store(name, text)
        if fresh:
            cache.load(path, fresh=True)
    dpath, _ = cache.store(gen.driver, gen.driver_source)
    driver = getattr(cache.load(dpath, fresh), gen.driver)
    region = types.Array(types.uint8, 1, "C")
    io = types.Array(types.int64, 1, "C")
    driver.compile((region, region, io) if gen.phases == 1 else (region, region, io, types.int64))
    return driver


BACKENDS = {"cpu": CPU, "cuda": lambda: __import__(   # runtime/cuda: numba-cuda loaded on use
    "jitgraph.runtime.cuda.backend", fromlist=["CUDA"]).CUDA()}


def get_backend(target: str):
    """The backend compiling for `target`; a ValueError names the known targets."""
    if target not in BACKENDS:
        raise ValueError(f"compile: unknown target {target!r}; expected "
                         f"{', '.join(repr(k) for k in BACKENDS)}")
    return BACKENDS[target]()

"""The CPU backend (runtime/backend.py's Backend): numba kernels on the host, each a C-callable
cfunc in the content-hashed kernel cache (runtime/cpu/cache.py), and per program one driver in
LLVM IR calling them in order (Driver, compiled by llvmlite).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from jitgraph.plan import ALIGN   # bytes: regions start on a cache line, as every slot

from . import cache


F16 = np.dtype(np.float16)


class CPU:
    """numba on the host: C-callable kernels, and per program one driver in LLVM IR
    calling them (compiled by llvmlite)."""
    name = "cpu"
    kinds = frozenset(("node", "elementwise", "gemm", "gemm_accumulate", "rows", "reduce",
                       "cross_entropy", "attention_store", "window", "half_stored"))

    def __init__(self):
        from . import bf16gemm
        if bf16gemm.enabled():      # GEMMs on bf16 buffers run vdpbf16ps (read at compile)
            self.kinds = CPU.kinds | {"gemm_bf16"}
        from .threading import configure
        configure()           # before numba starts its thread pool
        from .pointers import address

        def typed_address(a):
            # numba types no float16 array (an f16 value): its bits' view lies at the same place
            return address(a.view(np.uint16) if a.dtype == F16 else a)
        self.address = typed_address    # numba's, cheaper than ctypes (every input, step)
        from .blas import adapt
        self.before_step = adapt    # the Program calls it before each step: the one-thread
                                    # bound of small GEMMs follows the machine's load

    def check_fits(self, plan, gen, shared_params=False):
        """A MemoryError, before anything is compiled, when the program's memory (the arena
        with its workspace and the output buffers, and the persistent region unless it shares
        another program's) exceeds the host memory available now."""
        from .memory import available
        arena = plan.arena_bytes + gen.workspace_bytes
        arena += sum(s.nbytes for s in plan.outputs.values())
        need = arena + (0 if shared_params else plan.persist_bytes)
        have = available()
        if have is not None and need > have[0]:
            raise MemoryError(f"the program needs {_gib(need)} of memory (arena, scratch and "
                              f"outputs {_gib(arena)}, persistent {_gib(plan.persist_bytes)}), "
                              f"{_gib(have[0])} is available ({have[1]})")

    def generate(self, kernels, plan):
        from .codegen import generate
        gen = generate(kernels, plan, cache.module_name)
        return gen, gen.driver_source + "\n\n" + "\n\n".join(gen.kernels.values())

    def build(self, gen):
        t0 = time.perf_counter()
        before = dict(cache.COUNTS)
        reused = sum(f"jitgraph_cache.{k}" in sys.modules for k in gen.kernels)
        try:
            driver, cached = _build_driver(gen)
        except Exception:
            # A corrupt or stale numba cache entry: drop the machine code, rebuild from source once.
            for name in gen.kernels:
                cache.purge(cache.cache_dir() / f"{name}.py")
            driver, cached = _build_driver(gen, fresh=True)
        counts = {k: cache.COUNTS[k] - before.get(k, 0) for k in ("compiled", "loaded")}
        from . import blas
        return driver, {
            "kernel_functions": len(gen.kernels), "calls_per_step": gen.n_calls,
            "kernels_compiled": counts["compiled"], "kernels_loaded": counts["loaded"],
            "kernels_reused": reused, "driver_cached": cached,
            "driver_seconds": driver.compiled.seconds,
            "numba_seconds": time.perf_counter() - t0, "workspace_bytes": gen.workspace_bytes,
            "cache_dir": str(cache.cache_dir()), "gemm_library": f"{blas.BACKEND}: {blas.LIBRARY}"}

    def allocate(self, nbytes):
        buf = np.zeros(nbytes + ALIGN, np.uint8)
        off = (-buf.ctypes.data) % ALIGN
        return buf[off:off + nbytes]

    def view(self, region, slot, t):
        return region[slot.offset:slot.offset + slot.nbytes].view(t.np_dtype).reshape(
            t.storage_shape)


def _gib(n) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 27 else f"{n / (1 << 20):.1f} MiB"


def _build_driver(gen, fresh=False):
    """Write the modules, load (or compile) every kernel, registering its symbol, then compile
    the driver's LLVM IR; returns (the step function, True if the driver's text was already in
    the cache)."""
    paths = [cache.store(name, text)[0] for name, text in gen.kernels.items()]
    cache.load_kernels(paths, fresh)
    _, written = cache.store(gen.driver, gen.driver_source, ".ll")
    return Driver(gen.driver, gen.driver_source, gen.phases).function(), not written


class Driver:
    """A program's driver (runtime/cpu/codegen.py: LLVM IR calling the kernels' registered
    symbols) compiled by llvmlite's MCJIT at optimisation level 0: straight-line calls need no
    optimisation, so the compile stays short however many calls (numba's typing and
    optimisation of one @njit driver grew with every kernel call; bench/README.md: "Figures
    behind the code", the driver).
    `function()` is what runs a step, `driver(arena, persist, io[, phase])`: the three arrays'
    addresses are stored into the module's `ctx` cell when other arrays than the last ones are
    passed (a Program's never move; they are held so their addresses stay valid), then
    `<driver>.run(phase)` is called through ctypes (which releases the GIL, as the
    @njit(nogil=True) driver did)."""

    def __init__(self, name, text, phases):
        import ctypes

        from llvmlite import binding
        t0 = time.perf_counter()
        binding.initialize_native_target()
        binding.initialize_native_asmprinter()
        module = binding.parse_assembly(text)
        module.name = name
        module.verify()
        tm = binding.Target.from_default_triple().create_target_machine(
            cpu=binding.get_host_cpu_name(), opt=0, codemodel="jitdefault")
        module.triple, module.data_layout = tm.triple, str(tm.target_data)
        self._engine = binding.create_mcjit_compiler(module, tm)   # owns the module
        self._engine.finalize_object()
        run = self._engine.get_function_address(f"{name}.run")
        ctx = self._engine.get_global_value_address(f"{name}.ctx")
        if not run or not ctx:
            raise RuntimeError(f"driver {name}: no code after compiling its LLVM IR")
        self.name, self.phases = name, phases
        # no argtypes: the phase, a Python int, passes as a C int (the thunk's i32), the
        # cheapest ctypes call there is (argtypes add a conversion per call)
        self._run = ctypes.CFUNCTYPE(None)(run)
        self._ctx = (ctypes.c_int64 * 3).from_address(ctx)
        self._held = [None, None, None]
        self.seconds = time.perf_counter() - t0

    def function(self):
        """The step function: a plain function, not a bound method (whose call costs more,
        every step)."""
        run, bind, held = self._run, self._bind, self._held

        def driver(arena, persist, io, phase=0):
            if arena is not held[0] or persist is not held[1] or io is not held[2]:
                bind(arena, persist, io)
            run(phase)
        driver.compiled = self          # holds the engine, the machine code's owner
        return driver

    def _bind(self, arena, persist, io):
        for a, dt in ((arena, np.uint8), (persist, np.uint8), (io, np.int64)):
            if type(a) is not np.ndarray or a.dtype != dt or not a.flags.c_contiguous:
                raise TypeError(f"driver: expected C-contiguous {np.dtype(dt)} arrays (arena, "
                                f"persist, io), got {type(a).__name__} {getattr(a, 'dtype', '')}")
        self._ctx[:] = [arena.ctypes.data, persist.ctypes.data, io.ctypes.data]
        self._held[:] = [arena, persist, io]

"""The CUDA backend (runtime/backend.py's interface): numba-cuda kernels over device memory.

Memory. `allocate` gives device memory (a runtime/cuda/device.Region), zeroed: the Program
(runtime/executor.py, unchanged) allocates its arena block (the plan's arena, the scratch space,
its own output buffers) and the persistent region (params, optimizer state) once, so params and
optimizer state live on the device across steps. `view` gives device.DeviceView: what the
Program reads (outputs, params: one device-to-host copy each) and writes (params, the
optimizer's per-step scalars: one host-to-device copy each).

A step. The Program fills the io table as on the CPU: an input's entry is the caller's host
array (or its converted copy: then a device buffer of the backend's), an output's entry the
Program's own device buffer or, with step_into, the caller's host array. The driver resolves
each entry: an address inside one of this backend's allocations is device memory (used where it
lies); any other is host memory, copied into a device staging buffer of the driver's (inputs,
allocated once) before the launches, or from one (outputs) after them. So a step moves the
inputs up (through pinned host buffers), runs the launches (runtime/cuda/generate.py) on the
driver's one stream, or from the second step on replays them as one CUDA graph per phase
(runtime/cuda/graphs.py: JITGRAPH_CUDA_GRAPHS), and copies the outputs down; nothing is
allocated per step after the first.
"""
from __future__ import annotations

import time

import numpy as np

from . import device, gemm
from .kernel import Ref
from .gemm import describe

KINDS = frozenset(("node", "elementwise", "gemm", "rows", "reduce", "cross_entropy"))


class CUDA:
    """numba-cuda on an NVIDIA GPU (or numba's simulator, NUMBA_ENABLE_CUDASIM=1)."""
    name = "cuda"
    kinds = KINDS
    before_step = None      # nothing to adjust between steps

    def __init__(self):
        self.cuda = device.require()
        self.simulator = device.simulated()
        if self.simulator:
            device.fix_simulator()
        self._allocs = []          # (start, end, Region) of every allocation of this backend
        # the simulator runs every thread as a Python thread: small blocks, few of them
        self.tpb, self.tile, self.max_blocks = (8, 4, 2) if self.simulator else (256, 16, 4096)

    # ---- generate / build -----------------------------------------------------------------
    def generate(self, kernels, plan):
        from .generate import generate, listing
        # half values (f16, bf16) are read and written by the kernels (runtime/cuda/halfconv.py);
        # the block-quantized storage types (q8_0, ...) are not
        stored = [n for n in kernels.graph.nodes if n.type.is_storage and not n.type.is_half]
        if stored:
            raise NotImplementedError(
                f"the cuda backend does not read storage types yet: %{stored[0].id} "
                f"({stored[0].attr.get('name', stored[0].op)}) is {stored[0].type}; "
                f"use target='cpu' or f32")
        converted = [n for n in kernels.graph.nodes if n.attr.get("xq") is not None]
        if converted:
            raise NotImplementedError(
                f"the cuda backend has no dots on x converted as ggml's CPU does: %"
                f"{converted[0].id} = {converted[0].op} has xq={converted[0].attr['xq']}; use "
                f"target='cpu' or the exact dots (no jitgraph.dots.ggml_dots, --dot exact)")
        gen = generate(kernels, plan, self.tpb, self.tile, self.max_blocks)
        return gen, listing(gen, kernels.graph)

    def build(self, gen):
        t0 = time.perf_counter()
        self._check_fits(gen)
        ns = {}
        exec(compile(gen.source, "<jitgraph cuda kernels>", "exec"), ns)
        kernels = {k: self.cuda.jit(ns[k]) for k in gen.kernels}
        driver = Driver(self, gen, kernels, ns)
        return driver, {"kernel_functions": len(gen.kernels), "calls_per_step": len(gen.launches),
                        "kernels_compiled": len(gen.kernels), "kernels_loaded": 0,
                        "kernels_reused": 0, "driver_cached": False,
                        "numba_seconds": time.perf_counter() - t0,
                        "workspace_bytes": gen.workspace_bytes,
                        "gemm_library": describe(driver.gemm_library, gen.tile),
                        "device": "simulator" if self.simulator else _device_name(self.cuda),
                        "cuda_graphs": driver.graph_stats["mode"]}

    def check_fits(self, plan, gen, shared_params=False):
        """Device memory is checked at build (_check_fits), with the staged inputs."""

    def _check_fits(self, gen):
        """A clear error when the program's planned bytes exceed the device's free memory."""
        need = sum(gen.plan_bytes.values()) + sum(n for n, _, _ in gen.inputs.values())
        try:
            free, total = self.cuda.current_context().get_memory_info()
        except Exception:        # noqa: BLE001 - a context that cannot say: let allocation fail
            return
        if need > free:
            parts = ", ".join(f"{k} {v} B" for k, v in gen.plan_bytes.items())
            raise MemoryError(f"target cuda: the program needs {need} B of device memory "
                              f"({parts}, inputs staged), the device has {int(free)} B free of "
                              f"{int(total)} B")

    # ---- memory ---------------------------------------------------------------------------
    def allocate(self, nbytes):
        """`nbytes` of zeroed device memory, starting on a 256-byte boundary."""
        try:
            dev = self.cuda.to_device(np.zeros(nbytes + device.ALIGN, np.uint8))
        except Exception as e:   # noqa: BLE001 - the driver's out-of-memory error, named
            raise MemoryError(f"target cuda: cannot allocate {nbytes} B of device memory: "
                              f"{e}") from e
        off = (-device.device_pointer(dev)) % device.ALIGN
        r = device.Region(dev, off, nbytes)
        self._allocs.append((r.ptr, r.ptr + max(nbytes, 1), r))
        return r

    def view(self, region, slot, t):
        return device.DeviceView(region, slot.offset, t.shape, t.np_dtype)

    def address(self, a) -> int:
        if isinstance(a, (device.Region, device.DeviceView)):
            return a.ptr
        return a.__array_interface__["data"][0]

    def find(self, addr: int, nbytes: int):
        """(Region, offset) when [addr, addr + nbytes) lies in a device allocation of this
        backend; None: host memory (a caller's array)."""
        for lo, hi, r in self._allocs:
            if lo <= addr and addr + nbytes <= hi:
                return r, addr - r.ptr
        return None


def _device_name(cuda) -> str:
    try:
        d = cuda.get_current_device()
        name = d.name.decode() if isinstance(d.name, bytes) else d.name
        return f"{name} (sm_{d.compute_capability[0]}{d.compute_capability[1]})"
    except Exception:     # noqa: BLE001
        return "cuda"


class Driver:
    """driver(arena, persist, io[, phase]): one step, the launches of runtime/cuda/generate.py
    over device arrays, all on one stream of the driver's. The launch configurations and every
    launch's argument list are built once and rebuilt only when the arena, the persistent
    region or a buffer behind the io table changes (a caller's output array with step_into, a
    fed-back device view). A caller's host input is copied into a pinned staging buffer and
    up from there (asynchronously, on the stream), an output down into one and then into the
    caller's array after the stream is synchronised. From the second step on the launches of
    each phase run as one CUDA graph where graphs are enabled (runtime/cuda/graphs.py), plain
    launches otherwise; `graph_stats` counts captures and replays."""

    def __init__(self, backend, gen, kernels, namespace):
        from . import graphs
        self.backend, self.gen, self.cuda = backend, gen, backend.cuda
        self.kernels = kernels
        self.python = namespace            # the kernels as Python functions (PTX checks)
        self._views = {}                   # (region id, byte offset, shape, dtype) -> array
        self._staging = {}                 # io pointer -> Region for host memory behind it
        self._pinned = {}                  # io pointer -> pinned host array (its staging)
        self._key, self._args = None, None
        self.stream = self.cuda.stream()
        self.gemm_library = gemm.library(backend.simulator)
        self._launch = [(self._library_gemm(ln) or
                         kernels[ln.kernel][ln.grid, ln.block, self.stream], ln.phase)
                        for ln in gen.launches]
        self.stats = type("S", (), {"cache_hits": {}})()   # what backend.CPU's driver has
        mode = graphs.mode(backend.simulator)
        self._graphs = graphs.api(mode)
        self._graph = {}                   # phase -> captured graph (for the current _key)
        self._seen = set()                 # phases run once plainly (modules loaded)
        self.graph_stats = {"mode": mode, "captures": 0, "replays": 0, "fallback": None}

    def _library_gemm(self, ln):
        """A library call in place of GEMM launch `ln` (runtime/cuda/gemm.py), or None."""
        if self.gemm_library != "nvmath" or ln.gemm is None or ln.gemm.batched:
            return None
        if ln.gemm.half is not None:     # the hook for half operands: None today (f32 path)
            half = gemm.half_operands(ln.gemm, self.stream)
            if half is not None:
                return half
        return gemm.NvmathGemm(ln.gemm, self.stream)

    def _device(self, region, offset, nbytes, dtype, shape):
        key = (id(region), offset, tuple(shape), dtype)
        d = self._views.get(key)
        if d is None:
            d = self._views[key] = region.device(offset, nbytes, dtype, shape)
        return d

    def _io_buffer(self, p, addr, spec):
        """(Region, offset, host array or None) behind io entry `p` at `addr`: device memory
        of this backend where it lies, else the caller's host array and the staging buffer."""
        nbytes = spec[0]
        hit = self.backend.find(addr, nbytes)
        if hit is not None:
            return hit[0], hit[1], None
        st = self._staging.get(p)
        if st is None:
            st = self._staging[p] = self.backend.allocate(max(nbytes, 4))
            self._pinned[p] = self.cuda.pinned_array(spec[2], spec[1])
        return st, 0, device.host_array(addr, nbytes, spec[1], spec[2])

    def __call__(self, arena, persist, io, phase=0):
        gen, stream = self.gen, self.stream
        bufs, downloads = {}, []
        for p, spec in gen.inputs.items():
            r, off, host = self._io_buffer(p, int(io[p]), spec)
            bufs[p] = (r, off)
            if host is not None and spec[0]:
                pinned = self._pinned[p]
                np.copyto(pinned, host)
                self._device(r, off, spec[0], spec[1], spec[2]).copy_to_device(pinned,
                                                                               stream=stream)
        for p, spec in gen.outputs.items():
            r, off, host = self._io_buffer(p, int(io[p]), spec)
            bufs[p] = (r, off)
            if host is not None and spec[0]:
                downloads.append((self._device(r, off, spec[0], spec[1], spec[2]),
                                  self._pinned[p], host))
        key = (id(arena), id(persist), tuple((p, id(r), off) for p, (r, off) in bufs.items()))
        if key != self._key:
            regions = {"arena": (arena, 0), "persist": (persist, 0), **bufs}
            self._args = [[self._arg(a, regions) for a in ln.args] for ln in gen.launches]
            self._key = key
            self._drop_graphs()
        self._run(phase)
        for d, pinned, _ in downloads:
            d.copy_to_host(pinned, stream=stream)
        stream.synchronize()
        for _, pinned, host in downloads:
            np.copyto(host, pinned)

    def _issue(self, phase, launch_one):
        for (launch, ph), args in zip(self._launch, self._args):
            if not phase or ph == phase:
                launch_one(launch, args)

    def _run(self, phase):
        """The phase's launches: plainly the first time (kernels load, nothing to capture
        yet) and wherever graphs are off; else its graph, captured on first need."""
        gr = self._graphs
        if gr is None or phase not in self._seen:
            self._seen.add(phase)
            self._issue(phase, lambda launch, args: launch(*args))
            return
        graph = self._graph.get(phase)
        if graph is None:
            try:
                graph = self._graph[phase] = gr.capture(self.stream,
                                                        lambda one: self._issue(phase, one))
            except Exception as e:      # noqa: BLE001 - any refusal: plain launches from now
                self._drop_graphs()
                self._graphs = None
                self.graph_stats["fallback"] = f"{type(e).__name__}: {e}"
                self._issue(phase, lambda launch, args: launch(*args))
                return
            self.graph_stats["captures"] += 1
        gr.launch(graph, self.stream)
        self.graph_stats["replays"] += 1

    def _drop_graphs(self):
        if self._graphs is not None:
            for graph in self._graph.values():
                self._graphs.destroy(graph)
        self._graph = {}

    def _arg(self, a, regions):
        if not isinstance(a, Ref):
            return a
        r, off = regions[a.base]
        nbytes = int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
        return self._device(r, off + a.offset, nbytes, a.dtype, a.shape)

"""The backend interface (Backend, a typing.Protocol) and the registry of backends (BACKENDS).

jitgraph/compiler.py runs the pipeline of passes (passes/, which knows no backend), then calls
the target's backend; runtime/executor.py's Program runs what the backend built. Backends
consume the plan (jitgraph/plan.py: KernelGraph, MemoryPlan) and import no pass. A target is a
package runtime/<target>/ (runtime/cpu, runtime/cuda) with a class of these members, named in
BACKENDS; passes/ does not change:

  name          the target's name ("cpu"), as errors name the backend
  kinds         what it can fuse: the kernel kinds of passes/fuse.py it lowers, "node" (one op
                alone) and the fused kinds, and "gemm_accumulate" when its gemm kernels take
                further products accumulated into the output (Kernel.accumulate); the pipeline
                forms only those (Options.kinds) and the compiler refuses a kernel graph with
                another. "attention_store": it lowers attention_store and
                attention_back_stored, so autodiff may keep attention's probabilities
                (passes/attention.py). "window": its kernels read a value at any offset
                its slot gives (every CPU kernel takes an address), so contiguous slices
                become views (passes/views.py). "half_stored": its GEMMs read a half value at
                the weight position tile by tile as fast as an f32 copy of it once the
                GEMM is long and wide enough, so such GEMMs read half weights as they are
                (passes/half.py weights_read_stored); the CUDA backend's library GEMMs take
                f32 operands only, so there the casts stay. "gemm_bf16": its GEMMs run
                on bf16 operands held in buffers (the CPU's AVX512-BF16 kernel, where the
                CPU has it), so fusion keeps an f32 value's rounding to bf16 in a kernel
                of its own rather than in the GEMM's prologue (passes/fuse.py); "gemm_f16"
                the same for f16 (no backend names it yet: a cuBLASLt GEMM on f16 operands
                would).
  generate(kernels, plan) -> (module, source)
                lowering: every kernel of the KernelGraph, in order, reading and writing values
                where the MemoryPlan puts them (a region and offset; inputs and outputs through
                the per-call pointer table); a fused kernel by its kind, a lone node
                through the lowering table (op -> code; CPU: runtime/cpu/codegen.lower_node),
                then the driver calling them in order. `source`: the text
                `Program.ir("kernels")` shows; `module.workspace_bytes`: scratch bytes the
                arena needs after the plan's values.
  check_fits(plan, module, shared_params)
                a MemoryError, before the module is built, when the program's memory does
                not fit what the target has now (shared_params: the persistent region is
                another program's, not allocated again).
  build(module) -> (driver, stats)
                module build: compile it, or load it from the kernel cache (CPU:
                runtime/cpu/cache.py);
                `stats`: what the build did (kernels compiled and loaded, seconds, BLAS).
  allocate(nbytes) -> region,  view(region, slot, type) -> array
                buffer allocation, zero-filled (the Program writes no zero-initialised
                param): the two regions, allocated once per program (the arena:
                plan.arena_bytes + workspace; the persistent region: params and optimizer
                state) and the program's own output buffers, and the value at a plan Slot as an
                array of its type, through which the Program reads outputs and params (numpy
                arrays: on the CPU the regions are host memory).
  address(array) -> int
                where a numpy array (exactly np.ndarray, no subclass) lies: an array of
                `allocate`, or a caller's input or output array (its entry in the io table).
  before_step   None, or a function of no arguments the Program calls before each step (CPU:
                runtime/cpu/blas.adapt: the one-thread bound of small GEMMs follows the load)
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

from importlib import import_module
from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """What jitgraph/compiler.py and runtime/executor.py use of a target (the module docstring
    says what each member does)."""
    name: str
    kinds: frozenset
    before_step: Callable[[], None] | None

    def generate(self, kernels, plan) -> tuple[Any, str]: ...

    def check_fits(self, plan, module, shared_params: bool = False) -> None: ...

    def build(self, module) -> tuple[Callable, dict]: ...

    # zeroed memory: a Program does not write a zero-initialised param into it
    def allocate(self, nbytes: int) -> Any: ...

    def view(self, region, slot, t) -> Any: ...

    def address(self, array) -> int: ...


# target -> "module:class" of its backend, imported on first use (numba-cuda only for "cuda")
BACKENDS = {"cpu": "jitgraph.runtime.cpu.backend:CPU",
            "cuda": "jitgraph.runtime.cuda.backend:CUDA"}


def get_backend(target: str) -> Backend:
    """The backend compiling for `target`; a ValueError names the known targets."""
    if target not in BACKENDS:
        raise ValueError(f"compile: unknown target {target!r}; expected "
                         f"{', '.join(repr(k) for k in BACKENDS)}")
    module, cls = BACKENDS[target].split(":")
    return getattr(import_module(module), cls)()

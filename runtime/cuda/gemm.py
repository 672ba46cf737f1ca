"""The GEMM seam: which library runs the GEMM launches of a CUDA program.

codegen.gemm_launch marks each GEMM launch with a GemmSpec (transposes, M, N, K, dtype, batched)
next to its tiled numba kernel. The driver (runtime/cuda/backend.Driver) asks `library()` once
per program:

  "numba"   the tiled numba kernels (always on the simulator; on a GPU without nvmath-python
            and CuPy; or JITGRAPH_CUDA_GEMM=numba)
  "nvmath"  cuBLASLt through nvmath-python's stateful `nvmath.linalg.advanced.Matmul`, planned
            once per GEMM launch and argument binding (the first step after a binding), run
            on the driver's stream; the operands are zero-copy CuPy views of the launch's
            device arrays (__cuda_array_interface__). TF32 allowed (compute type
            COMPUTE_32F_FAST_TF32) unless JITGRAPH_CUDA_TF32=0. Batched GEMMs (3-D, broadcast
            batches) stay on the numba kernel.

Not done yet: the fusion pass's epilogues are not mapped onto cuBLASLt's (BIAS, RELU_BIAS,
GELU_BIAS, DRELU_BGRAD, BGRADA/B): the epilogue launch after the GEMM stays a numba kernel.
`execute()` returns a new array (nvmath allocates it from CuPy's pool), copied into the
program's buffer: one extra device copy per GEMM, and a capture that refuses the allocation
falls back to plain launches (runtime/cuda/graphs.py).

Half operands. passes/half.py gives a GEMM over f16 / bf16 values as casts to f32 (in the GEMM
kernel's fused prologue, or in the kernel computing the operand), an f32 GEMM, and a cast of the
product back: NvmathGemm (or the tiled kernel) runs over f32 arrays holding half values exactly,
f32 accumulation, the CPU's meaning (its sgemm over converted operands). Under TF32 that loses
nothing: bf16 and f16 values are exact in TF32. Where both operands are such casts of one half
type the launch's GemmSpec names the half values (`half`), and the driver asks
`half_operands()` first: the hook where a GPU would run cuBLASLt through nvmath-python on
bf16 / f16 operands (COMPUTE_32F: f32 accumulation, tensor cores). It returns None: not
implemented, as nothing here can check it without a GPU.

Only NvmathGemm runs on a GPU alone; bench/gpu_check.py checks it against the CPU target
(its correctness section) and times it (JITGRAPH_CUDA_GEMM=numba for the other row).
"""
from __future__ import annotations

import os


def library(simulator: bool) -> str:
    env = os.environ.get("JITGRAPH_CUDA_GEMM", "auto").strip().lower()
    if env not in ("auto", "numba", "nvmath"):
        raise ValueError(f"JITGRAPH_CUDA_GEMM={env!r}: expected auto, numba or nvmath")
    if simulator or env == "numba":
        return "numba"
    try:
        import cupy  # noqa: F401
        import nvmath.linalg.advanced  # noqa: F401
    except ImportError as e:
        if env == "nvmath":
            raise RuntimeError(f"target cuda: JITGRAPH_CUDA_GEMM=nvmath but {e}") from None
        return "numba"
    return "nvmath"


def describe(lib: str, tile: int) -> str:
    return "cuBLASLt (nvmath-python Matmul)" if lib == "nvmath" else \
        f"numba tiled GEMM ({tile}x{tile})"


class NvmathGemm:
    """Stands in for one GEMM launch: called with the launch's (a, b, c) device arrays, runs
    c = op(a) @ op(b) with a Matmul planned for that binding."""

    def __init__(self, spec, stream):
        self.spec, self.stream = spec, stream
        self._plans = {}            # (id(a), id(b), id(c)) -> (Matmul, c as CuPy)

    def _plan(self, a, b, c):
        import cupy
        from nvmath.linalg.advanced import Matmul, MatmulComputeType, MatmulOptions
        from .graphs import stream_handle
        ca, cb, cc = (cupy.asarray(x) for x in (a, b, c))
        if self.spec.ta:
            ca = ca.T
        if self.spec.tb:
            cb = cb.T
        opts = {}
        if self.spec.dtype == "f32" and os.environ.get("JITGRAPH_CUDA_TF32", "1") != "0":
            opts["compute_type"] = MatmulComputeType.COMPUTE_32F_FAST_TF32
        st = cupy.cuda.ExternalStream(stream_handle(self.stream))
        mm = Matmul(ca, cb, options=MatmulOptions(**opts), stream=st)
        mm.plan()
        return mm, cc, st

    def __call__(self, a, b, c):
        key = (id(a), id(b), id(c))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(a, b, c)
        mm, cc, st = plan
        with st:                    # the copy on the driver's stream too
            cc[...] = mm.execute()


def half_operands(spec, stream):
    """A library call for a GEMM over half operands (spec.half: dtype, A's node, B's node), or
    None: the f32 path runs (the prologue's casts, then NvmathGemm over the f32 operands).

    The hook only. What a GPU implementation does here: take the half operands (the f32
    arrays converted to spec.half's type, exactly, or the half values' own buffers where the
    plan keeps them, and then drop the launches that only convert them), plan
    `nvmath.linalg.advanced.Matmul` over them with compute type COMPUTE_32F and an f32 result.
    Not done: it cannot be checked without a GPU (bench/gpu_check.py is where it would be
    checked against the CPU target)."""
    return None

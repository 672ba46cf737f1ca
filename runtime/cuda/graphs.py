"""A whole step as one CUDA graph: after the first (plain) step the driver captures its kernel
launches on its stream into a graph and replays that graph every later step, so a step costs one
graph launch plus the input and output copies (runtime/cuda/backend.Driver).

How it is enabled: JITGRAPH_CUDA_GRAPHS, read when a program is compiled for target cuda:
  unset or "1"  on a GPU, graphs when cuda-bindings (cuda.bindings.driver, installed with
                numba-cuda) is importable; plain stream launches otherwise (and on the simulator)
  "0"           plain stream launches
  "record"      a stand-in that records the launches at capture and calls them again at replay:
                the simulator tests run the driver's capture / replay / recapture logic with it
A failed capture (a driver that refuses it) falls back to plain launches for the program's
life, the reason in `Driver.graph_stats["fallback"]`.

One graph per phase (a program with an update hook has two: the gradients, then the update); a
graph holds the launches' arguments, so it is captured again when the buffers behind them
change (another arena, a caller's output array bound with step_into).

Only CudaGraphs below runs on a GPU alone (this module's few lines calling cuda.bindings);
bench/gpu_check.py times the graph step against the plain-launch step on the GPU machine.
"""
from __future__ import annotations

import os


def mode(simulator: bool) -> str:
    """"graphs", "record" or "plain", from JITGRAPH_CUDA_GRAPHS and what is importable."""
    env = os.environ.get("JITGRAPH_CUDA_GRAPHS", "1").strip().lower()
    if env not in ("0", "1", "record"):
        raise ValueError(f"JITGRAPH_CUDA_GRAPHS={env!r}: expected 0, 1 or record")
    if env == "record":
        return "record"
    if env == "0" or simulator:
        return "plain"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return "plain"
    return "graphs"


def api(which: str):
    return {"graphs": CudaGraphs, "record": Recorder}.get(which, lambda: None)()


def stream_handle(stream) -> int:
    """The CUstream address behind a numba stream (cuda-bindings CUstream or ctypes)."""
    h = stream.handle
    if isinstance(h, int):
        return h
    v = getattr(h, "value", None)
    return int(v) if v is not None else int(h)


class Recorder:
    """The stand-in (JITGRAPH_CUDA_GRAPHS=record): capture keeps the launches, replay calls them
    in order; what a real graph would hold and do, without a GPU."""

    def capture(self, stream, issue):
        graph = []
        issue(lambda launch, args: graph.append((launch, args)))
        return graph

    def launch(self, graph, stream):
        for launch, args in graph:
            launch(*args)

    def destroy(self, graph):
        graph.clear()


class CudaGraphs:
    """Stream capture through cuda-bindings' driver API (CUDA 12+): begin capture on the
    driver's stream, issue the launches (recorded, not run), end capture, instantiate; replay
    with cuGraphLaunch on the same stream."""

    def __init__(self):
        from cuda.bindings import driver
        self.cu = driver

    def _check(self, res, what):
        err = res[0] if isinstance(res, tuple) else res
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"target cuda: {what} failed: {err}")
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    def capture(self, stream, issue):
        cu = self.cu
        h = cu.CUstream(stream_handle(stream))
        self._check(cu.cuStreamBeginCapture(
            h, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        try:
            issue(lambda launch, args: launch(*args))
        finally:
            graph = self._check(cu.cuStreamEndCapture(h), "cuStreamEndCapture")
        try:
            return graph, self._check(cu.cuGraphInstantiateWithFlags(graph, 0),
                                      "cuGraphInstantiate")
        except Exception:
            cu.cuGraphDestroy(graph)
            raise

    def launch(self, graph, stream):
        self._check(self.cu.cuGraphLaunch(graph[1], self.cu.CUstream(stream_handle(stream))),
                    "cuGraphLaunch")

    def destroy(self, graph):
        self.cu.cuGraphExecDestroy(graph[1])
        self.cu.cuGraphDestroy(graph[0])

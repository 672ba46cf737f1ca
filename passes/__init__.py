"""Compiler passes: pure functions over the IR, each returning its result and a Report of what
it did, listed in order by pipeline.py.

Graph -> Graph: patterns, autodiff, guard, optimizer, simplify, checkpoint. Then the plan:
fuse (Graph -> KernelGraph), schedule (KernelGraph -> KernelGraph), memory (KernelGraph ->
MemoryPlan). Outside the pipeline: precision.cast_graph (Graph -> Graph, no Report; the f64
oracle of jitgraph.testing); liveness.py and memory_check.py are analyses the planner and its
checks share. No pass imports the runtime.
"""
from .report import Report  # noqa: F401

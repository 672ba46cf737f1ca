"""The plan stages of the pipeline (half -> views -> fuse -> schedule -> memory), the compile
Options and the stage runner (passes/pipeline.py lists every stage). `plan(graph, options)` runs the plan
stages alone: the kernels and memory plan the pipeline ends with, and what passes/checkpoint.py
measures its candidates by.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from .fuse import group_kernels
from .half import compute_in_f32
from .memory import plan_memory
from .schedule import schedule
from .views import KIND as WINDOW, window_slices


@dataclass
class Options:
    loss: str | None = None
    optimizer: object = None
    fuse: bool = True
    plan_memory: bool = True
    checkpoint: object = None
    check_finite: object = False      # guard: a step with a non-finite value changes nothing;
    #                                   True: the executor raises, "skip": it counts the step
    boundary: bool = False            # update boundary: gradients, hook, update (boundary.py)
    param_slots: dict | None = None   # internal: place params in another program's region
    page_offsets: dict | None = None  # param -> where in a page its slot starts (a weight mapped
    #                                   from its file: the file offset's place in its page)
    kinds: frozenset | None = None    # the kernel kinds the target lowers (fuse; None: all)
    precision: str = "f32"            # mixed precision "bf16" / "f16" (precision.py mixed)
    loss_scale: object = None         # jitgraph.optim.LossScale: the backward seeded with the
    #                                   input opt/loss_scale, the optimizer unscales (optimizer.py)
    stored_params: dict | None = None  # internal: param -> the type it is stored in, read
    #                                   through a cast (an evaluator of bf16 master weights)


@dataclass
class State:
    graph: object
    options: Options
    kernels: object = None      # jitgraph.plan.KernelGraph
    memory: object = None       # jitgraph.plan.MemoryPlan
    ir: dict = field(default_factory=dict)        # stage -> printed IR
    stages: dict = field(default_factory=dict)    # stage -> (graph, kernels, memory) after it
    reports: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)   # stage -> seconds


def _half(st):
    st.graph, rep = compute_in_f32(st.graph, st.options.kinds)
    return rep


def _views(st):
    st.graph, rep = window_slices(st.graph, st.options.kinds)
    return rep


def _fuse(st):
    st.kernels, rep = group_kernels(st.graph, fuse=st.options.fuse, kinds=st.options.kinds)
    return rep


def _schedule(st):
    st.kernels, rep = schedule(st.kernels)
    return rep


def _memory(st):
    st.memory, rep = plan_memory(st.kernels, st.options.param_slots, st.options.plan_memory,
                                 page_offsets=st.options.page_offsets)
    return rep


def _always(opts):
    return True


PLAN_STAGES = [
    ("half", _half, _always),
    ("views", _views, lambda o: o.kinds is None or WINDOW in o.kinds),
    ("fuse", _fuse, _always),
    ("schedule", _schedule, lambda o: o.plan_memory),
    ("memory", _memory, _always),
]


def _printed(stage, st):
    if stage in ("fuse", "schedule"):
        return str(st.kernels)
    if stage == "memory":
        return st.memory.describe(st.graph)
    return str(st.graph)


def dump(stage: str, text: str) -> None:
    d = os.environ.get("JITGRAPH_DUMP")
    if d:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{stage}.txt"), "w") as f:
            f.write(text + "\n")


def run_stages(st, stages, record=False) -> State:
    """Run the enabled `stages` on state `st`, timing each and keeping its Report; `record`:
    keep (and dump) each stage's IR."""
    for name, fn, enabled in stages:
        if not enabled(st.options):
            continue
        t0 = time.perf_counter()
        rep = fn(st)
        st.timings[name] = time.perf_counter() - t0
        st.reports.append(rep)
        if record:
            st.ir[name] = _printed(name, st) + "\n" + str(rep)
            st.stages[name] = (st.graph, st.kernels, st.memory)
            dump(name, st.ir[name])
    return st


def plan(graph, options: Options) -> State:
    """fuse -> schedule -> memory over a finished graph with `options`: the kernels and memory
    plan the pipeline ends with, and what passes/checkpoint.py measures its candidates by."""
    return run_stages(State(graph, options), PLAN_STAGES)

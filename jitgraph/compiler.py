"""`jitgraph.compile`: the compiler drives. It runs the pipeline of passes on the graph
(passes/pipeline.py), then the target's backend (runtime/backend.py) generates and builds the
code, and hands the products to a Program (runtime/executor.py), which only runs them.

With JITGRAPH_CHECK_PLANS=1 every memory plan is verified (passes/memory_check.py) before code
is generated for it.
"""
from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from functools import partial


def compile(graph, loss=None, optimizer=None, target="cpu", fuse=True, plan_memory=True,
            checkpoint=None, *, seed=0, check_finite=False, check_indices=True,
            copy_outputs=True, share=None, hook=None, params=None, precision="f32",
            loss_scale=None):
    """Compile `graph` into a Program (see runtime/executor.py).

    loss: name of a scalar output to differentiate (adds grad/<param> outputs); optimizer: a
    jitgraph.optim optimizer (needs loss): `step` then runs forward, backward and the update.
    target: "cpu" (numba). fuse: group nodes into fused kernels (False: one kernel per node).
    plan_memory: liveness-based arena with in-place reuse (False: one buffer per value).
    checkpoint: None (keep every activation), "marks", "sqrt", or "budget:BYTES" /
    "budget:FRACTION" of the unchecked arena (passes/checkpoint.py). A training graph's
    attention with small heads keeps its probabilities for the backward (passes/attention.py:
    faster, a larger arena); a checkpoint policy recomputes them like any activation.
    seed: initial parameter values (graph.init_params(seed)).
    params: {name: array or formats.tensors.FileTensor}: the values of these params, written in
    place of their initialisation (a model's weights: a FileTensor's whole pages are mapped
    from its file into the program's memory, privately, the rest read); the others are
    initialised from `seed`.
    check_finite: a step whose loss, gradients or other float outputs hold NaN or Inf changes
    nothing (params, optimizer state, step count) and raises FloatingPointError naming the
    first such value (passes/guard.py); costs one extra read of the gradients per step.
    check_finite="skip": such a step changes nothing either, and is counted
    (Program.skipped, Program.last_skipped) instead of raising.
    check_indices: integer inputs that index (class labels, token ids, get_rows rows) are
    checked against their range before each step, as the interpreter does (IndexError, nothing
    changed); False skips the check, and an out-of-range index then reads outside its table.
    copy_outputs: `step` returns fresh arrays (True) or read-only views of the program's own
    buffers (False): no copy, but a view is valid only until the next `step` overwrites it.
    share: another Program whose params this one uses: each param of `graph` (same name, same
    type) lives at that program's slot in its persistent region, so weights assigned or updates
    made (a KV cache) through either program are seen by both (a decode and a prefill program,
    jitgraph/models/generate.py). Forward programs only (no optimizer); `seed` is then unused.
    hook: `hook(gradients)`, called between the gradients and the update of each step that
    applies the update (needs an optimizer): the update boundary (passes/boundary.py). The
    step runs as phase 1 (forward, backward, accumulation), the hook, phase 2 (clipping, the
    optimizer, the guard); `gradients` (runtime/executor.Gradients) maps param -> a writeable
    view of its gradient, and `.flat` is one array over all of them (contiguous in the arena),
    so the hook may change them in place (an MPI all-reduce: jitgraph/distributed.py). Fusion
    then keeps the update out of the GEMM epilogues, and the gradients stay in memory until
    the update: a larger arena (Program.stats()["memory"]["gradient_bucket_bytes"]). Without
    a hook nothing changes. `Program.hook` replaces it between steps.
    precision: "f32" (default), or "bf16" / "f16": mixed precision (passes/precision.py
    `mixed`): every f32 GEMM, forward and backward, reads its operands in that type and gives
    its product in it (accumulating in f32); norms, softmax, losses, the params (f32 master
    weights) and the optimizer stay f32.
    loss_scale: dynamic loss scaling (jitgraph.optim.LossScale, PyTorch's GradScaler): None
    (default: on with precision="f16" and an optimizer, else off), False (off), True (a
    LossScale() of the defaults: S starting at 2**16, halved on a step that is not finite,
    doubled after 2000 clean optimizer steps) or a LossScale. The backward starts from the
    f32 input opt/loss_scale = S (so f16 gradients below f16's smallest value do not become
    0), the optimizer multiplies the gradients by 1/S, and a step that is not finite is
    skipped (check_finite="skip", which loss scaling implies). Program.scaler holds S and its
    count (Program.scaler.state() / .load(), what a checkpoint keeps).
    """
    from .passes.pipeline import Options
    from .passes.precision import PRECISIONS
    from .runtime.backend import get_backend
    if precision not in PRECISIONS:
        raise ValueError(f"compile: precision={precision!r}; expected one of "
                         f"{', '.join(PRECISIONS)}")
    loss_scale = _loss_scale(loss_scale, precision, optimizer)
    if check_finite not in (False, True, "skip"):
        raise ValueError(f"compile: check_finite={check_finite!r}; expected False, True or "
                         f"'skip'")
    if loss_scale is not None:
        if check_finite is True:
            raise ValueError("compile: loss scaling skips the steps that are not finite (it "
                             "halves the scale); check_finite=True would raise instead: leave "
                             "check_finite out or pass 'skip'")
        check_finite = "skip"
    backend = get_backend(target)
    if hook is not None and not callable(hook):
        raise TypeError(f"compile: hook must be a callable hook(gradients), got "
                        f"{type(hook).__name__}")
    opts = Options(loss=loss, optimizer=optimizer, fuse=fuse, plan_memory=plan_memory,
                   checkpoint=checkpoint, check_finite=check_finite, boundary=hook is not None,
                   kinds=backend.kinds, precision=precision, loss_scale=loss_scale)
    persist = None
    if share is not None:
        opts.param_slots, persist = _shared_params(graph, share, optimizer)
    if params and share is not None:
        raise ValueError("compile: params= sets a program's own params; with share= they live "
                         "in the shared program: set them there")
    if params:
        opts.page_offsets = _page_offsets(params)
    prog = build_program(graph, opts, backend, seed=seed, persist=persist,
                         copy_outputs=copy_outputs, check_indices=check_indices, params=params)
    if hook is not None:
        prog.hook = hook
    return prog


def _loss_scale(spec, precision, optimizer):
    """The LossScale of compile's `loss_scale` (None: off)."""
    from .optim import LossScale
    if spec is None:
        return LossScale() if precision == "f16" and optimizer is not None else None
    if spec is False:
        return None
    if spec is True:
        spec = LossScale()
    if not isinstance(spec, LossScale):
        raise TypeError(f"compile: loss_scale must be None, True, False or a "
                        f"jitgraph.optim.LossScale, got {type(spec).__name__}")
    if optimizer is None:
        raise ValueError("compile: loss_scale needs an optimizer (the gradients are unscaled "
                         "before the update)")
    return spec


def _page_offsets(params) -> dict:
    """param -> its file offset's place in a page, for the params given as file tensors large
    enough to map (their `page_offset`, jitgraph.formats.tensors.FileTensor): the memory plan
    puts their slots at the same place in a page, so the program maps the file's pages instead
    of reading them."""
    offsets = {k: getattr(v, "page_offset", None) for k, v in params.items()}
    return {k: o for k, o in offsets.items() if o is not None}


def _shared_params(graph, share, optimizer):
    """(param name -> Slot, persistent region) of program `share` for the params of `graph`;
    a ValueError names a param `share` lacks or holds with another type."""
    from .runtime.executor import Program
    if not isinstance(share, Program):
        raise TypeError(f"compile: share must be a compiled Program, got {type(share).__name__}")
    if optimizer is not None:
        raise ValueError("compile: share= is for forward programs; an optimizer's state cannot "
                         "live in another program's region")
    theirs = share.graph
    for name, nid in graph.params.items():
        if name not in theirs.params:
            raise ValueError(f"compile: share: param {name!r} of graph {graph.name} is not a "
                             f"param of the shared program's graph {theirs.name}")
        a, b = graph.nodes[nid].type, theirs.nodes[theirs.params[name]].type
        if a != b:
            raise ValueError(f"compile: share: param {name!r} is {a} in graph {graph.name} but "
                             f"{b} in the shared program")
    return share._products.memory.params, share._persist


def build_program(source, options, backend, *, seed=0, persist=None, copy_outputs=True,
                  check_indices=True, params=None, scratch=None):
    """The Program running `source` compiled with `options` (passes/pipeline.py Options) by
    `backend`; `persist`: another program's persistent region to share (the evaluator's);
    `params`: values of params in place of their initialisation; `scratch`: another program's
    arena block to run in where it is large enough (the evaluator's, share_memory=True)."""
    from .runtime.executor import Program
    with _collector_paused():
        return Program(source, options, build(source, options, backend), seed=seed,
                       persist=persist, copy_outputs=copy_outputs, check_indices=check_indices,
                       compiler=partial(build_program, backend=backend), params=params,
                       scratch=scratch)


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while compiling: the passes allocate many small
    objects, and each full collection they trigger walks every object the process holds (a
    loaded vocabulary's hundreds of thousands of strings); it runs again afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def build(source, options, backend):
    """Pipeline, then the backend's code generation and module build: the Products."""
    from .passes.guard import FLAG
    from .passes.pipeline import dump, run_pipeline
    from .runtime.executor import Products
    t0 = time.perf_counter()
    st = run_pipeline(source, options)
    if os.environ.get("JITGRAPH_CHECK_PLANS") == "1":
        from .passes.memory_check import check_plan
        check_plan(st.kernels, st.memory)
    kinds = set().union(*(k.needs for k in st.kernels.kernels)) - backend.kinds
    if kinds:
        raise NotImplementedError(f"compile: the {backend.name} backend lowers no "
                                  f"{', '.join(sorted(kinds))} kernels; compile with fuse=False")
    t1 = time.perf_counter()
    module, st.ir["kernels"] = backend.generate(st.kernels, st.memory)
    st.stages["kernels"] = (st.graph, st.kernels, st.memory)
    dump("kernels", st.ir["kernels"])
    backend.check_fits(st.memory, module, shared_params=options.param_slots is not None)
    t2 = time.perf_counter()
    driver, built = backend.build(module)
    t3 = time.perf_counter()
    g, opt = st.graph, options.optimizer
    stats = {"kernels": len(st.kernels.kernels), **built, "compile_seconds": t3 - t0,
             "stage_seconds": {**st.timings, "lower": t2 - t1},
             "bytes_moved": st.kernels.bytes_moved(), "arena_bytes": st.memory.arena_bytes,
             "persistent_bytes": st.memory.persist_bytes, "memory": st.memory.summary()}
    return Products(
        g, st.kernels, st.memory, backend, module, driver,
        outputs=tuple(k for k in g.outputs if (opt is None or k in source.outputs)
                      and not k.startswith(FLAG)),
        nonfinite=FLAG if FLAG in g.outputs else None,
        checks={k: k[len(FLAG) + 1:] for k in g.outputs if k.startswith(FLAG + "/")},
        ir=st.ir, stages=st.stages, reports=st.reports, stats=stats)

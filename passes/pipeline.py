"""The compiler pipeline, as a list: (stage name, pass, enabled-by).

Each stage takes the compilation state, replaces what it transforms and returns its Report.
After every stage the state's IR is kept as text (`Program.ir(stage)`) and, when the environment
variable JITGRAPH_DUMP names a directory, written to `<dir>/<stage>.txt`. jitgraph/compiler.py
runs the pipeline, then the backend.

Stages and their switches (jitgraph.compile arguments):
  patterns    with `fuse`: softmax, log_softmax, rms_norm and layer_norm written from
              primitives become the row op (passes/patterns.py), before autodiff so the
              backward uses their *_back ops; `fuse=False` keeps one kernel per primitive
  precision   with `precision` "bf16" | "f16": the autocast policy (passes/precision.py
              `mixed`; sums of half GEMM products in f32, `sums_in_f32`, here and after
              autodiff)
  autodiff    when `loss` is given: adds the backward graph and grad/<param> outputs (with
              `loss_scale`: seeded with the input opt/loss_scale, not 1); an
              attention the backward differentiates keeps its probabilities when they are
              small and the backend lowers that (passes/attention.py)
  guard       with `check_finite`: flags whether every float output (loss, gradients) is
              finite and makes every update keep the old value when not (passes/guard.py);
              on by default with `loss_scale` (check_finite="skip")
  optimizer   when `optimizer` is given: appends the parameter update (needs `loss`;
              with `loss_scale` the gradients are multiplied by 1/S first); with
              `hook` (Options.boundary) the gradients become the outputs of phase 1 and the
              update phase 2 (the update boundary, passes/boundary.py), which fuse, schedule,
              memory and the backend's driver follow
  simplify    always (CSE, dead code, constant folding, transpose flags for matmul)
  checkpoint  when `checkpoint` is given: recompute activations in the backward (policy, see
              passes/checkpoint.py), measuring each candidate with `arena_peak` below
then the plan of the finished graph (passes/planning.py `plan`: the same four stages with the
same options wherever the arena is measured; Options and the stage runner live there too):
  views       on a backend whose kinds name "window" (the CPU): contiguous slices become
              windows, views of their operand's buffer, not copies (passes/views.py)
  fuse        always: groups nodes into kernels (`fuse=False`: one kernel per node)
  schedule    with `plan_memory`: reorders independent kernels so buffers die early
  memory      always: assigns buffers (`plan_memory=True`: liveness, in-place reuse, one
              arena; `plan_memory=False`: one buffer per value, the naive baseline)
"""
from __future__ import annotations

from jitgraph.optim import LOSS_SCALE
from jitgraph.types import ShapeError

from .attention import store_attention_probs
from .autodiff import grad
from .checkpoint import checkpoint
from .guard import guard
from .optimizer import apply_optimizer
from .patterns import recognise_patterns
from .precision import mixed, stored_as, sums_in_f32
from .planning import PLAN_STAGES, Options, State, dump, plan, run_stages
from .simplify import simplify


def _patterns(st):
    st.graph, rep = recognise_patterns(st.graph)
    return rep


def _precision(st):
    st.graph, rep = mixed(st.graph, st.options.precision)
    st.graph, rep.stats["f32_sums"] = sums_in_f32(st.graph)
    return rep


def _autodiff(st):
    seed = LOSS_SCALE if st.options.loss_scale is not None else None
    st.graph, rep = grad(st.graph, st.options.loss, seed=seed)
    if st.options.precision != "f32":   # the backward's sums of half GEMM products
        st.graph, rep.stats["f32_sums"] = sums_in_f32(st.graph)
    st.graph, stored = store_attention_probs(st.graph, st.options.kinds)
    if stored:
        rep.stats.update(stored)
        rep.lines.append(f"attention: {stored['attention_probs_stored']} ops keep their "
                         f"probabilities for the backward ({stored['attention_probs_bytes']:,} "
                         f"bytes; passes/attention.py)")
    return rep


def _guard(st):
    st.graph, rep = guard(st.graph)
    return rep


def _optimizer(st):
    st.graph, rep = apply_optimizer(st.graph, st.options.optimizer, st.options.loss,
                                    boundary=st.options.boundary)
    return rep


def _simplify(st):
    st.graph, rep = simplify(st.graph)
    return rep


def _checkpoint(st):
    st.graph, rep = checkpoint(st.graph, st.options.checkpoint, loss=st.options.loss or "loss",
                               measure=lambda g: arena_peak(g, st.options))
    return rep


def arena_peak(graph, options=None) -> int:
    """The arena bytes the plan stages give `graph` with `options` (default: fused, planned):
    what passes/checkpoint.py measures its candidates by."""
    return plan(graph, options or Options()).memory.arena_bytes


def _always(opts):
    return True


GRAPH_STAGES = [
    ("patterns", _patterns, lambda o: o.fuse),
    ("precision", _precision, lambda o: o.precision != "f32"),
    ("autodiff", _autodiff, lambda o: o.loss is not None),
    ("guard", _guard, lambda o: o.check_finite),
    ("optimizer", _optimizer, lambda o: o.optimizer is not None),
    ("simplify", _simplify, _always),
    ("checkpoint", _checkpoint, lambda o: o.checkpoint is not None),
]
STAGES = GRAPH_STAGES + PLAN_STAGES
# every IR a Program keeps, in order: the input graph, the stages above, the generated source
IR_STAGES = ("graph", *(name for name, _, _ in STAGES), "kernels")


def run_pipeline(graph, options: Options) -> State:
    if options.optimizer is not None and options.loss is None:
        raise ShapeError("compile: an optimizer needs loss=<output name> to differentiate")
    if options.loss_scale is not None and options.optimizer is None:
        raise ShapeError("compile: loss scaling needs an optimizer (it unscales the gradients "
                         "before the update)")
    if options.boundary and options.optimizer is None:
        raise ShapeError("compile: an update hook needs an optimizer (the hook runs between the "
                         "gradients and the update)")
    if options.stored_params:       # an evaluator of a program with bf16 master weights
        graph = stored_as(graph, options.stored_params)[0]
    st = State(graph, options)
    st.ir["graph"] = str(graph)
    st.stages["graph"] = (graph, None, None)
    dump("graph", st.ir["graph"])
    return run_stages(st, STAGES, record=True)


def describe() -> str:
    """The pipeline, one stage a line."""
    return "\n".join(f"{name:<11} {fn.__name__}" for name, fn, _ in STAGES)

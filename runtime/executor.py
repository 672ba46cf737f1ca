"""The static executor: it runs what the compiler built, allocated once, one native driver call
per step.

jitgraph/compiler.py runs the passes and the backend (runtime/backend.py) and hands a Program
its Products; the executor never runs a pass. A Program owns two byte regions: the arena
(inputs, activations, gradients: every per-step value at its memory-plan offset, values that
are never live together sharing bytes) and the persistent region (params and optimizer state).
`step` copies the inputs into their slots, feeds the optimizer's per-step scalars (`opt/lr`,
`opt/step`, `opt/apply`), calls the driver once and returns fresh copies of the outputs.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field, replace

import numpy as np

from jitgraph.ir import live_nodes
from jitgraph.types import ShapeError
from jitgraph.validate import index_inputs


@dataclass
class Products:
    """What the compiler hands a Program: the final graph, its kernels and memory plan (from
    passes/), the backend's built code, and the record of how they were made."""
    graph: object          # the Graph after every pass
    kernels: object        # its KernelGraph (passes/fuse.py)
    memory: object         # its MemoryPlan (passes/memory.py): slots, region sizes
    backend: object        # the runtime/backend.py backend that built the code
    module: object         # what backend.generate made (CPU: runtime/cpu/codegen.Generated)
    driver: object         # driver(arena, persist) runs one step
    outputs: tuple         # the graph outputs `step` returns
    nonfinite: str | None = None   # output that is nonzero when a checked value is not finite
    checks: dict = field(default_factory=dict)   # flag output -> the output it checks (guard)
    ir: dict = field(default_factory=dict)       # stage -> printed IR
    reports: list = field(default_factory=list)  # each pass's Report
    stats: dict = field(default_factory=dict)


class ArrayMap(MutableMapping):
    """Named arrays living in a program's persistent region. Reading returns a copy (so later
    steps never change an array you hold); assigning validates shape and dtype, then copies in."""

    def __init__(self, views: dict, what: str):
        self._views, self._what = views, what

    def __getitem__(self, name):
        return self._view(name).copy()

    def __setitem__(self, name, value):
        v = self._view(name)
        a = np.asarray(value)
        if a.shape != v.shape or not np.can_cast(a.dtype, v.dtype, "same_kind"):
            raise ShapeError(f"{self._what} {name}: expected {_typestr(v)}, got {_typestr(a)}")
        np.copyto(v, a, casting="same_kind")

    def _view(self, name):
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"no {self._what} {name!r}; expected one of {', '.join(self._views)}") \
                from None

    def __delitem__(self, name):
        raise TypeError(f"cannot delete {self._what} {name!r} from a compiled program")

    def __iter__(self):
        return iter(self._views)

    def __len__(self):
        return len(self._views)


def _typestr(a):
    return f"{a.dtype}[{','.join(map(str, a.shape))}]"


class Program:
    """A compiled graph. `step(**inputs)` runs it once (a training step when compiled with an
    optimizer) and returns its outputs as fresh numpy arrays, or with `copy_outputs=False` as
    read-only views of its buffers that the next step overwrites (copying a 16 MB output cost
    0.8 ms, as much as a fused softmax over it)."""

    def __init__(self, source, options, products: Products, *, seed=0, persist=None,
                 copy_outputs=True, check_indices=True, compiler=None):
        """`source`: the graph as the user built it; `options`: the pipeline's Options it was
        compiled with; `persist`: another program's persistent region to share (its params);
        `compiler(graph, options, persist=..., copy_outputs=..., check_indices=...)`: how the
        evaluator compiles its forward-only programs (jitgraph/compiler.py)."""
        self.source = source
        self.options = options
        self.check_indices = check_indices
        self.copy_outputs = copy_outputs
        self._products, self._compiler = products, compiler
        self._driver, self._stats = products.driver, products.stats
        g, plan, view = products.graph, products.memory, products.backend.view
        self.graph = g
        self._arena = products.backend.allocate(plan.arena_bytes +
                                                products.module.workspace_bytes)
        owner = persist is None
        self._persist = products.backend.allocate(plan.persist_bytes) if owner else persist

        def value(i):
            return view(self._arena if plan.slots[i].region == "arena" else self._persist,
                        plan.slots[i], g.nodes[i].type)

        self._param_views = {k: view(self._persist, plan.params[k], g.nodes[i].type)
                             for k, i in g.params.items()}
        if owner:
            for k, v in g.init_params(seed).items():
                self._param_views[k][...] = v
        opt = options.optimizer
        self._runtime = set(opt.runtime_inputs(0)) if opt is not None else set()
        live = live_nodes(g)
        self._inputs = {k: value(i) for k, i in g.inputs.items()
                        if i in live and k not in self._runtime}
        self._runtime_views = {k: value(g.inputs[k]) for k in self._runtime
                               if g.inputs.get(k) in live}
        self._outputs = {k: value(g.outputs[k]) for k in products.outputs}
        for v in self._outputs.values():
            v.flags.writeable = False       # `step` hands them out with copy_outputs=False
        self._nonfinite = None if products.nonfinite is None else \
            value(g.outputs[products.nonfinite])
        self._checks = {k: value(g.outputs[f]) for f, k in products.checks.items()}
        self._indices = [(self._inputs[k], k, bound, users)
                         for k, (bound, users) in index_inputs(g).items()
                         if k in self._inputs and check_indices]
        user = [k for k in source.params]
        self.params = ArrayMap({k: self._param_views[k] for k in user}, "param")
        self.state = ArrayMap({k: v for k, v in self._param_views.items() if k not in user},
                              "state")
        self.calls = 0

    # ---- running ------------------------------------------------------------------------
    def _feed(self, inputs):
        for name, value in inputs.items():
            view = self._inputs.get(name)
            if view is None:
                if name in self.graph.inputs:
                    continue    # declared but unused by these outputs
                raise ShapeError(f"graph {self.graph.name}: unknown input {name!r}; expected "
                                 f"{', '.join(self._inputs) or 'none'}")
            a = value if isinstance(value, np.ndarray) else np.asarray(value)
            if a.shape != view.shape:
                raise ShapeError(f"input {name}: expected shape {_typestr(view)}, got "
                                 f"{_typestr(a)}")
            if a.dtype != view.dtype and a.dtype.kind != view.dtype.kind and \
                    not (view.dtype.kind == "f" and a.dtype.kind in "iu"):
                raise ShapeError(f"input {name}: expected dtype {view.dtype}, got {a.dtype}")
            np.copyto(view, a, casting="unsafe")
        if len(inputs) < len(self._inputs):
            missing = [k for k in self._inputs if k not in inputs]
            if missing:
                raise ShapeError(f"graph {self.graph.name}: missing input "
                                 f"{', '.join(missing)}")

    def step(self, **inputs) -> dict:
        self._feed(inputs)
        if self._indices:
            self._check_indices()
        if self._runtime_views:
            for k, v in self.options.optimizer.runtime_inputs(self.calls).items():
                if k in self._runtime_views:
                    self._runtime_views[k][...] = v
        self._driver(self._arena, self._persist)
        if self._nonfinite is not None and self._nonfinite[()] != 0:
            self._raise_nonfinite()
        self.calls += 1
        return {k: v.copy() for k, v in self._outputs.items()} if self.copy_outputs else \
            dict(self._outputs)

    @property
    def check_finite(self) -> bool:
        return self.options.check_finite

    def _check_indices(self):
        """Integer inputs that index (labels, token ids, rows) must lie in [0, bound): checked
        before the driver runs, so a bad batch changes nothing (the interpreter's IndexError)."""
        for view, name, bound, users in self._indices:
            if view.size and (view.min() < 0 or view.max() >= bound):
                bad = np.flatnonzero((view < 0) | (view >= bound))[0]
                at = np.unravel_index(bad, view.shape)
                ops = ", ".join(f"{op} (%{nid})" for op, nid in users)
                raise IndexError(f"graph {self.graph.name}: input {name}[{','.join(map(str, at))}]"
                                 f" = {view.flat[bad]} is out of range [0, {bound}) for {ops}")

    def _raise_nonfinite(self):
        """The guard (passes/guard.py) kept every param and state: name the first non-finite
        value and leave the step uncounted."""
        what = next(k for k, v in self._checks.items() if v[()] != 0)
        kind = "gradient of param" if what.startswith("grad/") else "output"
        name = what[len("grad/"):] if what.startswith("grad/") else what
        raise FloatingPointError(f"step {self.calls + 1}: {kind} {name} is not finite; the "
                                 f"update was not applied (params and optimizer state unchanged)")

    run = step

    # ---- inspection ---------------------------------------------------------------------
    def ir(self, stage: str = "kernels") -> str:
        try:
            return self._products.ir[stage]
        except KeyError:
            raise KeyError(f"no IR for stage {stage!r}; this program has "
                           f"{', '.join(self._products.ir)}") from None

    def stats(self) -> dict:
        return {**self._stats, "steps": self.calls}

    def evaluator(self) -> "Evaluator":
        """Forward-only program for the source graph's outputs, sharing this program's params."""
        return Evaluator(self)


class Evaluator:
    """Runs the source graph's outputs with the parameters of a training program. Outputs that
    need inputs not given to `run` are left out (so `run(x=...)` gives logits without labels);
    each distinct set of given inputs compiles once."""

    def __init__(self, prog: Program):
        self._prog = prog
        self._programs = {}

    def run(self, **inputs) -> dict:
        key = frozenset(inputs)
        p = self._programs.get(key)
        if p is None:
            p = self._programs[key] = self._compile(key)
        return p.step(**inputs)

    def _compile(self, given):
        src = self._prog.source
        g = src.copy(src.name + "_eval")
        g.updates = {}
        inputs_of = {k: {n for n in live_nodes(src, [i]) if src.nodes[n].op == "input"}
                     for k, i in src.outputs.items()}
        given_ids = {src.inputs[k] for k in given if k in src.inputs}
        g.outputs = {k: i for k, i in src.outputs.items() if inputs_of[k] <= given_ids}
        if not g.outputs:
            need = {src.nodes[n].attr["name"] for s in inputs_of.values() for n in s} - set(given)
            raise ShapeError(f"graph {src.name}: no output can be computed from inputs "
                             f"{', '.join(sorted(given)) or 'none'}; missing "
                             f"{', '.join(sorted(need))}")
        prog = self._prog
        opts = replace(prog.options, loss=None, optimizer=None, checkpoint=None,
                       param_slots=prog._products.memory.params)
        return prog._compiler(g, opts, persist=prog._persist, copy_outputs=prog.copy_outputs,
                              check_indices=prog.check_indices)

    def stats(self) -> dict:
        return {"programs": len(self._programs)}

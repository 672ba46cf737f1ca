"""The static executor: it runs what the compiler built, allocated once, one native driver call
per step.

jitgraph/compiler.py runs the passes and the backend (runtime/backend.py) and hands a Program
its Products; the executor never runs a pass. A Program owns two byte regions: the arena
(activations, gradients: every per-step value at its memory-plan offset, values that are never
live together sharing bytes) and the persistent region (params and optimizer state), and one
buffer per output the plan puts in region "output". Inputs are not copied: `step` writes the
address of each input array (or of its converted copy, when it is not C-contiguous of the
exact dtype) into the driver's per-call pointer table `io`, feeds the optimizer's per-step
scalars (`opt/lr`, `opt/step`, `opt/apply`; `opt/loss_scale` from its Scaler when the graph
scales the loss), calls the driver once and returns fresh copies of the outputs; `step_into`
points the table's output entries at the caller's arrays.
With an update boundary (compile(hook=...), passes/boundary.py) a step is the driver's phase 1
(the gradients), `hook(Gradients)` (views of the gradients in the arena, which it may change in
place), then phase 2 (the update).
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, replace

import numpy as np

from jitgraph.ir import base, live_nodes
from jitgraph.optim import LOSS_SCALE, Scaler
from jitgraph.types import ShapeError, TensorType
from jitgraph.validate import index_inputs


@dataclass
class Products:
    """What the compiler hands a Program: the final graph, its kernels and memory plan (from
    passes/), the backend's built code, and the record of how they were made."""
    graph: object          # the Graph after every pass
    kernels: object        # its KernelGraph (jitgraph/plan.py, made by passes/fuse.py)
    memory: object         # its MemoryPlan (jitgraph/plan.py): slots, region sizes
    backend: object        # the runtime/backend.py backend that built the code
    module: object         # what backend.generate made (CPU: runtime/cpu/codegen.Generated)
    driver: object         # driver(arena, persist, io) runs one step (runtime/backend.py)
    outputs: tuple         # the graph outputs `step` returns
    nonfinite: str | None = None   # output that is nonzero when a checked value is not finite
    checks: dict = field(default_factory=dict)   # flag output -> the output it checks (guard)
    ir: dict = field(default_factory=dict)       # stage -> printed IR
    stages: dict = field(default_factory=dict)   # stage -> (graph, kernels, memory) after it
    reports: list = field(default_factory=list)  # each pass's Report
    stats: dict = field(default_factory=dict)


class Gradients(Mapping):
    """What an update hook sees (compile(hook=...)): param name -> its gradient (with
    accumulation: the accumulated sum the update applies) as a writeable view of the program's
    arena, valid during the hook only. `buckets`: dtype name -> one flat writeable array over
    all the gradients of that dtype, in param order, each gradient starting on a 64-byte line,
    the bytes between them zero (`flat`: the f32 bucket, or the only one; an in-place MPI
    Allreduce of it averages every gradient at once, no copy). `offsets`: param -> index of its
    first element in its bucket. `step`: the 1-based optimizer step the update applies.
    Changes made through the views are what the update reads."""

    def __init__(self, views: dict, buckets: dict, offsets: dict):
        self._views, self.buckets, self.offsets = views, buckets, offsets
        self.flat = buckets.get("f32", next(iter(buckets.values()), None))
        self.step = 0

    def __getitem__(self, name):
        return self._views[name]

    def __iter__(self):
        return iter(self._views)

    def __len__(self):
        return len(self._views)


class ArrayMap(MutableMapping):
    """Named arrays living in a program's persistent region. Reading returns a copy (so later
    steps never change an array you hold); assigning validates shape and dtype, then copies in."""

    def __init__(self, views: dict, what: str):
        self._views, self._what = views, what

    def __getitem__(self, name):
        return self._view(name).copy()

    def view(self, name):
        """The array where it lives, read-only and not copied: valid until the next step
        changes it (writing a model's weights out without a second copy of them)."""
        v = self._view(name).view()
        v.flags.writeable = False
        return v

    def __setitem__(self, name, value):
        v = self._view(name)
        if hasattr(value, "read_into"):
            # a tensor of a file (formats/tensors.py): its bytes are read straight into place
            t = value.type
            if t.shape == v.shape and (
                    (t.dtype == "f32" and _half_of(v.dtype) == "bf16") or
                    (t.dtype == "bf16" and v.dtype == np.float32)):
                # an f32 weight of a file into a bf16 slot (bf16 master weights): rounded; a
                # bf16 one into an f32 slot: its values. Converted straight into the slot a
                # chunk at a time, the file's pages released after (no whole-tensor copy)
                value.read_converted(v)
                return
            if t.storage_shape != v.shape or t.np_dtype != v.dtype:
                raise ShapeError(f"{self._what} {name}: expected {_typestr(v)}, got {t} from "
                                 f"{value.path}")
            value.read_into(v, mapped=True)     # the program's own region: pages mapped
            return
        a = np.asarray(value)
        half = _half_of(v.dtype)
        if half and a.dtype != v.dtype and a.shape == v.shape:
            a = _as_half(a, half, f"{self._what} {name}")
        if half is None and v.dtype.kind == "f" and a.dtype == np.uint16:
            # bf16 bits (a checkpoint's bf16 master weights): not numbers to convert
            raise ShapeError(f"{self._what} {name}: expected {_typestr(v)}, got {_typestr(a)} "
                             f"(bf16 bits; the program stores this value as {v.dtype})")
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


def _half_of(dtype):
    """The half type whose values are arrays of numpy `dtype` (float16: f16, uint16: bf16, the
    only values of those dtypes), or None."""
    return {np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16"}.get(np.dtype(dtype))


def _as_half(a, dtype, what):
    """A half value given as a float array rounded to its type (jitgraph/half.py)."""
    from jitgraph.half import as_value
    from jitgraph.types import TensorType
    return as_value(a, TensorType(dtype, a.shape), what)


def _typestr(a):
    return _typestr2(a.dtype, a.shape)


def _typestr2(dtype, shape):
    return f"{dtype}[{','.join(map(str, shape))}]"


PAGE = 4096


def _align(n, to=64):
    return -(-n // to) * to


def _readonly(a):
    v = a.view()
    v.flags.writeable = False
    return v


class Program:
    """A compiled graph. `step(**inputs)` runs it once (a training step when compiled with an
    optimizer) and returns its outputs as fresh numpy arrays, or with `copy_outputs=False` as
    read-only views of its buffers that the next step overwrites (a copy of a large output can
    cost as much as a fused kernel over it); `step_into(out, **inputs)` writes the outputs
    named in `out` into the caller's arrays.

    Calling convention (the driver's `io` table, runtime/backend.py): an input that is a
    C-contiguous array of its exact dtype is read where it lies (its address goes into the
    table, nothing is copied); any other is converted once per call into the program's staging
    buffer for it. The memory plan never writes into an input. Outputs computed by a kernel
    (the plan's region "output") are written through the table too: into the program's own
    buffer, or straight into the caller's array with `step_into`."""

    def __init__(self, source, options, products: Products, *, seed=0, persist=None,
                 copy_outputs=True, check_indices=True, compiler=None, params=None,
                 scratch=None):
        """`source`: the graph as the user built it; `options`: the pipeline's Options it was
        compiled with; `persist`: another program's persistent region to share (its params);
        `scratch`: another program's arena block (page-aligned) to run in when it is large
        enough (Program.evaluator(share_memory=True)), else one of its own is allocated;
        `compiler(graph, options, persist=..., copy_outputs=..., check_indices=...)`: how the
        evaluator compiles its forward-only programs (jitgraph/compiler.py); `params`: values
        of params written in place of their initialisation."""
        self.source = source
        self.options = options
        self.check_indices = check_indices
        self.copy_outputs = copy_outputs
        self._products, self._compiler = products, compiler
        self._driver, self._stats = products.driver, products.stats
        self._tick = products.backend.before_step
        g, plan, backend = products.graph, products.memory, products.backend
        self.graph, self._plan, self._backend = g, plan, backend
        self._addr = _address = backend.address
        # one block: the arena, then the program's own buffers behind the "output" pointers
        # (the defaults of the io table); an input lying in it is copied first. A buffer of a
        # page or more starts on a page: a kernel streaming from a caller's array (numpy's
        # large arrays start 16 B into a page) into it then never stores a little ahead of its
        # loads modulo 4 KiB (4K aliasing, which stalls such streaming loops).
        arena = _align(plan.arena_bytes + products.module.workspace_bytes)
        at = {}
        for s in plan.outputs.values():
            arena = _align(arena, PAGE if s.nbytes >= PAGE else 64)
            at[s.pointer], arena = (arena, arena + s.nbytes), arena + s.nbytes
        if scratch is not None and scratch.nbytes >= _align(arena) and \
                _address(scratch) % PAGE == 0:
            block = scratch[:_align(arena)]
        else:
            block = backend.allocate(_align(arena) + PAGE)
            first = (-_address(block)) % PAGE
            block = block[first:first + _align(arena)]
        self._block = block
        self._arena = block[:plan.arena_bytes + products.module.workspace_bytes]
        self._own_out = {p: block[lo:hi] for p, (lo, hi) in at.items()}
        self._written = (_address(block), _address(block) + block.nbytes)
        owner = persist is None
        if owner:       # on a page: weights whose slots share their file's page offsets
            region = backend.allocate(plan.persist_bytes + PAGE)   # get the file's pages
            first = (-_address(region)) % PAGE
            self._persist = region[first:first + plan.persist_bytes]
        else:
            self._persist = persist
        self._io = np.zeros(plan.pointers, np.int64)       # the driver's per-call pointers
        self._default = {p: _address(b) for p, b in self._own_out.items()}
        for p, a in self._default.items():
            self._io[p] = a

        self._param_views = {k: backend.view(self._persist, plan.params[k], g.nodes[i].type)
                             for k, i in g.params.items()}
        given = dict(params or {})
        unknown = [k for k in given if k not in source.params]
        if unknown:
            raise KeyError(f"params: no param {unknown[0]!r} in graph {source.name}; expected "
                           f"one of {', '.join(source.params)}")
        if owner:       # one param at a time; the region is allocated zeroed (backend.allocate)
            for k in g.params:
                if k not in given and not (getattr(g.inits[k], "zero", False) and
                                           not g.nodes[g.params[k]].type.is_storage):
                    self._param_views[k][...] = g.init_param(k, seed)
        opt = options.optimizer
        self._runtime = set(opt.runtime_inputs(0)) if opt is not None else set()
        if LOSS_SCALE in g.inputs and options.loss_scale is not None:
            self._runtime.add(LOSS_SCALE)       # the backward's seed: the scaler's S
        # user inputs: name -> (pointer, shape, dtype); the optimizer's per-step scalars live in
        # buffers of the program's own, their pointers set once
        self._in, self._runtime_views, self._stage = {}, {}, {}
        for k, s in plan.inputs.items():
            t = g.nodes[g.inputs[k]].type
            if k in self._runtime:
                buf = backend.allocate(s.nbytes)
                self._io[s.pointer] = _address(buf)
                self._runtime_views[k] = backend.view(buf, replace(s, offset=0), t)
            else:
                self._in[k] = (s.pointer, t.shape, t.np_dtype)
        # returned outputs: name -> array read after the step (None: the input it is)
        self._outputs, self._from_input = {}, {}
        for k in products.outputs:
            v = self._view(g.outputs[k])
            if v is None:
                self._from_input[k] = (g.nodes[base(g, g.outputs[k])].attr["name"],
                                       g.nodes[g.outputs[k]].type.shape)
            else:
                v.flags.writeable = False       # `step` hands them out with copy_outputs=False
                self._outputs[k] = v
        # step_into: output name -> (pointer, or None: copied into the caller's array; type, dtype)
        self._out_spec = {k: (plan.outputs[k].pointer if k in plan.outputs else None,
                              g.nodes[g.outputs[k]].type, g.nodes[g.outputs[k]].type.np_dtype)
                          for k in products.outputs}
        self._nonfinite = None if products.nonfinite is None else \
            self._view(g.outputs[products.nonfinite])
        self._checks = {k: self._view(g.outputs[f]) for f, k in products.checks.items()}
        # update boundary: the driver runs in phases, the hook between them
        self._phased = products.kernels.boundary is not None
        self._hook = None
        if self._phased:
            views = {k: self._backend.view(self._arena, s, g.nodes[g.params[k]].type)
                     for k, s in plan.gradients.items()}
            any_slot = next(iter(plan.gradients.values()))
            buckets = {dt: self._backend.view(
                self._arena, replace(any_slot, offset=off, nbytes=nb),
                TensorType(dt, (nb // TensorType(dt, ()).np_dtype.itemsize,)))
                for dt, off, nb in plan.buckets}
            offsets = {k: (s.offset - next(off for _, off, nb in plan.buckets
                                           if off <= s.offset < off + nb)) //
                       views[k].dtype.itemsize for k, s in plan.gradients.items()}
            self._grads = Gradients(views, buckets, offsets)
        self._indices = [(k, bound, users) for k, (bound, users) in index_inputs(g).items()
                         if k in self._in and check_indices]
        user = [k for k in source.params]
        self.params = ArrayMap({k: self._param_views[k] for k in user}, "param")
        for k, v in given.items():
            self.params[k] = v
        self.state = ArrayMap({k: v for k, v in self._param_views.items() if k not in user},
                              "state")
        self.calls = 0
        # dynamic loss scaling: S fed as opt/loss_scale before each step, updated after it
        self.scaler = Scaler(options.loss_scale) if LOSS_SCALE in self._runtime_views else None
        self._skip = options.check_finite == "skip"
        self.skipped = 0                # steps skipped as not finite (check_finite="skip")
        self.last_skipped = False       # whether the last step was one

    def _view(self, nid):
        """The array holding value `nid` between steps, where the plan put it (None for an
        input: it lies in the caller's array of the call)."""
        s, t = self._plan.slots[nid], self.graph.nodes[nid].type
        if s.region == "input":
            return None
        region = {"arena": self._arena, "persist": self._persist}.get(s.region)
        if region is None:
            region = self._own_out[s.pointer]
        return self._backend.view(region, s, t)

    def _address(self, where, offset=0) -> int:
        """The address the driver uses for (base, offset) of the generated code's calls
        (runtime/cpu/codegen.Generated.calls): base "arena", "persist" or an io entry."""
        if isinstance(where, str):
            return self._addr(self._arena if where == "arena" else self._persist) + offset
        return int(self._io[where]) + offset

    # ---- running ------------------------------------------------------------------------
    def _feed(self, inputs, read=None) -> dict:
        """Point the io table at the inputs; returns name -> the array the step reads, and
        appends the byte ranges of the caller's arrays read where they lie to `read`."""
        io, spec, fed, addr = self._io, self._in, {}, self._addr
        lo, hi = self._written
        for name, value in inputs.items():
            sp = spec.get(name)
            if sp is None:
                if name in self.graph.inputs:
                    continue    # declared but unused by these outputs
                raise ShapeError(f"graph {self.graph.name}: unknown input {name!r}; expected "
                                 f"{', '.join(self._in) or 'none'}")
            p, shape, dtype = sp
            a = value if type(value) is np.ndarray else np.asarray(value)   # no subclass
            if a.shape != shape:
                raise ShapeError(f"input {name}: expected shape {_typestr2(dtype, shape)}, got "
                                 f"{_typestr(a)}")
            f = a.flags
            if a.dtype == dtype and f.c_contiguous and f.aligned:
                at = addr(a)
                end = at + a.nbytes
                if end <= lo or hi <= at:       # not in memory the step writes
                    io[p] = at                  # read where it lies
                    fed[name] = a
                    if read is not None:
                        read.append((at, end))
                    continue
            fed[name], io[p] = self._convert(name, a, dtype, shape)
        if len(fed) < len(spec):
            missing = [k for k in spec if k not in fed]
            raise ShapeError(f"graph {self.graph.name}: missing input {', '.join(missing)}")
        return fed

    def _convert(self, name, a, dtype, shape):
        """(staging buffer, its address): `a` converted into the program's buffer for input
        `name` (another dtype, not C-contiguous or aligned, or lying in memory the step
        writes)."""
        half = _half_of(dtype)
        if half and a.dtype != dtype:
            a = _as_half(a, half, f"input {name}")
        elif a.dtype != dtype and a.dtype.kind != dtype.kind and \
                not (dtype.kind == "f" and a.dtype.kind in "iu"):
            raise ShapeError(f"input {name}: expected dtype {dtype}, got {a.dtype}")
        stage = self._stage.get(name)
        if stage is None:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            buf = self._backend.allocate(nbytes).view(dtype).reshape(shape)
            stage = self._stage[name] = (buf, self._addr(buf))
        np.copyto(stage[0], a, casting="unsafe")
        return stage

    @property
    def hook(self):
        """The update hook, `hook(Gradients)`, called between the gradients and the update of
        every step that applies the update (with accumulate=k, the k-th micro-step: the other
        micro-steps only add to the accumulators and call no hook). Settable to another
        callable or None (no hook: the two phases run back to back) on a program compiled
        with hook=. A hook that raises leaves the step unapplied (params, optimizer state and
        the step count unchanged) and the exception propagates."""
        return self._hook

    @hook.setter
    def hook(self, fn):
        if fn is not None and not callable(fn):
            raise TypeError(f"hook: expected a callable hook(gradients) or None, got "
                            f"{type(fn).__name__}")
        if fn is not None and not self._phased:
            raise ValueError(f"hook: program {self.graph.name} was compiled without an update "
                             f"boundary; compile it with hook= (and an optimizer)")
        self._hook = fn

    def applies_update(self, call=None) -> bool:
        """True if the call-th step (default: the next) applies the update (always, unless the
        optimizer accumulates: then its k-th micro-step)."""
        opt = self.options.optimizer
        call = self.calls if call is None else call
        return opt is not None and call % opt.accumulate == opt.accumulate - 1

    def _run(self):
        if self._tick is not None:
            self._tick()
        if self._hook is None or not self.applies_update():
            if self._phased:
                self._driver(self._arena, self._persist, self._io, 0)
            else:
                self._driver(self._arena, self._persist, self._io)
            return
        self._driver(self._arena, self._persist, self._io, 1)
        self._grads.step = self.calls // self.options.optimizer.accumulate + 1
        self._hook(self._grads)
        self._driver(self._arena, self._persist, self._io, 2)

    def step(self, **inputs) -> dict:
        fed = self._feed(inputs)
        self._before(fed)
        self._run()
        return self._after(fed, None, ())

    def step_into(self, out: dict, /, **inputs) -> dict:
        """Run one step like `step`, writing each output named in `out` into its array there
        (shape as the output, dtype it can take, writeable). An output computed by a kernel
        into a C-contiguous array of its exact dtype that shares no memory with the inputs is
        written there directly (no copy); any other is copied in after the step. Returns the
        outputs: the caller's arrays for those in `out`, the others as `step` does. `out` is
        positional, so an input may be called "out"."""
        read = [self._written]
        fed = self._feed(inputs, read)
        self._before(fed)
        moved = []
        try:
            copied = self._redirect(out, read, moved)
            self._run()
        finally:
            for p in moved:                      # the program's own buffers again
                self._io[p] = self._default[p]
        return self._after(fed, out, copied)

    def _before(self, fed):
        if self._indices:
            self._check_indices(fed)
        if self._runtime_views:
            for k, v in self.options.optimizer.runtime_inputs(self.calls).items():
                if k in self._runtime_views:
                    self._runtime_views[k][...] = v
            if self.scaler is not None:
                self._runtime_views[LOSS_SCALE][...] = self.scaler.scale

    def _after(self, fed, out, copied) -> dict:
        finite = self._nonfinite is None or self._nonfinite[()] == 0
        self.last_skipped = not finite
        if not finite:
            if not self._skip:
                self._raise_nonfinite()
            self.skipped += 1           # the guard kept everything: the step is not counted
            if self.scaler is not None:
                self.scaler.update(False)
        else:
            if self.scaler is not None:
                self.scaler.update(True, self.applies_update())
            self.calls += 1
        res = {k: v.copy() for k, v in self._outputs.items() if not out or k not in out} \
            if self.copy_outputs else dict(self._outputs)
        for k, (name, shape) in self._from_input.items():
            v = fed[name].reshape(shape)
            res[k] = v.copy() if self.copy_outputs else _readonly(v)
        if out:
            for k, a in copied:
                np.copyto(a, res[k] if k in res else self._outputs[k], casting="same_kind")
            res.update(out)
            res = {k: res[k] for k in self._out_spec}
        return res

    def _redirect(self, out, taken, moved) -> list:
        """Point the io table's output entries at the caller's arrays in `out` that share no
        byte with the ranges `taken` (appending the entries to `moved`); returns
        [(name, array)] to copy into after the step."""
        copied = []
        for name, a in out.items():
            spec = self._out_spec.get(name)
            if spec is None:
                raise KeyError(f"step_into: no output {name!r}; expected one of "
                               f"{', '.join(self._out_spec)}")
            p, t, dtype = spec
            ok = isinstance(a, np.ndarray) and a.shape == t.shape and a.flags.writeable
            if not ok or (a.dtype != dtype and not np.can_cast(dtype, a.dtype, "same_kind")):
                got = _typestr(a) if isinstance(a, np.ndarray) else type(a).__name__
                ro = isinstance(a, np.ndarray) and not a.flags.writeable
                raise ShapeError(f"step_into: output {name}: expected a writeable array of "
                                 f"{_typestr2(dtype, t.shape)}, got {got}"
                                 f"{' (read-only)' if ro else ''}")
            f = a.flags
            if p is not None and a.dtype == dtype and f.c_contiguous and f.aligned and a.nbytes:
                at = self._addr(a if type(a) is np.ndarray else np.asarray(a))
                end = at + a.nbytes
                for lo, hi in taken:
                    if lo < end and at < hi:
                        break
                else:
                    self._io[p] = at            # the kernel writes into the caller's array
                    moved.append(p)
                    taken.append((at, end))
                    continue
            copied.append((name, a))
        return copied

    @property
    def check_finite(self) -> bool:
        return self.options.check_finite

    def _check_indices(self, fed):
        """Integer inputs that index (labels, token ids, rows) must lie in [0, bound): checked
        before the driver runs, so a bad batch changes nothing (the interpreter's IndexError)."""
        for name, bound, users in self._indices:
            view = fed[name]
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
    run_into = step_into

    # ---- inspection ---------------------------------------------------------------------
    def ir(self, stage: str = "kernels", format: str = "text") -> str:
        """The IR after `stage`: printed text, or with format="dot" graphviz dot text of the
        graph, its kernels and memory plan as that stage left them (jitgraph/printer_dot.py)."""
        if format not in ("text", "dot"):
            raise ValueError(f"ir: format must be 'text' or 'dot', got {format!r}")
        try:
            text = self._products.ir[stage]
        except KeyError:
            raise KeyError(f"no IR for stage {stage!r}; this program has "
                           f"{', '.join(self._products.ir)}") from None
        if format == "text":
            return text
        from jitgraph.printer_dot import to_dot
        graph, kernels, memory = self.at_stage(stage)
        return to_dot(graph, kernels, memory, title=f"{graph.name} after {stage}")

    def at_stage(self, stage: str = "kernels") -> tuple:
        """(graph, KernelGraph, MemoryPlan) as compiler stage `stage` left them (kernels and
        plan None before fuse and memory)."""
        try:
            return self._products.stages[stage]
        except KeyError:
            raise KeyError(f"no stage {stage!r}; this program has "
                           f"{', '.join(self._products.stages)}") from None

    def stats(self) -> dict:
        return {**self._stats, "steps": self.calls}

    def evaluator(self, share_memory: bool = False) -> "Evaluator":
        """Forward-only program for the source graph's outputs, sharing this program's params.
        share_memory=True: its arena and output buffers lie in this program's arena where it
        is large enough (a step's activations and gradients are dead between steps: a 1B
        model's evaluation then needs no memory of its own); a run then overwrites what the
        last step left there (outputs returned with copy_outputs=False) and a step what the
        run returned: for results read at once."""
        return Evaluator(self, share_memory)


class Evaluator:
    """Runs the source graph's outputs with the parameters of a training program. Outputs that
    need inputs not given to `run` are left out (so `run(x=...)` gives logits without labels);
    each distinct set of given inputs compiles once."""

    def __init__(self, prog: Program, share_memory: bool = False):
        self._prog = prog
        self._share = share_memory
        self._programs = {}

    def run(self, **inputs) -> dict:
        key = frozenset(inputs)
        p = self._programs.get(key)
        if p is None:
            p = self._programs[key] = self._compile(key)
        return p.step(**inputs)

    def run_into(self, out: dict, /, **inputs) -> dict:
        """`run`, writing the outputs named in `out` into its arrays (Program.step_into)."""
        key = frozenset(inputs)
        p = self._programs.get(key)
        if p is None:
            p = self._programs[key] = self._compile(key)
        return p.step_into(out, **inputs)

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
        # params the training program stores in another type (bf16 master weights): the
        # evaluator's graph reads them so too (the pipeline's stored_params)
        types = {k: prog.graph.nodes[i].type.dtype for k, i in prog.graph.params.items()
                 if k in g.params and prog.graph.nodes[i].type != g.nodes[g.params[k]].type}
        opts = replace(prog.options, loss=None, stored_params=types or None, optimizer=None,
                       checkpoint=None, boundary=False,
                       param_slots=prog._products.memory.params, loss_scale=None,
                       check_finite=prog.options.check_finite is True)
        return prog._compiler(g, opts, persist=prog._persist, copy_outputs=prog.copy_outputs,
                              check_indices=prog.check_indices,
                              scratch=prog._block if self._share else None)

    def stats(self) -> dict:
        return {"programs": len(self._programs)}

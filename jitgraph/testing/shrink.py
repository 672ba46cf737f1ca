"""Shrinker (`shrink`): tries the failing config without training, fewer steps, then greedily
drops outputs and updates, moves an output to an operand of its node, drops nodes (a value
becomes a fresh input, or is bypassed by an operand of its type), turns params into inputs
and shrinks dims (one size at a time, everywhere it occurs), keeping only changes that still
fail the same way (Failure.signature); `to_python` prints the result as a script that builds
the graph and calls check_case."""
from __future__ import annotations

import math
import time
from dataclasses import replace


import jitgraph as jg
from jitgraph.types import ShapeError

from .generator import sane
from .runner import check_case, _compile, CONFIGS


def _rebuild(case, cut=(), bypass=None, drop_outputs=(), drop_updates=(), dims=None,
             params_to_inputs=(), retarget=None):
    """A new Case: nodes in `cut` become fresh inputs, `bypass` maps a node to an operand that
    replaces it, outputs/updates dropped, every dim size d -> dims[d], dead nodes removed.
    Raises ShapeError when the result does not type-check."""
    g = case.graph
    bypass = bypass or {}
    dims = dims or {}
    outputs = {k: (retarget or {}).get(k, v) for k, v in g.outputs.items()
               if k not in drop_outputs}
    updates = {k: v for k, v in g.updates.items() if k not in drop_updates}

    def resolve(i):
        while i in bypass:
            i = bypass[i]
        return i
    live, stack = set(), [resolve(i) for i in list(outputs.values()) + list(updates.values())]
    stack += [g.params[p] for p in updates]
    while stack:
        i = resolve(stack.pop())
        if i in live:
            continue
        live.add(i)
        if i not in cut:
            stack.extend(g.nodes[i].inputs)

    def dim(d):
        return dims.get(d, d)

    def shape(s):
        return tuple(dim(d) for d in s)

    new = jg.Graph(g.name)
    m, int_high = {}, {}
    for n in g.nodes:
        if n.id not in live:
            continue
        if n.id in cut or (n.op == "param" and n.attr["name"] in params_to_inputs):
            name = n.attr["name"] if n.op in ("input", "param") else f"c{n.id}"
            m[n.id] = new.input(name, shape(n.type.shape), n.type.dtype)
            if not n.type.is_float:
                int_high[name] = 2
        elif n.op == "input":
            m[n.id] = new.input(n.attr["name"], shape(n.type.shape), n.type.dtype)
            if n.attr["name"] in case.int_high:
                int_high[n.attr["name"]] = case.int_high[n.attr["name"]]
        elif n.op == "param":
            name = n.attr["name"]
            m[n.id] = new.param(name, shape(n.type.shape), n.type.dtype, init=g.inits[name],
                                trainable=n.attr["trainable"])
        else:
            a = dict(n.attrs)
            if dims:
                for key in ("shape",):
                    if key in a:
                        a[key] = shape(a[key])
                if "slices" in a:
                    src = g.nodes[n.inputs[0]].type.shape
                    a["slices"] = tuple(_reslice(sl, d, dim(d))
                                        for sl, d in zip(a["slices"], src))
            m[n.id] = new.add(n.op, [m[resolve(i)] for i in n.inputs], a)
    new.outputs = {k: m[resolve(v)].id for k, v in outputs.items()}
    for k, v in updates.items():
        if k in new.params:
            new.update(**{k: m[resolve(v)]})
    for k, v in case.int_high.items():
        if k in new.inputs and k not in int_high:
            int_high[k] = v
    for name in int_high:                           # labels: below the shrunk class count
        if name in new.inputs and name in case.int_high:
            int_high[name] = max(1, dim(case.int_high[name]))
    new.validate()
    return replace(case, graph=new, int_high=int_high)


def _reslice(sl, d, nd):
    """The (start, stop, step) triple of a slice of an axis of size d, for size nd."""
    st, sp, step = sl
    if nd == d:
        return sl
    stop = None if (step > 0 and sp >= d) or (step < 0 and sp < 0) else min(sp, nd)
    r = range(nd)[slice(min(st, nd - 1), stop, step)]
    return (r.start, r.stop, r.step)


def _size(case):
    g = case.graph
    return (sum(n.op not in ("input", "param") for n in g.nodes), len(g.nodes),
            sum(n.type.size for n in g.nodes))


def shrink(case, failure, budget_s=120.0, steps=None, log=None, compile_fn=_compile):
    """A smaller Case that still fails like `failure` (same kind; for exceptions the same type
    and message shape), for the failing config only. Returns (case, failure, steps)."""
    configs = [failure.config] if failure.config is not None else []
    steps = steps or (failure.step + 1 if failure.step >= 0 else 1)
    grad = failure.kind == "grad"
    deadline = time.monotonic() + budget_s
    sig = failure.signature()

    def fails(c, nsteps):
        if time.monotonic() > deadline:
            return None
        if not sane(c, steps=max(1, nsteps)):
            return None
        try:
            r = check_case(c, configs=configs, steps=nsteps, grad_check=grad,
                           compile_fn=compile_fn)
        except Exception:  # noqa: BLE001 - the reference itself failed: not the same bug
            return None
        for f in r.failures:
            if f.signature() == sig:
                return f
        return None

    best, best_f = case, failure
    if best.mode == "train" and failure.kind != "grad":        # fails without training?
        fwd = replace(best, mode="forward")
        f = fails(fwd, steps)
        if f is not None:
            best, best_f = fwd, f
    for s in range(1, steps):                       # fewer steps first
        f = fails(best, s)
        if f is not None:
            steps, best_f = s, f
            break

    def candidates(c):
        g = c.graph
        must = {"loss"} if c.mode == "train" else set()
        if len(g.outputs) > 2:
            for k in list(g.outputs):
                yield dict(drop_outputs=set(g.outputs) - {k} - must)
        for k in list(g.outputs):
            if k not in must and len(g.outputs) > 1:
                yield dict(drop_outputs={k})
        for k in list(g.updates):
            yield dict(drop_updates={k})
        for k, i in g.outputs.items():              # an output moves to an operand
            if k not in must:
                for j in dict.fromkeys(g.nodes[i].inputs):
                    yield dict(retarget={k: j})
        comp = [n for n in g.nodes if n.op not in ("input", "param")]
        for n in reversed(comp):
            for i in dict.fromkeys(n.inputs):
                if g.nodes[i].type == n.type:
                    yield dict(bypass={n.id: i})
            yield dict(cut={n.id})
        for p in list(g.params):
            if p not in g.updates:
                yield dict(params_to_inputs={p})
        sizes = sorted({d for n in g.nodes for d in n.type.shape if d > 1}, reverse=True)
        for d in sizes:
            for smaller in range(1, d):
                yield dict(dims={d: smaller})

    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for kw in candidates(best):
            try:
                cand = _rebuild(best, **kw)
            except (ShapeError, ValueError, KeyError, IndexError):
                continue
            if _size(cand) >= _size(best):
                continue
            f = fails(cand, steps)
            if f is not None:
                best, best_f, improved = cand, f, True
                if log:
                    log(f"  shrink: {_size(best)[0]} nodes ({kw})")
                break
    return best, best_f, steps


def _py(v):
    if isinstance(v, float):
        if math.isinf(v):
            return "float('inf')" if v > 0 else "-float('inf')"
        if math.isnan(v):
            return "float('nan')"
        return repr(v)
    if isinstance(v, tuple):
        inner = ", ".join(_py(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    return repr(v)


_SIMPLE = {"relu", "tanh", "sigmoid", "neg", "sqr", "abs", "gelu", "silu", "softplus", "exp",
           "log", "sqrt", "step", "sgn", "add", "sub", "mul", "div", "maximum", "minimum",
           "where", "matmul"}


def to_python(case, failure=None, steps=None, configs=None):
    """A runnable script: builds `case.graph` and checks it with check_case."""
    g = case.graph
    var = {}
    lines = ["import numpy as np", "import jitgraph as jg",
             "from jitgraph.testing.generator import Case",
             "from jitgraph.testing.runner import check_case", "",
             f"g = jg.Graph({g.name!r})"]
    for n in g.nodes:
        v = var[n.id] = (n.attr["name"].replace("/", "_") if n.op in ("input", "param")
                         else f"t{n.id}")
        if n.op == "input":
            lines.append(f"{v} = g.input({n.attr['name']!r}, {_py(n.type.shape)}, "
                         f"{n.type.dtype!r})")
        elif n.op == "param":
            spec = g.inits[n.attr["name"]].spec()
            lines.append(f"{v} = g.param({n.attr['name']!r}, {_py(n.type.shape)}, "
                         f"{n.type.dtype!r}, init=jg.init.from_spec({spec!r}), "
                         f"trainable={n.attr['trainable']})")
        else:
            args = ", ".join(var[i] for i in n.inputs)
            a = n.attr
            if n.op in _SIMPLE and (not a or a == {"ta": False, "tb": False}):
                lines.append(f"{v} = jg.{n.op}({args})")
            else:
                attrs = "{" + ", ".join(f"{k!r}: {_py(x)}" for k, x in n.attrs) + "}"
                lines.append(f"{v} = g.add({n.op!r}, [{args}], {attrs})")
    outs = ", ".join(f"{k!r}: {var[i]}" for k, i in g.outputs.items())
    lines.append(f"g.output(**{{{outs}}})")
    if g.updates:
        ups = ", ".join(f"{k!r}: {var[i]}" for k, i in g.updates.items())
        lines.append(f"g.update(**{{{ups}}})")
    cfgs = configs or ([failure.config] if failure and failure.config else list(CONFIGS))
    st = steps or (failure.step + 1 if failure and failure.step >= 0 else 1)
    if failure is not None:
        lines.append(f"# observed: {failure}")
    lines.append(f"case = Case(g, mode={case.mode!r}, lr={case.lr!r}, "
                 f"int_high={case.int_high!r}, seed={case.seed!r})")
    lines.append(f"check_case(case, configs={cfgs!r}, steps={st}, raise_on_fail=True)")
    return "\n".join(lines) + "\n"

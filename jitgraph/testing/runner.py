"""Runner (`check_case`): every program runs several steps with fresh inputs (stale state shows);
before each step the reference (float64 interpreter; in train mode jg.training_graph) starts
from the program's own parameters, so each step is checked on its own. Train mode also checks
autodiff against central differences (jg.testing.check_grad) and the reference's own SGD step
against p - lr * grad."""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, replace

import numpy as np

import jitgraph as jg

from .generator import feeds_for
from .reference import (C_TOL, compare, DELTA, reference, _reference_graphs, _run, _runtime, _to64,
                        U32)


CONFIGS = ((True, True), (True, False), (False, True), (False, False))   # (fuse, plan_memory)


@dataclass
class Failure:
    kind: str               # "error" | "mismatch" | "grad" | "reference" | "checker error"
    config: tuple | None    # (fuse, plan_memory)
    step: int
    where: str              # the output/param, or the exception type
    detail: str
    at: str = ""            # where an exception was raised: file:line
    op: str = ""            # mismatch: the op computing the wrong value ("param": the leaf)

    def signature(self):
        """What the shrinker preserves: the kind and, for an exception, its type and message
        without numbers."""
        if self.kind in ("error", "reference", "checker error"):
            return (self.kind, self.where, re.sub(r"[0-9]+", "", self.detail)[:60], self.at)
        if self.kind == "mismatch":
            return ("mismatch", self.op)
        return (self.kind,)

    def __str__(self):
        cfg = "" if self.config is None else \
            f" fuse={self.config[0]} plan_memory={self.config[1]}"
        at = f" (at {self.at})" if self.at else ""
        return f"{self.kind}{cfg} step {self.step} {self.where}: {self.detail}{at}"


@dataclass
class Result:
    failures: list
    programs: int = 0
    steps: int = 0


def _compile(case, fuse, plan):
    return jg.compile(case.graph, loss="loss" if case.mode == "train" else None,
                      optimizer=case.optimizer, fuse=fuse, plan_memory=plan)


def check_case(case, configs=CONFIGS, steps=None, grad_check=True, compile_fn=_compile,
               raise_on_fail=False):
    """Compile `case` under each (fuse, plan_memory) config and run `steps` steps (default 3,
    2 in train mode) on fresh inputs, each checked against the float64 reference started from
    the program's own parameters. Returns a Result; raise_on_fail raises AssertionError."""
    steps = steps if steps is not None else (2 if case.mode == "train" else 3)
    res = Result([])
    g32, g64 = _reference_graphs(case)
    init = case.graph.init_params(0)
    try:                         # the interpreters themselves (float64, float32) on step 0
        ps = {**init, **{k: v for k, v in g32.init_params(0).items() if k not in init}}
        feeds = {**feeds_for(case, 0), **_runtime(case, 0)}
        jg.interp.run(g32, feeds, dict(ps))
        _run(g64, _to64(feeds), _to64(ps))
    except Exception as e:  # noqa: BLE001
        f = _error(None, 0, e)
        res.failures.append(replace(f, kind="reference", where=f"interpreter {f.where}"))
        if raise_on_fail:
            raise AssertionError(str(res.failures[0])) from e
        return res
    if case.mode == "train" and grad_check:
        res.failures += _check_grad(case, init)
        res.failures += _check_sgd_reference(case, g64, init)
    for cfg in configs:
        try:
            prog = compile_fn(case, *cfg)
        except Exception as e:  # noqa: BLE001 - any exception is a finding
            res.failures.append(_error(cfg, -1, e))
            continue
        res.programs += 1
        for step in range(steps):
            pre = _to64({**prog.params, **getattr(prog, "state", {})})
            feeds = feeds_for(case, step)
            try:
                got = prog.step(**feeds)
            except Exception as e:  # noqa: BLE001
                res.failures.append(_error(cfg, step, e))
                break
            res.steps += 1
            post = {**{"param:" + k: np.array(v) for k, v in prog.params.items()},
                    **{"param:" + k: np.array(v) for k, v in getattr(prog, "state", {}).items()}}
            f = _compare_step(case, (g32, g64), cfg, step, feeds, pre, {**got, **post})
            if f is not None:
                res.failures.append(f)
                break
    if raise_on_fail and res.failures:
        raise AssertionError("\n".join(map(str, res.failures)))
    return res


def _error(cfg, step, e):
    tb = traceback.extract_tb(e.__traceback__)
    ours = [f for f in tb if "/jitgraph/" in f.filename or "/passes/" in f.filename or
            "/runtime/" in f.filename]
    at = f"{tb[-1].filename.split('/')[-1]}:{tb[-1].lineno}" if tb else ""
    if ours and ours[-1] is not tb[-1]:         # the deepest frame of jitgraph's own code
        at += f" from {ours[-1].filename.split('/')[-1]}:{ours[-1].lineno}"
    elif len(ours) >= 2:                        # and who called it
        at += f" from {ours[-2].filename.split('/')[-1]}:{ours[-2].name}"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return Failure("error", cfg, step, type(e).__name__, msg[:300], at)


def _compare_step(case, graphs, cfg, step, feeds, pre, got):
    g32, g64 = graphs
    feeds64 = _to64({**feeds, **_runtime(case, step)})
    for confirm in (False, True):
        try:
            ref, spread = reference(g64, feeds64, pre, samples=24 if confirm else 4,
                                    delta=DELTA * (2 if confirm else 1), seed=step, g32=g32)
        except Exception as e:  # noqa: BLE001 - the interpreter, on the program's own state
            f = _error(cfg, step, e)
            return replace(f, kind="reference", where=f"interpreter {f.where}")
        worst = None
        for k, r in ref.items():
            if k not in got:
                if k.startswith("param:"):
                    continue
                worst = (k, f"output missing from the program (has {sorted(got)})")
                break
            bad, why = compare(got[k], r, spread[k])
            if why:
                worst = (k, why)
                break
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0]) if np.ndim(r) else ()
                gv, rv = np.asarray(got[k], np.float64)[idx], np.asarray(r, np.float64)[idx]
                worst = (k, f"{int(bad.sum())}/{bad.size} elements wrong, at {list(idx)} got "
                            f"{gv:.6g} expected {rv:.6g} (float32 rounding allows "
                            f"{C_TOL * spread[k][idx] + U32 * abs(rv):.2g})")
                break
        if worst is None:
            return None
    g, k = case.graph, worst[0]
    nid = g.updates.get(k[6:], g.params.get(k[6:])) if k.startswith("param:") else \
        g.outputs.get(k)
    op = g.nodes[nid].op if nid is not None else "?"
    return Failure("mismatch", cfg, step, k, worst[1], op=op)


def _check_grad(case, init):
    """autodiff against central differences in float64 (jitgraph.testing.check_grad)."""
    from .grad import check_grad
    feeds = feeds_for(case, 0)
    g = case.graph.copy()
    g.updates = {}          # the interpreter would move updated state between the probes
    try:
        r = check_grad(g, feeds, init, loss="loss", eps=1e-6, rtol=1e-4, atol=1e-6,
                       max_elements=6, raise_on_fail=False)
    except Exception as e:  # noqa: BLE001
        return [_error(None, 0, e)]
    if r.ok:
        return []
    return [Failure("grad", None, 0, "check_grad", "; ".join(r.failures[:3]))]


def _check_sgd_reference(case, g64, init):
    """The reference's own training step is p - lr * grad (float64 autodiff + interpreter)."""
    from jitgraph.passes.precision import cast_graph
    gg = cast_graph(jg.grad(case.graph, "loss"), "f64")
    feeds = feeds_for(case, 0)
    params = _to64(dict(init))
    state = {k: v for k, v in _to64(g64.init_params(0)).items() if k not in params}
    grads = _run(gg, _to64(feeds), params)[0]
    _, upd, _ = _run(g64, _to64({**feeds, **_runtime(case, 0)}), {**params, **state})
    for p in case.graph.trainable_params():
        gp = grads.get(f"grad/{p}")
        lr = float(_runtime(case, 0)["opt/lr"])      # the float32 value the graph is fed
        want = params[p] - lr * (gp if gp is not None else 0.0)
        have = upd.get(p, params[p])
        if not np.allclose(have, want, rtol=1e-9, atol=1e-12):
            return [Failure("reference", None, 0, p, "training_graph's SGD step is not "
                            "p - lr * grad")]
    return []

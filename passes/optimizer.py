"""The optimizer pass: append the parameter update to a graph with gradients (ggml_opt_step_*).

Input: a graph with outputs `grad/<param>` (passes/autodiff.grad). Output: the same graph with
the update appended as ordinary ops plus the fused ema / ema_sq / adam_step ops, recorded as
`Graph.update`s, and the grad/<param> outputs removed (the update consumes them). Optimizer
state is non-trainable params `opt/m/<param>`, `opt/v/<param>` (moments; SGD's momentum
buffer is `opt/m`) and `opt/acc/<param>` (gradient accumulators), all zero-initialised.
The per-call scalars `opt/lr`, `opt/step`, `opt/apply` are f32 inputs (see jitgraph/optim.py).

Order per step: unscale -> accumulate -> clip by global norm -> weight decay -> update. Unscale:
when the graph has the input `opt/loss_scale` (the backward was seeded with the loss scale S,
passes/autodiff.grad(seed=)), every gradient is multiplied by 1/S first (f32), so what is
accumulated, clipped, handed to a hook and used is the loss's gradient; S may then change
between micro-steps. With accumulate=k
each micro-batch gradient is scaled by 1/k before it is summed (the `loss` output stays the
unscaled micro-batch loss); on other micro-steps params and moments keep their exact values
(`where(opt/apply, new, old)`), and the accumulators restart from zero after applying.
With an update boundary (passes/boundary.py) the boundary values are the gradients after
accumulation, so a hook on the micro-step that applies the update sees the whole sum.

bf16 master weights (optimizer.master == "bf16"): every trainable f32 param becomes a bf16
param read through a cast to f32 (the forward, backward and gradients are unchanged: they see
the f32 value of the bf16 weight); the update computes the new f32 value from that and stores
`sround_bf16(new, opt/step)`, rounded stochastically with seed optimizer.seed and a salt per
param (crc32 of its name), so no two params draw the same bits.
"""
from __future__ import annotations

import math
import zlib

from jitgraph import init
from jitgraph.ops import apply, cast, const, clamp, exp, mul, scale, sqr, sqrt, sum as rsum, where
from jitgraph.optim import APPLY, LOSS_SCALE, LR, STEP, Adam
from jitgraph.types import ShapeError

from .boundary import PREFIX
from .guard import gate
from .precision import stored_as
from .report import Report


def apply_optimizer(graph, optimizer, loss: str = "loss", boundary: bool = False):
    """Return (graph with the update appended, Report). `boundary`: the values the update
    consumes (each gradient, or its accumulated sum) become outputs `boundary/<param>`, the
    update boundary of passes/boundary.py (a hook sees them between the two phases)."""
    if loss not in graph.outputs:
        raise ShapeError(f"optimizer: graph {graph.name} has no output {loss!r}; outputs are "
                         f"{', '.join(graph.outputs) or 'none'}")
    names = [p for p in graph.params if f"grad/{p}" in graph.outputs]
    if not names:
        raise ShapeError(f"optimizer: graph {graph.name} has no grad/<param> outputs; run "
                         f"autodiff first (jitgraph.passes.autodiff.grad)")
    master = getattr(optimizer, "master", "f32")
    stored = {}                 # bf16 master weights: param -> its bf16 leaf
    if master != "f32":
        g, stored = stored_as(graph, {p: master for p in names})
    else:
        g = graph.copy()
    n0 = len(g.nodes)
    params = {p: g.tensor(g.params[p]) for p in names}
    params = {p: cast(t, "f32") if p in stored else t for p, t in params.items()}
    grads = {p: g.tensor(g.outputs.pop(f"grad/{p}")) for p in names}
    scalars = _Scalars(g.input(LR, ()), g.input(STEP, ()))
    if LOSS_SCALE in g.inputs:
        inv = 1.0 / g.tensor(g.inputs[LOSS_SCALE])
        scalars.f32["unscale"] = inv
        grads = {p: mul(t, scalars("unscale", t.dtype)) for p, t in grads.items()}
    k = optimizer.accumulate
    acc = {}
    if k > 1:
        for p in names:
            acc[p] = _state("acc", params[p], p) + scale(grads[p], 1.0 / k)
        grads = dict(acc)
    if boundary:
        for p in names:
            g.outputs[PREFIX + p] = grads[p].id
    if optimizer.clip_norm is not None:
        grads = _clip(grads, optimizer.clip_norm, scalars)
    rule = _adam if isinstance(optimizer, Adam) else _sgd
    new = {}
    for p in names:
        new.update(rule(optimizer, p, params[p], grads[p], scalars))
    for p in stored:
        new[p] = apply("sround_bf16", new[p], scalars.step, seed=int(optimizer.seed),
                       salt=zlib.crc32(p.encode()))
    if k > 1:
        do = g.input(APPLY, ())
        new = {name: where(do, t, g.tensor(g.params[name])) for name, t in new.items()}
        new.update({f"opt/acc/{p}": where(do, 0.0, a) for p, a in acc.items()})
    g.update(**gate(g, new))
    state = [n for n in g.params if n.startswith("opt/")]
    rep = Report("optimizer", {
        "params": len(names), "state_tensors": len(state),
        "state_bytes": sum(g.nodes[g.params[n]].type.nbytes for n in state),
        "nodes": len(g.nodes) - n0})
    spec = optimizer.spec()
    rep.lines.append(f"{spec.pop('kind')}: " + ", ".join(f"{f}={v}" for f, v in spec.items()))
    if boundary:
        rep.lines.append(f"update boundary: outputs {PREFIX}<param> ({len(names)}) are what the "
                         f"update reads, after the hook")
    if stored:
        rep.lines.append(f"master weights: {len(stored)} params stored as {master}, updated in "
                         f"f32 and rounded stochastically (seed {optimizer.seed})")
    if LOSS_SCALE in g.inputs:
        rep.lines.append(f"loss scaling: gradients multiplied by 1 / {LOSS_SCALE} first")
    if k > 1:
        rep.lines.append(f"accumulate={k}: gradients scaled by 1/{k} and summed in opt/acc/*; "
                         f"output {loss!r} is the unscaled micro-batch loss")
    return g.validate(), rep


class _Scalars:
    """The f32 scalars of the update (lr, clip coefficient, bias corrections), cast once per
    param dtype."""

    def __init__(self, lr, step):
        self.step, self.f32, self.casts = step, {"lr": lr}, {}

    def __call__(self, key, dtype):
        if key not in self.f32:                       # ("bc", beta): 1 / (1 - beta^t)
            beta = key[1]
            self.f32[key] = const(self.step.graph, 1.0) if beta == 0 else \
                1.0 / (1.0 - exp(scale(self.step, math.log(beta))))
        t = self.f32[key]
        if t.dtype == dtype:
            return t
        if (key, dtype) not in self.casts:
            self.casts[(key, dtype)] = cast(t, dtype)
        return self.casts[(key, dtype)]


def _state(slot, p, name, dtype=None):
    """Zero-initialised optimizer state `opt/<slot>/<name>` shaped like param p (the value of
    param `name`), of p's type or `dtype`."""
    return p.graph.param(f"opt/{slot}/{name}", p.shape, dtype or p.dtype, init=init.zeros(),
                         trainable=False)


def _clip(grads, clip_norm, scalars):
    """Scale every gradient by min(1, clip_norm / (global norm + 1e-6)), as PyTorch's
    clip_grad_norm_; the norm is summed in f32 over all params."""
    total = None
    for t in grads.values():
        s = rsum(sqr(t))
        s = s if s.dtype == "f32" else cast(s, "f32")
        total = s if total is None else total + s
    coef = clamp(clip_norm / (sqrt(total) + 1e-6), hi=1.0)
    scalars.f32["clip"] = coef
    return {p: mul(t, scalars("clip", t.dtype)) for p, t in grads.items()}


def _sgd(opt, name, p, grad, scalars):
    d = grad + scale(p, opt.weight_decay) if opt.weight_decay else grad
    new = {}
    if opt.momentum:
        d = scale(_state("m", p, name), opt.momentum) + d
        new[f"opt/m/{name}"] = d
    new[name] = p - mul(scalars("lr", p.dtype), d)
    return new


def _adam(opt, name, p, grad, scalars):
    if opt.weight_decay and not opt.decoupled:
        grad = grad + scale(p, opt.weight_decay)
    # moments stored in another type (bf16): read as p's type, stored rounded; the step uses
    # the unrounded new moments
    md = opt.moments if opt.moments != p.dtype and p.dtype == "f32" else p.dtype
    m_old, v_old = _state("m", p, name, md), _state("v", p, name, md)
    if md != p.dtype:
        m_old, v_old = cast(m_old, p.dtype), cast(v_old, p.dtype)
    m = apply("ema", m_old, grad, beta=opt.beta1)
    v = apply("ema_sq", v_old, grad, beta=opt.beta2)
    lr = scalars("lr", p.dtype)
    step = apply("adam_step", p, m, v, lr, scalars(("bc", opt.beta1), p.dtype),
                 scalars(("bc", opt.beta2), p.dtype), eps=opt.eps,
                 wd=opt.weight_decay if opt.decoupled else 0.0)
    if md != p.dtype:
        m, v = cast(m, md), cast(v, md)
    return {name: step, f"opt/m/{name}": m, f"opt/v/{name}": v}

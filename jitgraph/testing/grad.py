"""Gradient checking: autodiff against central finite differences in float64."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import interp
from ..types import ShapeError


@dataclass
class GradCheck:
    """Per-leaf results: max abs/rel error over checked elements, and elements skipped at kinks."""
    errors: dict = field(default_factory=dict)   # name -> (max_abs, max_rel, checked, skipped)
    ok: bool = True
    failures: list = field(default_factory=list)

    def __str__(self):
        rows = [f"{k}: max_abs={a:.3g} max_rel={r:.3g} checked={c} skipped={s}"
                for k, (a, r, c, s) in self.errors.items()]
        return "\n".join(rows + self.failures)


def check_grad(graph, inputs, params, *, loss=None, wrt=None, wrt_inputs=(), eps=1e-6,
               rtol=1e-6, atol=1e-8, expect=None, max_elements=64, seed=0, raise_on_fail=True):
    """Compare jitgraph's gradients with central differences through the interpreter in float64.

    loss: name of a float scalar output; by default the graph's only output is reduced to
    sum(out * R) with a fixed random R, so every output element is tested (R = 1 when `expect`
    is given, so the expected values apply to each element's derivative).
    expect: valid gradient values at non-differentiable points (e.g. (0, 1) for relu, ggml's
    grad_expect); an element whose numeric estimate is far from all of them, or whose one-sided
    differences disagree, is skipped and counted, never silently passed.
    """
    from jitgraph.passes.autodiff import grad
    from jitgraph.passes.precision import cast_graph
    from ..ops.common import apply
    g = cast_graph(graph, "f64")
    feeds = {k: np.asarray(v, np.float64) if np.issubdtype(np.asarray(v).dtype, np.floating)
             else np.asarray(v) for k, v in inputs.items()}
    ps = {k: np.asarray(v, np.float64) if g.nodes[g.params[k]].type.is_float else np.asarray(v)
          for k, v in params.items()}
    if loss is None:
        if len(g.outputs) != 1:
            raise ShapeError(f"check_grad: graph has outputs {list(g.outputs)}; name the loss")
        out = g.tensor(next(iter(g.outputs.values())))
        if out.type.shape == ():
            loss = next(iter(g.outputs))
        else:
            r = g.input("__check_grad_r", out.shape, "f64")
            # with `expect`, a plain sum keeps the listed values meaningful per element
            feeds["__check_grad_r"] = np.ones(out.shape) if expect is not None else \
                np.random.default_rng(seed + 1).standard_normal(out.shape)
            g.output(__loss=apply("sum", out * r, axes=tuple(range(out.ndim)), keepdims=False))
            loss = "__loss"
    wrt = list(g.trainable_params() if wrt is None else wrt)
    gg, _ = grad(g, loss, wrt=wrt, inputs=wrt_inputs)
    analytic = interp.run(gg, feeds, ps)

    def f(feeds_, ps_):
        return float(interp.run(g, feeds_, ps_)[loss])

    res = GradCheck()
    rng = np.random.default_rng(seed)
    for name in list(wrt) + list(wrt_inputs):
        table = ps if name in wrt else feeds
        base = table[name]
        ga = np.asarray(analytic[f"grad/{name}"])
        idx = np.arange(base.size)
        if base.size > max_elements:
            idx = rng.choice(base.size, max_elements, replace=False)
        max_abs = max_rel = 0.0
        checked = skipped = 0
        for i in idx:
            x = base.copy().reshape(-1)
            x0 = x[i]
            vals = {}
            for d in (eps, -eps, 0.0):
                x[i] = x0 + d
                table[name] = x.reshape(base.shape)
                vals[d] = f(feeds, ps)
            table[name] = base
            num = (vals[eps] - vals[-eps]) / (2 * eps)
            right, left = (vals[eps] - vals[0.0]) / eps, (vals[0.0] - vals[-eps]) / eps
            a = ga.reshape(-1)[i]
            kink = abs(right - left) > 1e-3 * (1 + abs(num))
            off_expect = expect is not None and min(abs(num - e) for e in expect) > 1e-4 * (1 + abs(num))
            if kink or off_expect:
                skipped += 1
                continue
            err = abs(a - num)
            max_abs = max(max_abs, err)
            max_rel = max(max_rel, err / max(abs(num), abs(a), 1e-12))
            checked += 1
            if err > atol + rtol * max(abs(num), abs(a)):
                res.ok = False
                res.failures.append(f"{name}[{np.unravel_index(i, base.shape)}]: autodiff {a!r}, "
                                    f"numeric {num!r}")
        res.errors[name] = (max_abs, max_rel, checked, skipped)
    if raise_on_fail and not res.ok:
        raise AssertionError("gradient check failed:\n" + str(res))
    return res

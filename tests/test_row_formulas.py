"""Every row op's portable formula (OpDef.rows, jitgraph/registry.py RowFormula), run by a plain
Python reading of its definition (passes of accumulators, the `after` lines, the value per
element; the `stored` variant through an output row), equals the op's numpy reference: the
formula both backends render is checked without either backend. New row ops are picked up
from the registry."""
import math

import numpy as np
import pytest

import jitgraph  # noqa: F401  (fills the registry)
from jitgraph.registry import OPS, RowFormula

ROW_OPS = sorted(name for name, d in OPS.items() if d.kind == "rows")


def run(formula: RowFormula, operands, attrs, dtype):
    """The op over the last axis of [R, D] operands, by the formula's definition."""
    R, D = operands[0].shape
    T = "np.float32" if dtype == np.float32 else "np.float64"
    fmt = {"T": T, "D": D, **{k: repr(float(v)) for k, v in attrs.items()}}
    names = [f"x{k}" for k in range(len(operands))]
    out = np.zeros((R, D), dtype)
    for r in range(R):
        env = {"math": math, "np": np, "buf": out[r]}

        def at(j):
            env.update({f"x{k}": x[r, j] for k, x in enumerate(operands)})
        for p in formula.passes:
            for name, comb, _ in p.accs:
                env[name] = 0.0 if comb == "sum" else dtype(-np.inf)
            for j in range(D):
                at(j)
                for name, e in p.lets:
                    env[name] = eval(e.format(*names, **fmt), env)
                if p.store:
                    out[r, j] = env[p.store]
                for name, comb, term in p.accs:
                    v = eval(term.format(*names, **fmt), env)
                    env[name] = env[name] + v if comb == "sum" else max(env[name], v)
            exec("\n".join(ln.format(*names, **fmt) for ln in p.after), env)
        final = formula.final.replace("{out}", "buf[j]")
        for j in range(D):
            at(j)
            env["j"] = j
            out[r, j] = eval(f"{T}({final.format(*names, **fmt)})", env)
    return out


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("op", ROW_OPS)
def test_the_formula_computes_the_reference(op, dtype):
    d = OPS[op]
    rng = np.random.default_rng(len(op))
    n = d.arity if isinstance(d.arity, int) else d.arity[0]
    xs = [rng.standard_normal((5, 7)).astype(dtype) for _ in range(n)]
    if op == "softmax_back":        # its first operand is softmax's output
        e = np.exp(xs[0] - xs[0].max(-1, keepdims=True))
        xs[0] = (e / e.sum(-1, keepdims=True)).astype(dtype)
    attrs = {k: v for k, (kind, v) in d.attrs.items() if kind == "float"}
    want = d.ref({k: v for k, (_, v) in d.attrs.items()}, *xs)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    for f in (d.rows, d.rows.stored):
        if f is not None:
            np.testing.assert_allclose(run(f, xs, attrs, dtype), want, rtol=tol, atol=tol)


def test_every_row_op_has_a_formula():
    assert {"softmax", "log_softmax", "rms_norm", "layer_norm", "softmax_back",
            "rms_norm_back", "layer_norm_back"} <= set(ROW_OPS)
    assert all(isinstance(OPS[op].rows, RowFormula) for op in ROW_OPS)

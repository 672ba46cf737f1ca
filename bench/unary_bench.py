"""Unary / backward-helper speed: runtime/cpu/approx.py in a numba loop against numpy (issue 16).

Per function and dtype, on N elements (default 4M): a single-threaded @njit loop over the
approx function (the shape of a generated elementwise kernel), optionally the same loop with
parallel=True (prange), optionally (--steps) the compiled op itself (a jitgraph program
computing op(x) from a param, `prog.run()` with copy_outputs=False: the generated kernel, its
parallel decision and the step's overhead), and numpy's own function or, for the ops numpy
lacks, numpy's formula written with `out=` buffers (no temporaries allocated in the timed
region). The sides run interleaved, one call each per round, and each figure is the median
over the rounds: the machine is shared and its speed comes in spells. `numpy/jit` > 1 means the
loop is faster, `numpy/step` > 1 the compiled op.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/unary_bench.py [--n N]
        [--repeat R] [--parallel] [--steps] [--only exp,log,...] [--dtype f32|f64]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
from numba import njit, prange

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jitgraph.cli.roofline import host_header  # noqa: E402
from jitgraph.runtime.cpu import approx  # noqa: E402

C, K = 0.7978845608028654, 0.044715     # jitgraph/ops/elementwise.py's gelu constants


# ---- numpy sides: out= forms; t is a scratch buffer of x's shape ----------------------------
def np_sigmoid(x, g, o, t):
    np.negative(x, out=o)
    np.exp(o, out=o)
    o += 1
    np.reciprocal(o, out=o)


def np_silu(x, g, o, t):
    np.negative(x, out=o)
    np.exp(o, out=o)
    o += 1
    np.divide(x, o, out=o)


def np_gelu(x, g, o, t):                    # 0.5 x (1 + tanh(c (x + k x^3)))
    np.multiply(x, x, out=t)
    t *= x.dtype.type(K)
    t += 1
    t *= x
    t *= x.dtype.type(C)
    np.tanh(t, out=t)
    t += 1
    np.multiply(x, t, out=o)
    o *= x.dtype.type(0.5)


def np_silu_back(x, g, o, t):               # g s (1 + x (1 - s))
    np_sigmoid(x, g, t, o)
    np.subtract(1, t, out=o)
    o *= x
    o += 1
    o *= t
    o *= g


def np_gelu_back(x, g, o, t):               # g s (1 + 2 x (1 - s) c (1 + 3 k x^2)), s = sigmoid(2u)
    dt = x.dtype.type
    np.multiply(x, x, out=t)
    t *= dt(K)
    t += 1
    t *= x
    t *= dt(-2 * C)
    np.exp(t, out=t)
    t += 1
    np.reciprocal(t, out=t)                  # s
    np.subtract(1, t, out=o)                 # 1 - s
    o *= x
    o *= dt(2 * C)
    o *= (1 + dt(3 * K) * x * x)             # the one temporary
    o += 1
    o *= t
    o *= g


def _np_unary(f):
    return lambda x, g, o, t: f(x, out=o)


NUMPY = {
    "exp": ("np.exp", _np_unary(np.exp)),
    "log": ("np.log", _np_unary(np.log)),
    "tanh": ("np.tanh", _np_unary(np.tanh)),
    "sqrt": ("np.sqrt", _np_unary(np.sqrt)),
    "sigmoid": ("1/(1+np.exp(-x))", np_sigmoid),
    "softplus": ("np.logaddexp(0,x)", lambda x, g, o, t: np.logaddexp(x.dtype.type(0), x, out=o)),
    "silu": ("x/(1+np.exp(-x))", np_silu),
    "gelu": ("0.5x(1+tanh(..))", np_gelu),
    "silu_back": ("formula", np_silu_back),
    "gelu_back": ("formula", np_gelu_back),
}
try:
    from scipy.special import expit
    NUMPY["sigmoid_expit"] = ("scipy expit", _np_unary(expit))
except ImportError:                          # pragma: no cover
    pass

BINARY = {"silu_back", "gelu_back"}


def _jit_fn(name):
    if name == "sqrt":
        return None
    return getattr(approx, "v" + name)


def make_loop(name, parallel):
    fn = _jit_fn(name)
    rng = prange if parallel else range
    if name == "sqrt":
        @njit(error_model="numpy", parallel=parallel)
        def run(x, g, out):
            for i in rng(x.shape[0]):
                out[i] = math.sqrt(x[i])
    elif name in BINARY:
        @njit(error_model="numpy", parallel=parallel)
        def run(x, g, out):
            for i in rng(x.shape[0]):
                out[i] = fn(x[i], g[i])
    else:
        @njit(error_model="numpy", parallel=parallel)
        def run(x, g, out):
            for i in rng(x.shape[0]):
                out[i] = fn(x[i])
    return run


def inputs(name, dtype, n):
    rng = np.random.default_rng(0)
    if name in ("log", "sqrt"):
        x = np.exp(rng.uniform(-10, 10, n))
    else:
        x = rng.uniform(-10, 10, n)
    return x.astype(dtype), rng.uniform(-1, 1, n).astype(dtype)


def compiled_op(name, x, g):
    """`prog.run` of a program computing op `name` of params x (and g), outputs as views."""
    import jitgraph as jg
    from jitgraph import init
    dt = np.dtype(x.dtype).name.replace("float", "f")
    graph = jg.Graph(f"unary_{name}")
    xp = graph.param("x", x.shape, dt, init=init.zeros(), trainable=False)
    gp = graph.param("g", g.shape, dt, init=init.zeros(), trainable=False)
    graph.output(out=jg.apply(name, xp, gp) if name in BINARY else jg.apply(name, xp))
    prog = jg.compile(graph, copy_outputs=False)
    prog.params["x"], prog.params["g"] = x, g
    return prog.run


def bench_one(name, dtype, n, repeat, parallel, steps=False):
    x, g = inputs(name, dtype, n)
    o, t = np.empty_like(x), np.empty_like(x)
    base = name.replace("_expit", "")
    sides = {"jit": lambda f=make_loop(base, False): f(x, g, o)}
    if parallel:
        sides["jit-par"] = lambda f=make_loop(base, True): f(x, g, o)
    if steps:
        sides["step"] = compiled_op(base, x, g)
    sides["numpy"] = lambda f=NUMPY[name][1]: f(x, g, o, t)
    with np.errstate(all="ignore"):
        for f in sides.values():
            f()                               # compile, warm
        times = {k: [] for k in sides}
        for _ in range(repeat):
            for k, f in sides.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4_000_000)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--parallel", action="store_true", help="also time a prange loop")
    ap.add_argument("--steps", action="store_true", help="also time the compiled op (prog.run)")
    ap.add_argument("--only", default="", help="comma-separated function names")
    ap.add_argument("--dtype", default="f32,f64")
    a = ap.parse_args(argv)
    names = [s for s in a.only.split(",") if s] or list(NUMPY)
    dtypes = [{"f32": np.float32, "f64": np.float64}[d] for d in a.dtype.split(",")]
    print(host_header())
    print(f"# {a.n} elements, median of {a.repeat} interleaved rounds; ms")
    cols = ["function", "dtype", "jit"] + (["jit-par"] if a.parallel else []) + \
        (["step"] if a.steps else []) + ["numpy", "numpy side", "numpy/jit"] + \
        (["numpy/step"] if a.steps else [])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for dtype in dtypes:
        for name in names:
            r = bench_one(name, dtype, a.n, a.repeat, a.parallel, a.steps)
            row = [name, np.dtype(dtype).name, f"{r['jit'] * 1e3:.2f}"]
            row += [f"{r[k] * 1e3:.2f}" for k in ("jit-par", "step") if k in r]
            row += [f"{r['numpy'] * 1e3:.2f}", NUMPY[name][0], f"{r['numpy'] / r['jit']:.2f}x"]
            if "step" in r:
                row.append(f"{r['numpy'] / r['step']:.2f}x")
            print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

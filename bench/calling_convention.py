"""The driver's calling convention (issue 16): inputs read where they lie, outputs written into
the caller's arrays. `prog.run` of `a + b` and of `tanh(a)` over N floats (default 4M) against
numpy's `np.add(a, b, out=z)` / `np.tanh(a, out=z)`, and the MNIST MLP (784-500-10, AdamW)
training step at batch 100 and 1000.

Sides, one call each per round, in a rotating order, medians over the rounds (the machine is
shared and its speed comes in spells):
  numpy        np.add(a, b, out=z) / np.tanh(a, out=z)
  jg view      prog.run(a=a, b=b) compiled with copy_outputs=False: the output is a view of the
               program's own buffer
  jg into      prog.run_into({"y": z}, a=a, b=b): the kernel writes into the caller's z
  jg copy      prog.run(a=a, b=b) with the default copy_outputs=True (a fresh array per call)
  njit loop    a plain serial @njit loop `o[i] = a[i] + b[i]` (jitgraph.runtime.cpu.approx.ftanh
               for tanh) into z: what numba makes of the kernel's loop, the floor of `jg`
`numpy` and `jg into` write the same array z (the same layout, page offsets included). The
target: `jg view` and `jg into` within 1.1x of numpy. With an install that predates
`run_into` (bench/compare_commits.py-style before/after runs) that side is left out.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/calling_convention.py
        [--n N] [--rounds R] [--mlp-rounds R] [--no-mlp]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jitgraph as jg  # noqa: E402
from mlp_common import mnist_mlp, random_batch  # noqa: E402
from jitgraph.cli.roofline import host_header  # noqa: E402


def interleaved(sides: dict, rounds: int, warmup: int = 3) -> dict:
    """name -> median seconds of one call; every round calls each side once, the order rotating."""
    names = list(sides)
    for _ in range(warmup):
        for f in sides.values():
            f()
    ts = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            sides[k]()
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in ts.items()}


def _loops():
    from numba import njit
    from jitgraph.runtime.cpu.approx import ftanh

    @njit(error_model="numpy", nogil=True)
    def add(a, b, o):
        for i in range(a.size):
            o[i] = np.float32(a[i] + b[i])

    @njit(error_model="numpy", nogil=True)
    def tanh(a, o):
        for i in range(a.size):
            o[i] = np.float32(ftanh(a[i]))
    return add, tanh


_add_loop, _tanh_loop = _loops()


def unary_case(name, n, rounds):
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    z = np.empty_like(a)
    g = jg.Graph(name)
    x, y = g.input("a", (n,)), g.input("b", (n,))
    if name == "add":
        g.output(y=x + y)
        feeds, want = {"a": a, "b": b}, (lambda: np.add(a, b, out=z))
        loop = (lambda: _add_loop(a, b, z))
    else:
        g.output(y=jg.tanh(x))
        feeds, want = {"a": a}, (lambda: np.tanh(a, out=z))
        loop = (lambda: _tanh_loop(a, z))
    view, copy = jg.compile(g, copy_outputs=False), jg.compile(g)
    sides = {"numpy": want, "jg view": lambda: view.run(**feeds)}
    if hasattr(view, "run_into"):
        sides["jg into"] = lambda: view.run_into({"y": z}, **feeds)
    sides["jg copy"] = lambda: copy.run(**feeds)
    sides["njit loop"] = loop
    med = interleaved(sides, rounds)
    want()
    got = view.run(**feeds)["y"]
    err = float(np.max(np.abs(got - z)))
    base = med["numpy"]
    cells = "  ".join(f"{k} {v * 1e3:.3f} ms ({v / base:.2f}x)" for k, v in med.items())
    pages = "/".join(str(v.ctypes.data % 4096) for v in (a, b, z))
    print(f"{name:5s} n={n}: {cells}  max|jg-np| {err:.2g}  (a/b/z at page offsets {pages})")
    return med


def mlp_case(batch, rounds):
    opt = jg.optim.AdamW(lr=1e-3)
    prog = jg.compile(mnist_mlp(batch), loss="loss", optimizer=opt, copy_outputs=False)
    feeds = random_batch(batch)
    loss = np.empty((), np.float32)
    sides = {"step": lambda: prog.step(**feeds)}
    if hasattr(prog, "step_into"):
        sides["step_into"] = lambda: prog.step_into({"loss": loss}, **feeds)
    med = interleaved(sides, rounds)
    st = prog.stats()
    cells = "  ".join(f"{k} {v * 1e3:.3f} ms" for k, v in med.items())
    print(f"mnist_mlp b{batch}: {cells}  arena {st['arena_bytes']} B "
          f"(inputs {st['memory'].get('input_bytes', 'in the arena')} B)")
    return med


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4 << 20)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--mlp-rounds", type=int, default=60)
    ap.add_argument("--no-mlp", action="store_true")
    args = ap.parse_args(argv)
    print(host_header())
    for name in ("add", "tanh"):
        unary_case(name, args.n, args.rounds)
    if not args.no_mlp:
        for batch in (100, 1000):
            mlp_case(batch, args.mlp_rounds)


if __name__ == "__main__":
    main()

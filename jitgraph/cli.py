"""The jitgraph command line."""
from __future__ import annotations

import argparse
import sys


def _demo(args):
    """Train a small MLP on generated data with the reference interpreter (no compilation)."""
    import numpy as np
    import jitgraph as jg
    rng = np.random.default_rng(args.seed)
    n, d, k = 256, 20, 4
    centers = rng.standard_normal((k, d)) * 2
    labels = rng.integers(0, k, n).astype(np.int32)
    data = (centers[labels] + rng.standard_normal((n, d))).astype(np.float32)
    g = jg.Graph("demo_mlp")
    x, y = g.input("x", (n, d)), g.input("y", (n,), "i32")
    w1 = g.param("w1", (d, 32), init=jg.init.he_uniform())
    b1 = g.param("b1", (32,))
    w2 = g.param("w2", (32, k), init=jg.init.he_uniform())
    b2 = g.param("b2", (k,))
    logits = jg.relu(x @ w1 + b1) @ w2 + b2
    g.output(loss=jg.cross_entropy(logits, y),
             correct=jg.count_equal(jg.argmax(logits, axis=-1), y))
    if not args.quiet:
        print(g)
    train = jg.grad(g, "loss")
    params = g.init_params(args.seed)
    for it in range(args.steps):
        out = jg.interp.run(train, {"x": data, "y": labels}, params)
        for name in params:
            params[name] = params[name] - 0.5 * out[f"grad/{name}"]
        if it % 10 == 0 or it == args.steps - 1:
            print(f"step {it:3d}  loss {float(out['loss']):.4f}  acc {int(out['correct']) / n:.3f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jitgraph", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a small MLP with the reference interpreter")
    d.add_argument("--steps", type=int, default=50)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(fn=_demo)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

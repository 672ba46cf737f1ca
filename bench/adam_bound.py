"""Is the AdamW update memory- or compute-bound? `python bench/adam_bound.py [--n N]`

One thread, float32, the update as the generated kernels spell it (adam_step's expression,
jitgraph/ops/update.py, with float32 literals) over N elements (default 784 x 500: the MNIST
MLP's w1), against the same loop without its division, without its square root, and a loop
that moves the same arrays (reads g, m, v, p; writes m, v, p) with one add each. Prints the
minimum and median of 200 calls and the host's sgemm rate (compare only within one run)."""
import argparse
import math
import time

import numpy as np
from numba import njit

F = np.float32
ONE = F(1.0)


UPDATES = {   # name: the loop body over element i (m, v, p written; g read)
    "adam": ("mi = b1 * m[i] + (ONE - b1) * g[i]\n"
             "vi = b2 * v[i] + (ONE - b2) * (g[i] * g[i])\n"
             "m[i], v[i] = mi, vi\n"
             "p[i] = p[i] - lr * (mi * c1) / (math.sqrt(vi * c2) + eps)"),
    "memory_only": "m[i] = m[i] + g[i]\nv[i] = v[i] + g[i]\np[i] = p[i] + g[i]",
}
UPDATES["no_division"] = UPDATES["adam"].replace(") / (math.sqrt", ") * (math.sqrt")
UPDATES["no_sqrt"] = UPDATES["adam"].replace("math.sqrt(vi * c2)", "(vi * c2)")
assert len(set(UPDATES.values())) == len(UPDATES)


def loop(name):
    """UPDATES[name] as its own compiled loop (each variant a separate kernel, as generated)."""
    body = "".join(f"        {line}\n" for line in UPDATES[name].split("\n"))
    src = f"def {name}(p, m, v, g, lr, c1, c2, b1, b2, eps):\n    for i in range(p.size):\n{body}"
    scope = {"math": math, "ONE": ONE}
    exec(src, scope)
    return njit(fastmath={"contract"}, error_model="numpy")(scope[name])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=784 * 500)
    n = ap.parse_args().n
    rng = np.random.default_rng(0)
    arrs = [rng.random(n, dtype=F) for _ in range(4)]
    scalars = [F(1e-3), F(1.1), F(1.2), F(0.9), F(0.999), F(1e-8)]
    a = rng.random((1024, 1024), dtype=F)
    a @ a
    best = min(_time(lambda: a @ a) for _ in range(10))
    print(f"host sgemm 1024^3: {2 * 1024 ** 3 / best / 1e9:.0f} GFLOP/s; n = {n}, one thread")
    for f in map(loop, ("adam", "no_division", "no_sqrt", "memory_only")):
        f(*arrs, *scalars)
        ts = [_time(lambda: f(*arrs, *scalars)) for _ in range(200)]
        print(f"{f.__name__:12s} min {1e6 * min(ts):7.1f} us  median {1e6 * np.median(ts):7.1f} us")


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()

"""Two installs of jitgraph (two commits, each in its own virtual environment) timed in
alternation in one run: the same workloads' training steps, round after round, A then B, so a
change of load on the machine hits both alike. Prints the median step time of each workload for
A and B over all rounds and the ratio B / A, with the host's sgemm rate.

    python bench/compare_commits.py A_PYTHON B_PYTHON [--rounds 8] [--steps 5]
        [--only mnist_mlp_b100 ...] [--quick]

A_PYTHON / B_PYTHON: the python of each environment (e.g. /tmp/before/.venv/bin/python).
Every round starts one process per install, which compiles (warm kernel cache after the first
round), runs 2 untimed steps and times `--steps` steps of each workload; the JSON it prints goes
back to this script. The workloads are jitgraph's own (jitgraph/workloads.py or
jitgraph/cli/workloads.py, whichever the install has). Run with the OpenBLAS overrides unset:
`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/compare_commits.py ...`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

DEFAULT = ("mnist_mlp_b100", "mnist_mlp_b1000", "mnist_cnn_b100")

WORKER = r"""
import json, sys, time
import jitgraph as jg
try:
    from jitgraph.cli import workloads as W
except ImportError:
    from jitgraph import workloads as W
names, steps, scale = sys.argv[1].split(","), int(sys.argv[2]), float(sys.argv[3])
out = {}
for name in names:
    w = W.WORKLOADS[name](scale=scale)
    prog = jg.compile(w.graph, loss=w.loss, optimizer=w.optimizer, copy_outputs=False)
    for _ in range(2):
        prog.step(**w.feeds)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        prog.step(**w.feeds)
        ts.append(time.perf_counter() - t0)
    out[name] = ts
print(json.dumps(out))
"""


def sgemm_rate(python) -> float:
    code = ("import numpy as np, time; a = np.ones((1024, 1024), np.float32); a @ a; "
            "ts = []\nfor _ in range(10):\n t = time.perf_counter(); a @ a; "
            "ts.append(time.perf_counter() - t)\nprint(2 * 1024**3 / min(ts) / 1e9)")
    return float(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                check=True).stdout)


def run(python, names, steps, scale) -> dict:
    r = subprocess.run([python, "-c", WORKER, ",".join(names), str(steps), str(scale)],
                       capture_output=True, text=True, cwd="/")   # not a checkout
    if r.returncode:
        raise RuntimeError(f"{python}: {r.stderr.strip().splitlines()[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--only", nargs="+", default=list(DEFAULT))
    p.add_argument("--quick", action="store_true", help="workloads at a quarter of their size")
    args = p.parse_args(argv)
    scale = 0.25 if args.quick else 1.0
    times = {side: {n: [] for n in args.only} for side in ("a", "b")}
    for r in range(args.rounds):
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            for n, ts in run(getattr(args, side), args.only, args.steps, scale).items():
                times[side][n] += ts
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    print(f"# sgemm 1024^3: {sgemm_rate(args.a):.0f} GFLOP/s; {args.rounds} rounds x "
          f"{args.steps} steps per install, alternating")
    print(f"{'workload':<18} {'A ms':>8} {'B ms':>8} {'B / A':>7}")
    for n in args.only:
        a, b = (statistics.median(times[s][n]) for s in ("a", "b"))
        print(f"{n:<18} {a * 1e3:8.3f} {b * 1e3:8.3f} {b / a:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

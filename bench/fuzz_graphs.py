"""The long random-graph profile (issues 13/14), run by hand:

    python bench/fuzz_graphs.py --graphs 200 --seed 1          # ~15-25 min on 2 cores
    python bench/fuzz_graphs.py --minutes 30 --seed 7 --out repros.md

Draws graphs with jitgraph.testing.fuzz (every --big-every-th with dims up to 64), compiles
each fused/unfused x planned/naive, runs every program several steps against the float64
interpreter (train-mode graphs also against finite differences and p - lr * grad), and prints
the graphs and programs run, the wall time, and each distinct failure shrunk to a runnable
Python repro. Exit status 1 when anything failed. The CI run is tests/test_random_graphs.py.
"""
import argparse
import os
import sys
import tempfile
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=int, default=None, help="graphs to check (default 200 "
                    "unless --minutes is given)")
    ap.add_argument("--minutes", type=float, default=None, help="stop drawing after this long")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=10, help="template steps per graph")
    ap.add_argument("--big-every", type=int, default=4, help="every k-th graph has big dims "
                    "(0: none)")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--shrink-budget", type=float, default=180.0, help="seconds per failure")
    ap.add_argument("--out", help="also write the report (with repros) to this file")
    ap.add_argument("--cache", help="JITGRAPH_CACHE_DIR (default: a fresh temporary one, "
                    "so compile times are counted)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.graphs is None and a.minutes is None:
        a.graphs = 200
    os.environ["JITGRAPH_CACHE_DIR"] = a.cache or tempfile.mkdtemp(prefix="jitgraph_fuzz_")
    os.environ.setdefault("JITGRAPH_CHECK_PLANS", "1")   # verify memory plans, as the tests do
    from jitgraph.testing import fuzz

    def log(msg):
        if not a.quiet:
            print(msg, flush=True)
    t0 = time.monotonic()
    s = fuzz.fuzz(graphs=a.graphs, seed=a.seed, max_steps=a.max_steps, big_every=a.big_every,
                time_budget=None if a.minutes is None else 60 * a.minutes,
                do_shrink=not a.no_shrink, shrink_budget=a.shrink_budget, log=log)
    text = s.report()
    text += "\n\nfeatures covered: " + ", ".join(f"{k} {v}" for k, v in
                                                 sorted(s.features.items()))
    text += f"\nwall time {time.monotonic() - t0:.1f} s (seed {a.seed})"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 1 if s.failures else 0


if __name__ == "__main__":
    sys.exit(main())

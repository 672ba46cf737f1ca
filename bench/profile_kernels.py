"""Per-kernel timing of a compiled program: `python bench/profile_kernels.py [batch|workload]
[--unfused] [--in-order]` (a batch size profiles the MNIST MLP; a name from
jitgraph/cli/workloads.py that workload).

Calls each kernel's C entry point on the program's own buffers (after one real step) and prints
the median time per kernel, slowest first, next to the whole step's median. By default each
kernel runs 20 times in a row (its data hot in cache); with --in-order the kernels run in step
order, one pass per step, as the driver runs them (each kernel finds the caches as the kernels
before it left them), and are listed in that order. With --cpu each kernel is timed by the
thread's CPU time instead of the wall clock: on a busy shared machine that is the kernel's own
cost (exact with JITGRAPH_NUM_THREADS=1; with more threads it misses the other threads' work)."""
import sys
import time

import numpy as np

from mlp_common import mnist_mlp, random_batch

from jitgraph.cli.roofline import describe, time_kernels


def profile(prog, inputs, repeat=20, in_order=False):
    """(microseconds, kernel) per kernel: in step order, or slowest first (the timing is
    jitgraph/cli/roofline.py's, shared with `jitgraph bench --roofline`)."""
    rows = [(s * 1e6, describe(prog.graph, k, width=10**6))
            for k, s in time_kernels(prog, inputs, repeat, in_order)]
    return rows if in_order else sorted(rows, reverse=True)


if __name__ == "__main__":
    import jitgraph as jg
    if "--cpu" in sys.argv:
        import types

        import jitgraph.cli.roofline as roofline
        roofline.time = types.SimpleNamespace(perf_counter=time.thread_time)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    from jitgraph.cli.workloads import WORKLOADS
    if args and args[0] in WORKLOADS:
        w = WORKLOADS[args[0]]()
        g, b, loss, opt = w.graph, w.feeds, w.loss, w.optimizer
    else:
        batch = int(args[0]) if args else 1000
        g, b, loss, opt = mnist_mlp(batch), random_batch(batch), "loss", jg.optim.AdamW(lr=1e-3)
    # replaying one kernel at a time is only sound when no buffer is reused: plan_memory=False
    prog = jg.compile(g, loss=loss, optimizer=opt, fuse="--unfused" not in sys.argv,
                      plan_memory=False)
    for _ in range(5):
        prog.step(**b)
    ts = []
    for _ in range(30):
        t = time.perf_counter()
        prog.step(**b)
        ts.append(time.perf_counter() - t)
    rows = profile(prog, b, in_order="--in-order" in sys.argv)
    total = sum(r[0] for r in rows) / 1e3
    print(f"step median {np.median(ts) * 1e3:.3f} ms; sum of kernels {total:.3f} ms")
    for us, what in rows:
        print(f"{us:9.1f} us  {what}")

"""Data-parallel step time (issue 20): one process against N MPI ranks, the same global batch.

    python bench/mpi_scaling.py mnist-fc                 # one process (JITGRAPH_NUM_THREADS, 1)
    mpiexec -n 2 python bench/mpi_scaling.py mnist-fc    # 2 ranks, each its half of each batch
    ... llama                                            # dim 128, 4 layers, ctx 128, batch 16
    python bench/mpi_scaling.py mnist-fc --predict 1000,500,250,125,64,32,16

Prints one JSON line (rank 0): median step, samples/s, and under MPI where a step's time goes:
phase 1 (forward + backward, up to the hook), the hook (the gradient all-reduce, waiting for
the slower rank included), phase 2 (the update), and the all-reduce of the same bytes timed
alone after a barrier (the transfer itself, the scaling model's bandwidth figure).

--predict B1,B2,...: one process, 1 thread, the step at each per-rank batch (no MPI), then the
scaling model's table (bench/README.md "Data parallel scaling"): step(N) = compute at the
per-rank batch B/N (its CPU time, interpolated, linear in the batch, between the measured
ones) + a ring all-reduce of the gradient bytes S, 2(N-1)/N * S / bandwidth + 2(N-1) * latency,
over 10 Gbit/s (25 us a message) and 100 Gbit/s (5 us) links.
"""
import argparse
import json
import os
import time

os.environ.setdefault("JITGRAPH_NUM_THREADS", "1")
for _k in ("OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_k, os.environ["JITGRAPH_NUM_THREADS"])

import numpy as np  # noqa: E402

import jitgraph as jg  # noqa: E402
from jitgraph import distributed, optim  # noqa: E402


def model(name, batch):
    """(graph, feeds(rng) -> inputs) of `name` at `batch` samples."""
    if name == "mnist-fc":
        from jitgraph.models.mnist import mnist_fc

        def feeds(rng):
            return {"x": rng.random((batch, 784), dtype=np.float32),
                    "y": rng.integers(0, 10, batch).astype(np.int32)}
        return mnist_fc(batch), feeds
    from jitgraph.models.llama import LlamaConfig, llama_forward
    cfg = LlamaConfig(vocab=260, dim=128, layers=4, heads=4, ctx=128)

    def feeds(rng):
        return {"tokens": rng.integers(0, cfg.vocab, (batch, cfg.ctx)).astype(np.int32),
                "pos": np.arange(cfg.ctx, dtype=np.int32),
                "labels": rng.integers(0, cfg.vocab, (batch, cfg.ctx)).astype(np.int32)}
    return llama_forward(cfg, batch, cfg.ctx, labels=True), feeds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=("mnist-fc", "llama"))
    ap.add_argument("--batch", type=int, default=None, help="global batch (1000 / 16)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--predict", default=None, metavar="B1,B2,...")
    a = ap.parse_args()
    if a.predict:
        return predict(a.model, sorted({int(b) for b in a.predict.split(",")}, reverse=True),
                       a.steps)
    batch = a.batch or (1000 if a.model == "mnist-fc" else 16)
    world = distributed.world()
    n = 1 if world is None else world.size
    marks = {}

    def hook(grads):
        marks["in"], marks["cpu_in"] = time.perf_counter(), time.process_time()
        world.hook(grads)
        marks["out"], marks["cpu_out"] = time.perf_counter(), time.process_time()

    graph, feeds = model(a.model, batch // n)

    def build():
        return jg.compile(graph, loss="loss", optimizer=optim.AdamW(lr=1e-4),
                          hook=None if world is None else hook)
    prog = build() if world is None else world.first(build)
    rng = np.random.default_rng(0 if world is None else world.rank)
    data = [feeds(rng) for _ in range(4)]
    for i in range(3):
        prog.step(**data[i % 4])
    steps, phases, cpu = [], [], []
    for i in range(a.steps):
        if world is not None:
            world.barrier("the step")
        c0, t0 = time.process_time(), time.perf_counter()
        prog.step(**data[i % 4])
        t1, c1 = time.perf_counter(), time.process_time()
        steps.append(t1 - t0)
        cpu.append(c1 - c0)
        if world is not None:
            phases.append((marks["in"] - t0, marks["out"] - marks["in"], t1 - marks["out"]))
            cpu[-1] -= marks["cpu_out"] - marks["cpu_in"]     # the step's CPU time but the hook's
    mem = prog.stats()["memory"]
    out = {"model": a.model, "ranks": n, "threads": int(os.environ["JITGRAPH_NUM_THREADS"]),
           "global_batch": batch, "step_ms": 1e3 * float(np.median(steps)),
           "samples_per_s": batch / float(np.median(steps)),
           "cpu_ms": 1e3 * float(np.median(cpu)), "load": os.getloadavg()[0],
           "arena_bytes": mem["arena_bytes"],
           "param_bytes": sum(v.nbytes for v in prog.params.values())}
    if world is not None:
        p = np.median(np.array(phases), axis=0) * 1e3
        out.update(phase1_ms=p[0], hook_ms=p[1], phase2_ms=p[2],
                   hook_share=p[1] / out["step_ms"],
                   gradient_bucket_bytes=mem["gradient_bucket_bytes"])
        buf = np.zeros(mem["gradient_bucket_bytes"] // 4, np.float32)
        alone = []
        for _ in range(20):
            world.barrier("the all-reduce alone")
            t0 = time.perf_counter()
            world.comm.Allreduce(world.MPI.IN_PLACE, buf)
            alone.append(time.perf_counter() - t0)
        t = float(np.median(alone))
        out.update(allreduce_alone_ms=1e3 * t,
                   bus_GBps=2 * (n - 1) / n * buf.nbytes / t / 1e9,
                   # on dedicated cores: the step's own CPU time and the transfer alone
                   dedicated_samples_per_s=batch / (out["cpu_ms"] / 1e3 + t))
    if world is None or world.is_root:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                          for k, v in out.items()}), flush=True)


def timed(prog, data, steps):
    """(median wall seconds, median CPU seconds) of a step: on a shared machine the CPU time
    is what the step takes on a core of its own."""
    for i in range(3):
        prog.step(**data[i % len(data)])
    ts, cs = [], []
    for i in range(steps):
        c0, t0 = time.process_time(), time.perf_counter()
        prog.step(**data[i % len(data)])
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    return float(np.median(ts)), float(np.median(cs))


LINKS = {"10 Gbit/s": (10e9 / 8, 25e-6), "100 Gbit/s": (100e9 / 8, 5e-6)}


def predict(name, batches, steps):
    rng = np.random.default_rng(0)
    local, size = {}, None
    for b in batches:
        graph, feeds = model(name, b)
        prog = jg.compile(graph, loss="loss", optimizer=optim.AdamW(lr=1e-4))
        size = sum(v.nbytes for v in prog.params.values())
        wall, local[b] = timed(prog, [feeds(rng) for _ in range(4)], steps)
        print(json.dumps({"model": name, "batch": b, "cpu_ms": round(1e3 * local[b], 3),
                          "wall_ms": round(1e3 * wall, 3), "load": os.getloadavg()[0]}),
              flush=True)
    big = batches[0]
    xs = sorted(local)

    def compute(b):             # linear between measured batches (extrapolated below the least)
        lo = max([x for x in xs if x <= b], default=xs[0])
        hi = min([x for x in xs if x >= b], default=xs[-1])
        if lo == hi:
            lo, hi = (xs[0], xs[1]) if b < xs[0] else (lo, hi)
        if lo == hi:
            return local[lo]
        return local[lo] + (local[hi] - local[lo]) * (b - lo) / (hi - lo)
    print(f"{name}: gradient bytes {size}, one process {1e3 * local[big]:.2f} ms at batch {big}")
    print(f"{'ranks':>5} {'batch/rank':>10} {'compute ms':>10} " +
          " ".join(f"{k + ' ar ms':>18} {'step ms':>8} {'speedup':>7}" for k in LINKS))
    for n in (1, 2, 4, 8, 16, 32, 64):
        b = big / n
        if b < 1:
            break
        c = compute(b)
        row = f"{n:>5} {b:>10.1f} {1e3 * c:>10.2f} "
        for bw, lat in LINKS.values():
            ar = 0.0 if n == 1 else 2 * (n - 1) / n * size / bw + 2 * (n - 1) * lat
            row += f"{1e3 * ar:>18.2f} {1e3 * (c + ar):>8.2f} {local[big] / (c + ar):>7.1f} "
        print(row, flush=True)


if __name__ == "__main__":
    main()

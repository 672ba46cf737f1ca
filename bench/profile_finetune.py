"""Where a llama finetuning step goes: `python bench/profile_finetune.py [--full] [--kernels]
[--gguf PATH] [--batch B --seq S] [--steps N] [--repeat R]` (LoRA rank 8 on q, k, v, o by
default; --full: every weight).

Compiles issue 18's step (batch 16 windows of 128 tokens, AdamW) from the stories260K GGUF of
../shared/data (or --gguf; the 1B-shaped model: `--gguf llama1b-f32.gguf --full --batch 1
--seq 512 --steps 1 --repeat 1`, ~17 GiB, the weights read straight into the program as
`finetune` does; a LoRA base stays in its file's type), then prints
  - the step's median wall time and its CPU time over wall time (2.0: both cores busy
    throughout; the threads' spin-waits count as CPU time, so this is an upper bound);
  - the kernels' in-order times (bench/profile_kernels.py --in-order: each kernel called on
    the program's own buffers, in step order) summed by kind and op set, largest first;
  - the matmuls by operand shapes and transposes, with their GFLOP/s (a kernel's time,
    epilogue included, shared among its matmuls by their FLOPs);
  - the step's FLOPs (the matmuls') against the host's sgemm rate: the time the step would take
    at that rate, and the share of it the kernels in order reach;
  - with --kernels, every kernel in step order.
Set JITGRAPH_BLAS_SERIAL_MAX=2097152 to pin the one-BLAS-thread bound (bench/README.md)."""
import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

import jitgraph as jg
from jitgraph.cli.roofline import describe, host_header, sgemm_gflops, time_kernels

HERE = Path(__file__).resolve().parent
GGUF = HERE.parent.parent / "shared" / "data" / "gguf" / "stories260K.gguf"
BATCH, SEQ, RANK = 16, 128, 8


def build(path, full, batch=BATCH, seq=SEQ):
    from jitgraph.models.llama import llama_forward, read_llama
    # as `finetune` reads a base: f32 matrices (--full) or every matrix in its file's type
    # (LoRA) read straight into the program's memory, not held twice
    cfg, params, _ = read_llama(path, keep_types=not full, f32_in_file=full)
    g = llama_forward(cfg, batch, seq, labels=True)
    if not full:
        g = jg.lora(g, "q,k,v,o", rank=RANK)
    # the program as it trains (memory planned, kernels scheduled): replayed in step order its
    # kernels read what the step would (plan_memory=False's unscheduled order would run every
    # weight gradient at the end, on cold activations)
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-3, weight_decay=0.0),
                      seed=0, copy_outputs=False,
                      params={k: v for k, v in params.items() if k in g.params})
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, (batch, seq)).astype(np.int32)
    labels = rng.integers(0, cfg.vocab, (batch, seq)).astype(np.int32)
    return prog, {"tokens": tokens, "labels": labels, "pos": np.arange(seq, dtype=np.int32)}


def wall_and_cpu(prog, inputs, steps=20):
    """(median wall seconds per step, CPU seconds / wall seconds over the steps)."""
    ts = []
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        prog.step(**inputs)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), (time.process_time() - c0) / (time.perf_counter() - w0)


def by_ops(prog, times):
    """[(microseconds, kernels, "kind op,op")] summed over kernels of the same kind and ops."""
    us, count = collections.Counter(), collections.Counter()
    for k, s in times:
        key = f"{k.kind} " + ",".join(sorted({prog.graph.nodes[i].op for i in k.nodes}))
        us[key] += s * 1e6
        count[key] += 1
    return [(u, count[key], key) for key, u in us.most_common()]


def by_matmul(prog, times):
    """[(microseconds, calls, GFLOP/s, "a @ b -> c (flags)")] per distinct matmul; a kernel of
    several GEMMs (dX products summed into one output) shares its time among them by FLOPs."""
    g = prog.graph
    us, calls, flops = collections.Counter(), collections.Counter(), {}
    for k, s in times:
        mine = []
        for i in k.nodes:
            n = g.nodes[i]
            if n.op != "matmul":
                continue
            a, b = (g.nodes[j].type for j in n.inputs)
            flags = ", ".join(f"{f}" for f, on in n.attrs if on) or "nn"
            key = f"{a} @ {b} -> {n.type} ({flags})"
            inner = a.shape[0] if dict(n.attrs).get("ta") else a.shape[-1]
            flops[key] = 2 * int(np.prod(n.type.shape)) * inner
            mine.append(key)
        for key in mine:
            us[key] += s * 1e6 * flops[key] / sum(flops[m] for m in mine)
            calls[key] += 1
    return [(u, calls[key], flops[key] * calls[key] / (u * 1e3), key)
            for key, u in us.most_common()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="full finetuning (default: LoRA)")
    ap.add_argument("--kernels", action="store_true", help="also list every kernel in order")
    ap.add_argument("--gguf", default=str(GGUF))
    ap.add_argument("--batch", type=int, default=BATCH, help="windows per step")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per window")
    ap.add_argument("--steps", type=int, default=20, help="steps timed for the median (after "
                                                         "min(5, steps) warm-up steps)")
    ap.add_argument("--repeat", type=int, default=10, help="rounds of the kernels in order")
    a = ap.parse_args(argv)
    if not Path(a.gguf).exists():
        sys.exit(f"profile_finetune: {a.gguf} not found (give --gguf PATH)")
    print(host_header())
    rate = sgemm_gflops()
    t0 = time.perf_counter()
    prog, inputs = build(a.gguf, a.full, a.batch, a.seq)
    print(f"compiled and loaded in {time.perf_counter() - t0:.1f} s")
    for _ in range(min(5, a.steps)):
        prog.step(**inputs)
    wall, ratio = wall_and_cpu(prog, inputs, a.steps)
    times = time_kernels(prog, inputs, repeat=a.repeat, in_order=True)
    total = sum(s for _, s in times)
    name = Path(a.gguf).stem
    print(f"\n{name} {'full finetune' if a.full else f'LoRA r{RANK} q,k,v,o'}, batch "
          f"{a.batch} x {a.seq}: step median {wall * 1e3:.1f} ms, CPU / wall {ratio:.2f}, "
          f"kernels in order {total * 1e3:.1f} ms")
    mm = by_matmul(prog, times)
    flops = sum(rate_ * u * 1e3 for u, _, rate_, _ in mm)
    print(f"matmul FLOPs {flops / 1e12:.3f} T a step: {flops / (rate * 1e6):.1f} ms at the "
          f"host's sgemm rate ({rate:.0f} GFLOP/s); the step reaches "
          f"{flops / (rate * 1e9) / wall:.0%} of it")
    print("\n      us  kernels  kind and ops")
    for u, c, key in by_ops(prog, times):
        print(f"{u:8.0f}  {c:7d}  {key}")
    print("\n      us  calls  GFLOP/s  matmul")
    for u, c, r, key in mm:
        print(f"{u:8.0f}  {c:5d}  {r:7.1f}  {key}")
    if a.kernels:
        print()
        for k, s in times:
            print(f"{s * 1e6:8.0f}  {describe(prog.graph, k, width=160)}")


if __name__ == "__main__":
    main()

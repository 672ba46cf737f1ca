"""Where a stories260K finetuning step goes: `python bench/profile_finetune.py [--full]
[--kernels] [--gguf PATH]` (LoRA rank 8 on q, k, v, o by default; --full: every weight).

Compiles issue 18's step (batch 16 windows of 128 tokens, AdamW) from the stories260K GGUF of
../shared/data (or --gguf), then prints
  - the step's median wall time and its CPU time over wall time (2.0: both cores busy
    throughout; the threads' spin-waits count as CPU time, so this is an upper bound);
  - the kernels' in-order times (bench/profile_kernels.py --in-order: each kernel called on
    the program's own buffers, in step order) summed by kind and op set, largest first;
  - the matmuls by operand shapes and transposes, with their GFLOP/s (a kernel's whole time,
    epilogue included, is given to each matmul in it);
  - with --kernels, every kernel in step order.
Set JITGRAPH_BLAS_SERIAL_MAX=2097152 to pin the one-BLAS-thread bound (bench/README.md)."""
import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

import jitgraph as jg
from jitgraph.cli.roofline import describe, host_header, time_kernels

HERE = Path(__file__).resolve().parent
GGUF = HERE.parent.parent / "shared" / "data" / "gguf" / "stories260K.gguf"
BATCH, SEQ, RANK = 16, 128, 8


def build(path, full):
    from jitgraph.models.llama import llama_forward, read_llama
    cfg, params, _ = read_llama(path)
    g = llama_forward(cfg, BATCH, SEQ, labels=True)
    if not full:
        g = jg.lora(g, "q,k,v,o", rank=RANK)
    # the program as it trains (memory planned, kernels scheduled): replayed in step order its
    # kernels read what the step would (plan_memory=False's unscheduled order would run every
    # weight gradient at the end, on cold activations)
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-3, weight_decay=0.0),
                      seed=0, copy_outputs=False)
    for k, v in params.items():
        if k in prog.params:
            prog.params[k] = v
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, (BATCH, SEQ)).astype(np.int32)
    labels = rng.integers(0, cfg.vocab, (BATCH, SEQ)).astype(np.int32)
    return prog, {"tokens": tokens, "labels": labels, "pos": np.arange(SEQ, dtype=np.int32)}


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
    """[(microseconds, calls, GFLOP/s, "a @ b -> c (flags)")] per distinct matmul."""
    g = prog.graph
    us, calls, flops = collections.Counter(), collections.Counter(), {}
    for k, s in times:
        for i in k.nodes:
            n = g.nodes[i]
            if n.op != "matmul":
                continue
            a, b = (g.nodes[j].type for j in n.inputs)
            flags = ", ".join(f"{f}" for f, on in n.attrs if on) or "nn"
            key = f"{a} @ {b} -> {n.type} ({flags})"
            inner = a.shape[0] if dict(n.attrs).get("ta") else a.shape[-1]
            flops[key] = 2 * int(np.prod(n.type.shape)) * inner
            us[key] += s * 1e6
            calls[key] += 1
    return [(u, calls[key], flops[key] * calls[key] / (u * 1e3), key)
            for key, u in us.most_common()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="full finetuning (default: LoRA)")
    ap.add_argument("--kernels", action="store_true", help="also list every kernel in order")
    ap.add_argument("--gguf", default=str(GGUF))
    a = ap.parse_args(argv)
    if not Path(a.gguf).exists():
        sys.exit(f"profile_finetune: {a.gguf} not found (give --gguf PATH)")
    print(host_header())
    prog, inputs = build(a.gguf, a.full)
    for _ in range(5):
        prog.step(**inputs)
    wall, ratio = wall_and_cpu(prog, inputs)
    times = time_kernels(prog, inputs, repeat=10, in_order=True)
    total = sum(s for _, s in times)
    print(f"\nstories260K {'full finetune' if a.full else f'LoRA r{RANK} q,k,v,o'}, batch "
          f"{BATCH} x {SEQ}: step median {wall * 1e3:.1f} ms, CPU / wall {ratio:.2f}, "
          f"kernels in order {total * 1e3:.1f} ms")
    print("\n      us  kernels  kind and ops")
    for u, c, key in by_ops(prog, times):
        print(f"{u:8.0f}  {c:7d}  {key}")
    print("\n      us  calls  GFLOP/s  matmul")
    for u, c, rate, key in by_matmul(prog, times):
        print(f"{u:8.0f}  {c:5d}  {rate:7.1f}  {key}")
    if a.kernels:
        print()
        for k, s in times:
            print(f"{s * 1e6:8.0f}  {describe(prog.graph, k, width=160)}")


if __name__ == "__main__":
    main()

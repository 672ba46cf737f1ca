"""Step time of `train llama`'s default model (width 128, 4 layers, batch 16 x 128 tokens, AdamW)
in f32 and in mixed precision (bf16, f16 with its loss scale; optionally bf16 moments and bf16
master weights), one
process, the programs' steps interleaved round by round so a busy machine's load falls on all
alike; each one's arena (activations, gradients) and persistent bytes (params, optimizer
state), its median ms per step, the median of its per-round ratios to f32 ("by round"), and
the host's sgemm rate before and after.

    python bench/precision_step.py [--rounds 15] [--steps 4] [--moments] [--master] [--convert]
        [--model llama|mnist] [--batch N] [--without]

--model mnist times the MNIST-shaped MLP (784-500-10, bench/mlp_common.py) at --batch (default
100) instead. --convert adds a bf16 program compiled with JITGRAPH_BF16_GEMM=0 ("bf16/cvt": its
GEMMs on bf16 operands cast both to f32 and run sgemm, not runtime/cpu/bf16gemm.py's
AVX512-BF16 kernel). --without adds f16 and bf16 programs compiled with three rewrites of the
half steps switched off ("/old"): an f16 attention's f32-kept probabilities
(passes/attention.py), casts moved before reshapes (passes/half.py `casts_before_reshapes`)
and sums of GEMM products in f32 (passes/precision.py `sums_in_f32`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import numpy as np


@contextlib.contextmanager
def _rewrites_off(off: bool):
    """With `off`, compile as before the three rewrites --without names: the passes replaced by
    ones that leave the graph as it is (an f16 attention recomputing its probabilities)."""
    import jitgraph.passes.half as half
    import jitgraph.passes.pipeline as pipeline
    saved = pipeline.store_attention_probs, half.casts_before_reshapes, pipeline.sums_in_f32
    store = saved[0]

    def recompute_f16(g, kinds=None):
        if any(n.op == "attention" and n.type.dtype == "f16" for n in g.nodes):
            return g, {}
        return store(g, kinds)
    if off:
        pipeline.store_attention_probs = recompute_f16
        half.casts_before_reshapes = pipeline.sums_in_f32 = lambda g: (g, 0)
    try:
        yield
    finally:
        pipeline.store_attention_probs, half.casts_before_reshapes, pipeline.sums_in_f32 = saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=4, help="steps of each program per round")
    p.add_argument("--moments", action="store_true", help="also bf16 with --moments bf16")
    p.add_argument("--convert", action="store_true",
                   help="also bf16 with its GEMMs on f32 copies and sgemm (JITGRAPH_BF16_GEMM=0)")
    p.add_argument("--master", action="store_true",
                   help="also bf16 with bf16 moments and bf16 master weights")
    p.add_argument("--model", choices=("llama", "mnist"), default="llama")
    p.add_argument("--batch", type=int, default=100, help="the MNIST MLP's batch")
    p.add_argument("--without", action="store_true",
                   help="also f16 and bf16 without three rewrites of the half steps (/old)")
    args = p.parse_args(argv)

    import jitgraph as jg
    from jitgraph.cli.roofline import host_header, sgemm_gflops
    from jitgraph.models.llama import LlamaConfig, llama_forward
    from jitgraph.models.text import byte_vocab

    print(host_header())
    cfg = LlamaConfig(vocab=len(byte_vocab()), dim=128, layers=4, heads=4, ctx=128)
    runs = [("f32", "f32", "f32"), ("bf16", "f32", "f32"), ("f16", "f32", "f32")]
    if args.moments:
        runs.append(("bf16", "bf16", "f32"))
    if args.master:
        runs.append(("bf16", "bf16", "bf16"))
    if args.convert:
        runs.insert(2, ("bf16/cvt", "f32", "f32"))
    if args.without:
        runs += [("f16/old", "f32", "f32"), ("bf16/old", "f32", "f32")]
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab, (16, 129)).astype(np.int32)
    feeds = dict(tokens=toks[:, :-1], pos=np.arange(128, dtype=np.int32), labels=toks[:, 1:])
    graph = lambda: llama_forward(cfg, 16, 128, labels=True)           # noqa: E731
    if args.model == "mnist":
        from mlp_common import mnist_mlp, random_batch
        feeds, graph = random_batch(args.batch), lambda: mnist_mlp(args.batch)   # noqa: E731
    progs = {}
    for prec, mom, master in runs:
        t0 = time.perf_counter()
        was = os.environ.get("JITGRAPH_BF16_GEMM")
        if prec.endswith("/cvt"):
            os.environ["JITGRAPH_BF16_GEMM"] = "0"     # read at compile
        with _rewrites_off(prec.endswith("/old")):
            progs[(prec, mom, master)] = jg.compile(
                graph(), loss="loss",
                optimizer=jg.optim.AdamW(lr=1e-3, weight_decay=0.0, moments=mom, master=master),
                precision=prec.split("/")[0], copy_outputs=False)
        if was is None:
            os.environ.pop("JITGRAPH_BF16_GEMM", None)
        else:
            os.environ["JITGRAPH_BF16_GEMM"] = was
        print(f"# compiled {prec} (moments {mom}, master {master}) in "
              f"{time.perf_counter() - t0:.1f} s")
    for prog in progs.values():
        prog.step(**feeds)                        # warm
    before = sgemm_gflops()
    times = {k: [] for k in progs}
    for _ in range(args.rounds):
        for k, prog in progs.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                prog.step(**feeds)
            times[k].append(1e3 * (time.perf_counter() - t0) / args.steps)
    after = sgemm_gflops()
    base = statistics.median(times[("f32", "f32", "f32")])
    ref = times[("f32", "f32", "f32")]
    print(f"{'precision':<10} {'moments':<8} {'master':<7} {'arena MB':>8} {'persist MB':>10} "
          f"{'ms/step':>8} {'vs f32':>7} {'by round':>8}  (median of {args.rounds} rounds of "
          f"{args.steps} steps; IQR)")
    for (prec, mom, master), ts in times.items():
        med = statistics.median(ts)
        # the median of each round's ratio to f32's time in that round: a machine whose speed
        # changes during the run (another tenant) changes both programs' times alike
        by_round = statistics.median(t / r for t, r in zip(ts, ref))
        q = statistics.quantiles(ts, n=4)
        extra = ""
        prog = progs[(prec, mom, master)]
        if prog.scaler is not None:
            extra = f"  loss scale {prog.scaler.scale:g}, {prog.skipped} skipped"
        st = prog.stats()
        print(f"{prec:<10} {mom:<8} {master:<7} {st['arena_bytes'] / 2**20:8.1f} "
              f"{st['persistent_bytes'] / 2**20:10.1f} {med:8.1f} {med / base:6.2f}x "
              f"{by_round:7.2f}x  ({q[0]:.1f}-{q[2]:.1f}){extra}")
    print(f"# sgemm 1024^3: {before:.0f} GFLOP/s before, {after:.0f} after")


if __name__ == "__main__":
    main()

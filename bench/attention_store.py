"""Attention's kept probabilities against the recompute (passes/attention.py): `python
bench/attention_store.py [--pairs 150] [--lora] [--gguf PATH]`.

Compiles stories260K's finetuning step (batch 16 x 128, AdamW; full, or LoRA rank 8 on q, k, v,
o with --lora) twice in one process, once as autodiff leaves it (attention_store +
attention_back_stored) and once with passes.attention.STORE_MAX_BYTES = 0 (attention +
attention_back, the backward recomputing the scores), and steps the two alternately: the median
of each pair's ratio is what the shared host's drifts cancel out of. Then the attention kernels
alone over 5 layers of stories260K's shape (forward in layer order, backward in reverse, 32 MB
of other traffic between rounds), each pair in turns, per layer on the program's threads.
"""
import argparse
import math
import time
from pathlib import Path

import numpy as np

import jitgraph as jg
from jitgraph.cli.roofline import host_header
from jitgraph.ops.attention import probs_size
from jitgraph.passes import attention as pa
from jitgraph.runtime.cpu import lib_attention as la

GGUF = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gguf" / "stories260K.gguf"


def program(path, lora, store):
    from jitgraph.models.llama import llama_forward, read_llama
    cfg, params, _ = read_llama(path)
    was, pa.STORE_MAX_BYTES = pa.STORE_MAX_BYTES, pa.STORE_MAX_BYTES if store else 0
    try:
        g = llama_forward(cfg, 16, 128, labels=True)
        if lora:
            g = jg.lora(g, "q,k,v,o", rank=8)
        prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-3, weight_decay=0.0),
                          seed=0)
    finally:
        pa.STORE_MAX_BYTES = was
    for k, v in params.items():
        if k in prog.params:
            prog.params[k] = v
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, cfg.vocab, (16, 128)).astype(np.int32),
             "labels": rng.integers(0, cfg.vocab, (16, 128)).astype(np.int32),
             "pos": np.arange(128, dtype=np.int32)}
    return prog, feeds


def alternate(a, fa, b, fb, pairs):
    """Programs a and b (with their feeds) stepped 3 times each, then `pairs` times in turns,
    which of them goes first alternating: (ms per step of a, of b) as arrays, pair by pair."""
    for p, f in ((a, fa), (b, fb)):
        for _ in range(3):
            p.step(**f)
    ta, tb = [], []
    for i in range(pairs):
        order = ((a, fa, ta), (b, fb, tb)) if i % 2 == 0 else ((b, fb, tb), (a, fa, ta))
        for p, f, ts in order:
            t = time.perf_counter()
            p.step(**f)
            ts.append(time.perf_counter() - t)
    return np.array(ta) * 1e3, np.array(tb) * 1e3


def steps(path, lora, pairs):
    (a, fa), (b, fb) = program(path, lora, False), program(path, lora, True)
    ta, tb = alternate(a, fa, b, fb, pairs)
    r = tb / ta
    print(f"{'LoRA' if lora else 'full'} finetuning step, {pairs} pairs: recompute {np.median(ta):.1f}"
          f" ms, stored {np.median(tb):.1f} ms; stored / recompute per pair: median "
          f"{np.median(r):.3f} (quartiles {np.percentile(r, 25):.3f}, {np.percentile(r, 75):.3f}); "
          f"arena {a.stats()['arena_bytes'] / 1e6:.1f} -> {b.stats()['arena_bytes'] / 1e6:.1f} MB")


def kernels(rounds=40, layers=5):
    B, S, H, Hkv, D = 16, 128, 8, 4, 8
    rng = np.random.default_rng(0)
    q, dout, out = ([rng.standard_normal((B, S, H, D), dtype=np.float32) for _ in range(layers)]
                    for _ in range(3))
    k, v = ([rng.standard_normal((B, S, Hkv, D), dtype=np.float32) for _ in range(layers)]
            for _ in range(2))
    nq, nk = B * S * H * D, B * S * Hkv * D
    st = [np.zeros(nq + B * H * (probs_size(S) + S), np.float32) for _ in range(layers)]
    grad = [np.zeros(nq + 2 * nk, np.float32) for _ in range(layers)]
    work = np.zeros(la.workspace_size_attention_back((B, S, H, D), (B, S, Hkv, D)),  # the largest
                    np.float32)
    other = np.zeros(8 << 20, np.float32)
    sc = 1 / math.sqrt(D)
    times = {}

    def timed(name, f):
        t = time.perf_counter()
        f()
        times.setdefault(name, []).append(time.perf_counter() - t)

    def recompute():
        for i in range(layers):
            timed("recompute forward", lambda: la.attention(q[i], k[i], v[i], out[i], work, sc))
        for i in reversed(range(layers)):
            timed("recompute backward", lambda: la.attention_back(
                q[i], k[i], v[i], out[i], dout[i], grad[i], work, sc))

    def stored():
        for i in range(layers):
            timed("stored forward", lambda: la.attention_store(q[i], k[i], v[i], st[i], work, sc))
        for i in reversed(range(layers)):
            timed("stored backward", lambda: la.attention_back_stored(
                q[i], k[i], v[i], st[i], dout[i], grad[i], work, sc))
    recompute()
    stored()
    times.clear()
    for i in range(rounds):
        for f in ((recompute, stored) if i % 2 == 0 else (stored, recompute)):
            other[:] += 1
            f()
    print(f"attention kernels, stories260K's shape [{B}, {S}, {H} heads over {Hkv}, {D}], "
          f"per layer (median of {rounds * layers}):")
    for name, ts in times.items():
        print(f"  {name:20s} {np.median(ts) * 1e3:.3f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=150)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--gguf", default=str(GGUF))
    args = ap.parse_args()
    print(host_header())
    if Path(args.gguf).exists():
        steps(args.gguf, args.lora, args.pairs)
    else:
        print(f"finetuning step: skipped ({args.gguf} not found; give --gguf PATH)")
    kernels()


if __name__ == "__main__":
    main()

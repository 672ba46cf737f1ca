"""Two builds of the stories260K finetuning step stepped alternately in one process (bench/
README.md "Session 16"): `python bench/paired_builds.py windows|bt-copies [--lora] [--pairs N]`.

  windows     contiguous slices as views (passes/views.py) against slice copies (the CPU
              backend's kinds without "window")
  bt-copies   gemm_bt with a transposed copy per pool thread against one shared copy
              (runtime/cpu/blas.py bt_copies)
Prints both builds' median and first quartile ms/step and the median (quartiles) of the pairs'
ratios, new / old: on a shared host the pairs see the same load. The two builds' losses are
printed first (the same bits: neither change moves a rounding)."""
import argparse
import sys
from pathlib import Path

import numpy as np

import jitgraph as jg
from jitgraph.runtime.backend import CPU
from jitgraph.runtime.cpu import blas

GGUF = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gguf" / \
    "stories260K.gguf"


def build(cfg, params, lora, new, what):
    from jitgraph.models.llama import llama_forward
    kinds, copies = CPU.kinds, blas.bt_copies
    if not new and what == "windows":
        CPU.kinds = kinds - {"window"}
    if not new and what == "bt-copies":
        blas.bt_copies = lambda: 1
    try:
        g = llama_forward(cfg, 16, 128, labels=True)
        if lora:
            g = jg.lora(g, "q,k,v,o", rank=8)
        prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-3, weight_decay=0.0),
                          seed=0)
    finally:
        CPU.kinds, blas.bt_copies = kinds, copies
    for k, v in params.items():
        if k in prog.params:
            prog.params[k] = v
    return prog


def main(argv=None):
    import time
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("windows", "bt-copies"))
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--pairs", type=int, default=300)
    a = ap.parse_args(argv)
    if not GGUF.exists():
        sys.exit(f"paired_builds: {GGUF} not found")
    from jitgraph.cli.roofline import host_header
    from jitgraph.models.llama import read_llama
    print(host_header())
    cfg, params, _ = read_llama(GGUF)
    old, new = (build(cfg, params, a.lora, n, a.what) for n in (False, True))
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, cfg.vocab, (16, 128)).astype(np.int32),
             "labels": rng.integers(0, cfg.vocab, (16, 128)).astype(np.int32),
             "pos": np.arange(128, dtype=np.int32)}
    for p in (old, new):
        for _ in range(3):
            p.step(**feeds)
    print("losses (old, new):", float(old.step(**feeds)["loss"]), float(new.step(**feeds)["loss"]))
    to, tn = [], []
    for i in range(a.pairs):
        for p, ts in ((old, to), (new, tn)) if i % 2 == 0 else ((new, tn), (old, to)):
            t = time.perf_counter()
            p.step(**feeds)
            ts.append(time.perf_counter() - t)
    to, tn = np.array(to) * 1e3, np.array(tn) * 1e3
    r = tn / to
    print(f"{a.what} ({'LoRA' if a.lora else 'full'}, {a.pairs} pairs): old {np.median(to):.1f} "
          f"ms (q25 {np.percentile(to, 25):.1f}), new {np.median(tn):.1f} (q25 "
          f"{np.percentile(tn, 25):.1f}); new / old median {np.median(r):.3f} (quartiles "
          f"{np.percentile(r, 25):.3f}, {np.percentile(r, 75):.3f})")


if __name__ == "__main__":
    main()

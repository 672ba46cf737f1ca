"""Two builds of the stories260K finetuning step stepped alternately in one process (bench/
README.md "2026-12-03, late morning (commit eafc842)"): `python bench/paired_builds.py windows|bt-copies [--lora] [--pairs N]`.

  windows     contiguous slices as views (passes/views.py) against slice copies (the CPU
              backend's kinds without "window")
  bt-copies   gemm_bt with a transposed copy per pool thread against one shared copy
              (runtime/cpu/blas.py bt_copies)
Prints both builds' median and first quartile ms/step and the median (quartiles) of the pairs'
ratios, new / old: on a shared host the pairs see the same load. The two builds' losses are
printed first (the same bits: neither change moves a rounding)."""
import argparse
import sys

import numpy as np

from jitgraph.runtime.cpu.backend import CPU
from jitgraph.runtime.cpu import blas

from attention_store import GGUF, alternate, program   # bench/: the script's directory


def build(lora, new, what):
    """(program, feeds): attention_store.py's finetuning step, built with the change (`new`)
    or without it."""
    kinds, copies = CPU.kinds, blas.bt_copies
    if not new and what == "windows":
        CPU.kinds = kinds - {"window"}
    if not new and what == "bt-copies":
        blas.bt_copies = lambda: 1
    try:
        return program(GGUF, lora, True)
    finally:
        CPU.kinds, blas.bt_copies = kinds, copies


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("windows", "bt-copies"))
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--pairs", type=int, default=300)
    a = ap.parse_args(argv)
    if not GGUF.exists():
        sys.exit(f"paired_builds: {GGUF} not found")
    from jitgraph.cli.roofline import host_header
    print(host_header())
    (old, feeds), (new, _) = (build(a.lora, n, a.what) for n in (False, True))
    print("losses (old, new):", float(old.step(**feeds)["loss"]), float(new.step(**feeds)["loss"]))
    to, tn = alternate(old, feeds, new, feeds, a.pairs)
    r = tn / to
    print(f"{a.what} ({'LoRA' if a.lora else 'full'}, {a.pairs} pairs): old {np.median(to):.1f} "
          f"ms (q25 {np.percentile(to, 25):.1f}), new {np.median(tn):.1f} (q25 "
          f"{np.percentile(tn, 25):.1f}); new / old median {np.median(r):.3f} (quartiles "
          f"{np.percentile(r, 25):.3f}, {np.percentile(r, 75):.3f})")


if __name__ == "__main__":
    main()

"""Weights in their file's type on the LLaMA-3.2-1B-shaped model (issue 39), side by side with
llama.cpp in one run: `perplexity` (tokens/s, PPL, peak RSS) against llama-perplexity on the
same file, context and chunks, and the load + compile time of `generate` (cold kernel cache and
warm), for each file type.

    python bench/weights_1b.py --models /work/models --llamacpp /work/llamacpp/build/bin \\
        [--llamacpp-lib DIR] [--types f32 f16 bf16 q8_0 q4_k_m] [--text FILE] [--chunks 4]
        [--no-ppl | --no-load]

The models: bench/make_1b_model.py, then llama-quantize (bench/llamacpp_peers_1b.sh makes both:
llama1b-<type>.gguf). --llamacpp-lib: a folder put first in LD_LIBRARY_PATH for llama.cpp's tools
(a ggml-cpu built without AMX where the AMX one crashes: bench/README.md). Prints the host's sgemm
rate and the load average with the table; peak RSS from /usr/bin/time -v.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd, env=None):
    """(stdout, stderr, wall seconds, peak RSS MiB) of cmd under /usr/bin/time -v."""
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    if r.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout, r.stderr, wall, int(m.group(1)) / 1024 if m else float("nan")


def load() -> float:
    return os.getloadavg()[0]


def jitgraph_ppl(model, text, ctx, chunks, batch):
    out, err, wall, rss = timed([sys.executable, "-m", "jitgraph.cli", "perplexity", str(model),
                                 "--text", str(text), "--split", "all", "--ctx", str(ctx),
                                 "--chunks", str(chunks), "--batch-size", str(batch), "--json",
                                 "--quiet"])
    res = json.loads(out.strip().splitlines()[-1])
    return res["perplexity"], res["tokens_per_second"], rss, wall


def llamacpp_ppl(bin_, env, model, text, ctx, chunks):
    _, err, wall, rss = timed([str(bin_ / "llama-perplexity"), "-m", str(model), "-f", str(text),
                               "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks), "-t",
                               "2"], env)
    ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", err).group(1))
    # llama-perplexity prints no rate: the log's timestamps (M.SS.mmm.uuu) from "calculating
    # perplexity" to "Final estimate"
    def at(pattern):
        m, sec, ms, us = re.search(r"(\d+)\.(\d+)\.(\d+)\.(\d+) I " + pattern, err).groups()
        return int(m) * 60 + int(sec) + int(ms) / 1e3 + int(us) / 1e6
    seconds = at("Final estimate") - at("perplexity: calculating")
    return ppl, chunks * ctx / seconds, rss, wall


def jitgraph_load(model, cache):
    """(compile seconds: the programs compiled and the weights mapped or read into them,
    warm-up seconds: the one decode step that faults the weights in, the wall seconds of the
    whole `generate -n 1` (imports, read_llama, tokenizing, the prompt and the token
    included), peak RSS) with the kernel cache at `cache` (cold when empty)."""
    env = dict(os.environ, JITGRAPH_CACHE_DIR=str(cache))
    out, err, wall, rss = timed([sys.executable, "-m", "jitgraph.cli", "generate", str(model),
                                 "--prompt", "Once upon a time", "-n", "1", "--ctx", "256",
                                 "--json", "--quiet"], env)
    res = json.loads(out.strip().splitlines()[-1])
    return res["compile_seconds"], res.get("warmup_seconds", float("nan")), wall, rss


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, default=Path("/work/models"))
    p.add_argument("--llamacpp", type=Path, default=None, help="llama.cpp's build/bin")
    p.add_argument("--llamacpp-lib", type=Path, default=None)
    p.add_argument("--types", nargs="+", default=["f32", "f16", "bf16", "q8_0", "q4_k_m"])
    p.add_argument("--text", type=Path, default=ROOT / "tests/data/tinyshakespeare_tail.txt")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--no-load", action="store_true", help="skip the load + compile timing")
    p.add_argument("--no-ppl", action="store_true", help="skip the perplexity table")
    args = p.parse_args(argv)
    from jitgraph.cli.roofline import sgemm_gflops
    env = dict(os.environ)
    if args.llamacpp_lib:
        env["LD_LIBRARY_PATH"] = f"{args.llamacpp_lib}:{env.get('LD_LIBRARY_PATH', '')}"
    print(f"host sgemm {sgemm_gflops():.0f} GFLOP/s; load average {load():.1f}; ctx {args.ctx}, "
          f"{args.chunks} chunks, {args.text.name}")
    if not args.no_ppl:
        print("| file | size | jitgraph PPL | llama.cpp PPL | jitgraph tok/s | llama.cpp tok/s | "
              "ratio | jitgraph RSS | llama.cpp RSS | load |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for t in [] if args.no_ppl else args.types:
        model = args.models / f"llama1b-{t}.gguf"
        size = model.stat().st_size / 2**30
        a = jitgraph_ppl(model, args.text, args.ctx, args.chunks, args.batch_size)
        b = llamacpp_ppl(args.llamacpp, env, model, args.text, args.ctx, args.chunks) \
            if args.llamacpp else (float("nan"),) * 4
        print(f"| {t} | {size:.2f} GiB | {a[0]:.4f} | {b[0]:.4f} | {a[1]:.1f} | {b[1]:.1f} | "
              f"{a[1] / b[1]:.2f} | {a[2]:.0f} MiB | {b[2]:.0f} MiB | {load():.1f} |", flush=True)
    if args.no_load:
        return 0
    print("\n| file | compile + weights, cold cache | warm | warm-up step (warm) | generate -n 1 "
          "wall, cold | warm | peak RSS (generate, ctx 256) | load |")
    print("|---|---|---|---|---|---|---|---|")
    for t in args.types:
        model = args.models / f"llama1b-{t}.gguf"
        cache = Path(tempfile.mkdtemp(prefix="jg_cache_"))
        try:
            cold = jitgraph_load(model, cache)
            warm = jitgraph_load(model, cache)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        print(f"| {t} | {cold[0]:.1f} s | {warm[0]:.1f} s | {warm[1]:.1f} s | {cold[2]:.1f} s | "
              f"{warm[2]:.1f} s | {warm[3]:.0f} MiB | {load():.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

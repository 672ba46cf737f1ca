"""Decode speed on the LLaMA-3.2-1B-shaped models (issue 39): `jitgraph generate` against
llama.cpp's llama-bench tg32, per weight type, side by side in one run, 2 threads each.

    python bench/decode_1b.py [--types f32,f16,q8_0,q4_k_m] [--models /work/models]
        [--llama-bench PATH] [--threads 2] [--n 32] [--reps 5] [--dot exact,ggml]
        [--mmap yes,no] [--profile TYPE]

For each type: the machine's load (1-minute load average), `jitgraph generate MODEL --prompt
"Once upon a time" -n N --ctx 256 --temp 0 --ignore-eos --json --quiet --threads T` in a fresh
process (decode tokens/s: generated tokens over the decode time; us per decode step), once per
--dot choice (ggml: x converted as llama.cpp does for Q8_0/Q4_K/Q6_K/F16 weights; skipped for
the types with none: f32, bf16) and --mmap choice (no: `--no-mmap`, the weights read into the
program's memory), then
`llama-bench -m MODEL -p 0 -n N -t T -r REPS -o json` (tg N tokens/s), and their ratio. The
host's sgemm rate (numpy's BLAS, 1024^3) is printed with the table, before and after.
--profile TYPE: where a decode step's time goes for that type's model, kernel by kernel in step
order (jitgraph/cli/roofline.py time_kernels), summed by kind: matmuls (gemm / qgemm) and the
rest, and the slowest kernels.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Once upon a time"


def load() -> float:
    return os.getloadavg()[0]


def jitgraph_decode(model, n, threads, dot="exact", mmap="yes"):
    """(decode tokens/s, us per decode step, generated tokens) of one generate run."""
    cmd = [sys.executable, "-m", "jitgraph.cli", "generate", model, "--prompt", PROMPT,
           "-n", str(n), "--ctx", "256", "--temp", "0", "--ignore-eos", "--json", "--quiet",
           "--threads", str(threads), "--dot", dot] + (["--no-mmap"] if mmap == "no" else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"decode_1b: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return (res["tokens"] / res["decode_seconds"], res["decode_seconds"] / res["tokens"] * 1e6,
            res["tokens"])


def llama_bench(binary, model, n, threads, reps):
    """llama-bench's tg-n tokens/s (mean of its `reps` repetitions)."""
    cmd = [binary, "-m", model, "-p", "0", "-n", str(n), "-t", str(threads), "-r", str(reps),
           "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"decode_1b: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def profile(model, threads, dot, repeat=3):
    """Print a decode step's kernels (in step order, median of `repeat`) summed by kind."""
    os.environ["JITGRAPH_NUM_THREADS"] = str(threads)
    import numpy as np

    from jitgraph.cli.roofline import describe, time_kernels
    from jitgraph.models.generate import Generator
    gen = Generator(model, ctx=256, dot=dot)
    gen.feed(gen.tokenizer.encode(PROMPT))
    feeds = {"tokens": np.zeros((1, 1), np.int32), "pos": np.full(1, gen.n_past, np.int32)}
    rows = time_kernels(gen.decode, feeds, repeat, in_order=True)
    total = sum(r.seconds for r in rows)
    kinds = {}
    for r in rows:
        text = describe(gen.decode.graph, r.kernel, width=10 ** 6)
        kind = "matmul" if " matmul" in text else text.split(":")[1].split()[1]
        kinds[kind] = kinds.get(kind, 0.0) + r.seconds
    print(f"profile {os.path.basename(model)}: {len(rows)} kernels, {total * 1e3:.1f} ms a step "
          f"(load {load():.1f})")
    for kind, s in sorted(kinds.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {kind:24s} {s * 1e3:8.2f} ms  {100 * s / total:5.1f} %")
    for r in sorted(rows, key=lambda r: -r.seconds)[:8]:
        print(f"  {r.seconds * 1e3:8.3f} ms  {describe(gen.decode.graph, r.kernel, width=90)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="f32,f16,q8_0,q4_k_m")
    ap.add_argument("--models", default="/work/models")
    ap.add_argument("--llama-bench", default="/work/llamacpp/build/bin/llama-bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5, help="llama-bench's repetitions (-r)")
    ap.add_argument("--dot", default="exact,ggml",
                    help="jitgraph generate's --dot choices to run")
    ap.add_argument("--mmap", default="yes", help="yes, no or yes,no: generate with the "
                    "weights' pages mapped from the file, read (--no-mmap), or both")
    ap.add_argument("--profile", default="")
    a = ap.parse_args()
    dots = a.dot.split(",")
    if a.profile:
        profile(os.path.join(a.models, f"llama1b-{a.profile}.gguf"), a.threads, dots[-1])
        return
    from jitgraph.cli.roofline import sgemm_gflops
    before = sgemm_gflops()
    rows = []
    for t in a.types.split(","):
        model = os.path.join(a.models, f"llama1b-{t}.gguf")
        if not os.path.exists(model):
            raise SystemExit(f"decode_1b: no model {model} (expected --models DIR holding "
                             f"llama1b-<type>.gguf)")
        runs = []
        for dot in dots:
            if dot == "ggml" and t in ("f32", "bf16"):
                continue
            for mm in a.mmap.split(","):
                l0 = load()
                runs.append((dot, mm, *jitgraph_decode(model, a.n, a.threads, dot, mm), l0))
        l1 = load()
        lc = llama_bench(a.llama_bench, model, a.n, a.threads, a.reps)
        for dot, mm, jg, us, n, l0 in runs:
            rows.append((t, dot, mm, jg, us, lc, jg / lc, l0, l1, load()))
            print(f"{t} --dot {dot} mmap {mm}: jitgraph {jg:.2f} tokens/s ({us:.0f} us/token, "
                  f"{n} tokens), llama.cpp tg{a.n} {lc:.2f} tokens/s", file=sys.stderr,
                  flush=True)
        time.sleep(1)
    after = sgemm_gflops()
    print(f"| type | --dot | mmap | jitgraph decode tokens/s | us/token | llama.cpp tg{a.n} "
          f"tokens/s | ratio | load (jitgraph, llama.cpp, after) |")
    print("|---|---|---|---|---|---|---|---|")
    for t, dot, mm, jg, us, lc, ratio, l0, l1, l2 in rows:
        print(f"| {t} | {dot} | {mm} | {jg:.2f} | {us:,.0f} | {lc:.2f} | {ratio:.2f} | "
              f"{l0:.1f}, {l1:.1f}, {l2:.1f} |")
    print(f"sgemm {before:.0f} GFLOP/s before, {after:.0f} after; {a.threads} threads")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()

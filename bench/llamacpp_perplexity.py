"""`jitgraph perplexity` against llama.cpp's `llama-perplexity` on the same files, text and
context (issues 39 and 40): stories260K converted by llama-quantize to F16, BF16 and Q8_0
(`base`), the model `jitgraph finetune --full` writes, in each --ftype (`full`), the LoRA
adapter `jitgraph finetune --lora-rank` writes, in each --ftype, applied by llama-perplexity's
`--lora` (`lora`), and that adapter merged into the model by `jitgraph export` (`export`).
Prints one table row per file: both perplexities (with their +/-), the difference in %, and
whether it is within --tol (0.5 %); exits 1 when a row is not.

    python bench/llamacpp_perplexity.py LLAMACPP_BIN [--lib DIR] [--work DIR] [--text FILE]
        [--ctx 128] [--chunks N] [--steps 300] [--kv-f16] [--only base,full,lora,export]
        [--json FILE]

Both tools score the same tokens: the whole file (`jitgraph perplexity --split all`) cut into
chunks of --ctx tokens, each evaluated alone from BOS, the second half of each chunk scored
(llama-perplexity's method without --ppl-stride; `-b` = ctx, so one chunk a batch); the script
checks that both scored the same number of chunks. `--kv-f16` rounds jitgraph's K, V, queries
and attention probabilities to f16 as llama.cpp's default F16 KV cache does.

The finetunes run once each (the text's first 90 % of bytes train: `jitgraph finetune`'s split;
seed 0) and write f32; the other --ftypes are that file written again by the writer
`finetune --ftype` calls (write_llama / write_adapter), so every row of a group holds the same
trained weights. --work keeps every file and each command's log (default: a temporary folder,
removed). `--lib DIR` puts DIR first on LD_LIBRARY_PATH (a libggml-cpu.so built without AMX
where the native one crashes on quantized weights). `--json FILE` writes the rows (the form of
tests/data/finetuned/llamacpp-perplexity.json).
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.eE+-]+|nan|inf) \+/- ([0-9.eE+-]+|nan|inf)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")
_QUANT_TYPE = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}


def run(cmd, env=None, log=None):
    """Run `cmd`; return (stdout + stderr, seconds). A failure exits naming the command."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    dt = time.perf_counter() - t0
    if log:
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n" + p.stdout)
    if p.returncode != 0:
        sys.exit(f"failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stdout[-3000:]}")
    return p.stdout, dt


def llama_ppl(args, env, model, lora=None, log=None):
    """llama-perplexity's final estimate (ppl, +/-, seconds, chunks) on `model` (with adapter
    `lora`)."""
    cmd = [os.path.join(args.llamacpp, "llama-perplexity"), "-m", model, "-f", args.score_text,
           "-c", str(args.ctx), "-b", str(args.ctx), "-t", str(args.threads)]
    if args.chunks:
        cmd += ["--chunks", str(args.chunks)]
    if lora:
        cmd += ["--lora", lora]
    out, dt = run(cmd, env=env, log=log)
    m = _FINAL.search(out)
    if not m:
        # llama.cpp 0.3.36's logger can lose the last lines at exit (bench/README.md)
        sys.exit(f"no 'Final estimate' in llama-perplexity's output (its last lines lost at "
                 f"exit? see bench/README.md): {' '.join(cmd)}\n{out[-2000:]}")
    c = _CHUNKS.search(out)
    return float(m.group(1)), float(m.group(2)), dt, int(c.group(1)) if c else None


def jitgraph_ppl(args, model, lora=None, log=None):
    """`jitgraph perplexity`'s (ppl, +/-, seconds, chunks) on the same tokens."""
    cmd = [sys.executable, "-m", "jitgraph.cli", "perplexity", model, "--text", args.score_text,
           "--split", "all", "--ctx", str(args.ctx), "--json", "--quiet"]
    if args.chunks:
        cmd += ["--chunks", str(args.chunks)]
    if args.kv_f16:
        cmd.append("--kv-f16")
    if lora:
        cmd += ["--lora", lora]
    out, dt = run(cmd, log=log)
    res = json.loads(out.strip().splitlines()[-1])
    return float(res["perplexity"]), float(res["uncertainty"]), dt, int(res["chunks"])


def finetune(args, base, out, extra, log):
    """`jitgraph finetune BASE ... --out OUT` with the script's steps, text and seed (--reuse: OUT
    as it is when there)."""
    if args.reuse and os.path.isfile(out):
        return 0.0
    cmd = [sys.executable, "-m", "jitgraph.cli", "finetune", base, "--text", args.text,
           "--ctx", str(args.ctx), "--steps", str(args.steps), "--lr", str(args.lr),
           "--seed", "0", "--no-ppl", "--quiet", "--out", out] + extra
    _, dt = run(cmd, log=log)
    return dt


def rewrite_model(src, dst, ftype):
    """The model file `src` written again with its weight matrices in `ftype`, by the writer
    `jitgraph finetune --full --ftype` calls (write_llama): the same weights as a finetune run
    with that --ftype, without training them again."""
    from jitgraph.models.llama import read_llama, write_llama
    cfg, params, tok = read_llama(src)
    write_llama(dst, cfg, params, tok, name="jitgraph finetune", ftype=ftype)


def rewrite_adapter(base, src, dst, ftype):
    """The adapter `src` written again in `ftype` by the writer `jitgraph finetune --lora-rank
    --ftype` calls (write_adapter)."""
    from jitgraph.models.llama import read_llama
    from jitgraph.models.lora import read_adapter, write_adapter
    cfg = read_llama(base)[0]
    params, alpha = read_adapter(src, cfg)
    write_adapter(dst, cfg, params, alpha, ftype=ftype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llamacpp", help="llama.cpp's build/bin folder (llama-perplexity, "
                                     "llama-quantize)")
    ap.add_argument("--lib", default=None, help="a folder put first on LD_LIBRARY_PATH")
    ap.add_argument("--work", default=None, help="keep the files and logs here (default: a "
                                                 "temporary folder, removed)")
    ap.add_argument("--base", default=os.path.join(ROOT, "tests", "data", "stories260K.gguf"))
    ap.add_argument("--text", default=os.path.join(ROOT, "tests", "data",
                                                   "tinyshakespeare_tail.txt"))
    ap.add_argument("--score-text", default=None, metavar="FILE",
                    help="the text both tools score (default: --text, which the finetunes "
                         "train on)")
    ap.add_argument("--heldout", action="store_true",
                    help="score only the finetunes' held-out part: --text's last 10 %% of bytes, "
                         "written to the work folder")
    ap.add_argument("--reuse", action="store_true",
                    help="keep a finetune's output already in --work instead of training again")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=None, help="score only the first N chunks")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300, help="finetune steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--ftypes", default="f32,f16,bf16,q8_0")
    ap.add_argument("--only", default="base,full,lora,export",
                    help="which groups of rows: base (llama-quantize's files), full, lora "
                         "(the adapter through --lora), export (the adapter merged)")
    ap.add_argument("--kv-f16", action="store_true")
    ap.add_argument("--tol", type=float, default=0.5, help="tolerance in %%")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    args.llamacpp = os.path.abspath(args.llamacpp)
    args.text = os.path.abspath(args.text)
    for tool in ("llama-perplexity", "llama-quantize"):
        if not os.access(os.path.join(args.llamacpp, tool), os.X_OK):
            sys.exit(f"{args.llamacpp}: no executable {tool} there")
    env = dict(os.environ)
    if args.lib:
        env["LD_LIBRARY_PATH"] = args.lib + (":" + env["LD_LIBRARY_PATH"]
                                             if env.get("LD_LIBRARY_PATH") else "")
    work = args.work or tempfile.mkdtemp(prefix="llamacpp-ppl-")
    os.makedirs(work, exist_ok=True)
    groups = set(args.only.split(","))
    args.score_text = os.path.abspath(args.score_text) if args.score_text else args.text
    if args.heldout:
        with open(args.text, "rb") as f:
            data = f.read()
        args.score_text = os.path.join(work, "heldout.txt")
        with open(args.score_text, "wb") as f:       # jitgraph finetune's split: tail:0.1
            f.write(data[int(0.9 * len(data)):])
    ftypes = args.ftypes.split(",")

    def to_type(src, ftype, dst):
        """llama-quantize SRC to DST in `ftype` (f32: a copy)."""
        if ftype == "f32":
            shutil.copyfile(src, dst)
        else:
            run([os.path.join(args.llamacpp, "llama-quantize"), src, dst, _QUANT_TYPE[ftype],
                 str(args.threads)], env=env, log=dst + ".quantize.log")

    jobs = []       # (label, model, lora)
    if "base" in groups:
        for ft in ftypes:
            dst = os.path.join(work, f"stories260K-{ft}.gguf")
            to_type(args.base, ft, dst)
            jobs.append((f"stories260K {ft} (llama-quantize)", dst, None))
    if "full" in groups:
        f32 = os.path.join(work, "ft-full-f32.gguf")
        dt = finetune(args, args.base, f32, ["--full"], f32 + ".finetune.log")
        print(f"# finetune --full: {dt:.1f} s", flush=True)
        for ft in ftypes:
            dst = os.path.join(work, f"ft-full-{ft}.gguf")
            if ft != "f32":
                rewrite_model(f32, dst, ft)
            jobs.append((f"finetune --full, written {ft}", dst, None))
    if "lora" in groups or "export" in groups:
        f32 = os.path.join(work, "ft-lora-f32.gguf")
        dt = finetune(args, args.base, f32, ["--lora-rank", str(args.lora_rank)],
                      f32 + ".finetune.log")
        print(f"# finetune --lora-rank {args.lora_rank}: {dt:.1f} s", flush=True)
    if "lora" in groups:
        for ft in ftypes:
            dst = os.path.join(work, f"ft-lora-{ft}.gguf")
            if ft != "f32":
                rewrite_adapter(args.base, f32, dst, ft)
            jobs.append((f"stories260K + LoRA r{args.lora_rank} adapter {ft} (--lora)",
                         args.base, dst))
    if "export" in groups:
        dst = os.path.join(work, "ft-lora-merged-f32.gguf")
        run([sys.executable, "-m", "jitgraph.cli", "export", args.base, "--lora", f32,
             "--out", dst, "--quiet"], log=dst + ".export.log")
        jobs.append(("stories260K + LoRA merged by `jitgraph export`", dst, None))

    print(f"# text {args.score_text}, ctx {args.ctx}, chunks {args.chunks or 'all'}, "
          f"threads {args.threads}, kv_f16 {args.kv_f16}, work {work}", flush=True)
    print("| file | jitgraph PPL | llama-perplexity PPL | difference | within |")
    print("| --- | --- | --- | --- | --- |", flush=True)
    rows = []
    for label, model, lora in jobs:
        stem = os.path.join(work, os.path.basename(lora or model))
        lp, le, lt, lc = llama_ppl(args, env, model, lora, log=stem + ".llama-perplexity.log")
        jp, je, jt, jc = jitgraph_ppl(args, model, lora, log=stem + ".jitgraph.log")
        if lc is not None and lc != jc:
            sys.exit(f"{label}: llama-perplexity scored {lc} chunks, jitgraph {jc}")
        d = 100.0 * (jp / lp - 1.0)
        ok = abs(d) < args.tol
        rows.append(dict(label=label, model=os.path.basename(model),
                         lora=os.path.basename(lora) if lora else None, chunks=jc,
                         jitgraph=jp, jitgraph_err=je, llamacpp=lp, llamacpp_err=le,
                         diff_percent=d, seconds_jitgraph=jt, seconds_llamacpp=lt))
        print(f"| {label} | {jp:.4f} +/- {je:.2f} | {lp:.4f} +/- {le:.2f} | {d:+.4f} % | "
              f"{'yes' if ok else 'NO'} |", flush=True)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(text=os.path.basename(args.score_text), ctx=args.ctx,
                           chunks=rows[0]["chunks"] if rows else None, kv_f16=args.kv_f16,
                           steps=args.steps, lr=args.lr, lora_rank=args.lora_rank,
                           rows=rows), f, indent=1)
        os.replace(tmp, args.json)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(abs(r["diff_percent"]) < args.tol for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

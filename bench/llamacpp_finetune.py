"""llama.cpp's llama-finetune against `jitgraph finetune --epochs` on the same model file, text,
ctx and batch (issue 40): the two take turns (--rounds), each a process of its own; printed per
run: training tokens/s, wall time, peak RSS (the process's max RSS, from wait4) and each
epoch's train / val loss and accuracy as each prints them, then both loss curves.

llama-finetune runs `-c C -b C -ub C -t T -epochs N -lr LR -val-split F` (one window a
micro-batch); its per-batch losses are recovered from the running means its progress bar
prints. jitgraph runs `--full --ctx C --batch-size 1 --epochs N --lr LR --val-split F`, its
curve read from its --log. Note llama.cpp pads the context to a multiple of 256
(llama-context.cpp GGML_PAD(n_ctx, 256)): below 256 its windows are 256 tokens, run as
256 / C micro-batches of C, and the K and V projections get no gradient (it warns so).

    python bench/llamacpp_finetune.py --llamacpp /work/llamacpp/build/bin \\
        --llamacpp-lib /work/llamacpp/build-noamx/bin --bytes 65536 --ctx 128 --epochs 1
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
_BAR = re.compile(r"(train|val): +\[[^\]]*\] data=(\d+)/(\d+) loss=([0-9.naif]+)±([0-9.naif]+) "
                  r"acc=([0-9.naif]+)±([0-9.naif]+)% t=(\d+):(\d+):(\d+)")


def find_finetune(path):
    """The llama-finetune binary: PATH (the binary or its folder) or the one on $PATH."""
    if path:
        p = os.path.join(path, "llama-finetune") if os.path.isdir(path) else path
        if not os.path.isfile(p):
            sys.exit(f"--llamacpp {path}: no llama-finetune there")
        return p
    p = shutil.which("llama-finetune")
    if not p:
        sys.exit("llama-finetune is not on PATH; give --llamacpp BUILD/bin")
    return p


def run(cmd, env=None):
    """(returncode, stdout, stderr, wall seconds, max RSS bytes) of one process."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return (p.returncode, out.read().decode("utf-8", "replace"),
                err.read().decode("utf-8", "replace"), wall, usage.ru_maxrss * 1024)


def parse_llamacpp(text):
    """Per epoch: the last train and val progress lines (loss, unc, acc, acc unc, batches,
    seconds) and the train batches' own losses (from the running means)."""
    epochs, cur, prev = [], None, None
    for m in _BAR.finditer(text):
        kind, i, n = m.group(1), int(m.group(2)), int(m.group(3))
        rec = {"batches": i, "loss": float(m.group(4)), "unc": float(m.group(5)),
               "acc": float(m.group(6)) / 100, "acc_unc": float(m.group(7)) / 100,
               "seconds": int(m.group(8)) * 3600 + int(m.group(9)) * 60 + int(m.group(10))}
        if kind == "train" and i == 1:
            cur = {"train": None, "val": None, "curve": []}
            epochs.append(cur)
            prev = 0.0
        if cur is None:
            continue
        if kind == "train" and i == len(cur["curve"]) + 1:
            cur["curve"].append(rec["loss"] * i - prev)
            prev = rec["loss"] * i
        cur[kind] = rec
    return epochs


def parse_jitgraph(out, log):
    res = json.loads(out.strip().splitlines()[-1])
    steps = [json.loads(ln) for ln in open(log)]
    curve = [r["loss"] for r in steps if r.get("kind") == "step"]
    per = len(curve) // max(1, len(res["curve"]))
    epochs = []
    for j, c in enumerate(res["curve"]):
        epochs.append({"train": {"loss": c["train"], "unc": c["train_unc"], "acc": c["train_acc"],
                                 "acc_unc": c["train_acc_unc"]},
                       "val": {"loss": c["val"], "unc": c["val_unc"], "acc": c["val_acc"],
                               "acc_unc": c["val_acc_unc"]},
                       "curve": curve[j * per:(j + 1) * per]})
    return res, epochs


def sampled(curve, n=12):
    """The curve as n means of consecutive stretches."""
    if not curve:
        return []
    k = max(1, len(curve) // n)
    return [round(sum(curve[i:i + k]) / len(curve[i:i + k]), 3) for i in range(0, len(curve), k)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "tests", "data", "stories260K.gguf"),
                   help="an F32 llama GGUF both load (llama-finetune trains F32 models only)")
    p.add_argument("--text", default=os.path.join(ROOT, "jitgraph", "models", "data",
                                                  "tinyshakespeare_head.txt"))
    p.add_argument("--bytes", type=int, default=65536, help="the text's first N bytes")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-split", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="runs of each, taking turns")
    p.add_argument("--llamacpp", help="llama.cpp's build/bin folder or the llama-finetune binary; "
                                      "default: on PATH")
    p.add_argument("--llamacpp-lib", metavar="DIR",
                   help="prepended to LD_LIBRARY_PATH for llama-finetune (another build's "
                        "libggml, e.g. one without the AMX path)")
    p.add_argument("--only", choices=("llamacpp", "jitgraph"), help="run one of the two")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="ft-bench-")
    text = os.path.join(work, "text.txt")
    with open(args.text, "rb") as f:
        data = f.read()
    with open(text, "wb") as f:
        f.write(data[:args.bytes] if args.bytes else data)
    c = str(args.ctx)
    env = dict(os.environ)
    if args.llamacpp_lib:
        env["LD_LIBRARY_PATH"] = args.llamacpp_lib + (
            os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    lc_cmd = None
    if args.only != "jitgraph":
        lc_cmd = [find_finetune(args.llamacpp), "-m", args.model, "-f", text, "-c", c, "-b", c,
                  "-ub", c, "-t", str(args.threads), "-epochs", str(args.epochs), "-lr",
                  str(args.lr), "-val-split", str(args.val_split), "-o",
                  os.path.join(work, "llamacpp.gguf")]
    log = os.path.join(work, "jitgraph.jsonl")
    jg_cmd = [sys.executable, "-c", "import sys; from jitgraph.cli import main; "
              "sys.exit(main(sys.argv[1:]))", "finetune", args.model, "--text", text, "--full",
              "--ctx", c, "--batch-size", "1", "--epochs", str(args.epochs), "--lr",
              str(args.lr), "--val-split", str(args.val_split), "--threads", str(args.threads),
              "--no-ppl", "--quiet", "--json", "--log", log, "--out",
              os.path.join(work, "jitgraph.gguf")]
    print(f"# model {args.model}, text {args.text} ({os.path.getsize(text):,} bytes), ctx "
          f"{args.ctx}, {args.epochs} epoch(s), lr {args.lr}, val split {args.val_split}, "
          f"{args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    for cmd in (lc_cmd, jg_cmd):
        if cmd:
            print("# " + " ".join(cmd))
    runs = []
    for r in range(args.rounds):
        for name, cmd in (("llama-finetune", lc_cmd), ("jitgraph", jg_cmd)):
            if cmd is None:
                continue
            if name == "jitgraph" and os.path.exists(log):
                os.remove(log)
            rc, out, err, wall, rss = run(cmd, env if name == "llama-finetune" else None)
            if rc != 0:
                print(f"{name} failed ({rc}):\n{err[-3000:]}", file=sys.stderr)
                return 1
            if name == "jitgraph":
                res, epochs = parse_jitgraph(out, log)
                tps, train_s = res["tokens_per_second"], res["steps"] * res["ms_per_step"] / 1e3
            else:
                epochs = parse_llamacpp(err)
                # each train batch is one micro-batch of ctx tokens; its bar's clock has
                # whole seconds
                train_s = sum(e["train"]["seconds"] for e in epochs)
                tokens = sum(e["train"]["batches"] for e in epochs) * args.ctx
                tps = tokens / train_s if train_s else float("nan")
            runs.append({"system": name, "round": r, "tokens_per_s": tps, "train_seconds": train_s,
                         "wall_seconds": wall, "max_rss_bytes": rss, "epochs": epochs})
            print(f"{name:15s} round {r}: {tps:9,.0f} tokens/s (training {train_s:.1f} s, wall "
                  f"{wall:.1f} s), peak RSS {rss / 2**20:,.0f} MiB")
            for j, e in enumerate(epochs):
                t, v = e["train"], e["val"]
                print(f"    epoch {j + 1}: train loss {t['loss']:.4f}±{t['unc']:.4f} acc "
                      f"{100 * t['acc']:.2f}%  val loss {v['loss']:.4f}±{v['unc']:.4f} acc "
                      f"{100 * v['acc']:.2f}%  ({len(e['curve'])} train batches)")
                print(f"    curve (means of {max(1, len(e['curve']) // 12)} batches): "
                      f"{sampled(e['curve'])}")
    by = {}
    for x in runs:
        by.setdefault(x["system"], []).append(x["tokens_per_s"])
    if len(by) == 2:
        import statistics
        a, b = statistics.median(by["jitgraph"]), statistics.median(by["llama-finetune"])
        print(f"jitgraph / llama-finetune tokens/s (medians): {a / b:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

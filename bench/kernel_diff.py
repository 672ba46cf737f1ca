"""The generated kernels of two commits, compared: the CPU backend's kernel source (driver and
kernel modules) and the CUDA backend's launch listing and kernel source, for a fixed set of
graphs (MNIST FC and CNN training, a small llama's training step, decode and prefill programs,
the row ops fused and alone), each commit checked out with `git worktree` into a temporary
folder and run from there.

    python bench/kernel_diff.py [A [B]] [--keep DIR] [--only NAME ...]

A, B: commits (default: main's e5df25f and HEAD; "." is the working tree as it is). Prints a
unified diff per file that differs and a summary line; exit status 1 when anything differs.
Kernel and module names carry content hashes (CPU: a hash of runtime/cpu's sources and the
kernel text; CUDA: of the kernel text), so each distinct name is replaced by its order of first
appearance before comparing; a real change of a kernel's text still shows in its body. No numba
compile runs: only the code generators (fast; no GPU, no numba-cuda needed).
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run inside the checkout (its jitgraph on sys.path): writes <out>/<backend>/<graph>.txt.
WORKER = r'''
import sys
from pathlib import Path
import numpy as np
import jitgraph as jg
from jitgraph import ops
from jitgraph.ir import Graph
from jitgraph.passes.pipeline import Options, run_pipeline

out = Path(sys.argv[1])
only = set(sys.argv[2:])


def rows_graph(axis=-1):
    """The row ops (fused with a prologue and an epilogue), trained so every *_back op
    appears; axis 0: softmax and log_softmax over another axis than the last (the CPU's
    library kernels)."""
    g = Graph("rows")
    x = g.input("x", (6, 10))
    w = g.param("w", (10, 10))
    h = ops.matmul(x, w)
    a = ops.layer_norm(ops.tanh(h)) * 2.0
    b = ops.rms_norm(h + 1.0)
    c = ops.softmax(a * 0.5, axis=axis) + ops.log_softmax(b, axis=axis)
    g.output(loss=ops.sum(c * c))
    return g


def graphs():
    from jitgraph.models.mnist import mnist_cnn, mnist_fc
    from jitgraph.models.llama import LlamaConfig, llama_forward
    train = dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-3))
    cfg = LlamaConfig(vocab=64, dim=64, layers=1, heads=4, kv_heads=2, ff=128, ctx=64)
    yield "mnist_fc_train", mnist_fc(100), train
    yield "mnist_cnn_train", mnist_cnn(100), train
    yield "mnist_cnn_train_unfused", mnist_cnn(100), dict(train, fuse=False)
    yield "llama_train", llama_forward(cfg, 2, 16, labels=True), train
    from jitgraph.models.generate import llama_decoder
    yield "llama_decode", llama_decoder(cfg, 1, 32, True), {}
    yield "llama_prefill", llama_decoder(cfg, 8, 32, True), {}
    yield "rows_train", rows_graph(), train
    yield "rows_train_unfused", rows_graph(), dict(train, fuse=False)
    yield "rows_axis0_train", rows_graph(0), train


def cpu(kg, plan):
    from jitgraph.runtime.backend import get_backend
    _, text = get_backend("cpu").generate(kg, plan)
    return text


def cuda(kg, plan):
    try:
        from jitgraph.runtime.cuda import generate as program
    except ImportError:         # before the CUDA backend's split: runtime/cuda/program.py
        from jitgraph.runtime.cuda import program
    gen = program.generate(kg, plan, tpb=256, tile=16)
    return program.listing(gen, kg.graph)


def kinds(name):
    from jitgraph.runtime.backend import BACKENDS
    import importlib
    mod, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(mod), cls).kinds


for title, g, opts in graphs():
    if only and title not in only:
        continue
    for target, gen in (("cpu", cpu), ("cuda", cuda)):
        try:
            st = run_pipeline(g, Options(kinds=kinds(target), **opts))
            text = gen(st.kernels, st.memory)
        except Exception as e:      # a backend without a lowering for some op: recorded
            text = f"error: {type(e).__name__}: {e}\n"
        (out / target).mkdir(parents=True, exist_ok=True)
        (out / target / f"{title}.txt").write_text(text)
'''

# hashed names: CPU modules and kernels (<prefix>_<24 hex>), CUDA kernels (k<16 hex>)
HASHED = re.compile(r"\b([A-Za-z][A-Za-z0-9_]*?_[0-9a-f]{24}|k[0-9a-f]{16})\b")


def normalise(text: str) -> str:
    """Each hashed name replaced by <prefix>#<order of first appearance>, the order read with
    the driver's `declare` lines left out; what is sorted by name, so by hash (the CPU driver's
    `declare` lines, the CUDA module's kernel functions), sorted again."""
    seen = {}
    body = "\n".join(ln for ln in text.splitlines() if not ln.startswith("declare "))
    for m in HASHED.finditer(body):
        name = m.group(1)
        prefix = name.rsplit("_", 1)[0] if "_" in name else "k"
        seen.setdefault(name, f"{prefix}#{len(seen)}")
    lines = HASHED.sub(lambda m: seen.get(m.group(1), m.group(1)), text).splitlines()
    decl = [i for i, ln in enumerate(lines) if ln.startswith("declare ")]
    for i, ln in zip(decl, sorted(lines[i] for i in decl)):
        lines[i] = ln
    blocks = "\n".join(lines).split("\n\n\n")
    funcs = [i for i, b in enumerate(blocks) if b.startswith("def k#")]
    for i, b in zip(funcs, sorted(blocks[i] for i in funcs)):
        blocks[i] = b
    return "\n\n\n".join(blocks) + "\n"


def checkout(commit: str, tmp: Path) -> Path:
    """A folder whose jitgraph package is `commit`'s (the working tree for "."), laid out as
    the install lays it out (passes/ and runtime/ inside jitgraph/)."""
    if commit == ".":
        src = ROOT
    else:
        src = tmp / f"tree-{commit}"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(src),
                        commit], check=True, capture_output=True)
    site = tmp / f"site-{commit.replace('/', '_')}"
    pkg = site / "jitgraph"
    pkg.mkdir(parents=True)
    for entry in (src / "jitgraph").iterdir():
        (pkg / entry.name).symlink_to(entry)
    (pkg / "passes").symlink_to(src / "passes")
    (pkg / "runtime").symlink_to(src / "runtime")
    return site


def dump(commit: str, tmp: Path, only) -> Path:
    site = checkout(commit, tmp)
    out = tmp / f"out-{commit.replace('/', '_')}"
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-c", WORKER, str(out), *only], env=env,
                       capture_output=True, text=True, cwd=str(tmp))
    if r.returncode:
        raise SystemExit(f"kernel_diff: generating at {commit} failed:\n{r.stderr[-3000:]}")
    return out


def cleanup(tmp: Path):
    for tree in tmp.glob("tree-*"):
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       capture_output=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", nargs="?", default="e5df25f")
    p.add_argument("b", nargs="?", default="HEAD")
    p.add_argument("--keep", type=Path, help="also write the normalised files here")
    p.add_argument("--only", nargs="*", default=[], help="graph names (default: all)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kernel_diff_") as t:
        tmp = Path(t)
        try:
            outs = [dump(c, tmp, args.only) for c in (args.a, args.b)]
        finally:
            cleanup(tmp)
        files = sorted({f.relative_to(o) for o in outs for f in o.rglob("*.txt")})
        differ = 0
        for rel in files:
            a, b = (normalise((o / rel).read_text()) if (o / rel).exists() else ""
                    for o in outs)
            if args.keep:
                for tag, text in (("a", a), ("b", b)):
                    dst = args.keep / tag / rel
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_text(text)
            if a == b:
                print(f"same     {rel}")
                continue
            differ += 1
            d = list(difflib.unified_diff(a.splitlines(), b.splitlines(), f"{args.a}/{rel}",
                                          f"{args.b}/{rel}", lineterm="", n=2))
            print(f"differs  {rel} ({sum(ln[:1] in '+-' for ln in d[2:])} lines)")
            print("\n".join(d))
    print(f"kernel_diff: {len(files) - differ} of {len(files)} files the same")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

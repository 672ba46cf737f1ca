"""The generated kernels of two commits, compared: the CPU backend's kernel source (driver and
kernel modules) and the CUDA backend's launch listing and kernel source, for the graphs issue 37
names, each commit checked out with `git worktree` into a temporary folder and run from there:
MNIST FC and CNN training, every `jitgraph bench` workload (jitgraph/cli/workloads.py, at
--scale) fused and unfused with its loss and optimizer, a small llama's training step, decode
and prefill programs, the stories260K finetuning graphs (tests/data/stories260K.gguf's config,
batch 16, ctx 128: LoRA rank 8 on q,k,v,o, and the full model), the row ops fused and alone, and
--random seeded random graphs (the random-graph tester's cases) fused and unfused.

    python bench/kernel_diff.py [A [B]] [--keep DIR] [--only NAME ...] [--list]
                                [--random N] [--seed S] [--scale F]

A, B: commits (default: main's e5df25f and HEAD; "." is the working tree as it is). Prints a
unified diff per file that differs and a summary line; exit status 1 when anything differs.
The random graphs are drawn once, by the working tree's generator, and saved as graph JSON that
both commits load, so a change in what the generator draws is no kernel difference.
Kernel and module names carry content hashes (CPU: a hash of runtime/cpu's sources and the
kernel text; CUDA: of the kernel text), so each distinct name is replaced by its order of first
appearance before comparing; a real change of a kernel's text still shows in its body. No numba
compile runs: only the code generators (fast; no GPU, no numba-cuda needed).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT / "tests" / "data" / "stories260K.gguf"

# Run inside the checkout (its jitgraph on sys.path). argv: out folder, the random graphs'
# folder, "list" (print the graph names) or "gen" (write <out>/<backend>/<graph>.txt), then the
# names to generate (none: all).
WORKER = r'''
import json
import sys
from pathlib import Path
import jitgraph as jg
import jitgraph.serialize  # noqa: F401  (installs Graph.to_json / Graph.from_json)
from jitgraph import ops
from jitgraph.ir import Graph
from jitgraph.passes.pipeline import Options, run_pipeline

out, rand, what = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
only = set(sys.argv[4:])
SCALE = float(__import__("os").environ.get("KERNEL_DIFF_SCALE", "1"))
STORIES = Path(__import__("os").environ["KERNEL_DIFF_STORIES"])


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


def train():
    return dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-3))


def small_llama():
    from jitgraph.models.llama import LlamaConfig
    return LlamaConfig(vocab=64, dim=64, layers=1, heads=4, kv_heads=2, ff=128, ctx=64)


def stories(lora):
    """The stories260K finetuning graph as `jitgraph finetune` builds it (cli/llama_train.py):
    batch 16, ctx 128; lora: rank 8 (alpha 8) on q,k,v,o, else the full model."""
    from jitgraph.models.llama import llama_forward, read_llama
    try:
        cfg = read_llama(str(STORIES), keep_types=lora)[0]
    except TypeError:          # a read_llama without keep_types
        cfg = read_llama(str(STORIES))[0]
    g = llama_forward(cfg, 16, 128, labels=True, name="llama_finetune")
    if lora:
        from jitgraph.cli.llama_train import lora_weights
        from jitgraph.lora import lora as add_lora
        targets = lora_weights(cfg.description, "q,k,v,o", lambda m: None)
        g = add_lora(g, targets=targets, rank=8, alpha=8.0, seed=0)
    return g, train()


def workload(name, fuse):
    from jitgraph.cli.workloads import WORKLOADS
    w = WORKLOADS[name](scale=SCALE, seed=0)
    return w.graph, dict(loss=w.loss, optimizer=w.optimizer, fuse=fuse)


def random_case(path, fuse):
    """A random graph saved by the parent (graph JSON, mode, lr), compiled as the random-graph
    tester compiles it (jitgraph/testing/runner.py: loss "loss" and SGD(lr) in train mode)."""
    spec = json.loads(path.read_text())
    g = Graph.from_json(spec["graph"])
    opts = dict(fuse=fuse)
    if spec["mode"] == "train":
        opts.update(loss="loss", optimizer=jg.optim.SGD(lr=spec["lr"]))
    return g, opts


def graphs():
    """(name, build) pairs; build() -> (graph, Options keywords but kinds)."""
    from jitgraph.models.mnist import mnist_cnn, mnist_fc
    yield "mnist_fc_train", lambda: (mnist_fc(100), train())
    yield "mnist_cnn_train", lambda: (mnist_cnn(100), train())
    yield "mnist_cnn_train_unfused", lambda: (mnist_cnn(100), dict(train(), fuse=False))

    def llama_train():
        from jitgraph.models.llama import llama_forward
        return llama_forward(small_llama(), 2, 16, labels=True), train()

    def decoder(rows):
        from jitgraph.models.generate import llama_decoder
        return llama_decoder(small_llama(), rows, 32, True), {}
    yield "llama_train", llama_train
    yield "llama_decode", lambda: decoder(1)
    yield "llama_prefill", lambda: decoder(8)
    yield "rows_train", lambda: (rows_graph(), train())
    yield "rows_train_unfused", lambda: (rows_graph(), dict(train(), fuse=False))
    yield "rows_axis0_train", lambda: (rows_graph(0), train())
    yield "stories260K_lora", lambda: stories(True)
    yield "stories260K_full", lambda: stories(False)
    from jitgraph.cli.workloads import WORKLOADS
    for name in WORKLOADS:
        yield f"bench_{name}", lambda name=name: workload(name, True)
        yield f"bench_{name}_unfused", lambda name=name: workload(name, False)
    for path in sorted(rand.glob("*.json")):
        yield path.stem, lambda path=path: random_case(path, True)
        yield f"{path.stem}_unfused", lambda path=path: random_case(path, False)


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


for title, build in graphs():
    if what == "list":
        print(title)
        continue
    if only and title not in only:
        continue
    try:
        g, opts = build()
    except Exception as e:      # a graph this commit cannot build: recorded for both backends
        g, opts = None, f"error: building: {type(e).__name__}: {e}\n"
    for target, gen in (("cpu", cpu), ("cuda", cuda)):
        if g is None:
            text = opts
        else:
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
    the install lays it out (passes/ and runtime/ inside jitgraph/); made once per commit."""
    site = tmp / f"site-{commit.replace('/', '_')}"
    if site.exists():
        return site
    if commit == ".":
        src = ROOT
    else:
        src = tmp / f"tree-{commit}"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(src),
                        commit], check=True, capture_output=True)
    pkg = site / "jitgraph"
    pkg.mkdir(parents=True)
    for entry in (src / "jitgraph").iterdir():
        (pkg / entry.name).symlink_to(entry)
    (pkg / "passes").symlink_to(src / "passes")
    (pkg / "runtime").symlink_to(src / "runtime")
    return site


def random_graphs(tmp: Path, count: int, seed: int) -> Path:
    """The first `count` cases the random-graph tester draws from `seed` (fuzz.case_at, as
    tests/test_random_graphs.py draws them), made once with the working tree's generator and
    saved as graph JSON with their mode and lr: both commits compile the same graphs, whatever
    their generators draw."""
    folder = tmp / "random"
    folder.mkdir()
    sys.path.insert(0, str(checkout(".", tmp)))
    from jitgraph.testing import fuzz
    i = made = 0
    while made < count:
        case = fuzz.case_at(seed, i)
        i += 1
        if case is None:                 # the tester draws again too
            continue
        spec = {"graph": case.graph.to_json(), "mode": case.mode, "lr": case.lr,
                "label": case.label}
        (folder / f"random_{seed}_{i - 1:03d}.json").write_text(json.dumps(spec))
        made += 1
    return folder


def worker(site: Path, out: Path, rand: Path, what: str, only, scale: float, tmp: Path):
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1",
               KERNEL_DIFF_SCALE=str(scale), KERNEL_DIFF_STORIES=str(STORIES))
    return subprocess.run([sys.executable, "-c", WORKER, str(out), str(rand), what, *only],
                          env=env, capture_output=True, text=True, cwd=str(tmp))


def dump(commit: str, tmp: Path, rand: Path, only, scale: float) -> Path:
    site = checkout(commit, tmp)
    out = tmp / f"out-{commit.replace('/', '_')}"
    r = worker(site, out, rand, "gen", only, scale, tmp)
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
    p.add_argument("--list", action="store_true", help="print the graph names and stop")
    p.add_argument("--random", type=int, default=32, metavar="N",
                   help="random graphs, each fused and unfused (default 32)")
    p.add_argument("--seed", type=int, default=14, help="the random graphs' seed (default: "
                   "tests/test_random_graphs.py's CI_SEED, 14)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="the bench workloads' scale (jitgraph/cli/workloads.py; default 1)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kernel_diff_") as t:
        tmp = Path(t)
        rand = random_graphs(tmp, args.random, args.seed)
        if args.list or args.only:
            r = worker(checkout(".", tmp), tmp, rand, "list", [], args.scale, tmp)
            if r.returncode:
                raise SystemExit(f"kernel_diff: listing failed:\n{r.stderr[-3000:]}")
            if args.list:
                print(r.stdout, end="")
                return 0
            unknown = sorted(set(args.only) - set(r.stdout.split()))
            if unknown:
                raise SystemExit(f"kernel_diff: --only: no graph named {', '.join(unknown)} "
                                 f"(--list prints the names)")
        try:
            outs = [dump(c, tmp, rand, args.only, args.scale) for c in (args.a, args.b)]
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

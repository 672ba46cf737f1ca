"""The one-command GPU check of the CUDA target (issue 19): `python bench/gpu_check.py`.

On a machine with an NVIDIA GPU and numba-cuda (`pip install --no-deps --no-build-isolation -e .`
where numba-cuda is preinstalled, else `pip install -e '.[cuda]'`), no network, < 5 minutes on an
H200 including cold compiles:

1. correctness: the MNIST FC (batch 1000), MNIST CNN (batch 100) and llama (the `jitgraph
   train llama` default config: byte vocabulary, width 128, 4 layers, 4 heads, context 128,
   batch 16) training steps (AdamW) compiled for target="cuda" against the same programs on
   target="cpu": the same initial params, the same batches, several steps; the loss each step
   and every param after them within float tolerance (FP32; GEMMs through cuBLASLt with TF32
   when nvmath-python and CuPy are importable, runtime/cuda/gemm.py, else the numba kernel);
2. step times, the batch uploaded from host memory every step by every system: jitgraph cuda,
   jitgraph cpu, and for the MNIST models PyTorch on the same GPU when importable: eager,
   torch.compile (default) and torch.compile(mode="reduce-overhead") (CUDA graphs), TF32
   allowed for PyTorch (no PyTorch llama here yet: bench/llama_peers.py has the CPU peers).

The jitgraph cuda rows: the default (CUDA graph replay from the second step,
runtime/cuda/graphs.py; cuBLASLt GEMMs where available), plain stream launches
(JITGRAPH_CUDA_GRAPHS=0) and the numba tiled GEMM (JITGRAPH_CUDA_GEMM=numba); each row's note
names its GEMM library, its graph captures and replays, and a capture's fallback reason.

Prints one table per model; exits 1 when a correctness check fails. `--quick` runs fewer
steps; `--models fc,cnn` picks models.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="fc,cnn,llama",
                   help="comma-separated: fc (MNIST FC), cnn (MNIST CNN), llama")
    p.add_argument("--batch", type=int, default=1000, help="MNIST FC batch (default 1000)")
    p.add_argument("--cnn-batch", type=int, default=100, help="MNIST CNN batch (default 100)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before timing")
    p.add_argument("--check-steps", type=int, default=3, help="AdamW steps compared to the CPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    p.add_argument("--no-cpu-timing", action="store_true", help="skip the jitgraph cpu rows")
    p.add_argument("--quick", action="store_true", help="10 timed steps, 2 warmup")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup = 10, 2
    if min(a.batch, a.cnn_batch, a.steps, a.check_steps) < 1 or a.warmup < 0:
        p.error("--batch, --cnn-batch, --steps and --check-steps must be positive")
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in a.models if m not in MODELS]
    if bad:
        p.error(f"--models: unknown {', '.join(bad)}; expected {', '.join(MODELS)}")
    return a


# ---- the models: (graph, batches(n, seed) -> [feed dict], PyTorch model or None) -------------
def fc_model(args):
    from jitgraph.models.mnist import mnist_fc
    B = args.batch

    def feeds(n, seed):
        rng = np.random.default_rng(seed)
        return [{"x": rng.random((B, 784), dtype=np.float32),
                 "y": rng.integers(0, 10, B).astype(np.int32)} for _ in range(n)]

    def torch_model(torch):
        return torch.nn.Sequential(torch.nn.Linear(784, 500), torch.nn.ReLU(),
                                   torch.nn.Linear(500, 10))
    return f"MNIST FC batch {B}", lambda: mnist_fc(B), feeds, torch_model


def cnn_model(args):
    from jitgraph.models.mnist import mnist_cnn
    B = args.cnn_batch

    def feeds(n, seed):
        rng = np.random.default_rng(seed)
        return [{"x": rng.random((B, 1, 28, 28), dtype=np.float32),
                 "y": rng.integers(0, 10, B).astype(np.int32)} for _ in range(n)]

    def torch_model(torch):
        nn = torch.nn
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(784, 10))
    return f"MNIST CNN batch {B}", lambda: mnist_cnn(B), feeds, torch_model


def llama_model(args):
    from jitgraph.models.llama import LlamaConfig, llama_forward
    from jitgraph.models.text import byte_vocab
    V, B, S = len(byte_vocab()), 16, 128
    cfg = LlamaConfig(vocab=V, dim=128, layers=4, heads=4, ctx=S)

    def feeds(n, seed):
        rng = np.random.default_rng(seed)
        return [{"tokens": rng.integers(0, V, (B, S)).astype(np.int32),
                 "pos": np.arange(S, dtype=np.int32),
                 "labels": rng.integers(0, V, (B, S)).astype(np.int32)} for _ in range(n)]
    return (f"llama {cfg.layers}x{cfg.dim} ctx {S} batch {B}",
            lambda: llama_forward(cfg, B, S, labels=True), feeds, None)


MODELS = {"fc": fc_model, "cnn": cnn_model, "llama": llama_model}


def timed(step, data, warmup, steps, sync=lambda: None):
    for i in range(warmup):
        step(data[i % len(data)])
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        step(data[i % len(data)])
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


def check(args, jg, graph, feeds):
    """(ok, gpu program, cpu program, lines): the CUDA program against the CPU program."""
    opt = dict(loss="loss", optimizer=jg.optim.AdamW(lr=args.lr))
    t0 = time.perf_counter()
    gpu = jg.compile(graph(), target="cuda", **opt)
    compile_s = time.perf_counter() - t0
    cpu = jg.compile(graph(), **opt)
    st = gpu.stats()
    lines, ok = [f"compile (cuda): {compile_s:.1f} s, {st['calls_per_step']} launches per step, "
                 f"device {st['device']}"], True
    for s, feed in enumerate(feeds(args.check_steps, 1)):
        t0 = time.perf_counter()
        rg = gpu.step(**feed)
        first = time.perf_counter() - t0
        rc = cpu.step(**feed)
        d = abs(float(rg["loss"]) - float(rc["loss"]))
        good = d <= 1e-4 * max(1.0, abs(float(rc["loss"])))
        ok &= good
        lines.append(f"step {s + 1}: loss cuda {float(rg['loss']):.6f} cpu {float(rc['loss']):.6f}"
                     f" |diff| {d:.2e}"
                     f"{'' if s else f' (first step {first:.1f} s: kernel compiles)'}"
                     f"{'' if good else '  MISMATCH'}")
    worst = 0.0
    for k in cpu.params:
        a, b = gpu.params[k], cpu.params[k]
        # AdamW divides by sqrt(v): a near-zero gradient's rounding moves its param by up to
        # lr; compare against lr-sized steps, not the param's own size
        err = float(np.max(np.abs(a - b))) / (args.lr * args.check_steps)
        worst = max(worst, err)
        if err > 0.05:
            ok = False
            lines.append(f"param {k}: max |diff| {err:.2e} x (lr * steps)  MISMATCH")
    lines.append(f"params: max |diff| {worst:.2e} x (lr * steps) over {len(cpu.params)} params")
    return ok, gpu, cpu, lines


def torch_rows(args, torch_model, data):
    """[(system, ms/step or why not, note)] for PyTorch eager and torch.compile on the GPU."""
    try:
        import torch
    except ImportError:
        return [("pytorch", "not importable", "")]
    if not torch.cuda.is_available():
        return [("pytorch", "no CUDA device", "")]
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device("cuda")
    rows = []

    def stepper(model, opt):
        lossf = torch.nn.CrossEntropyLoss()

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = lossf(model(x), y)
            loss.backward()
            opt.step()
            return loss
        return step

    for name, mode in (("pytorch eager", None), ("torch.compile", "default"),
                       ("torch.compile reduce-overhead", "reduce-overhead")):
        try:
            torch.manual_seed(0)
            model = torch_model(torch).to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
            step = stepper(model, opt)
            if mode is not None:
                step = torch.compile(step, mode=mode)

            def run(feed, step=step):
                xt = torch.from_numpy(feed["x"]).to(dev)
                yt = torch.from_numpy(feed["y"]).to(dev, dtype=torch.long)
                return float(step(xt, yt))      # the loss comes down, as jitgraph's does
            t0 = time.perf_counter()
            run(data[0])
            cold = time.perf_counter() - t0
            rows.append((name, timed(run, data, args.warmup, args.steps, torch.cuda.synchronize),
                         f"first step {cold:.1f} s"))
        except Exception as e:    # noqa: BLE001 - a row that could not run says why
            rows.append((name, f"failed: {type(e).__name__}: {str(e)[:80]}", ""))
    return rows


def _how(prog) -> str:
    """The GEMM library and the CUDA-graph state of a cuda program (after its steps)."""
    st = prog.stats()
    gs = prog._products.driver.graph_stats
    return (f"{st['gemm_library']}; graphs {gs['mode']}: {gs['captures']} captured, "
            f"{gs['replays']} replays{'; fallback ' + gs['fallback'] if gs['fallback'] else ''}")


def _compiled_with(env, jg, graph):
    """The cuda training program compiled under the environment variables `env`."""
    import os
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return jg.compile(graph(), target="cuda", loss="loss",
                          optimizer=jg.optim.AdamW(lr=1e-3))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def table(title, rows):
    print(f"\n== {title} ==")
    print(f"  {'system':<32} {'ms/step':>10} {'vs cuda':>8}  note")
    base = rows[0][1]
    for name, ms, note in rows:
        if isinstance(ms, str):
            print(f"  {name:<32} {'-':>10} {'-':>8}  {ms}")
        else:
            print(f"  {name:<32} {ms:>10.3f} {ms / base:>7.2f}x  {note}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import jitgraph as jg
    t_all, all_ok = time.perf_counter(), True
    for key in args.models:
        title, graph, feeds, torch_model = MODELS[key](args)
        try:
            ok, gpu, cpu, lines = check(args, jg, graph, feeds)
        except NotImplementedError as e:
            print(f"\n== {title}: not lowered for cuda: {str(e)[:200]} ==")
            all_ok = False
            continue
        all_ok &= ok
        print(f"\n== correctness: {title}, {args.check_steps} AdamW steps, cuda vs cpu: "
              f"{'OK' if ok else 'FAILED'} ==")
        print("\n".join("  " + ln for ln in lines))
        data = feeds(8, 2)
        rows = [("jitgraph cuda", timed(lambda f: gpu.step(**f), data, args.warmup,
                                        args.steps), _how(gpu))]
        for env, label in (({"JITGRAPH_CUDA_GRAPHS": "0"}, "jitgraph cuda, plain launches"),
                           ({"JITGRAPH_CUDA_GEMM": "numba"}, "jitgraph cuda, numba GEMM")):
            try:
                other = _compiled_with(env, jg, graph)
                rows.append((label, timed(lambda f: other.step(**f), data, args.warmup,
                                          args.steps), _how(other)))
            except Exception as e:    # noqa: BLE001 - a row that could not run says why
                rows.append((label, f"failed: {type(e).__name__}: {str(e)[:80]}", ""))
        if not args.no_cpu_timing:
            rows.append(("jitgraph cpu", timed(lambda f: cpu.step(**f), data,
                                               min(args.warmup, 2), min(args.steps, 10)), ""))
        if not args.no_torch and torch_model is not None:
            rows += torch_rows(args, torch_model, data)
        table(f"{title} training step (batch uploaded every step; {args.steps} steps after "
              f"{args.warmup} warmup)", rows)
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s; correctness "
          f"{'OK' if all_ok else 'FAILED'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

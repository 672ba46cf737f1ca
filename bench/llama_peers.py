"""Training a llama from scratch (issue 17), jitgraph against PyTorch eager, torch.compile and JAX
(when installed), in one process on the same data: ms/step, val loss at the same steps, compile
time; jitgraph's compile time cold and warm in fresh processes.

    python bench/llama_peers.py [--text FILE] [--steps 50] [--eval-every N] [--layers 4]
                                [--block 10] [--threads N] [--check] [--torch-adam fused]
                                [--systems jitgraph,torch,torch-compile,jax] [--no-train]
                                [--no-compile-probe] [--probe-layers 4,12] [--finetune]
                                [--json PATH] [--log-dir DIR]

The model, data and hyperparameters of issue 17: byte vocabulary (256), width 128, 4 layers,
4 heads, feed-forward 352 (SwiGLU), context 128, batch 16; AdamW lr 1e-3, weight decay 0, betas
(0.9, 0.999), no schedule, no clipping; each framework's default initialisation, seed 0. The
text (default: ../shared/data/text/tinyshakespeare.txt) is split at byte int(0.9 * size):
training batches are random contiguous windows of the first 90 %, drawn once (seed 0) and fed
alike to every system; val loss is the mean over 20 fixed random batches of the tail 10 %.

The systems train side by side, taking turns every `--block` steps, so a change of load on the
machine hits all alike (each turn starts after a 0.1 s pause: SETTLE_S); ms/step is the median
of the steps after the first 3 (torch.compile's first step compiles; its compile time is that
step less the median), with its 25th percentile
and minimum, and the process's CPU time per step (median): with `--threads 1` that is the
step's time on a core of its own, whatever else the machine runs. The host's sgemm rate
(numpy's BLAS, 1024^3, median of 7) is printed with every table: on a shared machine it says
how fast the machine was at the time.

Compile probe (jitgraph only): `jg.compile` of the training program timed in a fresh process
with an empty JITGRAPH_CACHE_DIR ("cold"; numba's cache of the runtime library is warm: a first
cold probe runs untimed), then again in a fresh process on the filled cache ("warm start"), for
each of --probe-layers. It also counts the kernel modules the cache holds: identical layers
sharing their kernels makes that number independent of the depth.

--finetune adds stories260K (../shared/data/gguf/stories260K.gguf) finetuning step times,
LoRA (rank 8 on q, k, v, o) and full, jitgraph against PyTorch eager, when jitgraph has its
LoRA API (`jitgraph.lora`): medians, and the fastest steps (with their ratio) beside them, the
figure a neighbour's burst moves least (the LoRA row's median ratio read 2.4x-3.0x from run to
run on the shared 2-core host). Generation against llama.cpp (llama-cpp-python) runs only when
llama_cpp is installed.

PyTorch is not a jitgraph dependency: `pip install -e '.[peers]'` (or `pip install torch`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_TEXT = HERE.parent.parent / "shared" / "data" / "text" / "tinyshakespeare.txt"
DEFAULT_GGUF = HERE.parent.parent / "shared" / "data" / "gguf" / "stories260K.gguf"
CONFIG = dict(vocab=256, dim=128, layers=4, heads=4, ff=352, ctx=128)
BATCH, LR, BETAS, SEED, VAL_BATCHES = 16, 1e-3, (0.9, 0.999), 0, 20
# At each change of turn: the threads of the system that just ran spin-wait after its last
# step (PyTorch's OpenMP threads for ~10 ms, jitgraph's pool a moment), and on a 2-core host
# the next system's first steps waited for a core meanwhile (jitgraph's first full finetuning
# step after PyTorch's turn: 64 ms with 12 ms of it waiting, against 35 ms; PyTorch's first
# after jitgraph's 106-114 ms against 86-91). Neither happens in a run of one system alone.
SETTLE_S = 0.1


def _threads_from_argv(argv):
    """--threads N must act before jitgraph (and numba, OpenBLAS) load: JITGRAPH_NUM_THREADS."""
    if "--threads" in argv[:-1]:
        os.environ["JITGRAPH_NUM_THREADS"] = argv[argv.index("--threads") + 1]


_threads_from_argv(sys.argv)


def _import_torch():
    """torch before jitgraph, in the main process only: libgomp reads OMP_WAIT_POLICY once, when
    it loads, and one copy serves the process, so torch keeps its own default here, and jitgraph
    runs in a worker process of its own (Remote), whose pool is jitgraph's alone (sharing
    torch's runtime made jitgraph's 2-thread step 197 ms, not 122, when both pools spun)."""
    if os.environ.get("JITGRAPH_PEERS_WORKER"):
        return None
    try:
        import torch
        n = os.environ.get("JITGRAPH_NUM_THREADS", "")
        if n.isdigit() and int(n) > 0:
            torch.set_num_threads(int(n))
        return torch
    except ImportError:
        return None


TORCH = _import_torch()

import jitgraph as jg  # noqa: E402
from jitgraph.models.llama import LlamaConfig, llama_forward  # noqa: E402


# ---- data ------------------------------------------------------------------------------------
class Text:
    """Tokens (default: the bytes of the file at `path`) split at int(0.9 * length); batches of
    random contiguous windows [batch, ctx + 1] (tokens = [:, :-1], labels = [:, 1:])."""

    def __init__(self, path, ctx, batch, steps, seed=SEED, data=None):
        if data is None:
            data = np.frombuffer(Path(path).read_bytes(), np.uint8).astype(np.int32)
        cut = int(0.9 * len(data))
        self.train, self.val = data[:cut], data[cut:]
        if min(len(self.train), len(self.val)) <= ctx + 1:
            raise SystemExit(f"{path}: {len(data)} tokens is too short for context {ctx}")
        self.ctx, self.batch = ctx, batch
        rng = np.random.default_rng(seed)
        self.starts = rng.integers(0, len(self.train) - ctx - 1, (steps, batch))
        vrng = np.random.default_rng(seed + 1)
        self.val_batches = [self._windows(self.val, s) for s in
                            vrng.integers(0, len(self.val) - ctx - 1, (VAL_BATCHES, batch))]

    def _windows(self, data, starts):
        w = np.stack([data[s:s + self.ctx + 1] for s in starts])
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])

    def batch_at(self, step):
        return self._windows(self.train, self.starts[step])


# ---- the systems: each `make(cfg, batch)` returns an object with step(tokens, labels) -> loss,
# val_loss(batches) -> float and compile_s (None when it has no separate compile) ---------------
class Jitgraph:
    name = "jitgraph"

    def __init__(self, cfg, batch, params=None, lora_rank=None, seq=None):
        self.seq = seq or cfg.ctx
        g = llama_forward(cfg, batch, self.seq, labels=True)
        if lora_rank:
            g = jg.lora(g, "q,k,v,o", rank=lora_rank)
        opt = jg.optim.AdamW(lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=0.0)
        t = time.perf_counter()
        self.prog = jg.compile(g, loss="loss", optimizer=opt, seed=SEED, copy_outputs=False)
        self.compile_s = time.perf_counter() - t
        self.kernels = self.prog.stats().get("kernels")
        for k, v in (params or {}).items():
            self.prog.params[k] = v
        self.pos = np.arange(self.seq, dtype=np.int32)
        self.eval = self.prog.evaluator()

    def step(self, tokens, labels):
        return float(self.prog.step(tokens=tokens, labels=labels, pos=self.pos)["loss"])

    def val_loss(self, batches):
        # float() at once: with copy_outputs=False each output is a view the next run overwrites
        return float(np.mean([float(self.eval.run(tokens=t, labels=y, pos=self.pos)["loss"])
                              for t, y in batches]))


def torch_llama(torch, cfg, ctx=None):
    """The same llama in PyTorch: RMSNorm, bias-free projections, llama.cpp's NORM rope (adjacent
    pairs), causal scaled_dot_product_attention (GQA: query head h reads kv head h // (heads /
    kv_heads), as ggml), SwiGLU; PyTorch's default initialisation. `lora_rank` on the module
    (set_lora) adds LoRA adapters to q, k, v, o and freezes every other weight."""
    nn, F = torch.nn, torch.nn.functional
    d, h, hkv, hd, rd = cfg.dim, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.rope_dims
    ctx = ctx or cfg.ctx

    class Linear(nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            ab = self._modules.get("lora")
            return y if ab is None else y + ab[1](ab[0](x))

    lin = lambda i, o: Linear(i, o, bias=False)     # noqa: E731

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.ffn_norm = nn.RMSNorm(d, eps=cfg.rms_eps), \
                nn.RMSNorm(d, eps=cfg.rms_eps)
            self.q, self.o = lin(d, d), lin(d, d)
            self.k, self.v = lin(d, cfg.kv_dim), lin(d, cfg.kv_dim)
            self.gate, self.up, self.down = lin(d, cfg.ff), lin(d, cfg.ff), lin(cfg.ff, d)

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            a = self.attn_norm(x)

            def heads(t, n, rotate):
                t = t.view(b, s, n, hd)
                if rotate:
                    r0, r1 = t[..., 0:rd:2], t[..., 1:rd:2]
                    r = torch.stack((r0 * cos - r1 * sin, r0 * sin + r1 * cos), -1).flatten(-2)
                    t = r if rd == hd else torch.cat((r, t[..., rd:]), -1)
                return t.transpose(1, 2)
            att = F.scaled_dot_product_attention(
                heads(self.q(a), h, True), heads(self.k(a), hkv, True),
                heads(self.v(a), hkv, False), is_causal=True, enable_gqa=hkv != h)
            x = x + self.o(att.transpose(1, 2).reshape(b, s, d))
            f = self.ffn_norm(x)
            return x + self.down(F.silu(self.gate(f)) * self.up(f))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.norm = nn.RMSNorm(d, eps=cfg.rms_eps)
            self.out = None if cfg.tied else lin(d, cfg.vocab)
            ang = torch.arange(ctx)[:, None] * cfg.rope_base ** (-torch.arange(0, rd, 2) / rd)
            self.register_buffer("cos", torch.cos(ang)[:, None, :], persistent=False)
            self.register_buffer("sin", torch.sin(ang)[:, None, :], persistent=False)

        def forward(self, tokens, labels):
            x = self.embed(tokens)
            s = tokens.shape[1]
            for blk in self.blocks:
                x = blk(x, self.cos[:s], self.sin[:s])
            x = self.norm(x)
            logits = x @ self.embed.weight.T if self.out is None else self.out(x)
            return F.cross_entropy(logits.view(-1, cfg.vocab), labels.reshape(-1))

        def load_gguf_params(self, params):
            """Copy weights named and laid out as in GGUF (jitgraph's params) into the module."""
            names = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
            if self.out is not None:
                names["out.weight"] = "output.weight"
            for i in range(cfg.layers):
                for mine, theirs in (("attn_norm", "attn_norm"), ("ffn_norm", "ffn_norm"),
                                     ("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"),
                                     ("o", "attn_output"), ("gate", "ffn_gate"),
                                     ("up", "ffn_up"), ("down", "ffn_down")):
                    names[f"blocks.{i}.{mine}.weight"] = f"blk.{i}.{theirs}.weight"
            state = self.state_dict()
            with torch.no_grad():
                for k, v in names.items():
                    state[k].copy_(torch.from_numpy(np.asarray(params[v], np.float32)))

        def set_lora(self, rank):
            """PEFT-style adapters on q, k, v, o (A Kaiming-uniform, B zero); the rest frozen."""
            for p in self.parameters():
                p.requires_grad_(False)
            for blk in self.blocks:
                for m in (blk.q, blk.k, blk.v, blk.o):
                    a, b = nn.Linear(m.in_features, rank, bias=False), \
                        nn.Linear(rank, m.out_features, bias=False)
                    nn.init.zeros_(b.weight)
                    m.lora = nn.ModuleList([a, b])      # a submodule: trained, saved

    return Llama()


class Torch:
    name = "torch"
    compiled = False

    def __init__(self, cfg, batch, adam=None, params=None, lora_rank=None, seq=None):
        if TORCH is None:
            raise ImportError("torch is not installed (pip install -e '.[peers]')")
        torch = self.torch = TORCH
        torch.manual_seed(SEED)
        self.net = torch_llama(torch, cfg, seq)
        if params is not None:
            self.net.load_gguf_params(params)
        if lora_rank:
            self.net.set_lora(lora_rank)
        kw = {} if adam in (None, "default") else {adam: True}
        self.opt = torch.optim.AdamW([p for p in self.net.parameters() if p.requires_grad],
                                     lr=LR, betas=BETAS, weight_decay=0.0, **kw)
        self.fn = torch.compile(self.net) if self.compiled else self.net
        self.compile_s = None           # torch.compile compiles in the first step

    def step(self, tokens, labels):
        t = self.torch
        self.opt.zero_grad(set_to_none=True)
        loss = self.fn(t.from_numpy(tokens), t.from_numpy(labels).long())
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def val_loss(self, batches):
        t = self.torch
        with t.no_grad():     # the eager module: the same weights, no recompile for no_grad
            return float(np.mean([float(self.net(t.from_numpy(x), t.from_numpy(y).long()))
                                  for x, y in batches]))


class TorchCompile(Torch):
    name = "torch.compile"
    compiled = True


def _serve(conn, name, args):
    """Worker process of Remote: builds SYSTEMS[name](*args), then answers step / val_loss."""
    system = SYSTEMS[name](*args)
    conn.send((system.compile_s, getattr(system, "kernels", None)))
    while True:
        try:
            what, payload = conn.recv()
        except EOFError:            # the parent has gone
            return
        if what == "step":
            t, c = time.perf_counter(), time.process_time()
            loss = system.step(*payload)
            conn.send((loss, time.perf_counter() - t, time.process_time() - c))
        elif what == "val_loss":
            conn.send(system.val_loss(payload))
        else:
            return


class Remote:
    """A system in a process of its own (spawned, without torch: see _import_torch), timed there;
    the parent sends it the same batches, so it still takes turns with the others."""

    def __init__(self, name, *args):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.name, (self._conn, child) = SYSTEMS[name].name, ctx.Pipe()
        os.environ["JITGRAPH_PEERS_WORKER"] = "1"    # the child's copy of this module skips torch
        try:
            self._proc = ctx.Process(target=_serve, args=(child, name, args), daemon=True)
            self._proc.start()
        finally:
            del os.environ["JITGRAPH_PEERS_WORKER"]
        self.compile_s, self.kernels = self._conn.recv()

    def timed_step(self, tokens, labels):
        self._conn.send(("step", (tokens, labels)))
        return self._conn.recv()

    def val_loss(self, batches):
        self._conn.send(("val_loss", batches))
        return self._conn.recv()

    def close(self):
        self._conn.send(("close", None))
        self._proc.join(10)


def close_all(systems):
    """Close the Remote systems and wait for their processes to end: a worker left to exit
    when its pipe is collected tears its interpreter down (~0.4 s of a core) while the next
    row's worker runs its first steps, and that worker's blas.adapt() took the contention for a
    busy machine (its GEMMs on one thread for the rest of the row: full finetuning 30 -> 44-49
    ms a step)."""
    for s in systems:
        if hasattr(s, "close"):
            s.close()


def _jax_unavailable(cfg, batch):
    try:
        import jax  # noqa: F401
    except ImportError:
        raise ImportError("jax is not installed") from None
    raise ImportError("jax is installed, but this script has no JAX llama yet")


SYSTEMS = {"jitgraph": Jitgraph, "torch": Torch, "torch-compile": TorchCompile,
           "jax": _jax_unavailable}


def check_same_model(cfg, text):
    """PyTorch's llama given jitgraph's initial weights computes jitgraph's loss."""
    if TORCH is None:
        print("check: skipped (torch is not installed)")
        return
    jgs = Jitgraph(cfg, BATCH)
    params = {k: np.array(v) for k, v in jgs.prog.params.items()}
    ts = Torch(cfg, BATCH, params=params)
    a, b = jgs.val_loss(text.val_batches[:2]), ts.val_loss(text.val_batches[:2])
    print(f"check: val loss with jitgraph's initial weights: jitgraph {a:.6f}, torch {b:.6f}")
    if not abs(a - b) <= 1e-4 * abs(b):
        raise SystemExit("check FAILED: the PyTorch model is not jitgraph's model")


# ---- timing ----------------------------------------------------------------------------------
def sgemm():
    from jitgraph.cli.roofline import sgemm_gflops
    return sgemm_gflops()


def train_side_by_side(systems, text, steps, eval_at, block, logs=None):
    """Every system trains `steps` steps on the same batches, taking turns every `block` steps.
    Returns {name: {"times": [s per step], "loss": [...], "val": {step: val loss}}}. `logs`:
    {name: jitgraph.formats.runlog.RunLog} given a step and an eval record as they happen."""
    logs = logs or {}
    tokens = BATCH * text.ctx                         # tokens a step trains on
    res = {s.name: {"times": [], "cpu": [], "loss": [], "val": {}} for s in systems}
    done = 0
    while done < steps:
        n = min(block, steps - done)
        for s in systems:
            r = res[s.name]
            if len(systems) > 1:
                time.sleep(SETTLE_S)    # the other system's threads stop spinning first
            for i in range(done, done + n):
                tok, lab = text.batch_at(i)
                if hasattr(s, "timed_step"):            # Remote: timed in its process
                    loss, wall, cpu = s.timed_step(tok, lab)
                else:
                    t, c = time.perf_counter(), time.process_time()
                    loss = s.step(tok, lab)
                    wall, cpu = time.perf_counter() - t, time.process_time() - c
                r["loss"].append(loss)
                r["times"].append(wall)
                r["cpu"].append(cpu)
                log = logs.get(s.name)
                if log:
                    log.step(i + 1, loss, lr=LR, ms=wall * 1e3, tokens_per_s=tokens / wall,
                             tokens=tokens * (i + 1))
                if i + 1 in eval_at:
                    r["val"][i + 1] = s.val_loss(text.val_batches)
                    if log:
                        v = r["val"][i + 1]
                        log.eval(i + 1, v, perplexity=float(np.exp(v)) if v < 709 else None)
        done += n
    return res


def _steady(xs):
    """The steps after the first 3 (warm-up, torch.compile's compile), or all when fewer."""
    return xs[3:] or xs


def _table(header, rows):
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa
    return "\n".join([fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *map(fmt, rows)])


def training_table(systems, res, eval_at, gflops_before, gflops_after):
    base = next((statistics.median(_steady(res[s.name]["times"])) for s in systems
                 if s.name == "torch"), None)
    rows = []
    for s in systems:
        r = res[s.name]
        times = _steady(r["times"])
        med = statistics.median(times)
        comp = s.compile_s
        if comp is None and s.name == "torch.compile":
            comp = r["times"][0] - med
        p25 = float(np.percentile(times, 25))
        cpu = statistics.median(_steady(r["cpu"]))
        rows.append([s.name, f"{med * 1e3:.1f}", f"{p25 * 1e3:.1f}", f"{min(times) * 1e3:.1f}",
                     f"{cpu * 1e3:.1f}",
                     f"{base / med:.2f}x" if base else "-",
                     "-" if comp is None else f"{comp:.1f}",
                     *(f"{r['val'][k]:.4f}" for k in sorted(eval_at)),
                     f"{r['loss'][-1]:.4f}"])
    head = ["system", "ms/step (median)", "p25", "min", "CPU ms/step", "vs torch eager",
            "compile s",
            *(f"val loss @{k}" for k in sorted(eval_at)), "last train loss"]
    return (f"sgemm {gflops_before:.0f} GFLOP/s before, {gflops_after:.0f} after\n"
            + _table(head, rows))


# ---- the compile probe ------------------------------------------------------------------------
def probe_main(layers):
    """Child process: build and compile the training program, print one JSON line."""
    t0 = time.perf_counter()
    cfg = LlamaConfig(**{**CONFIG, "layers": layers})
    g = llama_forward(cfg, BATCH, cfg.ctx, labels=True)
    t1 = time.perf_counter()
    opt = jg.optim.AdamW(lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=0.0)
    prog = jg.compile(g, loss="loss", optimizer=opt, seed=SEED, copy_outputs=False)
    t2 = time.perf_counter()
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.vocab, (BATCH, cfg.ctx), dtype=np.int32)
    prog.step(tokens=tok, labels=tok, pos=np.arange(cfg.ctx, dtype=np.int32))
    t3 = time.perf_counter()
    st = prog.stats()
    print(json.dumps({"layers": layers, "build_s": t1 - t0, "compile_s": t2 - t1,
                      "first_step_s": t3 - t2, "kernels": st.get("kernels"),
                      "numba_s": st.get("numba_seconds"), "stages_s": st.get("stage_seconds"),
                      "kernels_compiled": st.get("kernels_compiled"),
                      "driver_cached": st.get("driver_cached")}))


def _probe(layers, cache):
    env = {**os.environ, "JITGRAPH_CACHE_DIR": str(cache)}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--_probe", str(layers)], env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - t
    if out.returncode:
        raise RuntimeError(f"compile probe ({layers} layers) failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["process_s"] = wall
    files = list(Path(cache).rglob("*.py"))
    r["modules"] = len(files)
    r["kernel_modules"] = sum(f.name.startswith("k_") for f in files)
    return r


def compile_probe(layer_counts):
    rows, out = [], []
    with tempfile.TemporaryDirectory(prefix="llama-peers-") as tmp:
        _probe(layer_counts[0], Path(tmp) / "untimed")      # numba's runtime-library cache warm
        for n in layer_counts:
            cache = Path(tmp) / f"l{n}"
            cold = _probe(n, cache)
            warm = _probe(n, cache)
            out.append({"layers": n, "cold": cold, "warm": warm})
            passes = sum((cold.get("stages_s") or {}).values())
            rows.append([n, cold["kernels"], cold["kernel_modules"], f"{cold['compile_s']:.1f}",
                         f"{passes:.1f}", f"{cold.get('numba_s') or 0:.1f}",
                         f"{cold['first_step_s']:.2f}", f"{warm['compile_s']:.2f}",
                         f"{warm['first_step_s']:.2f}", f"{warm['process_s']:.1f}"])
    head = ["layers", "kernels", "kernel modules", "cold compile s", "passes s", "numba s",
            "cold 1st step s",
            "warm compile s", "warm 1st step s", "warm process s"]
    return out, _table(head, rows)


# ---- finetuning stories260K (LoRA and full), when jitgraph.lora exists --------------------------
FT_BATCH, FT_SEQ, FT_RANK = 16, 128, 8          # issue 18: batch 16 windows of 128 (+1)


def finetune_rows(steps, text_path, block):
    """stories260K finetuning step times on the text tokenized by its own tokenizer: LoRA (rank
    8 on q, k, v, o; PEFT init: A uniform, B zero) and full finetuning, jitgraph against PyTorch
    eager from the same weights (their first losses agree: the same model)."""
    if not hasattr(jg, "lora"):
        return None, "finetune: skipped (jitgraph has no LoRA API, jg.lora, yet)"
    if not DEFAULT_GGUF.exists():
        return None, f"finetune: skipped ({DEFAULT_GGUF} not found)"
    if TORCH is None:
        return None, "finetune: skipped (torch is not installed)"
    from jitgraph.models.llama import read_llama
    cfg, params, tok = read_llama(DEFAULT_GGUF)
    ids = np.asarray(tok.encode(Path(text_path).read_text(encoding="utf-8")[:200_000]), np.int32)
    text = Text(text_path, FT_SEQ, FT_BATCH, steps, data=ids)
    rows, out = [], {}
    gflops = sgemm()
    for mode, rank in (("lora r8 q,k,v,o", FT_RANK), ("full", None)):
        systems = [Remote("jitgraph", cfg, FT_BATCH, params, rank, FT_SEQ),
                   Torch(cfg, FT_BATCH, None, params, rank, FT_SEQ)]
        first = [s.val_loss(text.val_batches[:1]) for s in systems]
        res = train_side_by_side(systems, text, steps, set(), block)
        close_all(systems)
        ms = [statistics.median(_steady(res[s.name]["times"])) * 1e3 for s in systems]
        cpu = [statistics.median(_steady(res[s.name]["cpu"])) * 1e3 for s in systems]
        best = [min(_steady(res[s.name]["times"])) * 1e3 for s in systems]
        out[mode] = {"jitgraph_ms": ms[0], "torch_ms": ms[1], "jitgraph_cpu_ms": cpu[0],
                     "torch_cpu_ms": cpu[1], "jitgraph_min_ms": best[0], "torch_min_ms": best[1],
                     "first_loss": first,
                     "last_loss": [res[s.name]["loss"][-1] for s in systems]}
        rows.append([mode, f"{ms[0]:.1f}", f"{ms[1]:.1f}", f"{ms[1] / ms[0]:.2f}x",
                     f"{best[0]:.1f} / {best[1]:.1f} ({best[1] / best[0]:.2f}x)",
                     f"{cpu[0]:.1f} / {cpu[1]:.1f}",
                     f"{first[0]:.4f} / {first[1]:.4f}",
                     f"{res['jitgraph']['loss'][-1]:.4f} / {res['torch']['loss'][-1]:.4f}"])
    head = ["stories260K finetune", "jitgraph ms/step", "torch eager ms/step", "speedup",
            "min ms (jg / torch)", "CPU ms/step (jg / torch)",
            "loss before (jg / torch)", f"train loss @{steps} (jg / torch)"]
    return out, (f"\nfinetuning stories260K, batch {FT_BATCH} x {FT_SEQ} tokens, {steps} steps\n"
                 f"sgemm {gflops:.0f} GFLOP/s\n" + _table(head, rows))


def generation_rows():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None, "generation vs llama.cpp: skipped (llama-cpp-python is not installed)"
    return None, "generation vs llama.cpp: llama-cpp-python is installed, but not wired here yet"


# ---- main ---------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=None,
                    help="val loss every N steps (default: at the last step only)")
    ap.add_argument("--layers", type=int, default=CONFIG["layers"])
    ap.add_argument("--block", type=int, default=10, help="steps per turn")
    ap.add_argument("--systems", default="jitgraph,torch,torch-compile,jax")
    ap.add_argument("--torch-adam", choices=("default", "foreach", "fused"), default="default",
                    help="PyTorch AdamW implementation (default: PyTorch's own choice)")
    ap.add_argument("--threads", type=int, help="threads for every system (default: all cores; "
                    "sets JITGRAPH_NUM_THREADS and torch.set_num_threads)")
    ap.add_argument("--no-train", action="store_true", help="only the compile probe")
    ap.add_argument("--no-compile-probe", action="store_true")
    ap.add_argument("--probe-layers", default="4,12")
    ap.add_argument("--finetune", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="first: the PyTorch model given jitgraph's initial weights must compute "
                         "jitgraph's loss (the same model)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--log-dir", metavar="DIR",
                    help="write a run log per system trained, DIR/<system>.jsonl (the format of "
                         "`jitgraph train --log`: `jitgraph plot DIR/*.jsonl` compares them)")
    ap.add_argument("--_probe", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._probe is not None:
        return probe_main(args._probe)
    report = {"config": {**CONFIG, "layers": args.layers, "batch": BATCH, "lr": LR,
                         "betas": BETAS, "weight_decay": 0.0, "seed": SEED},
              "torch": getattr(TORCH, "__version__", None),
              "torch_threads": TORCH.get_num_threads() if TORCH else None,
              "jitgraph_threads": os.environ.get("JITGRAPH_NUM_THREADS") or os.cpu_count()}
    print(f"llama {report['config']}; jitgraph {report['jitgraph_threads']} threads, torch "
          f"{report['torch']} ({report['torch_threads']} threads)")
    if not args.no_train:
        if not Path(args.text).exists():
            raise SystemExit(f"{args.text}: no such file (give --text FILE)")
        cfg = LlamaConfig(**{**CONFIG, "layers": args.layers})
        text = Text(args.text, cfg.ctx, BATCH, args.steps)
        every = args.eval_every or args.steps
        eval_at = set(range(every, args.steps + 1, every)) | {args.steps}
        if args.check:
            check_same_model(cfg, text)
        systems = []
        for name in args.systems.split(","):
            if name not in SYSTEMS:
                raise SystemExit(f"--systems: unknown {name!r}; known: {', '.join(SYSTEMS)}")
            make = SYSTEMS[name]
            try:
                systems.append(make(cfg, BATCH, args.torch_adam) if name.startswith("torch")
                               else Remote(name, cfg, BATCH) if name == "jitgraph"
                               else make(cfg, BATCH))
            except ImportError as e:
                print(f"{name}: skipped ({e})")
        logs = {}
        if args.log_dir:
            from jitgraph.formats.runlog import RunLog
            os.makedirs(args.log_dir, exist_ok=True)
            logs = {s.name: RunLog(Path(args.log_dir) / f"{s.name}.jsonl",
                                   f"bench/llama_peers.py {s.name}",
                                   options={**CONFIG, "layers": args.layers, "batch": BATCH,
                                            "lr": LR, "steps": args.steps})
                    for s in systems}
        before = sgemm()
        res = train_side_by_side(systems, text, args.steps, eval_at, args.block, logs)
        for log in logs.values():
            log.close()
        close_all(systems)
        after = sgemm()
        print(f"\ntraining, {args.steps} steps on {Path(args.text).name} "
              f"(torch AdamW: {args.torch_adam})")
        print(training_table(systems, res, eval_at, before, after))
        report["training"] = {"sgemm_gflops": [before, after], "systems": {
            s.name: {"ms_median": statistics.median(_steady(res[s.name]["times"])) * 1e3,
                     "compile_s": s.compile_s, "val": res[s.name]["val"],
                     "times_ms": [t * 1e3 for t in res[s.name]["times"]],
                     "cpu_ms": [t * 1e3 for t in res[s.name]["cpu"]],
                     "kernels": getattr(s, "kernels", None)} for s in systems}}
    if not args.no_compile_probe:
        g0 = sgemm()
        probe, table = compile_probe([int(n) for n in args.probe_layers.split(",")])
        print(f"\njitgraph compile (fresh processes; cold = empty JITGRAPH_CACHE_DIR)\n"
              f"sgemm {g0:.0f} GFLOP/s\n{table}")
        report["compile"] = probe
    for part, (rows, msg) in (("finetune", finetune_rows(args.steps, args.text, args.block)
                               if args.finetune else (None, None)),
                              ("generation", generation_rows())):
        if msg:
            print(f"\n{msg}")
        if rows is not None:
            report[part] = rows
    if args.json:
        tmp = Path(args.json).with_name(Path(args.json).name + ".tmp")     # atomic
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

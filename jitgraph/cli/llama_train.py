"""`jitgraph train llama`, `jitgraph finetune` and `jitgraph dump llama`: training llama models on
text with compiled kernels.

Both training commands share one loop (LMTrainer, _fit): random windows of ctx + 1 tokens from
the first 90 % of the text's bytes, validation on 20 fixed batches of windows from the last 10 %
(jitgraph.models.text), AdamW, gradient accumulation (--logical-batch), gradient checkpointing
(--recompute), a progress bar, and resumable checkpoints. `finetune --epochs N` runs
llama.cpp's workflow instead (_fit_epochs, on the core's jitgraph.training.fit): every window
of ctx tokens of the whole text at a stride of ctx/2, in order, the last --val-split of them
validating after each epoch, ggml-opt's loss and accuracy with their uncertainties, AdamW or
SGD, llama.cpp's per-epoch exponential learning-rate decay; one process only. Ctrl-C and
SIGTERM are deferred to the end of the running step: the checkpoint (and for finetune the
output) is saved, then the command exits 130 / 143.

A llama training checkpoint (jitgraph/formats/llama_checkpoint.py) holds the options that shape
the run, the program's call count, the window sampler's RNG state (--epochs: the epoch and the
windows done in it), the step and the loss curve besides the params and the optimizer state.
Resuming restores all of it, so k steps, a checkpoint and N - k more steps give bitwise the
params of N steps straight.

Under `mpiexec -n N` both commands train data-parallel (jitgraph/distributed.py, as `train
mnist-fc` does): --batch-size (and --logical-batch) stay the global batch, every rank draws the
same global windows from the same seed and runs its 1/N slice of each batch (World.shard) in a
program compiled for batch / N whose update hook averages the gradients across the ranks; the
training and validation losses are averaged across the ranks, so one command trains the same
model (within float reassociation) whatever N. Rank 0 alone prints, shows the progress bar and
writes files (model, adapter, checkpoint; atomically); a checkpoint resumes with any N. Ranks
compile one after the other (rank 0 first, into the kernel cache). A rank's error aborts the
whole job with its message. Ctrl-C / SIGTERM: the ranks agree after each step whether any of
them got one, so all stop after the same step, rank 0 saves, and the job exits 130 / 143.
finetune's perplexity before and after is computed by rank 0 alone (the other ranks wait for it
at the next collective): the simplest correct choice, the same figures as without MPI. --json
adds mpi_ranks, allreduce_seconds (rank 0's time in the gradient all-reduce, waits for slower
ranks included) and param_checks (JITGRAPH_MPI_CHECK=N: the params hashed across the ranks
after each optimizer step whose count of compiled steps is a multiple of N).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import signal
import sys
import time

import numpy as np

from ..formats.llama_checkpoint import load_llama_checkpoint, save_llama_checkpoint
from ..lora import SHORTHANDS
from .common import (EXIT_INTERRUPT, EXIT_TERMINATED, Run, Terminated, add_compile_flags,
                     add_ftype, add_precision_flag, add_threads_flag, adopt_resumed,
                     apply_threads, check_model_file, check_outputs, compile_progress,
                     compile_target, f32_weights, float_in, int_at_least, loss_scale,
                     note_unsaved, restore_scale, resume_precision, say, scale_line, scale_meta,
                     scale_summary, stored_weights, warn)
from .logs import add_log_option, open_log

VAL_BATCHES = 20
# `train llama` options a checkpoint records: --resume continues with these
TRAIN_RESUMED = ("text", "vocab", "dim", "layers", "heads", "kv_heads", "ff", "ctx",
                 "batch_size", "logical_batch", "lr", "weight_decay", "seed", "recompute",
                 "no_fuse", "no_plan", "loss_scale", "loss_scale_interval", "moments",
                 "master")
FINETUNE_RESUMED = ("text", "full", "lora_rank", "lora_alpha", "lora_targets", "ctx",
                    "batch_size", "logical_batch", "lr", "weight_decay", "seed", "recompute",
                    "no_fuse", "no_plan", "optimizer", "val_split", "lr_min", "decay_epochs",
                    "loss_scale", "loss_scale_interval", "moments", "master")
# finetune's options of llama.cpp's workflow, which need --epochs
EPOCH_ONLY = ("val_split", "lr_min", "decay_epochs")
VAL_SPLIT = 0.05                   # --val-split's default with --epochs (llama-finetune's)
# --lora-targets names -> the projection's GGUF tensor name part (q k v o gate up down)
LORA_TARGETS = SHORTHANDS
# the model `train llama` builds by default (the training target) and `dump llama` shows
DEFAULTS = {"dim": 128, "layers": 4, "heads": 4, "kv_heads": None, "ff": None, "ctx": 128,
            "batch_size": 16}


# ---- option types ------------------------------------------------------------------------------
_SUFFIX = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def recompute_spec(text):
    """--recompute: "sqrt", "budget:BYTES" (a K/M/G suffix allowed), "budget:F" (0 < F <= 1, a
    fraction of the arena without recomputation) or "none" -> compile's checkpoint= value."""
    t = str(text).strip().lower()
    if t in ("none", "off"):
        return None
    if t == "sqrt":
        return "sqrt"
    if t.startswith("budget:"):
        v = t[len("budget:"):]
        try:
            if v[-1:] in _SUFFIX:
                n = int(float(v[:-1]) * _SUFFIX[v[-1]])
            elif "." in v or "e" in v:
                f = float(v)
                if 0 < f <= 1:
                    return f"budget:{f!r}"
                n = 0
            else:
                n = int(v)
            if n >= 1:
                return f"budget:{n}"
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(
        f"expected sqrt, budget:BYTES (e.g. budget:64M) or budget:F (0 < F <= 1, a fraction of "
        f"the arena without recomputation), got {text!r}")


recompute_spec.__name__ = "recomputation policy"


def vocab_spec(text):
    """--vocab: "byte" (jitgraph.models.text.byte_vocab) or a vocabulary size >= 260 learned
    from the training text (jitgraph.models.tokenizer.build_vocab)."""
    if str(text).strip().lower() == "byte":
        return "byte"
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < 260:
        raise argparse.ArgumentTypeError(f"expected 'byte' or a vocabulary size >= 260 (<unk> "
                                         f"<s> </s>, 256 byte tokens and \u2581), got {text!r}")
    return n


vocab_spec.__name__ = "vocabulary"


def targets_spec(text):
    """--lora-targets: comma-separated names among q,k,v,o,gate,up,down -> a sorted tuple."""
    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    bad = [t for t in names if t not in LORA_TARGETS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated names among "
                                         f"{','.join(LORA_TARGETS)}, got {text!r}")
    return ",".join(t for t in LORA_TARGETS if t in names)


targets_spec.__name__ = "projection list"


def lora_weights(desc, spec: str, say) -> tuple:
    """--lora-targets roles -> the layer weights of architecture `desc` that get adapters
    (names ending in .weight, so a bias beside a weight is never matched). A role computed by
    a fused weight adapts all of it: llama.cpp's adapter format has no per-part form; `say`
    is told which roles that adapter covers."""
    roles = spec.split(",")
    out = []
    for role in roles:
        w = desc.weight_of(role)
        if w in out:
            continue
        out.append(w)
        shared = desc.fused_roles(w)
        if len(shared) > 1:
            say(f"note: on {desc.name}, {role} is part of the fused {w[:-len('.weight')]} "
                f"(roles {','.join(shared)}): the adapter covers the whole fused weight "
                f"(llama.cpp's adapter format has no per-part form)")
    return tuple(out)


# ---- parsers -----------------------------------------------------------------------------------
def _loop_options(p, steps):
    p.add_argument("--text", metavar="FILE",
                   help="UTF-8 text to train on: its first 90 %% of bytes train, the last 10 %% "
                        "validate; default: the tiny-shakespeare slice shipped with jitgraph "
                        "(262 KB, public domain)")
    p.add_argument("--batch-size", type=int_at_least(1), default=DEFAULTS["batch_size"],
                   metavar="B", help="windows per compiled step")
    p.add_argument("--logical-batch", type=int_at_least(1), default=None, metavar="L",
                   help="windows per optimizer step, a multiple of --batch-size (gradient "
                        "accumulation over L/B compiled steps); default: the batch size")
    p.add_argument("--steps", type=int_at_least(1), default=steps, metavar="N",
                   help="optimizer steps in all (with --resume: counting the checkpoint's)")
    p.add_argument("--lr", type=float_in(0, lo_open=True), default=1e-3,
                   help="learning rate (constant; finetune --epochs with --lr-min: the first "
                        "epoch's)")
    p.add_argument("--weight-decay", type=float_in(0), default=0.0, metavar="WD",
                   help="decoupled weight decay: w * (1 - lr * WD) before the update (AdamW, "
                        "and SGD as ggml's)")
    p.add_argument("--eval-every", type=int_at_least(1), default=100, metavar="N",
                   help="validate every N steps and at the end: the mean loss of --val-batches "
                        "fixed batches of held-out windows")
    p.add_argument("--val-batches", type=int_at_least(1), default=VAL_BATCHES, metavar="N",
                   help=f"held-out batches each validation runs (a forward pass each); default "
                        f"{VAL_BATCHES}")
    p.add_argument("--recompute", type=recompute_spec, default=None, metavar="POLICY",
                   help="gradient checkpointing: sqrt, budget:BYTES (e.g. budget:64M) or "
                        "budget:F (a fraction of the arena without it); default: keep every "
                        "activation")
    p.add_argument("--seed", type=int_at_least(0), default=0, metavar="S",
                   help="seed of the initial weights, the training windows and the validation "
                        "windows")
    p.add_argument("--checkpoint", metavar="CKPT.gguf",
                   help="save a resumable training checkpoint every --save-every steps, at the "
                        "end and on Ctrl-C; default: none")
    p.add_argument("--save-every", type=int_at_least(1), default=100, metavar="N",
                   help="steps between saves")
    p.add_argument("--resume", metavar="CKPT.gguf",
                   help="continue a checkpointed run bit for bit, with the checkpoint's "
                        "training options; default: start afresh")
    add_log_option(p)
    add_threads_flag(p)
    add_compile_flags(p)
    add_precision_flag(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar and no per-evaluation lines")


def add_train_llama(p):
    """The options of `jitgraph train llama` on parser `p`."""
    d = DEFAULTS
    p.add_argument("--vocab", type=vocab_spec, default="byte", metavar="byte|N",
                   help="byte: one token per byte (354 tokens, SentencePiece format); N: a "
                        "vocabulary of N tokens learned from the training text by BPE")
    p.add_argument("--dim", type=int_at_least(2), default=d["dim"], metavar="D",
                   help="model width (embedding length)")
    p.add_argument("--layers", type=int_at_least(1), default=d["layers"], metavar="N",
                   help="transformer blocks")
    p.add_argument("--heads", type=int_at_least(1), default=d["heads"], metavar="H",
                   help="attention heads (the head size D/H must be even, for rope)")
    p.add_argument("--kv-heads", type=int_at_least(1), default=None, metavar="H",
                   help="key/value heads, dividing --heads (grouped-query attention); default: "
                        "--heads")
    p.add_argument("--ff", type=int_at_least(1), default=None, metavar="F",
                   help="feed-forward width; default: llama's 8D/3 rounded up to 32 (352 for "
                        "width 128)")
    p.add_argument("--ctx", type=int_at_least(2), default=d["ctx"], metavar="C",
                   help="context: tokens per training window (and the model's context length)")
    _loop_options(p, steps=1000)
    p.add_argument("--out", metavar="MODEL.gguf",
                   help="write the trained model, with its tokenizer, as a llama.cpp GGUF; "
                        "default: not saved")
    add_ftype(p, "the weight matrices of --out (norms stay f32)")
    p.set_defaults(fn=train_llama, parser=p)


def add_finetune(p):
    """The options of `jitgraph finetune` on parser `p`."""
    p.add_argument("base", metavar="BASE.gguf",
                   help="the llama model to finetune (llama.cpp's GGUF layout, with its "
                        "tokenizer)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--lora-rank", type=int_at_least(1), default=None, metavar="R",
                     help="train LoRA adapters of rank R on a frozen base; the output is a "
                          "llama.cpp LoRA adapter GGUF")
    how.add_argument("--full", action="store_true",
                     help="train every weight; the output is a complete model GGUF")
    p.add_argument("--lora-alpha", type=float_in(0, lo_open=True), default=None, metavar="A",
                   help="LoRA scale alpha (the update is alpha/R * B A x); default: R")
    p.add_argument("--lora-targets", type=targets_spec, default="q,v", metavar="LIST",
                   help=f"projections that get adapters, among {','.join(LORA_TARGETS)}")
    p.add_argument("--ctx", type=int_at_least(2), default=128, metavar="C",
                   help="tokens per training window and per perplexity chunk")
    _loop_options(p, steps=300)
    e = p.add_argument_group("llama.cpp's workflow (llama-finetune's data set, epochs and "
                             "schedule)")
    e.add_argument("--epochs", type=int_at_least(1), default=None, metavar="N",
                   help="train N epochs over every window of --ctx tokens of the whole text at "
                        "a stride of ctx/2 (llama.cpp's data set), in order; the last "
                        "--val-split of the windows validate after each epoch; not with --steps")
    e.add_argument("--val-split", type=float_in(0, 1, hi_open=True), default=None, metavar="F",
                   help=f"with --epochs: the last fraction F of the windows validate "
                        f"(default {VAL_SPLIT})")
    e.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="adamw (ggml's: beta1 0.9, beta2 0.999, eps 1e-8) or sgd (no momentum)")
    e.add_argument("--lr-min", type=float_in(0, lo_open=True), default=None, metavar="LR",
                   help="with --epochs: decay the learning rate exponentially per epoch from "
                        "--lr to LR (llama.cpp's -lr-min); default: constant")
    e.add_argument("--decay-epochs", type=float_in(0, lo_open=True), default=None, metavar="E",
                   help="with --lr-min: reach it after E epochs (llama.cpp's -decay-epochs); "
                        "default: --epochs")
    p.add_argument("--ppl-chunks", type=int_at_least(2), default=None, metavar="N",
                   help="score at most N chunks of the held-out split in the perplexity before "
                        "and after (faster, less precise); default: every chunk")
    p.add_argument("--no-ppl", action="store_true",
                   help="skip the perplexity before and after")
    p.add_argument("--out", metavar="OUT.gguf", required=True,
                   help="the adapter (--lora-rank) or the model (--full), saved every "
                        "--save-every steps, at the end and on Ctrl-C")
    add_ftype(p, "the adapter's tensors (--lora-rank: convert_lora_to_gguf.py's --outtype) or "
                 "the model's weight matrices (--full)")
    p.set_defaults(fn=finetune, parser=p)


def add_dump_options(p):
    """`jitgraph dump llama`'s own option (the dump parser is shared with the MNIST models)."""
    p.add_argument("--program", choices=("train", "prefill", "decode"), default="train",
                   help="llama only: the training step, or generation's prompt (prefill) or "
                        "one-token (decode) program")
    p.add_argument("--layers", type=int_at_least(1), default=None, metavar="N",
                   help="llama only: transformer blocks (default: 4, or the --gguf model's)")
    p.add_argument("--gguf", metavar="MODEL.gguf",
                   help="llama only: the architecture of this model (its metadata: width, "
                        "heads, vocabulary; context at most 128 tokens); default: `train "
                        "llama`'s default model")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- the loop ----------------------------------------------------------------------------------
class LMTrainer:
    """A training program over token windows: the sampler of training windows, the fixed
    validation windows, the optimizer step count.

    `batch_size` is the global batch. With `world` (a jitgraph.distributed.World) `program` is
    compiled for batch_size / world.size windows with hook=world.hook: every rank draws the
    same global windows and runs its slice (`rows`) of each batch, and the losses returned are
    averaged across the ranks."""

    def __init__(self, program, train, val, *, batch_size, accumulate=1, seed=0,
                 val_batches=VAL_BATCHES, world=None):
        from ..models.text import WindowSampler, fixed_starts
        self.program, self.train, self.val = program, train, val
        self.accumulate = int(accumulate)
        self.world = world
        # this rank's rows of every global batch (all of them without MPI)
        self.rows = None if world is None else world.shard(np.arange(batch_size))
        self.sampler = WindowSampler(train, batch_size, seed)
        self.val_starts = fixed_starts(val, batch_size, val_batches, seed)
        self.pos = np.arange(train.length - 1, dtype=np.int32)
        self.step = 0                      # optimizer steps done
        self.window = []                   # training losses since the last evaluation
        # runs in the training program's arena, dead between steps (its losses are read at once)
        self.evaluator = program.evaluator(share_memory=True)
        self.tokens_per_step = self.accumulate * batch_size * (train.length - 1)

    def train_step(self) -> float:
        """One optimizer step (`accumulate` compiled steps that applied); the mean of their
        losses (over the ranks too, under MPI). A compiled step skipped as not finite (f16
        loss scaling: the scaler halved its scale) is not counted: the next batch of windows
        takes its place (under MPI every rank skips the same steps: the guard reads the
        all-reduced gradients)."""
        total, done = 0.0, 0
        while done < self.accumulate:
            if self.world is None:
                x, y = self.sampler.next()
            else:
                x, y = self.train.batch(self.sampler.next_starts()[self.rows])
            loss = float(self.program.step(tokens=x, pos=self.pos, labels=y)["loss"])
            if self.program.last_skipped:
                continue        # not finite (f16 loss scaling): dropped, the next batch instead
            total += loss
            done += 1
        self.step += 1
        if self.world is None:
            return total / self.accumulate
        self.world.maybe_check(self.program)
        return self.world.mean(total / self.accumulate,
                               f"averaging the training loss of step {self.step}")

    def val_loss(self) -> float:
        """The mean loss of the fixed validation batches (over the ranks too, under MPI)."""
        losses = []
        for starts in self.val_starts:
            x, y = self.val.batch(starts if self.rows is None else starts[self.rows])
            losses.append(float(self.evaluator.run(tokens=x, pos=self.pos, labels=y)["loss"]))
        if self.world is None:
            return float(np.mean(losses))
        return self.world.mean(np.mean(losses), f"averaging the validation loss at step "
                                                f"{self.step}")

    def warm_up(self) -> None:
        """Compile the evaluator now (on the first validation batch), not at the first
        evaluation: under MPI every rank compiles inside World.first, before any collective."""
        x, y = self.val.batch(self.val_starts[0] if self.rows is None else
                              self.val_starts[0][self.rows])
        self.evaluator.run(tokens=x, pos=self.pos, labels=y)

    def restore(self, params, state, meta):
        _restore_program(self.program, params, state, meta)
        self.step = meta["step"]
        self.sampler.state = meta["rng"]
        self.window = [float(v) for v in meta.get("window", [])]

    def position(self) -> dict:
        """Where the run is, for a checkpoint: the sampler's state, the losses since the last
        evaluation."""
        return {"rng": self.sampler.state, "window": self.window}


class _Deferred:
    """SIGINT and SIGTERM noted while a step runs and raised at the next `check()` (after the
    caller saved); a second signal raises at once."""

    def __init__(self):
        self.signum, self.old = None, {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):           # only the main thread can
                self.old[s] = signal.signal(s, self._note)
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)
        return False

    def _note(self, signum, frame):
        if self.signum is not None:
            self._raise(signum)
        self.signum = signum

    @staticmethod
    def _raise(signum):
        if signum == signal.SIGTERM:
            raise Terminated()
        raise KeyboardInterrupt

    @property
    def pending(self) -> bool:
        return self.signum is not None

    def check(self):
        if self.signum is not None:
            self._raise(self.signum)


def _bar(args, total, initial):
    from tqdm import tqdm
    enabled = not args.quiet and sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=args.cmd, unit="step", disable=not enabled,
                dynamic_ncols=True, file=sys.stderr, leave=True)


def _fit(args, trainer, save, curve):
    """Train to --steps: evaluate every --eval-every steps and at the end, call save() every
    --save-every steps and at the end; Ctrl-C / SIGTERM: save(stopping=True), then raise. Returns the timing
    {"seconds": training time without evaluations and saves, "steps": steps run now}.
    Under MPI (trainer.world) the ranks agree after each step whether any got a signal: then
    all save (rank 0 writes) after that same step and raise _Stopped."""
    total, seconds, ran, window = args.steps, 0.0, 0, trainer.window
    world = trainer.world
    log = open_log(args, f"jitgraph {'train llama' if args.cmd == 'train' else args.cmd}",
                   world is None or world.is_root)
    with _Deferred() as signals, _bar(args, total, min(trainer.step, total)) as bar:
        while trainer.step < total:
            t0 = time.perf_counter()
            loss = trainer.train_step()
            dt = time.perf_counter() - t0
            seconds += dt
            ran += 1
            if log:
                log.step(trainer.step, loss, lr=args.lr, ms=1e3 * dt,
                         tokens_per_s=trainer.tokens_per_step / dt,
                         tokens=trainer.tokens_per_step * trainer.step)
            window.append(loss)
            bar.update(1)
            bar.set_postfix_str(f"loss {loss:.4f}, {trainer.tokens_per_step * ran / seconds:,.0f} "
                                f"tokens/s", refresh=False)
            s = trainer.step
            if s % args.eval_every == 0 or s == total:
                val = trainer.val_loss()
                curve.append({"step": s, "train": float(np.mean(window)), "val": val})
                if log:
                    log.eval(s, val, train_loss=curve[-1]["train"],
                             perplexity=math.exp(val) if val < 709 else None)
                window.clear()
                line = (f"step {s}/{total}: train {curve[-1]['train']:.4f}  val {val:.4f}  "
                        f"({1e3 * seconds / ran:.1f} ms/step, "
                        f"{trainer.tokens_per_step * ran / seconds:,.0f} tokens/s"
                        f"{scale_line(trainer.program)})")
                if not args.quiet:
                    if bar.disable:
                        print(line, flush=True)
                    else:
                        bar.write(line, file=sys.stderr)
            if world is not None:
                stop = _agreed_stop(world, signals, s)
                if stop or s == total or s % args.save_every == 0:
                    save(bool(stop))
                if stop:
                    raise _Stopped(stop)
                continue
            if signals.pending or s == total or s % args.save_every == 0:
                save(signals.pending)
            signals.check()
    if log:
        log.close()
    return {"seconds": seconds, "steps": ran}


# ---- finetune --epochs: llama.cpp's workflow on the core's fit -----------------------------------
def _epoch_options(args, world):
    """Usage errors of --epochs and its options, before anything is read; --val-split's
    default."""
    given = getattr(args, "given", set())
    if args.epochs is None:
        bad = [k for k in EPOCH_ONLY if getattr(args, k) is not None]
        if bad:
            args.parser.error(f"argument --{bad[0].replace('_', '-')}: needs --epochs (llama.cpp's "
                              f"windows and split; --steps draws random windows of the first "
                              f"90 %% of the bytes)")
        return
    if "steps" in given:
        args.parser.error("argument --epochs: not allowed with argument --steps (--epochs walks "
                          "every window of the text N times, --steps draws random windows; give "
                          "one of them)")
    if args.decay_epochs is not None and args.lr_min is None:
        args.parser.error("argument --decay-epochs: needs --lr-min (the rate it decays to)")
    if args.lr_min is not None and args.lr_min >= args.lr:
        args.parser.error(f"argument --lr-min: must be below --lr {args.lr} (it is the rate the "
                          f"schedule decays to), got {args.lr_min}")
    if world is not None:
        raise ValueError("--epochs: runs in one process; data-parallel training under mpiexec "
                         "takes --steps")
    if args.val_split is None:
        args.val_split = VAL_SPLIT


def _epoch_windows(args, data, tok, what, cfg):
    """llama-finetune's data set of the whole text: its tokens with BOS (the file's last
    newline dropped, as llama.cpp's -f does), windows of --ctx at a stride of ctx/2, the last
    --val-split of them held out. (StridedWindows, training windows)."""
    from ..models.text import StridedWindows, llama_split
    text = data[:-1] if data.endswith(b"\n") else data
    tokens = np.asarray(tok.encode(text, bos=tok.add_bos), np.int32)
    windows = StridedWindows(tokens, args.ctx, what=what)
    n = len(windows)
    n_train = llama_split(n, args.val_split)
    lb = args.logical_batch or args.batch_size
    if n_train < lb:
        raise ValueError(f"--val-split {args.val_split}: {what} makes {n} windows of --ctx "
                         f"{args.ctx} (stride {windows.stride}), {n_train} of them to train, "
                         f"fewer than one batch of {lb}; use a smaller --ctx, --batch-size or "
                         f"--val-split, or a longer text")
    say(args, f"base: {args.base} ({cfg.layers} layers, width {cfg.dim}, vocab {cfg.vocab}); "
              f"text: {what} ({len(data):,} bytes, {len(tokens):,} tokens): {n} windows of "
              f"{args.ctx} tokens at a stride of {windows.stride}, {n_train} train, "
              f"{n - n_train} validate (--val-split {args.val_split})")
    # whole logical batches train (the windows left over validate, as ggml_opt_fit's split)
    # and whole batches validate: a last partial batch of windows is left out
    n_tr = n_train // lb * lb
    keep = n_tr + (n - n_tr) // args.batch_size * args.batch_size
    if keep < n or n_tr < n_train:
        say(args, f"note: --batch-size {args.batch_size}, --logical-batch {lb}: {n_tr} windows "
                  f"train, {keep - n_tr} validate, {n - keep} left out (whole batches only)")
        windows.starts = windows.starts[:keep]
    return windows, n_tr


def _optimizer(args, acc, steps_per_epoch=1):
    """The optimizer of the options: AdamW or SGD, the learning rate constant or llama.cpp's
    per-epoch decay (--lr-min, --decay-epochs)."""
    from .. import optim
    lr = args.lr
    if getattr(args, "lr_min", None) is not None:
        lr = optim.EpochDecay(args.lr, args.lr_min, args.epochs, max(1, steps_per_epoch),
                              args.decay_epochs if args.decay_epochs is not None else -1.0)
    if getattr(args, "optimizer", "adamw") == "sgd":
        if args.moments != "f32":
            raise ValueError(f"--moments {args.moments}: AdamW's moments; --optimizer sgd has "
                             f"none")
        return optim.SGD(lr=lr, weight_decay=args.weight_decay, accumulate=acc,
                         master=args.master, seed=args.seed)
    return optim.AdamW(lr=lr, weight_decay=args.weight_decay, accumulate=acc,
                       moments=args.moments, master=args.master, seed=args.seed)


def _precision_line(args) -> str:
    return ("" if args.precision == "f32" else f", {args.precision} mixed precision") + \
        ("" if args.moments == "f32" else f", {args.moments} moments") + \
        ("" if args.master == "f32" else f", {args.master} master weights")


def _optimizer_line(args):
    name = "SGD" if getattr(args, "optimizer", "adamw") == "sgd" else "AdamW"
    if getattr(args, "lr_min", None) is not None:
        e = args.decay_epochs if args.decay_epochs is not None else args.epochs
        return f"{name} lr {args.lr} decaying to {args.lr_min} over {e:g} epochs"
    return f"{name} lr {args.lr}"


def _restore_program(program, params, state, meta) -> None:
    """A checkpoint into `program`: its trainable params (a LoRA checkpoint holds those alone:
    the frozen base weights come from --base, checked by its hash), as stored (bf16 master
    weights bit for bit), the optimizer state, the call count and the loss scaling."""
    trainable = set(program.source.trainable_params())
    for k, v in params.items():
        if k in trainable:
            program.params[k] = v
    for k, v in state.items():
        program.state[k] = v
    program.calls = meta["calls"]
    restore_scale(program, meta)


class _Timed:
    """A program whose training steps are timed (`seconds`: their sum), for tokens/s."""

    def __init__(self, program):
        self._p, self.seconds, self.last = program, 0.0, 0.0

    def step(self, **inputs):
        t0 = time.perf_counter()
        out = self._p.step(**inputs)
        self.last = time.perf_counter() - t0
        self.seconds += self.last
        return out

    # the program's counters a trainer or a resume sets: set on the program, not on the wrapper
    _FORWARDED = frozenset(("calls", "skipped"))

    def __getattr__(self, name):        # all but step and the timings: the program's
        return getattr(self._p, name)

    def __setattr__(self, name, value):
        if name in self._FORWARDED:
            setattr(self._p, name, value)
        else:
            object.__setattr__(self, name, value)


def _epoch_trainer(args, prog, windows, n_train):
    from ..training import Trainer

    class EpochTrainer(Trainer):
        """jitgraph.training.Trainer over llama.cpp's windows, in order (no shuffle), with what
        finetune's checkpoint and summary read."""
        world, window = None, []

        @property
        def step(self):                 # optimizer steps done
            return self.program.calls // self.accumulate

        def position(self):
            return {"epoch": self.epoch, "batch": self.batch,
                    "partial": {"losses": self.partial.losses, "sizes": self.partial.sizes,
                                "ncorrect": self.partial.ncorrect}}

        def restore(self, params, state, meta):
            _restore_program(self.program, params, state, meta)
            self.epoch, self.batch = meta["epoch"], meta["batch"]
            part = meta["partial"]
            self.partial.losses = [float(v) for v in part["losses"]]
            self.partial.sizes = [int(v) for v in part["sizes"]]
            self.partial.ndata = sum(self.partial.sizes)
            self.partial.ncorrect = int(part["ncorrect"])

    pos = np.arange(args.ctx, dtype=np.int32)
    t = EpochTrainer(_Timed(prog), windows, batch_size=args.batch_size,
                     logical_batch=args.logical_batch, shuffle=False, n_train=n_train,
                     inputs=lambda f: {"tokens": f["x"], "pos": pos, "labels": f["y"]},
                     unit=args.ctx)
    t.accumulate = t.logical_batch // t.batch_size
    t.tokens_per_step = t.logical_batch * args.ctx
    return t


def _fit_epochs(args, trainer, save, curve):
    """Train to --epochs with the core's fit over llama.cpp's windows: a progress bar per
    epoch (loss and accuracy with their uncertainties, as ggml-opt prints), the validation
    windows after each; save() every --save-every optimizer steps, after each epoch and on
    Ctrl-C / SIGTERM (then raise). Returns the timing as _fit does."""
    from ..training import fit
    prog, acc = trainer.program, trainer.accumulate
    log = open_log(args, "jitgraph finetune")
    opt = _optimizer(args, acc, trainer.n_train // trainer.logical_batch)
    t_start, ran, pending = prog.seconds, [0], []
    mark = [t_start, 0]                  # the training seconds and steps at the epoch's start

    def on_step(loss):
        if prog.last_skipped:        # not finite (f16 loss scaling): the batch is dropped
            return
        pending.append(loss)
        if prog.calls % acc:
            return
        s = trainer.step
        ran[0] += 1
        if log:
            ms = 1e3 * prog.last * acc
            log.step(s, float(np.mean(pending)), lr=opt.lr_at(s), ms=ms,
                     tokens_per_s=trainer.tokens_per_step / max(prog.last * acc, 1e-12),
                     tokens=trainer.tokens_per_step * s)
        pending.clear()
        if signals.pending or s % args.save_every == 0:
            save(signals.pending)
        signals.check()

    def on_epoch(tr, ep):
        (tl, tu), (ta, tau) = ep.train.loss(), ep.train.accuracy()
        (vl, vu), (va, vau) = ep.val.loss(), ep.val.accuracy()
        s = trainer.step
        curve.append({"epoch": ep.epoch, "step": s, "train": tl, "train_unc": tu,
                      "train_acc": ta, "train_acc_unc": tau, "val": vl, "val_unc": vu,
                      "val_acc": va, "val_acc_unc": vau})
        if log:
            log.eval(s, vl, train_loss=tl, accuracy=va,
                     perplexity=math.exp(vl) if vl < 709 else None)
        # this epoch's steps alone (a resumed epoch: those run since the resume)
        sec, n = prog.seconds - mark[0], ran[0] - mark[1]
        mark[:] = [prog.seconds, ran[0]]
        rate = trainer.tokens_per_step * n / sec if sec else math.nan
        say(args, f"epoch {ep.epoch}/{args.epochs}: train {ep.train}  val {ep.val}  "
                  f"({1e3 * sec / max(n, 1):.1f} ms/step, {rate:,.0f} tokens/s"
                  f"{scale_line(prog)})")
        save()

    with _Deferred() as signals:
        fit(prog, trainer.dataset, epochs=args.epochs, trainer=trainer, on_step=on_step,
            callbacks=[on_epoch], progress=False if args.quiet else None)
    if log:
        log.close()
    return {"seconds": prog.seconds - t_start, "steps": ran[0]}


class _Stopped(Exception):
    """Every MPI rank stops after the same step: one of them got SIGINT / SIGTERM (`signum`)."""

    def __init__(self, signum):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


def _agreed_stop(world, signals, step):
    """Whether any rank got SIGINT or SIGTERM by the end of `step`, the same on every rank:
    None, or the signal to exit with (SIGTERM when any rank got one)."""
    got = [float(signals.pending), float(signals.signum == signal.SIGTERM)]
    pending, term = world.mean(got, f"agreeing whether to stop after step {step}")
    if not pending:
        return None
    return signal.SIGTERM if term else signal.SIGINT


def _data_parallel(fn, args):
    """fn(args, world): world None without MPI; under `mpiexec -n N` a
    jitgraph.distributed.World, the other ranks quiet, a rank's error aborting the job, and a
    stop agreed by the ranks (_Stopped) ending every rank with 130 / 143 (rank 0 reports it)."""
    apply_threads(args)
    from ..distributed import world as mpi_world
    world = mpi_world()
    if world is None:
        return fn(args, None)
    if not world.is_root:
        args.quiet, args.json, args.rank = True, False, world.rank
    with world.abort_on_error():
        try:
            return fn(args, world)
        except _Stopped as e:
            stop = e.signum
    if world.is_root:                # main reports it, with the checkpoint to resume from
        raise Terminated() if stop == signal.SIGTERM else KeyboardInterrupt
    return EXIT_TERMINATED if stop == signal.SIGTERM else EXIT_INTERRUPT


def _warn_once(args, msg):
    """warn on rank 0 only under MPI."""
    if not getattr(args, "rank", 0):
        warn(args, msg)


def _accumulation(args):
    """Compiled steps per optimizer step (--logical-batch / --batch-size); a usage error when
    it does not divide."""
    if args.logical_batch is not None and (args.logical_batch < args.batch_size or
                                           args.logical_batch % args.batch_size):
        args.parser.error(f"argument --logical-batch: must be a multiple of --batch-size "
                          f"{args.batch_size} (gradient accumulation over whole batches), got "
                          f"{args.logical_batch}")
    return (args.logical_batch or args.batch_size) // args.batch_size


def _compile(args, graph, what, world=None, params=None, opt=None):
    from .. import compile as jg_compile
    acc = _accumulation(args)
    opt = opt or _optimizer(args, acc)
    target = compile_target(args)
    t0 = time.perf_counter()
    with compile_progress(args, what):
        prog = jg_compile(graph, loss="loss", optimizer=opt, fuse=not args.no_fuse,
                          plan_memory=not args.no_plan, checkpoint=args.recompute,
                          seed=args.seed, copy_outputs=False,
                          hook=None if world is None else world.hook, target=target,
                          params=params, precision=args.precision, loss_scale=loss_scale(args))
    return prog, acc, time.perf_counter() - t0


def _windows(args, split, what):
    """(train, val) Windows of ctx + 1 tokens; errors name --ctx and the text."""
    from ..models.text import Windows
    n = args.ctx + 1
    parts = ((split.train, "training part (first 90 %)"), (split.val, "held-out part (last 10 %)"))
    for tokens, part in parts:
        if len(tokens) < n:
            raise ValueError(f"--ctx {args.ctx}: the {part} of {what} has {len(tokens)} tokens, "
                             f"fewer than one window of ctx + 1 = {n}; use a smaller --ctx or a "
                             f"longer text")
    return Windows(split.train, n, "training part"), Windows(split.val, n, "held-out part")


def _check_outputs(args, **inputs):
    """--out and --checkpoint writable, distinct and none of the inputs (--text, --resume and
    `inputs`), before anything is read or compiled."""
    check_outputs(args, {"--text": args.text, "--resume": args.resume, **inputs})


def _resume(args, kind, resumed):
    """Load --resume and apply its recorded options to `args` (a warning lists the given ones
    it overrides). Returns (cfg, tok, params, state, meta)."""
    check_model_file(args.resume, "--resume", "a checkpoint file")
    cfg, tok, params, state, meta = load_llama_checkpoint(args.resume)
    if meta["kind"] != kind:
        raise ValueError(f"--resume {args.resume}: a {meta['kind']} checkpoint, not {kind}")
    # options a checkpoint of an older jitgraph does not record keep their defaults
    saved = {k: meta["args"][k] for k in resumed if k in meta["args"]}
    if args.text is not None and "text" in getattr(args, "given", ()):
        saved.pop("text")            # the user's copy: _read_text checks it against the hash
    adopt_resumed(args, args.resume, saved, _warn_once)
    resume_precision(args, args.resume, meta["args"].get("precision"))
    Run.checkpoint, Run.epoch, Run.unit = args.resume, meta["step"], "step"
    epochs = getattr(args, "epochs", None)
    if ("epoch" in meta) != bool(epochs):
        raise ValueError(f"--resume {args.resume}: the checkpoint was made "
                         f"{'with --epochs' if 'epoch' in meta else 'with --steps'}; resume it "
                         f"with {'--epochs N' if 'epoch' in meta else '--steps N, not --epochs'}")
    if epochs:
        if meta["epoch"] >= epochs:
            _warn_once(args, f"--resume {args.resume} is at epoch {meta['epoch']}, --epochs is "
                             f"{epochs}: nothing left to train")
    elif meta["step"] >= args.steps:
        _warn_once(args, f"--resume {args.resume} is at step {meta['step']}, --steps is "
                         f"{args.steps}: nothing left to train")
    return cfg, tok, params, state, meta


def _read_text(args, meta=None):
    """(bytes of --text or of the shipped corpus, how to name it). With a checkpoint's `meta`
    the text must be the one it was trained on (its SHA-256): the recorded path, or the
    --text given on the command line."""
    from ..models.text import read_corpus
    if args.text is not None:
        if meta is not None and not os.path.exists(args.text):
            raise FileNotFoundError(f"--resume {args.resume}: its text {args.text} is not found; "
                                    f"give the same text with --text FILE")
        check_model_file(args.text, "--text", "a text file")
    data = read_corpus(args.text)
    if meta is not None and meta.get("text_sha256") not in (None, _sha256(data)):
        where = args.text or "the shipped corpus"
        raise ValueError(f"--resume {args.resume}: the text ({where}) is not the one the "
                         f"checkpoint was trained on (its SHA-256 differs); a resumed run needs "
                         f"the same text")
    what = args.text if args.text else "the shipped tiny-shakespeare slice"
    return data, what


def _meta(args, kind, resumed, trainer, curve, data, extra=None):
    """A checkpoint's JSON: the options (the text as an absolute path, so a resume from another
    directory finds it), the program's and the sampler's state, the curve."""
    saved = {k: getattr(args, k) for k in (*resumed, "precision")}
    if saved.get("text") is not None:
        saved["text"] = os.path.abspath(saved["text"])
    return {"kind": kind, "args": saved,
            "calls": trainer.program.calls, "step": trainer.step, **trainer.position(),
            **scale_meta(trainer.program),
            "curve": curve, "text_sha256": _sha256(data),
            **(extra or {})}


def _summary(trainer, timing, curve, compile_s):
    sec, ran = timing["seconds"], timing["steps"]
    last = curve[-1] if curve else {}
    return {"train_loss": last.get("train"), "val_loss": last.get("val"),
            "steps": trainer.step, "ms_per_step": 1e3 * sec / ran if ran else None,
            "tokens_per_second": trainer.tokens_per_step * ran / sec if ran else None,
            "compile_seconds": compile_s, "curve": curve,
            "precision": trainer.program.options.precision, **scale_summary(trainer.program),
            "moments": getattr(trainer.program.options.optimizer, "moments", None),
            "master": trainer.program.options.optimizer.master}


def _count(n):
    return f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n:,}"


def _bytes(n):
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _trainable(prog) -> dict:
    """The program's trainable params, name -> read-only view, as stored (what a checkpoint
    keeps: bf16 master weights as their bits, which --resume puts back bit for bit)."""
    return stored_weights(prog, prog.source.trainable_params())


def _views(values) -> dict:
    """A program's params or optimizer state, name -> read-only view of where it lives (valid
    until the next step): written out without a second copy (a 1B model's AdamW state is
    9 GB)."""
    return {k: values.view(k) for k in values}


def _memory(prog):
    """A program's memory plan: trainable params; the bytes of its weights and optimizer state
    (the persistent region), of its arena (activations and gradients), of its kernels' scratch
    space (workspace, after the arena) and of its output buffers."""
    g = prog.source
    size = {k: g.nodes[i].type.size for k, i in g.params.items()}   # storage types too
    st = prog.stats()
    return {"trainable_params": int(sum(size[k] for k in g.trainable_params())),
            "params": int(sum(size[k] for k in prog.params)),
            # as stored (bf16 master weights: 2 bytes each)
            "weights_bytes": int(sum(prog.params.view(k).nbytes for k in prog.params)),
            # views, not copies: prog.state[k] copies (an AdamW moment of a 1B model's
            # embedding is 1 GB)
            "optimizer_state_bytes": int(sum(prog.state.view(k).nbytes for k in prog.state)),
            "arena_bytes": int(st["arena_bytes"]), "persistent_bytes": int(st["persistent_bytes"]),
            "workspace_bytes": int(st.get("workspace_bytes", 0)),
            "output_bytes": int(st["memory"]["output_bytes"])}


def _memory_line(mem) -> str:
    """The memory plan in one line, printed before the first step."""
    total = sum(mem[k] for k in ("persistent_bytes", "arena_bytes", "workspace_bytes",
                                 "output_bytes"))
    return (f"memory plan: weights {_bytes(mem['weights_bytes'])}, optimizer state "
            f"{_bytes(mem['optimizer_state_bytes'])}, activations and gradients (arena) "
            f"{_bytes(mem['arena_bytes'])}, workspace {_bytes(mem['workspace_bytes'])}, outputs "
            f"{_bytes(mem['output_bytes'])}: {_bytes(total)} in all")


# ---- train llama -------------------------------------------------------------------------------
def _model_config(args, vocab):
    """The LlamaConfig of the options; errors name the options."""
    from ..models.llama import LlamaConfig
    kv = args.kv_heads or args.heads
    if args.dim % args.heads:
        raise ValueError(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if (args.dim // args.heads) % 2:
        raise ValueError(f"--dim {args.dim} / --heads {args.heads} = head size "
                         f"{args.dim // args.heads} must be even (rope rotates pairs)")
    if args.heads % kv:
        raise ValueError(f"--kv-heads {kv} must divide --heads {args.heads}")
    return LlamaConfig(vocab=vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                       kv_heads=kv, ff=args.ff, ctx=args.ctx)


def _tokenizer(args, data):
    from ..models.text import byte_vocab, split_bytes
    from ..models.tokenizer import build_vocab
    if args.vocab == "byte":
        return byte_vocab(), "byte vocabulary"
    head, _ = split_bytes(data)
    tok = build_vocab(head.decode("utf-8", "replace"), args.vocab)
    return tok, "vocabulary learned from the training part by BPE"


def train_llama(args):
    """`jitgraph train llama` (data-parallel under `mpiexec -n N`: see the module docstring)."""
    return _data_parallel(_train_llama, args)


def _data_parallel_line(args, world):
    if world is not None:
        say(args, f"data parallel: {world.size} MPI ranks, {args.batch_size // world.size} "
                  f"windows of each batch and {world.threads} thread(s) per rank")


def _mpi_summary(world):
    return {} if world is None else {"mpi_ranks": world.size,
                                     "allreduce_seconds": world.seconds["allreduce"],
                                     "param_checks": world.checks}


def _build(args, graph, what, world, make_trainer, params=None, opt=None):
    """Compile `graph` (`params`: values of params in place of their initialisation) and make
    its LMTrainer; under MPI rank 0 first, then the others (the evaluator compiled too), before
    any collective. (prog, acc, compile seconds, trainer)."""
    _accumulation(args)              # a usage error before anything compiles

    def build():
        prog, acc, compile_s = _compile(args, graph, what, world, params, opt)
        trainer = make_trainer(prog, acc)
        if world is not None:
            trainer.warm_up()
        return prog, acc, compile_s, trainer
    return build() if world is None else world.first(build, f"compiling {what}")


def _train_llama(args, world):
    from ..models.llama import llama_forward, write_llama
    from ..models.text import tokenize_split
    kind = "train-llama"
    _check_outputs(args)
    resumed = None
    if args.resume:
        resumed = _resume(args, kind, TRAIN_RESUMED)
        _check_outputs(args)             # the text the checkpoint recorded too
    data, what = _read_text(args, resumed and resumed[4])
    if resumed:
        tok, how = resumed[1], "vocabulary of the checkpoint"
    else:
        tok, how = _tokenizer(args, data)
    cfg = resumed[0] if resumed else _model_config(args, len(tok))
    split = tokenize_split(data, tok)
    train_w, val_w = _windows(args, split, what)
    say(args, f"text: {what} ({split.size:,} bytes: {split.cut:,} train, "
              f"{split.size - split.cut:,} held out), {how} ({len(tok)} tokens): "
              f"{len(split.train):,} + {len(split.val):,} tokens")
    note_unsaved(args, not getattr(args, "rank", 0))
    local = args.batch_size if world is None else world.local_batch(args.batch_size)
    graph = llama_forward(cfg, local, args.ctx, labels=True, name="llama_train")
    prog, acc, compile_s, trainer = _build(
        args, graph, "llama", world,
        lambda prog, acc: LMTrainer(prog, train_w, val_w, batch_size=args.batch_size,
                                    accumulate=acc, seed=args.seed, world=world,
                                    val_batches=args.val_batches))
    curve = []
    if resumed:
        trainer.restore(resumed[2], resumed[3], resumed[4])
        curve = list(resumed[4].get("curve", []))
    mem = _memory(prog)
    say(args, f"llama: {cfg.layers} layers, width {cfg.dim}, {cfg.heads} heads "
              f"({cfg.kv_heads} kv), ff {cfg.ff}, ctx {cfg.ctx}, vocab {cfg.vocab}: "
              f"{_count(mem['params'])} params; batch {args.batch_size}"
              f"{f' x {acc} accumulated' if acc > 1 else ''}, AdamW lr {args.lr}"
              f"{_precision_line(args)}"
              f"{f', recompute {args.recompute}' if args.recompute else ''}; compiled in "
              f"{compile_s:.2f} s (arena {_bytes(mem['arena_bytes'])})")
    _data_parallel_line(args, world)
    root = world is None or world.is_root

    def save(stopping=False):
        if not root:
            return
        if args.checkpoint:
            save_llama_checkpoint(args.checkpoint, cfg, tok, stored_weights(prog),
                                  _views(prog.state),
                                  _meta(args, kind, TRAIN_RESUMED, trainer, curve, data))
            Run.checkpoint, Run.epoch, Run.unit = args.checkpoint, trainer.step, "step"
        if stopping and args.out:            # interrupted: the model so far
            write_llama(args.out, cfg, stored_weights(prog), tok, name="jitgraph llama",
                        ftype=args.ftype)
            Run.out = (args.out, f"the model after step {trainer.step}")

    timing = _fit(args, trainer, save, curve)
    if args.out and root:
        write_llama(args.out, cfg, stored_weights(prog), tok, name="jitgraph llama",
                    ftype=args.ftype)
        say(args, f"saved {args.out}")
    if args.json:
        print(json.dumps({**_summary(trainer, timing, curve, compile_s), **mem,
                          "vocab": cfg.vocab, **_mpi_summary(world)}))
    return 0


# ---- finetune ----------------------------------------------------------------------------------
def _lora_modules():
    from ..lora import lora
    from ..models import lora as lora_file
    return lora, lora_file


def _perplexity(args, cfg, params, tok, tail, label, lora=None):
    """Perplexity on the held-out bytes (--epochs: the whole text, perplexity's --split all)
    with llama.cpp's method (at most --ppl-chunks chunks); lora: (adapter params, alpha)
    applied unmerged."""
    from ..models.perplexity import perplexity
    ids = tok.encode(tail, bos=tok.add_bos)
    if args.ppl_chunks:
        ids = ids[:args.ppl_chunks * args.ctx]
    res = perplexity((cfg, params, tok), ids, n_ctx=args.ctx, batch=8, kv_f16=False, lora=lora)
    say(args, f"perplexity {label}: {res}")
    return res


def finetune(args):
    """`jitgraph finetune` (data-parallel under `mpiexec -n N`: see the module docstring; the
    perplexity before and after on rank 0 alone)."""
    return _data_parallel(_finetune, args)


def _finetune(args, world):
    from ..models.llama import llama_forward, read_llama, write_llama
    from ..models.text import split_bytes, tokenize_split
    kind = "finetune"
    _epoch_options(args, world)
    if args.optimizer == "sgd" and args.moments != "f32":
        args.parser.error(f"argument --moments: AdamW's moments; --optimizer sgd has none")
    check_model_file(args.base, "base model")
    _check_outputs(args, **{"the base model": args.base})
    resumed = None
    if args.resume:
        resumed = _resume(args, kind, FINETUNE_RESUMED)
        _check_outputs(args, **{"the base model": args.base})    # the recorded text too
    if args.lora_alpha is not None and args.full:
        raise ValueError("--lora-alpha applies to --lora-rank, not --full")
    # LoRA: the frozen base stays in its file's type, read straight into the program; --full:
    # its f32 weight matrices are read straight into the program too (not held twice)
    cfg, base, tok = read_llama(args.base, keep_types=not args.full, f32_in_file=args.full)
    if tok is None:
        raise ValueError(f"{args.base}: the model has no tokenizer in its metadata (SPM or BPE: "
                         f"tokenizer.ggml.model llama or gpt2); finetune needs it to tokenize "
                         f"the text")
    if args.ctx > cfg.ctx:
        raise ValueError(f"--ctx {args.ctx} exceeds the model's context length {cfg.ctx}")
    with open(args.base, "rb") as f:
        base_sha = hashlib.file_digest(f, "sha256").hexdigest()
    if resumed and resumed[4].get("base_sha256") not in (None, base_sha):
        raise ValueError(f"--resume {args.resume}: was made from another base model than "
                         f"{args.base}")
    lora = lora_file = None
    if not args.full:
        lora, lora_file = _lora_modules()
    alpha = float(args.lora_alpha if args.lora_alpha is not None else args.lora_rank or 0)
    data, what = _read_text(args, resumed and resumed[4])
    if args.epochs:
        windows, n_train = _epoch_windows(args, data, tok, what, cfg)
        tail = data                          # perplexity on the training text itself
    else:
        split = tokenize_split(data, tok)
        train_w, val_w = _windows(args, split, what)
        say(args, f"base: {args.base} ({cfg.layers} layers, width {cfg.dim}, vocab "
                  f"{cfg.vocab}); text: {what} ({split.size:,} bytes: {split.cut:,} train, "
                  f"{split.size - split.cut:,} held out; {len(split.train):,} + "
                  f"{len(split.val):,} tokens)")
        _, tail = split_bytes(data)
    root = world is None or world.is_root
    local = args.batch_size if world is None else world.local_batch(args.batch_size)
    ppl = not args.no_ppl and root
    ppl_before = _perplexity(args, cfg, base, tok, tail, "before") if ppl else None

    # --epochs: ggml-opt's accuracy needs the count of right predictions
    graph = llama_forward(cfg, local, args.ctx, labels=True, name="llama_finetune",
                          correct=bool(args.epochs), logits=False)
    targets = None
    if not args.full:
        targets = lora_weights(cfg.description, args.lora_targets, lambda m: say(args, m))
        graph = lora(graph, targets=targets, rank=args.lora_rank, alpha=alpha, seed=args.seed)
    if args.epochs:
        make = (lambda prog, acc: _epoch_trainer(args, prog, windows, n_train))
        opt = _optimizer(args, _accumulation(args), n_train // (args.logical_batch or
                                                                 args.batch_size))
    else:
        make = (lambda prog, acc: LMTrainer(prog, train_w, val_w, batch_size=args.batch_size,
                                            accumulate=acc, seed=args.seed, world=world,
                                            val_batches=args.val_batches))
        opt = None
    prog, acc, compile_s, trainer = _build(args, graph, "finetune", world, make,
                                           params=base,  # the base weights (frozen with LoRA)
                                           opt=opt)
    curve = []
    if resumed:
        trainer.restore(resumed[2], resumed[3], resumed[4])
        curve = list(resumed[4].get("curve", []))
    mem = _memory(prog)
    mode = "full" if args.full else \
        f"LoRA rank {args.lora_rank}, alpha {alpha:g} on {args.lora_targets}"
    say(args, f"finetune ({mode}): batch {args.batch_size}"
              f"{f' x {acc} accumulated' if acc > 1 else ''}, ctx {args.ctx}, "
              f"{_optimizer_line(args)}{f', recompute {args.recompute}' if args.recompute else ''}"
              f"{_precision_line(args)}"
              f"; compiled in {compile_s:.2f} s")
    say(args, f"{mem['trainable_params']:,} trainable params of {mem['params']:,}; "
              f"{_memory_line(mem)}")
    _data_parallel_line(args, world)

    def adapter():      # the names first: prog.params.items() would copy every base weight
        return f32_weights(prog, [k for k in prog.params if k.endswith((".lora_a", ".lora_b"))])

    def write_out():
        if args.full:
            # the weights where they lie, not copied (a 1B model's 4.6 GiB not held twice), as
            # stored: bf16 master weights as their bits, each converted as it is written
            write_llama(args.out, cfg, stored_weights(prog), tok, name="jitgraph finetune",
                        ftype=args.ftype)
        else:
            lora_file.write_adapter(args.out, cfg, adapter(), alpha, ftype=args.ftype)

    def save(stopping=False):
        if not root:
            return
        write_out()
        Run.out = (args.out, f"the {'model' if args.full else 'adapter'} after step "
                              f"{trainer.step}")
        if args.checkpoint:
            meta = _meta(args, kind, FINETUNE_RESUMED, trainer, curve, data,
                         {"base_sha256": base_sha})
            save_llama_checkpoint(args.checkpoint, cfg, tok, _trainable(prog),
                                  _views(prog.state), meta)
            Run.checkpoint, Run.epoch, Run.unit = args.checkpoint, trainer.step, "step"

    timing = (_fit_epochs if args.epochs else _fit)(args, trainer, save, curve)
    say(args, f"saved {args.out}")
    ppl_after = None
    if ppl:       # LoRA: the adapter applied unmerged, on the base in its file's type
        ppl_after = _perplexity(args, cfg, f32_weights(prog), tok, tail, "after") \
            if args.full \
            else _perplexity(args, cfg, base, tok, tail, "after", (adapter(), alpha))
        say(args, f"perplexity: {ppl_before.ppl:.4f} -> {ppl_after.ppl:.4f} "
                  f"({ppl_after.ppl / ppl_before.ppl:.3f}x)")
    if args.json:
        print(json.dumps({**_summary(trainer, timing, curve, compile_s), **mem,
                          "mode": "full" if args.full else "lora",
                          **({"epochs": trainer.epoch, "windows": len(windows),
                              "train_windows": trainer.n_train} if args.epochs else {}),
                          "ppl_before": ppl_before and ppl_before.ppl,
                          "ppl_after": ppl_after and ppl_after.ppl,
                          "ppl_chunks": ppl_after and ppl_after.chunks,
                          **_mpi_summary(world)}))
    return 0


# ---- dump llama --------------------------------------------------------------------------------
def dump_llama(args):
    """`jitgraph dump llama`: the IR of the default `train llama` model's training step, or of
    generation's prefill / decode program."""
    from .. import compile as jg_compile, optim
    from ..models.generate import llama_decoder
    from ..models.llama import LlamaConfig, llama_forward
    from ..models.text import byte_vocab
    from .dump import emit
    d = DEFAULTS
    if args.gguf:
        cfg = _gguf_config(args.gguf)
    else:
        cfg = LlamaConfig(vocab=len(byte_vocab()), dim=d["dim"], layers=d["layers"],
                          heads=d["heads"], kv_heads=d["kv_heads"], ff=d["ff"], ctx=d["ctx"])
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    program = getattr(args, "program", "train")
    if program == "train":
        graph = llama_forward(cfg, args.batch_size or d["batch_size"], cfg.ctx, labels=True,
                              name="llama_train")
        kw = {"loss": "loss", "optimizer": optim.AdamW(lr=1e-3, weight_decay=0.0,
                                                       moments=args.moments,
                                                       master=args.master),
              "precision": args.precision, "loss_scale": loss_scale(args)}
    else:
        graph = llama_decoder(cfg, 16 if program == "prefill" else 1, cfg.ctx,
                              last=program == "prefill")
        kw = {"precision": args.precision}
        loss_scale(args)                # (a usage error: loss scaling without f16)
    if args.stage == "graph" and not args.memory_timeline:
        return emit(args, graph=graph)
    absent = {"checkpoint"} | (set() if program == "train" else {"autodiff", "optimizer"})
    if args.stage in absent:
        raise ValueError(f"--stage {args.stage}: the llama {program} program has no such stage"
                         f"{' (it is forward only)' if program != 'train' else ''}")
    with compile_progress(args, f"llama {program}"):
        prog = jg_compile(graph, fuse=not args.no_fuse, plan_memory=not args.no_plan,
                          check_finite=args.stage == "guard" and not kw.get("loss_scale"),
                          target=compile_target(args), **kw)
    return emit(args, prog)


def _gguf_config(path):
    """A LlamaConfig from a GGUF file's metadata alone (no weights read), its context capped
    at `dump llama`'s default so the program stays small."""
    from ..formats.gguf_metadata import read_metadata
    from ..models.llama import LlamaConfig
    check_model_file(path, "--gguf")
    cfg = LlamaConfig.from_metadata(read_metadata(path))
    return dataclasses.replace(cfg, ctx=min(cfg.ctx, DEFAULTS["ctx"]))

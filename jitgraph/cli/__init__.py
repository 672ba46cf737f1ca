"""The jitgraph command line: train, eval, dump, bench.

Exit status: 0 success, 1 a benchmark failed, 2 a usage or input error (one line naming the
option or file), 130 interrupted by Ctrl-C, 143 terminated by SIGTERM. Every option and output
path is checked before anything is compiled or trained.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
import warnings

from jitgraph.passes.pipeline import IR_STAGES as STAGES   # the IRs `dump --stage` can print

EXIT_ERROR, EXIT_INTERRUPT, EXIT_TERMINATED = 2, 130, 143
# training options a checkpoint records: `--resume` continues with these, not the command line's
RESUMED = ("batch_size", "logical_batch", "lr", "val_split", "seed", "data", "n_train",
           "no_fuse", "no_plan")


class Terminated(BaseException):
    """SIGTERM, raised in the main thread by the CLI's handler (so `finally` blocks run: an
    atomic write removes its temporary file)."""


def _raise_terminated(signum, frame):
    raise Terminated()


# ---- option types: each error names the value and what is allowed (argparse adds the flag) ----
def _int_at_least(lo):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def _float_in(lo, hi=math.inf, lo_open=False, hi_open=True, what=None):
    what = what or (f"a number > {lo}" if lo_open and hi == math.inf else
                    f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")

    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        bad = (not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi
               or (hi_open and v == hi))
        if bad:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v
    parse.__name__ = what
    return parse


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option's help that has a default and does not say it."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if "default" not in h and action.option_strings and \
                not (d is None or d is False or d is argparse.SUPPRESS):
            h += " (default: %(default)s)"
        return h


# ---- helpers -----------------------------------------------------------------------------------
def _data_kind(args):
    return "mnist" if args.data else "synthetic"


def _describe_data(args, train_ds, test_ds):
    sizes = ", ".join(f"{len(d)} {k}" for k, d in (("training", train_ds), ("test", test_ds))
                      if d is not None)
    if args.data:
        return f"data: MNIST from {args.data} ({sizes} samples)"
    return f"data: built-in synthetic digits, seed {args.seed} ({sizes} samples; --data DIR " \
           f"for real MNIST)"


def _load_data(args, need_train=True):
    """(train, test) data sets: real MNIST from --data, else the built-in synthetic digits."""
    from ..formats import data
    if args.data:
        if not os.path.isdir(args.data):
            raise FileNotFoundError(f"--data {args.data}: no such directory")
        train = data.load_mnist(args.data, "train") if need_train else None
        return train, data.load_mnist(args.data, "test")
    train = data.synthetic_digits(args.n_train, seed=args.seed) if need_train else None
    return train, data.synthetic_digits(args.n_test, seed=args.seed + 1_000_003)


def _finite(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def _say(args, *msg):
    if not args.quiet:
        print(*msg, flush=True)


def _warn(args, msg):
    print(f"jitgraph {args.cmd}: warning: {msg}", file=sys.stderr, flush=True)


def adopt_resumed(args, path, saved, warn=_warn):
    """Continue with the training options the checkpoint at `path` recorded (`saved`: option ->
    value; a bit-exact resume needs them), warning through `warn` about each option the user
    gave that they override."""
    given = getattr(args, "given", set())
    ignored = [f"{_flag(k, getattr(args, k))} (checkpoint: {_shown(v)})"
               for k, v in saved.items() if k in given and getattr(args, k) != v]
    if ignored:
        warn(args, f"--resume {path} continues with the checkpoint's training options (a "
                   f"bit-exact resume needs them); ignored {', '.join(ignored)}")
    for k, v in saved.items():
        setattr(args, k, v)


def _check_model_file(path, what, kind="a model file"):
    """An input file that exists and is not a directory (`kind`: what it should be)."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what} {path}: is a directory, not {kind}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path}: no such file")


@contextlib.contextmanager
def _compile_progress(args, what):
    """A progress bar of kernels compiled / total while `what` compiles: on a terminal only
    (stderr a tty) and not with --quiet; it shows after half a second, so loading cached
    kernels prints nothing."""
    if args.quiet or not sys.stderr.isatty():
        yield
        return
    from tqdm import tqdm
    from ..runtime.cpu import cache
    bar = None

    def report(done, total):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=f"compiling {what}", unit="kernel", file=sys.stderr,
                       leave=False, delay=0.5, dynamic_ncols=True)
        elif done == 0:
            bar.reset(total)
        bar.update(done - bar.n)

    old = cache.set_progress(report)
    try:
        yield
    finally:
        cache.set_progress(old)
        if bar is not None:
            bar.close()


class _Run:
    """What an interrupt message reports: the files this run wrote and what they hold."""
    checkpoint = None      # the last checkpoint written (or resumed from)
    epoch = None
    unit = "epoch"         # what `epoch` counts ("step" for the llama commands)
    out = None             # (--out path, what it holds) once written
    unsaved = False        # neither --out nor --checkpoint: the run writes nothing

    @classmethod
    def reset(cls):
        cls.checkpoint = cls.epoch = cls.out = None
        cls.unit, cls.unsaved = "epoch", False


def note_unsaved(args, root=True) -> None:
    """A training run given neither --out nor --checkpoint says so once at its start (on MPI's
    rank 0: `root`), and again if interrupted."""
    if not args.out and not args.checkpoint:
        _Run.unsaved = True
        if root:
            _warn(args, "neither --out nor --checkpoint is given: nothing of this run will be "
                        "saved")


# ---- commands ----------------------------------------------------------------------------------
def _given(parser, argv):
    """Dests of the options given on the command line `argv` (parsed again, defaults hidden)."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a, d in saved:
            a.default = d


def _flag(dest, value):
    flag = "--" + dest.replace("_", "-")
    return flag if isinstance(value, bool) else f"{flag} {value}"


def _shown(v):
    return "none" if v is None else "off" if v is False else "on" if v is True else v


# what a training checkpoint's meta holds (written by `_train`), and its JSON types
_META = {"args": dict, "epoch": int, "calls": int, "rng": dict, "order": list}


def _check_meta(path, meta):
    """A checkpoint whose meta lacks a field or holds the wrong kind is a ModelFormatError."""
    from jitgraph.errors import ModelFormatError
    for k, kind in _META.items():
        v = meta.get(k)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ModelFormatError(f"{path}: checkpoint meta field {k!r} is missing or not a "
                                   f"{kind.__name__} (got {type(v).__name__})")
    if meta["epoch"] < 0 or meta["calls"] < 0:
        raise ModelFormatError(f"{path}: checkpoint meta has a negative epoch or step count")


def _train(args):
    """`train`; under `mpiexec -n N` data-parallel (jitgraph/distributed.py): --batch-size is
    the global batch, rank 0 prints and writes files, a rank's error aborts the job."""
    from ..distributed import world as mpi_world
    world = mpi_world()
    if world is None:
        return _train_ranks(args, None)
    if not world.is_root:
        args.quiet, args.json = True, False
    with world.abort_on_error():
        return _train_ranks(args, world)


def _train_ranks(args, world):
    import numpy as np
    from .. import compile as jg_compile, optim
    from ..formats.gguf import load_checkpoint, save_checkpoint, save_model
    from ..models import MODELS
    from .train import Trainer, evaluate, train_samples

    # everything that can fail is checked before anything compiles or trains
    check_outputs(args, {"--resume": args.resume, "--data": args.data})
    meta = None
    if args.resume:
        _check_model_file(args.resume, "--resume", "a checkpoint file")
        arch, params, state, meta = load_checkpoint(args.resume)
        _check_meta(args.resume, meta)
        if arch != args.model:
            raise ValueError(f"--resume {args.resume}: holds a {arch} checkpoint, not "
                             f"{args.model}")
        adopt_resumed(args, args.resume, {k: meta["args"].get(k, False if k.startswith("no_")
                                                             else None) for k in RESUMED})
        _Run.checkpoint, _Run.epoch = args.resume, meta["epoch"]   # until a newer one is saved
    elif args.logical_batch is not None and (args.logical_batch < args.batch_size or
                                             args.logical_batch % args.batch_size):
        args.parser.error(f"argument --logical-batch: must be a multiple of --batch-size "
                          f"{args.batch_size} (gradient accumulation over whole batches), got "
                          f"{args.logical_batch}")
    train_ds, test_ds = _load_data(args)
    _say(args, _describe_data(args, train_ds, test_ds))
    lb = args.logical_batch or args.batch_size
    if len(train_ds) < lb:
        what = f"--logical-batch {lb}" if args.logical_batch else f"--batch-size {lb}"
        raise ValueError(f"{what}: larger than the {len(train_ds)} training samples"
                         f"{'' if args.data else ' (--n-train)'}")
    try:
        train_samples(len(train_ds), args.batch_size, lb, args.val_split)
    except ValueError:
        raise ValueError(f"--val-split {args.val_split} leaves no training batch: "
                         f"{len(train_ds)} samples make {len(train_ds) // lb} batch(es) of {lb}") \
            from None
    if meta is not None and meta["epoch"] >= args.epochs:
        _warn(args, f"--resume {args.resume} is at epoch {meta['epoch']}, --epochs is "
                    f"{args.epochs}: nothing left to train")

    note_unsaved(args, world is None or world.is_root)
    graph = MODELS[args.model](args.batch_size if world is None else
                               world.local_batch(args.batch_size))
    acc = lb // args.batch_size
    opt = optim.AdamW(lr=args.lr, accumulate=acc)
    target = compile_target(args)
    t0 = time.perf_counter()

    def build():
        prog = jg_compile(graph, loss="loss", optimizer=opt, fuse=not args.no_fuse,
                          plan_memory=not args.no_plan, seed=args.seed,
                          hook=None if world is None else world.hook, target=target)
        return prog, Trainer(prog, train_ds, batch_size=args.batch_size,
                             logical_batch=args.logical_batch, val_split=args.val_split,
                             seed=args.seed, world=world)
    with _compile_progress(args, args.model):
        prog, trainer = build() if world is None else world.first(build)
    compile_s = time.perf_counter() - t0      # training program and its evaluator
    if meta is not None:
        for k, v in params.items():
            prog.params[k] = v
        for k, v in state.items():
            prog.state[k] = v
        prog.calls, trainer.epoch = meta["calls"], meta["epoch"]
        trainer.rng.bit_generator.state = meta["rng"]
        trainer.order = np.asarray(meta["order"], dtype=np.int64)
    _say(args, f"{args.model}: batch {args.batch_size}"
               f"{f', logical batch {lb}' if lb != args.batch_size else ''}, "
               f"{trainer.n_train} samples train and {len(train_ds) - trainer.n_train} validate "
               f"each epoch; compiled in {compile_s:.2f} s")
    if world is not None:
        _say(args, f"data parallel: {world.size} MPI ranks, {args.batch_size // world.size} "
                   f"samples of each batch and {world.threads} thread(s) per rank")
    progress = None if not args.quiet else False
    epoch_seconds, last = [], None
    try:
        while trainer.epoch < args.epochs:
            last = trainer.run_one_epoch(progress)
            epoch_seconds.append(last.seconds)
            _say(args, f"epoch {last.epoch}/{args.epochs}: train {last.train}  val {last.val}  "
                       f"({last.seconds:.2f} s)")
            if args.checkpoint and (world is None or world.is_root):
                meta_out = {"args": {k: getattr(args, k) for k in RESUMED},
                            "calls": prog.calls, "epoch": trainer.epoch,
                            "rng": trainer.rng.bit_generator.state,
                            "order": trainer.order.tolist()}
                save_checkpoint(args.checkpoint, args.model, dict(prog.params), dict(prog.state),
                                meta_out, data=_data_kind(args))
                _Run.checkpoint, _Run.epoch = args.checkpoint, trainer.epoch
    except (KeyboardInterrupt, Terminated):
        if args.out and world is None:      # the weights after the last whole step
            save_model(args.out, args.model, dict(prog.params), data=_data_kind(args))
            n = prog.calls
            _Run.out = (args.out, f"the model after {n} step{'s' * (n != 1)} (interrupted in "
                                  f"epoch {trainer.epoch + 1})")
        raise
    test = evaluate(trainer.evaluator, test_ds, args.batch_size, progress, world=world)
    _say(args, f"test ({test.ndata} samples): {test}")
    if args.out and (world is None or world.is_root):
        save_model(args.out, args.model, dict(prog.params), data=_data_kind(args))
        _say(args, f"saved {args.out}")
    if args.json:
        n_train = trainer.n_train * len(epoch_seconds)
        print(json.dumps({
            "test_acc": _finite(test.accuracy()[0]), "test_loss": _finite(test.loss()[0]),
            "train_loss": _finite(last.train.loss()[0]) if last else None,
            "val_acc": _finite(last.val.accuracy()[0]) if last else None,
            "epochs": trainer.epoch, "epoch_seconds": epoch_seconds,
            "compile_seconds": compile_s,
            "samples_per_second": n_train / sum(epoch_seconds) if epoch_seconds else None,
            "data": _data_kind(args), "n_test": test.ndata,
            **({} if world is None else {"mpi_ranks": world.size,
                                         "allreduce_seconds": world.seconds["allreduce"]})}))
    return 0


def _eval(args):
    from .. import compile as jg_compile
    from ..formats.gguf import load_model, trained_on
    from ..models import MODELS
    from .train import evaluate
    _check_model_file(args.model_file, "model")
    arch, params = load_model(args.model_file)
    trained = trained_on(args.model_file)
    if not args.data and trained not in (None, "synthetic"):
        name = {"mnist": "MNIST"}.get(trained, trained)
        raise ValueError(f"{args.model_file} was trained on {name} data; pass --data DIR "
                         f"to evaluate it on that data set (without --data, eval uses the "
                         f"built-in synthetic digits)")
    if not args.data and trained is None:
        _warn(args, f"{args.model_file} does not record its training data (a model not "
                    f"written by `jitgraph train`); evaluating on the built-in synthetic "
                    f"digits; pass --data DIR for MNIST")
    _, test_ds = _load_data(args, need_train=False)
    _say(args, _describe_data(args, None, test_ds))
    batch = min(args.batch_size, len(test_ds))   # a larger batch would only be padding
    with _compile_progress(args, arch):
        prog = jg_compile(MODELS[arch](batch))
    for k, v in params.items():
        prog.params[k] = v
    res = evaluate(prog, test_ds, batch, None if not args.quiet else False)
    _say(args, f"{arch} {args.model_file} ({res.ndata} test samples): {res}")
    if args.json:
        (l, lu), (a, au) = res.loss(), res.accuracy()
        print(json.dumps({"test_acc": _finite(a), "test_acc_unc": _finite(au),
                          "test_loss": _finite(l), "test_loss_unc": _finite(lu), "n": res.ndata,
                          "data": _data_kind(args)}))
    return 0


def _perplexity(args):
    from ..models.llama import read_llama
    from ..models.perplexity import perplexity, split_text
    _check_model_file(args.model_file, "model")
    _check_stdout(args)
    model = read_llama(args.model_file)
    if args.text is None:
        raise ValueError("--text FILE is required: the text to score (e.g. "
                         "../shared/data/text/tinyshakespeare.txt)")
    _check_model_file(args.text, "--text", "a text file")
    target = compile_target(args)
    lora = _read_lora(args, model[0])
    part = split_text(args.text, args.split, errors=None)
    text = part.decode("utf-8", "replace")
    _say(args, f"{args.model_file}: {model[0].layers} layers, width {model[0].dim}; text "
               f"{args.text} ({args.split}: {len(part)} bytes), n_ctx {args.ctx}")
    bar = None if args.quiet or not sys.stderr.isatty() else _tqdm_bar("perplexity")
    try:
        res = perplexity(model, text, n_ctx=args.ctx, batch=args.batch_size, kv_f16=args.kv_f16,
                         progress=None if bar is None else bar, lora=lora,
                         lora_scale=args.lora_scale, target=target)
    finally:                        # an error's line is not written over the bar
        if bar is not None:
            bar.close()
    _say(args, res)
    if args.json:
        print(json.dumps({"perplexity": res.ppl, "uncertainty": res.uncertainty,
                          "chunks": res.chunks, "scored_tokens": res.scored,
                          "n_ctx": args.ctx, "seconds": res.seconds,
                          "tokens_per_second": res.tokens_per_second}))
    return 0


# C0 controls but newline and tab, DEL, and C1 controls, shown as Python escapes on a terminal:
# a token's bytes (or a prompt) holding ESC ] 0 ; ... BEL would retitle the window, ESC [ 2 J clear
# it. A prompt's undecodable bytes (surrogate escapes) are shown as \xNN too. Piped output is
# written as it is.
_CONTROLS = {**{c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (9, 10)},
             **{c: f"\\x{c - 0xDC00:02x}" for c in range(0xDC80, 0xDD00)}}


def _for_terminal(text: str) -> str:
    return text.translate(_CONTROLS)


def _check_stdout(args):
    """Raise OSError when standard output is closed (`>&-`) and the command has output."""
    if sys.stdout is None and (args.json or not args.quiet):
        raise OSError(f"standard output is closed: nowhere to write the output; redirect it "
                      f"(e.g. >/dev/null){'' if args.json else ' or pass --quiet'}")


def _generate(args):
    from ..errors import NonFiniteError
    from ..models.generate import Generator, Sampler, check_context, stream_text
    from ..models.llama import read_llama
    _check_model_file(args.model_file, "model")
    _check_stdout(args)
    apply_threads(args)
    cfg, params, tok = read_llama(args.model_file)
    if tok is None:
        raise ValueError(f"{args.model_file}: the model has no tokenizer in its metadata (SPM "
                         f"or BPE: tokenizer.ggml.model llama or gpt2)")
    ctx = args.ctx if args.ctx is not None else min(512, cfg.ctx)
    if ctx > cfg.ctx:
        raise ValueError(f"--ctx {ctx} exceeds the model's context length {cfg.ctx} "
                         f"({cfg.arch}.context_length)")
    prompt_ids = tok.encode(args.prompt, bos=tok.add_bos)
    check_context(len(prompt_ids), args.n_predict, ctx)   # before compiling anything
    target = compile_target(args)
    lora = _read_lora(args, cfg)
    sampler = Sampler(args.temp, args.top_k, args.top_p, args.seed)
    with _compile_progress(args, "generate"):
        gen = Generator((cfg, params, tok), ctx=ctx, chunk=args.chunk,
                        kv_f16=not args.no_kv_f16, lora=lora, lora_scale=args.lora_scale,
                        target=target)
    out = sys.stdout
    shown = _for_terminal if out is not None and out.isatty() else str

    def write(text):
        out.write(shown(text))
        out.flush()

    on_token = None
    if not args.quiet:
        write(args.prompt)
        on_token = stream_text(tok, write)
    try:
        res = gen.generate(prompt_ids, args.n_predict, sampler, stop_at_eos=not args.ignore_eos,
                           on_token=on_token)
    except NonFiniteError:
        if on_token is not None:
            write("\n")                 # the error line starts on a line of its own
        raise
    if on_token is not None:
        on_token.flush()
        write("\n")
        per_token = res.decode_seconds / max(len(res.ids), 1) * 1e6
        print(f"jitgraph generate: {len(res.ids)} tokens ({res.stop}) in {res.seconds:.4f} s: "
              f"{res.tokens_per_second:,.0f} tokens/s (prompt {len(prompt_ids)} tokens "
              f"{res.prefill_seconds * 1e3:.2f} ms, {per_token:.1f} us a token); ctx {ctx}, "
              f"compiled in {gen.compile_seconds:.2f} s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({**res.as_dict(), "text": res.text, "ctx": ctx, "seed": sampler.seed,
                          "temp": args.temp, "top_k": args.top_k, "top_p": args.top_p,
                          "kv_f16": not args.no_kv_f16, "compile_seconds": gen.compile_seconds}))
    return 0


def _read_lora(args, cfg, merged=False):
    """(adapter params, alpha) of --lora, checked against the base model's config; None without
    --lora (then --lora-scale is an error). `merged`: the command merges it into the weights
    (export), else it is applied unmerged."""
    if args.lora is None:
        if args.lora_scale != 1.0:
            raise ValueError("--lora-scale needs --lora ADAPTER.gguf")
        return None
    from ..models.lora import read_adapter
    _check_model_file(args.lora, "--lora", "an adapter file")
    params, alpha = read_adapter(args.lora, cfg)
    n = len(params) // 2
    _say(args, f"--lora {args.lora}: {n} adapted weights, rank "
               f"{sorted({a.shape[0] for k, a in params.items() if k.endswith('.lora_a')})}, "
               f"alpha {alpha:g}, scale {args.lora_scale:g}"
               f"{'' if merged else ' (applied unmerged)'}")
    return params, alpha


def _export(args):
    from ..models.llama import read_llama, tokenizer_fields, write_llama
    from ..models.lora import merge
    _check_model_file(args.model_file, "model")
    check_outputs(args, {"the base model": args.model_file, "--lora": args.lora})
    cfg, params, tok = read_llama(args.model_file)
    adapter, alpha = _read_lora(args, cfg, merged=True)
    merged = merge(params, adapter, alpha, args.lora_scale)
    vocabulary = tokenizer_fields(args.model_file) if tok is None else None   # BPE: as it is
    write_llama(args.out, cfg, merged, tok, ftype=args.ftype, vocabulary=vocabulary,
                name=f"{os.path.basename(args.model_file)} + {os.path.basename(args.lora)}")
    _say(args, f"saved {args.out}: {args.model_file} with {args.lora} merged (scale "
               f"{args.lora_scale:g}, {args.ftype})")
    return 0


class _tqdm_bar:
    """progress(chunks_done, n_chunks, running_ppl) as a tqdm bar on the terminal."""

    def __init__(self, desc):
        self.desc, self.bar = desc, None

    def __call__(self, done, total, ppl):
        from tqdm import tqdm
        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.desc, unit="chunk", leave=False)
        self.bar.update(done - self.bar.n)
        self.bar.set_postfix(ppl=f"{ppl:.2f}")

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _lora_options(p, required=False):
    p.add_argument("--lora", metavar="ADAPTER.gguf", required=required,
                   help="a llama.cpp LoRA adapter for this base model" +
                        ("" if required else ", applied unmerged at load; default: none"))
    p.add_argument("--lora-scale", type=_float_in(-math.inf, what="a finite number"),
                   default=1.0, metavar="S",
                   help="the adapter's scale, as llama.cpp's --lora-scaled (0: the base model)")


def _dump(args):
    from .. import compile as jg_compile, optim
    from ..models import MODELS
    if args.model == "llama":
        from .llama_train import dump_llama
        return dump_llama(args)
    graph = MODELS[args.model](args.batch_size or 100)
    if args.stage == "graph":
        print(graph)
        return 0
    with _compile_progress(args, args.model):
        prog = jg_compile(graph, loss="loss", optimizer=optim.AdamW(lr=1e-3),
                          fuse=not args.no_fuse, plan_memory=not args.no_plan,
                          check_finite=args.stage == "guard",   # the stage check_finite adds
                          target=compile_target(args))
    print(prog.ir(args.stage))
    return 0


# ---- the parser --------------------------------------------------------------------------------
def _common_data(p):
    p.add_argument("--data", metavar="DIR", help="directory of the MNIST IDX files (.gz or raw); "
                                                 "default: the built-in synthetic digits")
    p.add_argument("--n-train", type=_int_at_least(1), default=12000, metavar="N",
                   help="built-in data: training samples")
    p.add_argument("--n-test", type=_int_at_least(1), default=2000, metavar="N",
                   help="built-in data: test samples")
    p.add_argument("--seed", type=_int_at_least(0), default=0, metavar="S",
                   help="seed of the initial weights, the data order and the built-in data")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars, no per-epoch or summary lines")


def _threads(text):
    """--threads: an integer from 1 to 4x the cores."""
    from ..runtime.cpu.threading import max_threads
    top = max_threads()
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or not 1 <= v <= top:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {top} (4x this "
                                         f"machine's {top // 4} cores), got {text!r}")
    return v


_threads.__name__ = "thread count"


def add_threads_flag(p):
    """--threads N: threads of a command's GEMMs and parallel kernels (apply_threads)."""
    p.add_argument("--threads", type=_threads, default=None, metavar="N",
                   help="threads for GEMMs and parallel kernels (JITGRAPH_NUM_THREADS); 1 is "
                        "much faster on a machine whose cores other jobs keep busy; default: "
                        "all cores")


def apply_threads(args):
    """--threads, before the GEMM library loads (it reads the count once) and before MPI sets
    the per-rank threads from it."""
    if getattr(args, "threads", None):
        os.environ["JITGRAPH_NUM_THREADS"] = str(args.threads)


def check_outputs(args, inputs: dict) -> None:
    """--out and --checkpoint (those `args` has) writable for real, distinct, and none of them
    one of `inputs` (option -> path; --checkpoint may be --resume), before anything compiles."""
    from ..formats.paths import check_not_inputs, check_writable
    outputs = {f: getattr(args, f[2:], None) for f in ("--out", "--checkpoint")}
    check_not_inputs(outputs, inputs, allow=(("--checkpoint", "--resume"),))
    for flag, path in outputs.items():
        if path:
            check_writable(path, flag)


def add_compile_flags(p):
    """--no-fuse and --no-plan, the compiler switches every compiling command offers."""
    p.add_argument("--no-fuse", action="store_true",
                   help="compile without kernel fusion (slower; for comparison)")
    p.add_argument("--no-plan", action="store_true",
                   help="one buffer per value, no memory planning (for comparison)")
    add_target_flags(p)


def add_target_flags(p):
    """--target and --device: where a command's compiled programs run."""
    p.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                   help="where the compiled step runs: cpu (numba) or cuda (an NVIDIA GPU; "
                        "needs the cuda extra, pip install -e '.[cuda]')")
    p.add_argument("--device", type=_int_at_least(0), default=None, metavar="N",
                   help="--target cuda: the GPU to run on (default: 0)")


def compile_target(args) -> str:
    """The target of add_compile_flags' --target / --device, checked before anything compiles:
    a ValueError (exit 2) says why CUDA cannot run here (no numba-cuda, no GPU, no device N)."""
    target = getattr(args, "target", "cpu")
    device = getattr(args, "device", None)
    if target != "cuda":
        if device is not None:
            raise ValueError(f"--device {device}: only with --target cuda")
        return target
    from ..runtime.cuda.device import select
    try:
        select(device or 0)
    except RuntimeError as e:
        raise ValueError(str(e)) from None
    return target


def parser():
    from ..models import MODELS
    models = sorted(MODELS)
    p = argparse.ArgumentParser(
        prog="jitgraph", formatter_class=_HelpFormatter,
        description="A JIT compiler for neural-network training graphs: train and evaluate "
                    "the MNIST models with compiled kernels.",
        epilog="exit status: 0 success, 1 a benchmark failed, 2 a usage or input error, "
               "130 Ctrl-C, 143 SIGTERM")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name, help):
        return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                              formatter_class=_HelpFormatter, allow_abbrev=False,
                              epilog=p.epilog)

    from .llama_train import add_dump_options, add_finetune, add_train_llama
    tr = command("train", "train a model with compiled kernels: an MNIST model, or a llama on "
                          "text")
    ts = tr.add_subparsers(dest="model", required=True, metavar="MODEL",
                           help=f"{', '.join(models)} (MNIST digits) or llama (a language model "
                                f"on text); `jitgraph train MODEL --help` lists its options")
    t = argparse.ArgumentParser(add_help=False)     # the MNIST models' options
    _common_data(t)
    t.add_argument("--epochs", type=_int_at_least(1), default=2, metavar="N",
                   help="epochs in all (with --resume: counting the checkpoint's)")
    t.add_argument("--batch-size", type=_int_at_least(1), default=100, metavar="B",
                   help="samples per compiled step")
    t.add_argument("--logical-batch", type=_int_at_least(1), default=None, metavar="L",
                   help="samples per optimizer step, a multiple of --batch-size (gradient "
                        "accumulation); default: the batch size")
    t.add_argument("--lr", type=_float_in(0, lo_open=True), default=1e-3,
                   help="AdamW learning rate")
    t.add_argument("--val-split", type=_float_in(0, 1), default=0.05, metavar="F",
                   help="fraction of the training data held out to validate after each epoch")
    t.add_argument("--out", metavar="MODEL.gguf",
                   help="save the trained model as GGUF (ggml's MNIST layout); default: not saved")
    t.add_argument("--checkpoint", metavar="CKPT.gguf",
                   help="save a training checkpoint after every epoch; default: none")
    t.add_argument("--resume", metavar="CKPT.gguf",
                   help="continue a checkpointed run bit for bit, with the checkpoint's training "
                        "options (batch sizes, --lr, --val-split, --seed, data); default: start "
                        "afresh")
    add_compile_flags(t)
    for m in models:
        h = f"train the MNIST model {m} with compiled kernels"
        mp = ts.add_parser(m, parents=[t], help=h, description=h[0].upper() + h[1:] + ".",
                           formatter_class=_HelpFormatter, allow_abbrev=False, epilog=p.epilog)
        mp.set_defaults(fn=_train, parser=mp)
    h = "train a llama language model from scratch on a text, with compiled kernels"
    add_train_llama(ts.add_parser("llama", help=h, description=h[0].upper() + h[1:] + ".",
                                  formatter_class=_HelpFormatter, allow_abbrev=False,
                                  epilog=p.epilog))

    e = command("eval", "evaluate a GGUF model on the test set")
    e.add_argument("model_file", metavar="MODEL.gguf",
                   help="a model or checkpoint written by `jitgraph train` or by ggml's MNIST "
                        "example")
    _common_data(e)
    e.add_argument("--batch-size", type=_int_at_least(1), default=100, metavar="B",
                   help="samples per compiled step (every test sample is evaluated)")
    e.set_defaults(fn=_eval, parser=e)

    d = command("dump", "print a model's IR after a compiler stage")
    d.add_argument("model", choices=models + ["llama"],
                   help=f"the model: {', '.join(models)}, llama")
    d.add_argument("--stage", choices=STAGES, default="kernels",
                   help=f"the stage: {', '.join(STAGES)}")
    d.add_argument("--batch-size", type=_int_at_least(1), default=None, metavar="B",
                   help="samples per step (default: 100; llama: 16 windows of 128 tokens)")
    add_dump_options(d)
    add_compile_flags(d)
    d.add_argument("--quiet", action="store_true", help="no compile progress bar")
    d.set_defaults(fn=_dump, parser=d)

    q = command("perplexity", "perplexity of a llama GGUF model on a text, with llama.cpp's "
                              "method")
    q.add_argument("model_file", metavar="MODEL.gguf", help="a llama model in llama.cpp's GGUF "
                                                          "layout")
    q.add_argument("--text", metavar="FILE", help="the text to score (UTF-8); required")
    q.add_argument("--split", default="tail:0.1", metavar="SPEC",
                   help="which part of the file: tail:F (its last F of bytes: the held-out "
                        "split), head:F (the rest), all")
    q.add_argument("--ctx", type=_int_at_least(3), default=128, metavar="N",
                   help="tokens per chunk (n_ctx); the second half of each chunk is scored")
    q.add_argument("--batch-size", type=_int_at_least(1), default=8, metavar="B",
                   help="chunks per compiled forward pass")
    q.add_argument("--kv-f16", action="store_true",
                   help="round K, V, queries and attention probabilities to float16 as "
                        "llama.cpp's F16 KV cache does (slower)")
    q.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    q.add_argument("--quiet", action="store_true", help="print only the JSON / the result")
    add_target_flags(q)
    _lora_options(q)
    q.set_defaults(fn=lambda a: in_worker(_perplexity, a), parser=q)

    n = command("generate", "generate text with a llama GGUF model: one compiled decode "
                            "program over a KV cache, streaming the text")
    n.add_argument("model_file", metavar="MODEL.gguf", help="a llama model in llama.cpp's GGUF "
                                                          "layout, with its tokenizer")
    n.add_argument("--prompt", default="", metavar="TEXT",
                   help="the text to continue (BOS added as the vocabulary says); default: none")
    n.add_argument("-n", "--n-predict", type=_int_at_least(0), default=128, metavar="N",
                   help="tokens to generate (fewer when EOS comes first)")
    n.add_argument("--ctx", type=_int_at_least(1), default=None, metavar="C",
                   help="context: the KV cache's capacity in tokens, which the prompt and N "
                        "must fit; default: 512 or the model's context length if smaller")
    n.add_argument("--temp", type=_float_in(0), default=0.8, metavar="T",
                   help="sampling temperature; 0: greedy (argmax)")
    n.add_argument("--top-k", type=_int_at_least(0), default=40, metavar="K",
                   help="sample among the K most likely tokens (0: all)")
    n.add_argument("--top-p", type=_float_in(0, 1, lo_open=True, hi_open=False), default=0.95,
                   metavar="P", help="then among the fewest most likely tokens whose "
                                     "probabilities reach P (1: all)")
    n.add_argument("--seed", type=_int_at_least(0), default=None, metavar="S",
                   help="sampling seed; default: random (reported with --json)")
    n.add_argument("--chunk", type=_int_at_least(1), default=16, metavar="B",
                   help="prompt tokens per prefill program call")
    n.add_argument("--ignore-eos", action="store_true",
                   help="go on after the end-of-sequence token (always N tokens)")
    n.add_argument("--no-kv-f16", action="store_true",
                   help="keep K, V, queries and attention probabilities in float32 (default: "
                        "rounded to float16 as llama.cpp's F16 KV cache does)")
    add_threads_flag(n)
    n.add_argument("--json", action="store_true",
                   help="print one JSON object as the last line (tokens/s, timings, the text)")
    n.add_argument("--quiet", action="store_true",
                   help="no streamed text and no summary line: only the JSON")
    _lora_options(n)
    add_target_flags(n)
    n.set_defaults(fn=lambda a: in_worker(_generate, a), parser=n)

    x = command("export", "merge a LoRA adapter into a llama GGUF model, as llama.cpp's "
                          "export-lora does")
    x.add_argument("model_file", metavar="BASE.gguf", help="the base llama model")
    _lora_options(x, required=True)
    x.add_argument("--out", required=True, metavar="MERGED.gguf", help="the merged model to write")
    x.add_argument("--ftype", choices=("f32", "f16", "q8_0"), default="f32",
                   help="storage of the merged 2-D weights")
    x.add_argument("--quiet", action="store_true", help="no summary line")
    x.set_defaults(fn=_export, parser=x)

    add_finetune(command("finetune", "finetune a llama GGUF model on a text: LoRA adapters on "
                                     "the frozen model, or every weight"))

    from .tokenize import add_tokenize
    add_tokenize(command("tokenize", "print the token ids of a text under a GGUF model's "
                                     "tokenizer, as llama.cpp's llama-tokenize does"))

    sub.add_parser("bench", help="fused against unfused benchmark suite (see `jitgraph bench "
                                 "--help`)", add_help=False)
    return p


def _interrupted(cmd, how, code):
    saved = []
    if _Run.out:
        saved.append(f"{_Run.out[0]} holds {_Run.out[1]}")
    if _Run.checkpoint:
        saved.append(f"last checkpoint: {_Run.checkpoint} ({_Run.unit} {_Run.epoch}), continue "
                     f"with --resume {_Run.checkpoint}")
    if _Run.unsaved:
        saved.append("nothing was saved (neither --out nor --checkpoint was given)")
    start = "\n" if sys.stderr.isatty() else ""       # off the line of a progress bar or ^C
    print(f"{start}jitgraph {cmd}: {how}{''.join('; ' + s for s in saved)}", file=sys.stderr,
          flush=True)
    return code


def in_worker(fn, *args):
    """fn(*args) on a daemon thread while the main thread waits: a long native call (the
    compiled step releases the GIL) cannot hold off Ctrl-C or SIGTERM, whose exceptions the
    main thread raises at once; the worker ends with the process. For commands that write
    nothing (generate, perplexity): nothing is left half done."""
    import threading

    from ..runtime.cpu import blas  # noqa: F401  (it sets up OpenBLAS's threads on load, which
    #                                 it may do only while no other thread runs)
    box = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as e:          # noqa: BLE001 - re-raised on the main thread
            box["error"] = e

    t = threading.Thread(target=run, name="jitgraph-worker", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["result"]


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"jitgraph: warning: {message}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd = argv[0] if argv and not argv[0].startswith("-") else "jitgraph"
    _Run.reset()
    old_handler = None
    with contextlib.suppress(ValueError):       # (only the main thread can set handlers)
        old_handler = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            if argv[:1] == ["bench"]:           # the suite parses its own options
                from .bench import main as bench_main
                return bench_main(argv[1:])
            p = parser()
            args = p.parse_args(argv)
            from ..runtime.cpu.threading import requested_threads
            try:
                if not getattr(args, "threads", None):    # (--threads replaces it)
                    requested_threads()
            except ValueError as e:
                args.parser.error(str(e))
            if args.cmd in ("train", "finetune") and args.resume:   # train MODEL: its own parser
                args.given = _given(args.parser, argv[2:] if args.cmd == "train" else argv[1:])
            try:
                return args.fn(args)
            except BrokenPipeError:             # `jitgraph dump ... | head`: not an error
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
            except (ValueError, OSError) as e:
                print(f"jitgraph {args.cmd}: error: {_message(e)}", file=sys.stderr)
                return EXIT_ERROR
            except MemoryError as e:
                print(f"jitgraph {args.cmd}: error: {str(e) or 'out of memory'}; "
                      f"{_smaller(args)}", file=sys.stderr)
                return EXIT_ERROR
    except KeyboardInterrupt:
        return _interrupted(cmd, "interrupted (Ctrl-C)", EXIT_INTERRUPT)
    except Terminated:
        return _interrupted(cmd, "terminated (SIGTERM)", EXIT_TERMINATED)
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)


# the options that size each command's programs, named when a program does not fit in memory
_SIZES = {"train": "--batch-size", "train llama": "--ctx, --batch-size, --dim or --layers (or "
          "--recompute sqrt)", "finetune": "--ctx or --batch-size (or --recompute sqrt)",
          "generate": "--ctx", "perplexity": "--ctx or --batch-size", "eval": "--batch-size",
          "dump": "--batch-size"}


def _smaller(args) -> str:
    cmd = "train llama" if args.cmd == "train" and args.model == "llama" else args.cmd
    return f"try a smaller {_SIZES[cmd]}" if cmd in _SIZES else "try smaller sizes"


def _message(e) -> str:
    """An error in the user's terms: OSErrors as `path: reason`."""
    if isinstance(e, OSError) and e.strerror and e.filename:
        return f"{e.filename}: {e.strerror}"
    return str(e)

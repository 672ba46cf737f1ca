"""`jitgraph train MODEL`, `jitgraph eval` and `jitgraph dump` for the MNIST models: training on
jg.fit's loop (jitgraph/training.py) with checkpoints and --resume, MPI data parallelism, and the
options of the MNIST data (--data, or the built-in synthetic digits)."""
from __future__ import annotations

import json
import math
import os
import time

from .common import (Run, Terminated, adopt_resumed, check_model_file, check_outputs,
                     compile_progress, compile_target, f32_weights, int_at_least, loss_scale,
                     note_unsaved, restore_scale, resume_precision, say, scale_line, scale_meta,
                     scale_summary, stored_weights, warn)
from .logs import StepLog, log_result, open_log


# training options a checkpoint records: `--resume` continues with these, not the command line's
RESUMED = ("batch_size", "logical_batch", "lr", "val_split", "seed", "data", "n_train",
           "no_fuse", "no_plan", "loss_scale", "loss_scale_interval", "moments",
           "master")


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


def _precision_line(args) -> str:
    return ("" if args.precision == "f32" else f", {args.precision} mixed precision") + \
        ("" if args.moments == "f32" else f", {args.moments} moments") + \
        ("" if args.master == "f32" else f", {args.master} master weights")


def _finite(v):
    return None if isinstance(v, float) and math.isnan(v) else v


# what a training checkpoint's meta holds (written by `train_mnist`), and its JSON types
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


def train_mnist(args):
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
    from ..training import Trainer, evaluate, train_samples

    # everything that can fail is checked before anything compiles or trains
    check_outputs(args, {"--resume": args.resume, "--data": args.data})
    meta = None
    if args.resume:
        check_model_file(args.resume, "--resume", "a checkpoint file")
        arch, params, state, meta = load_checkpoint(args.resume)
        _check_meta(args.resume, meta)
        if arch != args.model:
            raise ValueError(f"--resume {args.resume}: holds a {arch} checkpoint, not "
                             f"{args.model}")
        adopt_resumed(args, args.resume, {k: meta["args"].get(k, False if k.startswith("no_")
                                                             else None) for k in RESUMED})
        resume_precision(args, args.resume, meta["args"].get("precision"))
        Run.checkpoint, Run.epoch = args.resume, meta["epoch"]   # until a newer one is saved
    elif args.logical_batch is not None and (args.logical_batch < args.batch_size or
                                             args.logical_batch % args.batch_size):
        args.parser.error(f"argument --logical-batch: must be a multiple of --batch-size "
                          f"{args.batch_size} (gradient accumulation over whole batches), got "
                          f"{args.logical_batch}")
    train_ds, test_ds = _load_data(args)
    say(args, _describe_data(args, train_ds, test_ds))
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
        warn(args, f"--resume {args.resume} is at epoch {meta['epoch']}, --epochs is "
                   f"{args.epochs}: nothing left to train")

    note_unsaved(args, world is None or world.is_root)
    graph = MODELS[args.model](args.batch_size if world is None else
                               world.local_batch(args.batch_size))
    acc = lb // args.batch_size
    opt = optim.AdamW(lr=args.lr, accumulate=acc, moments=args.moments, master=args.master,
                      seed=args.seed)
    scaling = loss_scale(args)
    target = compile_target(args)
    t0 = time.perf_counter()

    def build():
        prog = jg_compile(graph, loss="loss", optimizer=opt, fuse=not args.no_fuse,
                          plan_memory=not args.no_plan, seed=args.seed,
                          hook=None if world is None else world.hook, target=target,
                          precision=args.precision, loss_scale=scaling)
        return prog, Trainer(prog, train_ds, batch_size=args.batch_size,
                             logical_batch=args.logical_batch, val_split=args.val_split,
                             seed=args.seed, world=world)
    with compile_progress(args, args.model):
        prog, trainer = build() if world is None else world.first(build)
    compile_s = time.perf_counter() - t0      # training program and its evaluator
    if meta is not None:
        for k, v in params.items():
            prog.params[k] = v
        for k, v in state.items():
            prog.state[k] = v
        prog.calls, trainer.epoch = meta["calls"], meta["epoch"]
        restore_scale(prog, meta)
        trainer.rng.bit_generator.state = meta["rng"]
        trainer.order = np.asarray(meta["order"], dtype=np.int64)
    say(args, f"{args.model}: batch {args.batch_size}"
              f"{f', logical batch {lb}' if lb != args.batch_size else ''}, "
              f"{trainer.n_train} samples train and {len(train_ds) - trainer.n_train} validate "
              f"each epoch{_precision_line(args)}; compiled in {compile_s:.2f} s")
    if world is not None:
        say(args, f"data parallel: {world.size} MPI ranks, {args.batch_size // world.size} "
                  f"samples of each batch and {world.threads} thread(s) per rank")
    progress = None if not args.quiet else False
    epoch_seconds, last = [], None
    log = open_log(args, f"jitgraph train {args.model}", world is None or world.is_root)
    steps = log and StepLog(log, prog, lr=args.lr, per_step=args.batch_size, unit="samples")
    try:
        while trainer.epoch < args.epochs:
            last = trainer.run_one_epoch(progress, steps and steps.started())
            log_result(log, prog.calls, last.val, train=last.train)
            epoch_seconds.append(last.seconds)
            say(args, f"epoch {last.epoch}/{args.epochs}: train {last.train}  val {last.val}  "
                      f"({last.seconds:.2f} s{scale_line(prog)})")
            if args.checkpoint and (world is None or world.is_root):
                meta_out = {"args": {**{k: getattr(args, k) for k in RESUMED},
                                     "precision": args.precision},
                            "calls": prog.calls, "epoch": trainer.epoch,
                            "rng": trainer.rng.bit_generator.state,
                            "order": trainer.order.tolist(), **scale_meta(prog)}
                save_checkpoint(args.checkpoint, args.model, stored_weights(prog),
                                dict(prog.state), meta_out, data=_data_kind(args))
                Run.checkpoint, Run.epoch = args.checkpoint, trainer.epoch
    except (KeyboardInterrupt, Terminated):
        if args.out and world is None:      # the weights after the last whole step
            save_model(args.out, args.model, f32_weights(prog), data=_data_kind(args))
            n = prog.calls
            Run.out = (args.out, f"the model after {n} step{'s' * (n != 1)} (interrupted in "
                                  f"epoch {trainer.epoch + 1})")
        raise
    test = evaluate(trainer.evaluator, test_ds, args.batch_size, progress, world=world)
    say(args, f"test ({test.ndata} samples): {test}")
    log_result(log, prog.calls, test, split="test")
    if log:
        log.close()
    if args.out and (world is None or world.is_root):
        save_model(args.out, args.model, f32_weights(prog), data=_data_kind(args))
        say(args, f"saved {args.out}")
    if args.json:
        n_train = trainer.n_train * len(epoch_seconds)
        print(json.dumps({
            "test_acc": _finite(test.accuracy()[0]), "test_loss": _finite(test.loss()[0]),
            "train_loss": _finite(last.train.loss()[0]) if last else None,
            "val_acc": _finite(last.val.accuracy()[0]) if last else None,
            "epochs": trainer.epoch, "epoch_seconds": epoch_seconds,
            "compile_seconds": compile_s,
            "samples_per_second": n_train / sum(epoch_seconds) if epoch_seconds else None,
            "data": _data_kind(args), "n_test": test.ndata, "precision": args.precision,
            **scale_summary(prog), "moments": args.moments, "master": args.master,
            **({} if world is None else {"mpi_ranks": world.size,
                                         "allreduce_seconds": world.seconds["allreduce"]})}))
    return 0


def eval_mnist(args):
    from .. import compile as jg_compile
    from ..formats.gguf import load_model, trained_on
    from ..models import MODELS
    from ..training import evaluate
    check_model_file(args.model_file, "model")
    arch, params = load_model(args.model_file)
    trained = trained_on(args.model_file)
    if not args.data and trained not in (None, "synthetic"):
        name = {"mnist": "MNIST"}.get(trained, trained)
        raise ValueError(f"{args.model_file} was trained on {name} data; pass --data DIR "
                         f"to evaluate it on that data set (without --data, eval uses the "
                         f"built-in synthetic digits)")
    if not args.data and trained is None:
        warn(args, f"{args.model_file} does not record its training data (a model not "
                   f"written by `jitgraph train`); evaluating on the built-in synthetic "
                   f"digits; pass --data DIR for MNIST")
    _, test_ds = _load_data(args, need_train=False)
    say(args, _describe_data(args, None, test_ds))
    batch = min(args.batch_size, len(test_ds))   # a larger batch would only be padding
    with compile_progress(args, arch):
        prog = jg_compile(MODELS[arch](batch))
    for k, v in params.items():
        prog.params[k] = v
    res = evaluate(prog, test_ds, batch, None if not args.quiet else False)
    say(args, f"{arch} {args.model_file} ({res.ndata} test samples): {res}")
    if args.json:
        (l, lu), (a, au) = res.loss(), res.accuracy()
        print(json.dumps({"test_acc": _finite(a), "test_acc_unc": _finite(au),
                          "test_loss": _finite(l), "test_loss_unc": _finite(lu), "n": res.ndata,
                          "data": _data_kind(args)}))
    return 0


def dump(args):
    from .. import compile as jg_compile, optim
    from ..models import MODELS
    from .dump import check_picture_options, emit
    check_picture_options(args)
    if args.stage == "precision" and args.precision == "f32":
        raise ValueError("--stage precision: the stage runs with --precision bf16 or f16")
    if args.model == "llama":
        from .llama_train import dump_llama
        return dump_llama(args)
    if args.layers is not None or args.gguf:
        args.parser.error("arguments --layers and --gguf: apply to `dump llama` only")
    graph = MODELS[args.model](args.batch_size or 100)
    if args.stage == "graph" and not args.memory_timeline:
        return emit(args, graph=graph)
    with compile_progress(args, args.model):
        scaling = loss_scale(args)
        prog = jg_compile(graph, loss="loss", optimizer=optim.AdamW(lr=1e-3, moments=args.moments),
                          fuse=not args.no_fuse, plan_memory=not args.no_plan,
                          # the stage check_finite adds (loss scaling has it anyway)
                          check_finite=args.stage == "guard" and not scaling,
                          target=compile_target(args), precision=args.precision,
                          loss_scale=scaling)
    return emit(args, prog)


def add_data_options(p):
    p.add_argument("--data", metavar="DIR", help="directory of the MNIST IDX files (.gz or raw); "
                                                 "default: the built-in synthetic digits")
    p.add_argument("--n-train", type=int_at_least(1), default=12000, metavar="N",
                   help="built-in data: training samples")
    p.add_argument("--n-test", type=int_at_least(1), default=2000, metavar="N",
                   help="built-in data: test samples")
    p.add_argument("--seed", type=int_at_least(0), default=0, metavar="S",
                   help="seed of the initial weights, the data order and the built-in data")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars, no per-epoch or summary lines")

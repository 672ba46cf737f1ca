"""The jitgraph command line: train, eval, dump, bench."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from jitgraph.passes.pipeline import IR_STAGES as STAGES   # the IRs `dump --stage` can print


def _load_data(args, need_train=True):
    """(train, test) data sets: real MNIST from --data, else the built-in synthetic digits."""
    from . import data
    if args.data:
        train = data.load_mnist(args.data, "train") if need_train else None
        return train, data.load_mnist(args.data, "test")
    train = data.synthetic_digits(args.n_train, seed=args.seed) if need_train else None
    return train, data.synthetic_digits(args.n_test, seed=args.seed + 1_000_003)


def _finite(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def _say(args, *msg):
    if not args.quiet:
        print(*msg, flush=True)


def _train(args):
    import numpy as np
    from . import compile as jg_compile, optim
    from .gguf_io import load_checkpoint, save_checkpoint, save_model
    from .models import MODELS
    from .train import Trainer, evaluate

    meta = None
    if args.resume:
        arch, params, state, meta = load_checkpoint(args.resume)
        if arch != args.model:
            raise SystemExit(f"error: {args.resume} holds a {arch} checkpoint, not {args.model}")
        for k in ("batch_size", "logical_batch", "lr", "val_split", "seed", "data", "n_train"):
            setattr(args, k, meta["args"][k])
    train_ds, test_ds = _load_data(args)
    graph = MODELS[args.model](args.batch_size)
    acc = (args.logical_batch or args.batch_size) // args.batch_size
    opt = optim.AdamW(lr=args.lr, accumulate=acc)
    t0 = time.perf_counter()
    prog = jg_compile(graph, loss="loss", optimizer=opt, fuse=not args.no_fuse,
                      plan_memory=not args.no_plan, seed=args.seed)
    trainer = Trainer(prog, train_ds, batch_size=args.batch_size,
                      logical_batch=args.logical_batch, val_split=args.val_split, seed=args.seed)
    compile_s = time.perf_counter() - t0      # training program and its evaluator
    if meta is not None:
        for k, v in params.items():
            prog.params[k] = v
        for k, v in state.items():
            prog.state[k] = v
        prog.calls, trainer.epoch = meta["calls"], meta["epoch"]
        trainer.rng.bit_generator.state = meta["rng"]
        trainer.order = np.asarray(meta["order"], dtype=np.int64)
    _say(args, f"{args.model}: {len(train_ds)} training samples "
               f"({'MNIST from ' + args.data if args.data else 'built-in synthetic digits'}), "
               f"batch {args.batch_size}, compiled in {compile_s:.2f} s")
    progress = None if not args.quiet else False
    epoch_seconds, last = [], None
    while trainer.epoch < args.epochs:
        last = trainer.run_one_epoch(progress)
        epoch_seconds.append(last.seconds)
        _say(args, f"epoch {last.epoch}/{args.epochs}: train {last.train}  val {last.val}  "
                   f"({last.seconds:.2f} s)")
        if args.checkpoint:
            meta_out = {"args": {k: getattr(args, k) for k in ("batch_size", "logical_batch", "lr",
                                                               "val_split", "seed", "data",
                                                               "n_train")},
                        "calls": prog.calls, "epoch": trainer.epoch,
                        "rng": trainer.rng.bit_generator.state,
                        "order": trainer.order.tolist()}
            save_checkpoint(args.checkpoint, args.model, dict(prog.params), dict(prog.state),
                            meta_out)
    test = evaluate(trainer.evaluator, test_ds, args.batch_size, progress)
    _say(args, f"test: {test}")
    if args.out:
        save_model(args.out, args.model, dict(prog.params))
        _say(args, f"saved {args.out}")
    if args.json:
        n_train = trainer.n_train * len(epoch_seconds)
        print(json.dumps({
            "test_acc": _finite(test.accuracy()[0]), "test_loss": _finite(test.loss()[0]),
            "train_loss": _finite(last.train.loss()[0]) if last else None,
            "val_acc": _finite(last.val.accuracy()[0]) if last else None,
            "epochs": trainer.epoch, "epoch_seconds": epoch_seconds,
            "compile_seconds": compile_s,
            "samples_per_second": n_train / sum(epoch_seconds) if epoch_seconds else None}))
    return 0


def _eval(args):
    from . import compile as jg_compile
    from .gguf_io import load_model
    from .models import MODELS
    from .train import evaluate
    arch, params = load_model(args.model_file)
    _, test_ds = _load_data(args, need_train=False)
    prog = jg_compile(MODELS[arch](args.batch_size))
    for k, v in params.items():
        prog.params[k] = v
    res = evaluate(prog, test_ds, args.batch_size, None if not args.quiet else False)
    _say(args, f"{arch} {args.model_file}: {res}")
    if args.json:
        (l, lu), (a, au) = res.loss(), res.accuracy()
        print(json.dumps({"test_acc": _finite(a), "test_acc_unc": _finite(au),
                          "test_loss": _finite(l), "test_loss_unc": _finite(lu), "n": res.ndata}))
    return 0


def _dump(args):
    from . import compile as jg_compile, optim
    from .models import MODELS
    graph = MODELS[args.model](args.batch_size)
    if args.stage == "graph":
        print(graph)
        return 0
    prog = jg_compile(graph, loss="loss", optimizer=optim.AdamW(lr=1e-3),
                      fuse=not args.no_fuse, plan_memory=not args.no_plan)
    print(prog.ir(args.stage))
    return 0


def _common_data(p):
    p.add_argument("--data", metavar="DIR", help="real MNIST IDX files (.gz or raw); default: "
                                                 "the built-in synthetic digits")
    p.add_argument("--n-train", type=int, default=12000,
                   help="built-in data: training samples (default 12000)")
    p.add_argument("--n-test", type=int, default=2000,
                   help="built-in data: test samples (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-epoch lines")


def main(argv=None) -> int:
    from .models import MODELS
    p = argparse.ArgumentParser(prog="jitgraph", description="A JIT compiler for training graphs.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train an MNIST model with compiled kernels")
    t.add_argument("model", choices=sorted(MODELS))
    _common_data(t)
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--batch-size", type=int, default=100)
    t.add_argument("--logical-batch", type=int, default=None,
                   help="optimizer batch; a multiple of --batch-size (gradient accumulation)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--val-split", type=float, default=0.05)
    t.add_argument("--out", metavar="MODEL.gguf", help="save the trained model (ggml layout)")
    t.add_argument("--checkpoint", metavar="CKPT.gguf",
                   help="save a training checkpoint after every epoch")
    t.add_argument("--resume", metavar="CKPT.gguf", help="continue a checkpointed run")
    t.add_argument("--no-fuse", action="store_true", help="compile without the fusion pass")
    t.add_argument("--no-plan", action="store_true", help="one buffer per value (no planning)")
    t.set_defaults(fn=_train)

    e = sub.add_parser("eval", help="evaluate a GGUF model on the test set")
    e.add_argument("model_file", metavar="MODEL.gguf")
    _common_data(e)
    e.add_argument("--batch-size", type=int, default=100)
    e.set_defaults(fn=_eval)

    d = sub.add_parser("dump", help="print a model's IR after a compiler stage")
    d.add_argument("model", choices=sorted(MODELS))
    d.add_argument("--stage", choices=STAGES, default="kernels")
    d.add_argument("--batch-size", type=int, default=100)
    d.add_argument("--no-fuse", action="store_true")
    d.add_argument("--no-plan", action="store_true")
    d.set_defaults(fn=_dump)

    sub.add_parser("bench", help="fused vs unfused benchmark suite (`jitgraph bench --help`)")

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:           # the suite parses its own options
        from .bench import main as bench_main
        return bench_main(argv[1:])
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jitgraph {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

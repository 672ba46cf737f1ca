"""What the jitgraph commands share: exit codes, SIGTERM as an exception, the option types (each
error names the value and what is allowed; argparse adds the flag), the flags every compiling
command offers (--no-fuse, --no-plan, --target, --device, --threads), output checks, messages,
the compile progress bar, what an interrupt message reports (Run), and `in_worker`."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys


EXIT_ERROR, EXIT_INTERRUPT, EXIT_TERMINATED = 2, 130, 143


class Terminated(BaseException):
    """SIGTERM, raised in the main thread by the CLI's handler (so `finally` blocks run: an
    atomic write removes its temporary file)."""


def raise_terminated(signum, frame):
    raise Terminated()


def int_at_least(lo):
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


def float_in(lo, hi=math.inf, lo_open=False, hi_open=True, what=None):
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


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option's help that has a default and does not say it."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if "default" not in h and action.option_strings and \
                not (d is None or d is False or d is argparse.SUPPRESS):
            h += " (default: %(default)s)"
        return h


def say(args, *msg):
    if not args.quiet:
        print(*msg, flush=True)


def warn(args, msg):
    print(f"jitgraph {args.cmd}: warning: {msg}", file=sys.stderr, flush=True)


def adopt_resumed(args, path, saved, warn=warn):
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


def check_model_file(path, what, kind="a model file"):
    """An input file that exists and is not a directory (`kind`: what it should be)."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what} {path}: is a directory, not {kind}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path}: no such file")


@contextlib.contextmanager
def compile_progress(args, what):
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


class Run:
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
        Run.unsaved = True
        if root:
            warn(args, "neither --out nor --checkpoint is given: nothing of this run will be "
                       "saved")


def _flag(dest, value):
    flag = "--" + dest.replace("_", "-")
    return flag if isinstance(value, bool) else f"{flag} {value}"


def _shown(v):
    return "none" if v is None else "off" if v is False else "on" if v is True else v


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
    """--out, --checkpoint and --log (those `args` has) writable for real, distinct, and none of
    them one of `inputs` (option -> path; --checkpoint may be --resume); --tensorboard usable;
    before anything compiles."""
    from ..formats.paths import check_not_inputs, check_writable
    outputs = {f: getattr(args, f[2:], None) for f in ("--out", "--checkpoint", "--log")}
    check_not_inputs(outputs, inputs, allow=(("--checkpoint", "--resume"),))
    for flag, path in outputs.items():
        if path:
            check_writable(path, flag)
    from .logs import check_tensorboard
    check_tensorboard(args)


PRECISIONS = ("f32", "bf16", "f16")


def add_precision_flag(p):
    """--precision: a training command's mixed precision (jg.compile's precision=)."""
    p.add_argument("--precision", choices=PRECISIONS, default="f32",
                   help="f32, or mixed precision: GEMM products and the activations computed "
                        "from them in bf16 or f16, forward and backward (params, the residual "
                        "stream, norms, softmax, reductions, losses and the optimizer stay f32); "
                        "f16 scales the loss dynamically (--loss-scale)")
    p.add_argument("--moments", choices=("f32", "bf16"), default="f32",
                   help="the type AdamW's moments m and v are stored in: bf16 halves the "
                        "optimizer state (the update is computed in f32)")
    p.add_argument("--master", choices=("f32", "bf16"), default="f32",
                   help="the type the trainable weights are stored in (master weights): bf16 "
                        "halves their bytes; each update is computed in f32 and rounded to "
                        "bf16 stochastically (its randomness a hash of --seed and the step, so "
                        "--resume stays bit-exact); checkpoints keep them as BF16 tensors (the "
                        "bits), models and adapters (--out) follow --ftype")
    p.add_argument("--loss-scale", type=_loss_scale, default=None, metavar="S|off",
                   help="--precision f16: the dynamic loss scale's first value (halved at each "
                        "step whose gradients are not finite, which is skipped; doubled after "
                        "--loss-scale-interval clean steps), or off; default 65536")
    p.add_argument("--loss-scale-interval", type=int_at_least(1), default=None, metavar="N",
                   help="--precision f16: clean optimizer steps in a row that double the loss "
                        "scale; default 2000")


def _loss_scale(text):
    """--loss-scale: off, or a number in (0, 3e38)."""
    if text == "off":
        return text
    try:
        v = float(text)
    except ValueError:
        v = None
    if v is None or not (0 < v < 3e38):
        raise argparse.ArgumentTypeError(f"expected off or a number in (0, 3e38) (an f32 "
                                         f"scale), got {text!r}")
    return v


_loss_scale.__name__ = "loss scale"


def loss_scale(args):
    """compile's loss_scale of --precision, --loss-scale and --loss-scale-interval (a usage
    error when they are given without f16): a LossScale for f16 unless off, else False."""
    from ..optim import LossScale
    given = [f for f, v in (("--loss-scale", args.loss_scale),
                            ("--loss-scale-interval", args.loss_scale_interval)) if v is not None]
    if args.precision != "f16":
        if given:
            raise ValueError(f"{given[0]}: loss scaling is for --precision f16 (the run is "
                             f"{args.precision})")
        return False
    if args.loss_scale == "off":
        return False
    d = LossScale()
    return LossScale(init=d.init if args.loss_scale is None else args.loss_scale,
                     interval=args.loss_scale_interval or d.interval)


def scale_line(prog) -> str:
    """`, loss scale S, N skipped` of a program that scales its loss (else "")."""
    if prog.scaler is None:
        return ""
    return f", loss scale {prog.scaler.scale:g}, {prog.skipped} skipped"


def scale_summary(prog) -> dict:
    """--json's loss scale and skipped steps (None without loss scaling)."""
    return {"loss_scale": prog.scaler.scale if prog.scaler is not None else None,
            "skipped_steps": prog.skipped}


def scale_meta(prog) -> dict:
    """What a checkpoint keeps of the loss scaling: its state and the steps skipped."""
    return {"skipped": prog.skipped,
            **({"scaler": prog.scaler.state()} if prog.scaler is not None else {})}


def restore_scale(prog, meta) -> None:
    """The loss scaling's state from a checkpoint's meta (what scale_meta wrote)."""
    prog.skipped = int(meta.get("skipped", 0))
    if prog.scaler is not None:
        if "scaler" not in meta:
            raise ValueError("--resume: the checkpoint holds no loss scale state (it was not "
                             "trained with --precision f16's loss scaling)")
        prog.scaler.load(meta["scaler"])


def resume_precision(args, path, saved) -> None:
    """--precision of a resumed run: the checkpoint's (`saved`; a checkpoint of an older
    jitgraph records none: f32). A --precision given that differs is an error: params,
    optimizer state and the loss scale continue bit for bit only in the precision they were
    trained in."""
    saved = saved or "f32"
    if "precision" in getattr(args, "given", ()) and args.precision != saved:
        raise ValueError(f"--resume {path}: the checkpoint was trained with --precision {saved}, "
                         f"not {args.precision}; a resumed run keeps its precision (give "
                         f"--precision {saved} or leave it out)")
    args.precision = saved


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
    p.add_argument("--device", type=int_at_least(0), default=None, metavar="N",
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


def add_ftype(p, what: str) -> None:
    """--ftype: the type a written GGUF stores `what` in."""
    from ..quant import WRITE_TYPES
    p.add_argument("--ftype", choices=WRITE_TYPES, default="f32",
                   help=f"storage of {what}: f32, f16, bf16 or q8_0 (rows that are not whole "
                        f"q8_0 blocks are f16); default f32")


def stored_weights(prog, names=None) -> dict:
    """Program `prog`'s params `names` (default: all) as the checkpoint writers and the model
    writer (write_llama) take them, name -> read-only view of where each lives (not copied), in
    the type the program stores it in: bf16 master weights as their bf16 bits (uint16), which
    checkpoints keep as BF16 tensors and --resume puts back bit for bit, and which write_llama
    converts one tensor at a time as it writes them."""
    return {k: prog.params.view(k) for k in (prog.params if names is None else names)}


def f32_weights(prog, names=None) -> dict:
    """Program `prog`'s params `names` (default: all) as f32 values (the adapter writer, the
    perplexity after a finetune), name -> array: read-only views of where they live (not copied),
    except bf16 master weights (f32 params of the source graph the program stores as bf16
    bits) given as their f32 values: exact, and a bf16 file rounds them back to the same
    bits."""
    import numpy as np

    from ..half import to_f32
    src, out = prog.source, {}
    for k in (prog.params if names is None else names):
        v = prog.params.view(k)
        master = v.dtype == np.uint16 and src.nodes[src.params[k]].type.dtype == "f32"
        out[k] = to_f32(v, "bf16") if master else v
    return out

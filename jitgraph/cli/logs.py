"""--log FILE.jsonl and --tensorboard DIR on the training commands: the options, and the logs
they open (jitgraph/formats/runlog.py: one JSON line per step and per evaluation, flushed as
written; TensorBoard scalars through tensorboardX, the optional extra `tensorboard`)."""
from __future__ import annotations

import os
import time

# option values a run log's header leaves out: the parser's own objects, not options
_NOT_OPTIONS = ("fn", "parser", "given")


def add_log_option(p):
    p.add_argument("--log", metavar="FILE.jsonl",
                   help="write one JSON line per step and per evaluation (step, loss, lr, ms, "
                        "throughput; val loss and perplexity or accuracy), flushed as written: "
                        "a new run truncates the file, --resume appends; `jitgraph plot` draws "
                        "it")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write the step and evaluation figures as TensorBoard scalars in "
                        "DIR (`tensorboard --logdir DIR` shows them); needs tensorboardX: "
                        "pip install -e '.[tensorboard]'")


def check_tensorboard(args):
    """--tensorboard: tensorboardX importable and DIR a directory (made if missing), before
    anything compiles."""
    d = getattr(args, "tensorboard", None)
    if not d:
        return
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        raise ValueError("--tensorboard needs tensorboardX, which is not installed: pip install "
                         "-e '.[tensorboard]' (the optional extra `tensorboard`)") from None
    if os.path.exists(d) and not os.path.isdir(d):
        raise NotADirectoryError(f"--tensorboard {d}: exists and is not a directory")
    os.makedirs(d, exist_ok=True)


class TensorBoardLog:
    """Step and eval records as TensorBoard scalars: train/loss, train/ms, train/lr and the
    throughput at each step; <split>/loss, perplexity, accuracy at each evaluation."""

    def __init__(self, logdir):
        from tensorboardX import SummaryWriter
        self._w = SummaryWriter(logdir=logdir)

    def _add(self, tag, value, step):
        if value is not None and not isinstance(value, bool):
            self._w.add_scalar(tag, float(value), int(step))

    def step(self, step, loss, **fields):
        self._add("train/loss", loss, step)
        for k in ("ms", "lr", "tokens_per_s", "samples_per_s"):
            self._add(f"train/{k}", fields.get(k), step)
        self._w.flush()

    def eval(self, step, loss, split="val", **fields):
        self._add(f"{split}/loss", loss, step)
        for k in ("perplexity", "accuracy"):
            self._add(f"{split}/{k}", fields.get(k), step)
        self._w.flush()

    def close(self):
        self._w.close()


class _Both:
    """The JSON-lines log and the TensorBoard scalars, written together."""

    def __init__(self, *logs):
        self.logs = logs

    def step(self, *a, **kw):
        for log in self.logs:
            log.step(*a, **kw)

    def eval(self, *a, **kw):
        for log in self.logs:
            log.eval(*a, **kw)

    def close(self):
        for log in self.logs:
            log.close()


def open_log(args, name: str, write=True):
    """The RunLog of --log (appended to under --resume, truncated otherwise) and the scalars of
    --tensorboard, or None without them or when `write` is false (an MPI rank other than 0).
    Each record is flushed as it is written, so a command that ends by an error loses nothing
    by leaving the log to be closed."""
    path, board = getattr(args, "log", None), getattr(args, "tensorboard", None)
    if not write or not (path or board):
        return None
    logs = []
    if path:
        from ..formats.runlog import RunLog
        options = {k: v for k, v in vars(args).items()
                   if k not in _NOT_OPTIONS and isinstance(v, (str, int, float, bool, type(None)))}
        logs.append(RunLog(path, name, resume=bool(getattr(args, "resume", None)),
                           options=options))
    if board:
        logs.append(TensorBoardLog(board))
    return logs[0] if len(logs) == 1 else _Both(*logs)


class StepLog:
    """`on_step(loss)` for a loop that times nothing itself (jg.fit's Trainer): writes a step
    record with the program's step count and the time since the previous step (or since
    `started()`, called before each epoch so that validation time is not counted)."""

    def __init__(self, log, program, *, lr, per_step: int, unit: str):
        self.log, self.program, self.lr = log, program, lr
        self.per_step, self.unit = per_step, unit
        self.t = time.perf_counter()

    def started(self):
        self.t = time.perf_counter()
        return self

    def __call__(self, loss):
        now = time.perf_counter()
        sec, self.t = now - self.t, now
        n = self.program.calls
        self.log.step(n, float(loss), lr=self.lr, ms=1e3 * sec,
                      **{f"{self.unit}_per_s": self.per_step / sec if sec > 0 else None,
                         self.unit: n * self.per_step})


def log_result(log, step: int, result, split="val", train=None):
    """An eval record of a jitgraph.training.Result: its loss and accuracy (and the training
    Result's mean loss beside it)."""
    if log is None:
        return
    extra = {} if train is None else {"train_loss": train.loss()[0]}
    log.eval(step, result.loss()[0], split=split, accuracy=result.accuracy()[0], **extra)

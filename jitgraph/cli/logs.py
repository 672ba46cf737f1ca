"""--log FILE.jsonl on the training commands: the option, and the run log it opens
(jitgraph/formats/runlog.py: one JSON line per step and per evaluation, flushed as written)."""
from __future__ import annotations

import time

# option values a run log's header leaves out: the parser's own objects, not options
_NOT_OPTIONS = ("fn", "parser", "given")


def add_log_option(p):
    p.add_argument("--log", metavar="FILE.jsonl",
                   help="write one JSON line per step and per evaluation (step, loss, lr, ms, "
                        "throughput; val loss and perplexity or accuracy), flushed as written: "
                        "a new run truncates the file, --resume appends; `jitgraph plot` draws "
                        "it")


def open_log(args, name: str, write=True):
    """The RunLog of --log (appended to under --resume, truncated otherwise), or None without
    --log or when `write` is false (an MPI rank other than 0). Each line is flushed as it is
    written, so a command that ends by an error loses nothing by leaving it to be closed."""
    path = getattr(args, "log", None)
    if not path or not write:
        return None
    from ..formats.runlog import RunLog
    options = {k: v for k, v in vars(args).items()
               if k not in _NOT_OPTIONS and isinstance(v, (str, int, float, bool, type(None)))}
    return RunLog(path, name, resume=bool(getattr(args, "resume", None)), options=options)


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

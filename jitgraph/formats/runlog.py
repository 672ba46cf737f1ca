"""Run logs: JSON lines, one object per training step and per evaluation (`--log FILE.jsonl`).

The writer appends one line at a time and flushes it, so a crash or Ctrl-C loses at most the
line being written; a new run truncates the file, a resumed run appends to it. The reader
skips a torn last line (a run killed mid-write) and refuses anything else that is not a
record. `train`, `finetune`, bench/llama_peers.py and `jitgraph plot` share this module.

Records (every one has "kind"; numbers are JSON numbers, null where not finite):
  {"kind": "run", "name": "jitgraph train llama", "resumed": false, "time": 1733360000.0,
   "options": {...}}                         at the start of each run (and of each resume)
  {"kind": "step", "step": 12, "loss": 2.31, "lr": 0.001, "ms": 41.2,
   "tokens_per_s": 49000.0 | "samples_per_s": 2400.0, "tokens": 24576 | "samples": 1200}
  {"kind": "eval", "step": 100, "split": "val", "loss": 2.2, "train_loss": 2.3,
   "perplexity": 9.03, "accuracy": 0.97}     (perplexity for language models, accuracy for
                                             classifiers; train_loss: the mean since the last)
"""
from __future__ import annotations

import json
import math
import os
import time

KINDS = ("run", "step", "eval")
# the fields each kind must have, and their JSON types
REQUIRED = {"run": {"name": str}, "step": {"step": int, "loss": (float, int, type(None))},
            "eval": {"step": int, "split": str, "loss": (float, int, type(None))}}


def _clean(v):
    """A JSON-safe value: non-finite floats as null, numpy scalars as Python numbers."""
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class RunLog:
    """Appends records to a JSON-lines file, each line flushed as it is written. `resume`:
    append to what is there (a resumed run); otherwise the file is truncated."""

    def __init__(self, path, name: str, *, resume=False, options=None):
        self.path = os.fspath(path)
        if resume:
            _drop_torn_tail(self.path)
        self._f = open(self.path, "a" if resume else "w", encoding="utf-8")
        self.write("run", name=name, resumed=bool(resume), time=time.time(),
                   options=_clean(options or {}))

    def write(self, kind: str, **fields) -> None:
        if kind not in KINDS:
            raise ValueError(f"run log {self.path}: unknown record kind {kind!r}; expected one of "
                             f"{', '.join(KINDS)}")
        self._f.write(json.dumps({"kind": kind, **_clean(fields)}, allow_nan=False) + "\n")
        self._f.flush()

    def step(self, step: int, loss: float, **fields) -> None:
        self.write("step", step=int(step), loss=loss, **fields)

    def eval(self, step: int, loss: float, split: str = "val", **fields) -> None:
        self.write("eval", step=int(step), split=split, loss=loss, **fields)

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _drop_torn_tail(path) -> None:
    """Cut a torn last line (a run killed mid-write) off the file, so the records appended
    after it start on a line of their own."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        pass


def check_record(path, lineno: int, rec) -> None:
    """ValueError naming the file and line unless `rec` is a record of a known kind with its
    required fields."""
    where = f"{path}:{lineno}"
    if not isinstance(rec, dict) or rec.get("kind") not in KINDS:
        kind = rec.get("kind") if isinstance(rec, dict) else type(rec).__name__
        raise ValueError(f"{where}: not a run-log record (kind {kind!r}; expected one of "
                         f"{', '.join(KINDS)})")
    for k, t in REQUIRED[rec["kind"]].items():
        v = rec.get(k)
        if k not in rec or not isinstance(v, t) or isinstance(v, bool):
            raise ValueError(f"{where}: {rec['kind']} record field {k!r} is missing or not "
                             f"{t.__name__ if isinstance(t, type) else 'a number'} "
                             f"(got {v!r})")


def read_log(path) -> list:
    """The records of a run log, in order. A last line without its newline that does not parse
    (a torn write) is skipped; any other bad line is a ValueError naming the file and line."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    torn_ok = not data.endswith(b"\n")
    out = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if torn_ok and i == len(lines):
                break                       # the torn last line of a killed run
            raise ValueError(f"{path}:{i}: not a JSON line ({e})") from None
        check_record(path, i, rec)
        out.append(rec)
    return out


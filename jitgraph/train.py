"""The training loop, in the spirit of ggml_opt: fit, evaluate, results with uncertainties."""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Result:
    """Loss and accuracy over one pass (ggml_opt_result): per-batch losses, samples, correct."""
    losses: list = field(default_factory=list)
    ndata: int = 0
    ncorrect: int = 0

    def add(self, loss: float, n: int, correct=None):
        self.losses.append(float(loss))
        self.ndata += n
        self.ncorrect = -1 if correct is None or self.ncorrect < 0 else self.ncorrect + int(correct)

    def loss(self):
        """Mean batch loss and its standard error (ggml_opt_result_loss)."""
        nb = len(self.losses)
        if nb == 0:
            return 0.0, math.nan
        a = np.asarray(self.losses, np.float64)
        mean = float(a.mean())
        if nb < 2:
            return mean, math.nan
        var = float((a * a).sum() / nb - mean * mean)
        return mean, math.sqrt(max(var, 0.0) / (nb - 1))

    def accuracy(self):
        """Fraction correct and its standard error (ggml_opt_result_accuracy)."""
        if self.ncorrect < 0 or self.ndata == 0:
            return math.nan, math.nan
        acc = self.ncorrect / self.ndata
        unc = math.sqrt(acc * (1 - acc) / (self.ndata - 1)) if self.ndata >= 2 else math.nan
        return acc, unc

    def summary(self) -> dict:
        (l, lu), (a, au) = self.loss(), self.accuracy()
        return {"loss": l, "loss_unc": lu, "acc": a, "acc_unc": au, "n": self.ndata}

    def __str__(self):
        (l, lu), (a, au) = self.loss(), self.accuracy()
        return f"loss={l:.5f}±{lu:.5f} acc={100 * a:.2f}±{100 * au:.2f}%"


@dataclass
class EpochLog:
    epoch: int
    train: Result
    val: Result
    seconds: float


def _feeds(xb, yb, names=("x", "y")):
    return {names[0]: xb, names[1]: yb}


def _bar(total, desc, progress):
    from tqdm import tqdm
    enabled = sys.stderr.isatty() if progress is None else bool(progress)
    return tqdm(total=total, desc=desc, unit="sample", disable=not enabled, leave=True,
                dynamic_ncols=True, file=sys.stderr)


def run_epoch(fn, ds, idx, batch_size, result, bar=None):
    """Run `fn(feeds) -> outputs` over the samples `idx` of `ds` in fixed-size batches."""
    for s in range(0, len(idx) - batch_size + 1, batch_size):
        b = idx[s:s + batch_size]
        out = fn(_feeds(ds.x[b], ds.y[b]))
        result.add(out["loss"], batch_size, out.get("correct"))
        if bar is not None:
            bar.update(batch_size)
            bar.set_postfix_str(str(result), refresh=False)
    return result


class Trainer:
    """State of a `fit` run that can be checkpointed: the program, the epoch, the data RNG."""

    def __init__(self, program, dataset, *, batch_size, logical_batch=None, val_split=0.0,
                 seed=0):
        n = len(dataset)
        lb = logical_batch or batch_size
        if lb % batch_size:
            raise ValueError(f"logical batch {lb} is not a multiple of the batch size {batch_size}")
        if n < lb:
            raise ValueError(f"data set has {n} samples, fewer than one logical batch of {lb}")
        if not 0.0 <= val_split < 1.0:
            raise ValueError(f"val_split must be in [0, 1), got {val_split}")
        self.program, self.dataset = program, dataset
        self.batch_size, self.logical_batch = batch_size, lb
        nlogical = n // lb
        self.n_train = int((1.0 - val_split) * nlogical) * lb     # ggml_opt_fit's split
        if self.n_train == 0:
            raise ValueError(f"val_split {val_split} leaves no training batch")
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(n) if lb < n else np.arange(n)
        self.epoch = 0
        self.evaluator = program.evaluator()
        first = self.order[:batch_size]     # compile the evaluator now, not inside epoch timing
        self.evaluator.run(**_feeds(dataset.x[first], dataset.y[first]))

    def run_one_epoch(self, progress=None) -> EpochLog:
        t0 = time.perf_counter()
        train_idx = self.order[:self.n_train]
        if self.logical_batch < self.n_train:
            train_idx = train_idx[self.rng.permutation(self.n_train)]
            self.order[:self.n_train] = train_idx
        tr, va = Result(), Result()
        with _bar(len(train_idx), f"epoch {self.epoch + 1} train", progress) as bar:
            run_epoch(lambda f: self.program.step(**f), self.dataset, train_idx,
                      self.batch_size, tr, bar)
        val_idx = self.order[self.n_train:]
        if len(val_idx) >= self.batch_size:
            with _bar(len(val_idx), f"epoch {self.epoch + 1} val", progress) as bar:
                run_epoch(lambda f: self.evaluator.run(**f), self.dataset, val_idx,
                          self.batch_size, va, bar)
        self.epoch += 1
        return EpochLog(self.epoch, tr, va, time.perf_counter() - t0)


def fit(model, dataset, *, epochs=1, batch_size=None, logical_batch=None, val_split=0.0,
        optimizer=None, seed=0, callbacks=(), progress=None, loss="loss", **compile_options):
    """Train `model` (a graph with inputs x, y and outputs loss [, correct], or a compiled
    training program) on `dataset` for `epochs`. A logical batch larger than the graph's batch
    uses gradient accumulation. Returns the list of EpochLog (train and validation results).
    Each callback is called as `callback(trainer, epoch_log)` after every epoch."""
    from .ir import Graph
    program = model
    if isinstance(model, Graph):
        from . import compile as jg_compile, optim
        batch = model.nodes[model.inputs["x"]].type.shape[0]
        if batch_size not in (None, batch):
            raise ValueError(f"batch_size {batch_size} differs from the graph's batch {batch}")
        batch_size = batch
        if (logical_batch or batch) % batch:
            raise ValueError(f"logical batch {logical_batch} is not a multiple of the batch size "
                             f"{batch}")
        acc = (logical_batch or batch) // batch
        opt = optimizer or optim.AdamW(lr=1e-3)
        if acc > 1:
            opt = dataclasses.replace(opt, accumulate=acc)
        program = jg_compile(model, loss=loss, optimizer=opt, **compile_options)
    if batch_size is None:
        raise ValueError("fit: batch_size is required with a compiled program")
    trainer = Trainer(program, dataset, batch_size=batch_size, logical_batch=logical_batch,
                      val_split=val_split, seed=seed)
    logs = []
    for _ in range(epochs):
        log = trainer.run_one_epoch(progress)
        logs.append(log)
        for cb in callbacks:
            cb(trainer, log)
    return logs


def evaluate(program, dataset, batch_size, progress=None) -> Result:
    """Forward-only pass over `dataset` (a trailing partial batch is left out, as ggml does).
    `program` is anything with `run(**inputs)`: a forward program or a training program's
    evaluator()."""
    ev = program
    res = Result()
    with _bar(len(dataset) // batch_size * batch_size, "eval", progress) as bar:
        run_epoch(lambda f: ev.run(**f), dataset, np.arange(len(dataset)), batch_size, res, bar)
    return res

"""Training a graph: `training_graph` (one static graph for a whole optimizer step: forward,
backward, update) and the loop, in the spirit of ggml_opt: fit, evaluate, results with
uncertainties.

Under MPI (`world`: a jitgraph.distributed.World) batch sizes are global: every rank walks the
same global order and runs its slice of each batch (`World.shard`; a last, partial evaluation
batch is split as evenly as it goes), and the figures of an epoch are merged across the ranks
(`merge`) so every rank reports what one process would have."""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Result:
    """Loss and accuracy over one pass (ggml_opt_result): per-batch losses, samples, correct.
    `unit`: predictions per sample (a language model's window of ctx tokens: ctx), which
    `correct` counts."""
    losses: list = field(default_factory=list)
    ndata: int = 0
    ncorrect: int = 0
    sizes: list = field(default_factory=list)     # samples in each batch
    unit: int = 1

    def add(self, loss: float, n: int, correct=None):
        self.losses.append(float(loss))
        self.sizes.append(int(n))
        self.ndata += n
        self.ncorrect = -1 if correct is None or self.ncorrect < 0 else self.ncorrect + int(correct)

    def loss(self):
        """Mean batch loss and its standard error (ggml_opt_result_loss); batches of different
        sizes (a last, partial one) are weighted by their samples. (nan, nan) when empty."""
        nb = len(self.losses)
        if nb == 0:
            return math.nan, math.nan
        a = np.asarray(self.losses, np.float64)
        w = np.asarray(self.sizes if len(self.sizes) == nb else [1] * nb, np.float64)
        if (w == w[0]).all():
            mean = float(a.mean())
            var = float((a * a).sum() / nb - mean * mean)
        else:
            mean = float((w * a).sum() / w.sum())
            var = float((w * (a - mean) ** 2).sum() / w.sum())
        if nb < 2:
            return mean, math.nan
        return mean, math.sqrt(max(var, 0.0) / (nb - 1))

    def accuracy(self):
        """Fraction correct and its standard error (ggml_opt_result_accuracy)."""
        n = self.ndata * self.unit
        if self.ncorrect < 0 or n == 0:
            return math.nan, math.nan
        acc = self.ncorrect / n
        unc = math.sqrt(acc * (1 - acc) / (n - 1)) if n >= 2 else math.nan
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


def _bar(total, desc, progress, initial=0):
    from tqdm import tqdm
    enabled = sys.stderr.isatty() if progress is None else bool(progress)
    return tqdm(total=total, initial=initial, desc=desc, unit="sample", disable=not enabled,
                leave=True, dynamic_ncols=True, file=sys.stderr)


def run_epoch(fn, ds, idx, batch_size, result, bar=None, partial=False, world=None, after=None):
    """Run `fn(feeds) -> outputs` over the samples `idx` of `ds` in fixed-size batches. The
    samples that do not fill a last batch are left out (training), or with `partial` scored too:
    padded to a whole batch by repeating them, the padding masked out (see _score_partial).
    `world` (MPI): `batch_size` is the global batch and `fn` runs this rank's slice of each;
    a rank with no sample of the last, partial batch records an empty entry. `after()` runs
    after each batch."""
    full = len(idx) - len(idx) % batch_size
    local = batch_size if world is None else world.local_batch(batch_size)
    for s in range(0, full, batch_size):
        b = idx[s:s + batch_size]
        if world is not None:
            b = world.shard(b)
        out = fn(_feeds(ds.x[b], ds.y[b]))
        result.add(out["loss"], local, out.get("correct"))
        if after is not None:
            after()
        if bar is not None:
            bar.update(batch_size)
            bar.set_postfix_str(str(result), refresh=False)
    if partial and full < len(idx):
        rest = idx[full:]
        b = rest if world is None else world.split(rest)
        if len(b):
            padded = np.resize(b, local)
            out = fn(_feeds(ds.x[padded], ds.y[padded]))
            result.add(*_score_partial(out, ds.y[b]))
        else:
            result.add(0.0, 0, 0)
        if bar is not None:
            bar.update(len(rest))
            bar.set_postfix_str(str(result), refresh=False)
    return result


def merge(result, world) -> Result:
    """The Result of all ranks together (MPI): batch j's loss is the mean of the ranks' losses
    of batch j weighted by their samples, its samples and hits the sums. Without `world`, the
    result itself."""
    if world is None:
        return result
    parts = world.allgather((result.losses, result.sizes, result.ncorrect), "merging figures")
    out = Result(unit=result.unit)
    n = max(len(p[0]) for p in parts)
    for j in range(n):
        got = [(p[0][j], p[1][j]) for p in parts if j < len(p[0])]
        size = sum(z for _, z in got)
        if size:
            out.losses.append(float(sum(loss * z for loss, z in got) / size))
            out.sizes.append(size)
            out.ndata += size
    out.ncorrect = -1 if any(p[2] < 0 for p in parts) else sum(p[2] for p in parts)
    return out


def _score_partial(out, y):
    """(loss, n, correct) of the first len(y) rows of a padded batch, from its logits: the mean
    cross-entropy and the argmax hits of those rows alone (the outputs `loss` and `correct`
    cover the padding too)."""
    n = len(y)
    logits = out.get("logits")
    if logits is None:
        raise ValueError(f"evaluation: the last {n} samples do not fill a batch, and the program "
                         f"has no `logits` output to score them alone; use a batch size that "
                         f"divides the number of samples")
    z = np.asarray(logits[:n], np.float64)
    m = z.max(axis=-1, keepdims=True)
    logp = z - (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))
    y = np.asarray(y)
    if y.dtype.kind in "iu":
        loss = -logp[np.arange(n), y].mean()
        hits = np.argmax(z, axis=-1) == y
    else:                                   # probability targets
        loss = -(y * logp).sum(axis=-1).mean()
        hits = np.argmax(z, axis=-1) == np.argmax(y, axis=-1)
    correct = int(hits.sum()) if out.get("correct") is not None else None
    return float(loss), n, correct


def check_partial_scoring(program) -> None:
    """Raise ValueError unless a padded last batch can be scored from the logits: the graph's
    `loss` must be cross_entropy(logits, y) (what _score_partial recomputes)."""
    src = getattr(program, "source", None) or getattr(getattr(program, "_prog", None),
                                                      "source", None)
    if src is None:
        return
    ok = "loss" in src.outputs and "logits" in src.outputs and "y" in src.inputs
    if ok:
        node = src.nodes[src.outputs["loss"]]
        ok = node.op == "cross_entropy" and list(node.inputs) == [src.outputs["logits"],
                                                                  src.inputs["y"]]
    if not ok:
        raise ValueError(f"evaluation: a last, partial batch can only be scored for a graph whose "
                         f"`loss` is cross_entropy(logits, y); graph {src.name} is not, so use a "
                         f"batch size that divides the number of samples")


def train_samples(n, batch_size, logical_batch, val_split) -> int:
    """Samples of `n` that train each epoch (ggml_opt_fit's split: whole logical batches, the
    rest validates); ValueError when the sizes leave no training batch."""
    lb = logical_batch or batch_size
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if lb % batch_size:
        raise ValueError(f"logical batch {lb} is not a multiple of the batch size {batch_size}")
    if n < lb:
        raise ValueError(f"data set has {n} samples, fewer than one logical batch of {lb}")
    if not 0.0 <= val_split < 1.0:
        raise ValueError(f"val_split must be in [0, 1), got {val_split}")
    n_train = int((1.0 - val_split) * (n // lb)) * lb
    if n_train == 0:
        raise ValueError(f"val_split {val_split} leaves no training batch ({n} samples make "
                         f"{n // lb} batches of {lb})")
    return n_train


class Trainer:
    """State of a `fit` run that can be checkpointed: the program, the epoch, the data RNG, the
    training batches done in the running epoch (`batch`) and their figures (`partial`)."""

    def __init__(self, program, dataset, *, batch_size, logical_batch=None, val_split=0.0,
                 seed=0, world=None, shuffle=True, n_train=None, inputs=None, unit=1):
        """`batch_size`, `logical_batch`: global sizes; `program` runs this rank's slice of a
        batch when `world` (jitgraph.distributed.World) is given (compile it with
        hook=world.hook), the whole batch otherwise. `shuffle=False` walks the training
        samples in their order every epoch (llama-finetune's); `n_train` (samples, rounded
        down to whole logical batches) replaces `val_split`'s count; `inputs(feeds)` maps the
        feeds {"x", "y"} to the program's inputs (default: as they are); `unit`: predictions
        per sample (Result.unit)."""
        n = len(dataset)
        self.world = world
        lb = logical_batch or batch_size
        if n_train is None:
            self.n_train = train_samples(n, batch_size, lb, val_split)
        else:
            train_samples(n, batch_size, lb, 0.0)            # the sizes' own errors
            self.n_train = int(n_train) // lb * lb
            if self.n_train == 0:
                raise ValueError(f"{n_train} training samples make no logical batch of {lb}")
        self.program, self.dataset = program, dataset
        self.batch_size, self.logical_batch = batch_size, lb
        self.shuffle = bool(shuffle)
        self.inputs = inputs or (lambda feeds: feeds)
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(n) if self.shuffle and lb < n else np.arange(n)
        self.epoch = 0
        self.unit = int(unit)
        self.batch, self.partial = 0, Result(unit=self.unit)
        # the validation runs in the training program's arena (its activations are dead
        # between steps): run_epoch reads each batch's figures at once
        self.evaluator = program.evaluator(share_memory=True)
        first = self.order[:batch_size if world is None else world.local_batch(batch_size)]
        # compile the evaluator now, not inside epoch timing
        self.evaluator.run(**self.inputs(_feeds(dataset.x[first], dataset.y[first])))

    def run_one_epoch(self, progress=None, on_step=None) -> EpochLog:
        """One epoch: training, then validation; a checkpointed epoch (`batch` > 0) continues
        after its last training batch. `on_step(loss)` is called after each training batch
        with its loss (this rank's, under MPI)."""
        t0 = time.perf_counter()
        if self.batch == 0:
            self.partial = Result(unit=self.unit)
            if self.shuffle and self.logical_batch < self.n_train:
                train_idx = self.order[:self.n_train]
                self.order[:self.n_train] = train_idx[self.rng.permutation(self.n_train)]
        done = self.batch * self.batch_size
        train_idx = self.order[done:self.n_train]
        tr, va = self.partial, Result(unit=self.unit)
        w = self.world
        check = None if w is None or not w.check_every else \
            (lambda: w.maybe_check(self.program))

        def after():
            self.batch += 1
            if check is not None:
                check()
            if on_step is not None:
                on_step(tr.losses[-1])
        with _bar(self.n_train, f"epoch {self.epoch + 1} train", progress, done) as bar:
            run_epoch(lambda f: self.program.step(**self.inputs(f)), self.dataset, train_idx,
                      self.batch_size, tr, bar, world=w, after=after)
        val_idx = self.order[self.n_train:]
        if len(val_idx):                  # every validation sample, a last partial batch too
            if len(val_idx) % self.batch_size:
                check_partial_scoring(self.evaluator)
            with _bar(len(val_idx), f"epoch {self.epoch + 1} val", progress) as bar:
                run_epoch(lambda f: self.evaluator.run(**self.inputs(f)), self.dataset,
                          val_idx, self.batch_size, va, bar, partial=True, world=w)
        tr, va = merge(tr, w), merge(va, w)
        self.epoch += 1
        self.batch, self.partial = 0, Result(unit=self.unit)
        return EpochLog(self.epoch, tr, va, time.perf_counter() - t0)


def fit(model, dataset, *, epochs=1, batch_size=None, logical_batch=None, val_split=0.0,
        optimizer=None, seed=0, callbacks=(), progress=None, loss="loss", trainer=None,
        on_step=None, shuffle=True, n_train=None, inputs=None, unit=1, **compile_options):
    """Train `model` (a graph with inputs x, y and outputs loss [, correct], or a compiled
    training program) on `dataset` for `epochs`. A logical batch larger than the graph's batch
    uses gradient accumulation. Returns the list of EpochLog (train and validation results).
    Each callback is called as `callback(trainer, epoch_log)` after every epoch, `on_step(loss)`
    after every training batch. `trainer`: a Trainer to continue (a restored checkpoint: its
    epoch counts towards `epochs`); `shuffle`, `n_train`, `inputs`, `unit`: see Trainer."""
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
    if trainer is None:
        if batch_size is None:
            raise ValueError("fit: batch_size is required with a compiled program")
        trainer = Trainer(program, dataset, batch_size=batch_size, logical_batch=logical_batch,
                          val_split=val_split, seed=seed, shuffle=shuffle, n_train=n_train,
                          inputs=inputs, unit=unit)
    logs = []
    while trainer.epoch < epochs:
        log = trainer.run_one_epoch(progress, on_step)
        logs.append(log)
        for cb in callbacks:
            cb(trainer, log)
    return logs


def evaluate(program, dataset, batch_size, progress=None, world=None) -> Result:
    """Forward-only pass over every sample of `dataset`. `program` is anything with
    `run(**inputs)` compiled for `batch_size` samples: a forward program or a training program's
    evaluator(). Samples that do not fill a last batch (or a data set smaller than one batch)
    run padded to a whole batch, the padding masked out: their loss and hits are computed from
    their rows of the `logits` output, so the graph's loss must be cross_entropy(logits, y).
    An empty data set is a ValueError. With `world` (MPI) `batch_size` is the global batch,
    `program` runs this rank's slice, and the result is every rank's together."""
    n = len(dataset)
    if n == 0:
        raise ValueError("evaluate: the data set is empty; there is nothing to evaluate")
    if int(batch_size) < 1:
        raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
    if n % batch_size:
        check_partial_scoring(program)
    ev = program
    res = Result()
    with _bar(n, "eval", progress) as bar:
        run_epoch(lambda f: ev.run(**f), dataset, np.arange(n), batch_size, res, bar,
                  partial=True, world=world)
    return merge(res, world)



def training_graph(graph, loss: str = "loss", optimizer=None, wrt=None):
    """autodiff + optimizer. Run a step with
    `jitgraph.interp.run(tg, {**batch, **optimizer.runtime_inputs(call)}, params_and_state)`:
    the params dict (start from `tg.init_params()`: params and zeroed optimizer state) is
    updated in place. wrt: params to train (default: every trainable param)."""
    from jitgraph.passes.autodiff import grad
    from jitgraph.passes.optimizer import apply_optimizer
    if optimizer is None:
        raise ValueError("training_graph: pass an optimizer, e.g. optimizer=jitgraph.optim.AdamW()")
    g, _ = grad(graph, loss, wrt=wrt)
    return apply_optimizer(g, optimizer, loss)[0]

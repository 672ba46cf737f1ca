"""Random-graph testing: a generator of small training graphs, a runner that compiles each one
fused/unfused x planned/naive and checks every program against the float64 interpreter, a
triage that tells float32 rounding from real bugs, and a shrinker that prints a failing graph
as a minimal runnable Python repro.

    from jitgraph import testing_graphs as tg
    summary = tg.fuzz(graphs=20, seed=0)          # generate, run, triage, shrink failures
    print(summary.report())

Generator (`generate(chooser)`; `case_at(seed, i)` is the fuzzer's i-th case): leaves are
inputs and params of one random base shape (dims in 1..5, size-1 axes often; `big`: up to 64)
and broadcastable relatives. Each graph opens with a focus (FOCI: the shapes that broke the
compiler before, forced; the fuzzer cycles through them) and goes on with templates: unary and
binary elementwise ops (domain-safe forms of log/sqrt/div/pow), python-number and full_like
constants, reductions sum/mean/max/logsumexp over axis=(), one axis, the size-1 axes, several
or all axes (keepdims or not), argmax, views (reshape merge/split/unit axes/no-op, permute,
transpose, slice with steps 1/2/-1, broadcast_to incl. the no-op, cast to the same dtype and
f64 round trips, concat), GEMMs (square weights so the result meets its operand again; the
operand computed by an elementwise producer that others read too; batched; transposed), the
primitive forms of softmax / log_softmax / logsumexp / rms_norm / layer_norm (the ones
passes/patterns.py rewrites, on values, on constants and on values read elsewhere), the row ops
themselves and cross_entropy. Outputs: sinks plus random values, params and inputs themselves,
one value under two names; params updated with Graph.update (running statistics) whose
pre-update value is also an output. Two modes: "forward" (outputs and updates) and "train"
(loss = sum of outputs weighted by random inputs; compiled with SGD).

Runner (`check_case`): every program runs several steps with fresh inputs (stale state shows);
before each step the reference (float64 interpreter; in train mode jg.training_graph) starts
from the program's own parameters, so each step is checked on its own. Train mode also checks
autodiff against central differences (jg.testing.check_grad) and the reference's own SGD step
against p - lr * grad.

Triage: the float64 reference is run again with every computed value (and leaf) multiplied by
(1 + d*u), u uniform in [-1, 1], d a few float32 ulps, and once as the float32 interpreter
(rounding inside one op: log of a sum next to 1 in log_softmax). The spread s of those runs is
how far float32 rounding can move each element (a cancelling sum spreads by about d * sum|x|,
a value next to a kink such as relu, step or an argmax tie flips). An element is wrong only
when |got - ref| > C_TOL * s + ulp * |ref|; a mismatch is confirmed with 24 samples at twice
the noise before it counts. On the fuzzer's graphs, correct programs stay below 0.05 of that
tolerance (the largest err / s seen: 0.9, with dims up to 64), wrong ones exceed it by orders
of magnitude.

Shrinker (`shrink`): tries the failing config without training, fewer steps, then greedily
drops outputs and updates, moves an output to an operand of its node, drops nodes (a value
becomes a fresh input, or is bypassed by an operand of its type), turns params into inputs
and shrinks dims (one size at a time, everywhere it occurs), keeping only changes that still
fail the same way (Failure.signature); `to_python` prints the result as a script that builds
the graph and calls check_case.
"""
from __future__ import annotations

import math
import re
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

import jitgraph as jg
from jitgraph.registry import get_op
from jitgraph.types import ShapeError

CONFIGS = ((True, True), (True, False), (False, True), (False, False))   # (fuse, plan_memory)
U32 = 2.0 ** -24            # float32 unit roundoff
DELTA = 8 * U32             # relative noise per value in the sensitivity runs
C_TOL = 16.0                # an error must exceed C_TOL times the noise spread to count
LIMIT = 1e4                 # graphs whose float64 values exceed this (or overflow) are redrawn
LR = 0.05

# ops whose result only moves values (no rounding of their own: no noise on them; leaves do
# get noise, which stands for the rounding of whatever computed them)
_EXACT = {"input", "param", "reshape", "permute", "slice", "broadcast_to", "concat", "pad",
          "slice_back", "get_rows", "argmax", "count_equal"}


# ---- random choices ---------------------------------------------------------------------------
class RandomChooser:
    """Choices from a numpy Generator (the seeded fuzzer)."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def int(self, lo, hi):                       # inclusive
        return int(self.rng.integers(lo, hi + 1))

    def choice(self, seq, weights=None):
        seq = list(seq)
        if weights is None:
            return seq[int(self.rng.integers(len(seq)))]
        w = np.asarray(weights, float)
        return seq[int(self.rng.choice(len(seq), p=w / w.sum()))]

    def coin(self, p=0.5):
        return bool(self.rng.random() < p)


class HypothesisChooser:
    """Choices drawn through hypothesis (`st.data()`), so hypothesis records and replays them."""

    def __init__(self, data):
        from hypothesis import strategies as st
        self.data, self.st = data, st

    def int(self, lo, hi):
        return self.data.draw(self.st.integers(lo, hi))

    def choice(self, seq, weights=None):
        seq = list(seq)
        return seq[self.data.draw(self.st.integers(0, len(seq) - 1))]

    def coin(self, p=0.5):
        return self.data.draw(self.st.integers(0, 99)) < 100 * p


# ---- cases ----------------------------------------------------------------------------------
@dataclass
class Case:
    """A graph and how to run it: mode "forward" (outputs and Graph.update) or "train" (compiled
    with loss="loss" and SGD(lr)); int_high: exclusive upper bound of each i32 input's values."""
    graph: jg.Graph
    mode: str = "forward"
    lr: float = LR
    int_high: dict = field(default_factory=dict)
    seed: int = 0                      # the feeds' seed
    label: str = ""

    @property
    def optimizer(self):
        return jg.optim.SGD(lr=self.lr) if self.mode == "train" else None


def feeds_for(case, step):
    """Inputs of step `step`: normal f32 values, i32 values in [0, int_high) (default 2)."""
    g, out = case.graph, {}
    for name, nid in g.inputs.items():
        if name.startswith("opt/"):
            continue
        t = g.nodes[nid].type
        rng = np.random.default_rng([case.seed, step, zlib.crc32(name.encode())])
        if t.is_float:
            out[name] = rng.standard_normal(t.shape).astype(t.np_dtype)
        else:
            out[name] = rng.integers(0, case.int_high.get(name, 2), t.shape).astype(t.np_dtype)
    return out


# ---- the generator --------------------------------------------------------------------------
UNARY = ("relu", "tanh", "sigmoid", "neg", "sqr", "abs", "gelu", "silu", "softplus",
         "leaky_relu", "scale", "exp", "log", "sqrt", "pow", "clamp", "step", "sgn")
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum", "where")
ROW_FORMS = ("softmax", "softmax_lse", "log_softmax", "log_softmax_lse", "logsumexp",
             "rms_norm", "layer_norm")


# Each graph starts with one focus: template steps with the choices that make bug-prone shapes
# forced (and graph-level choices: a size-1 axis in the base shape, an updated param that is
# also an output), so any len(FOCI) consecutive graphs of the fuzzer contain all of them.
_NORMS, _SOFTMAXES = ("rms_norm", "layer_norm"), ("softmax", "softmax_lse")
FOCI = {
    "size-1 reduce": dict(size1=True, steps=[
        ("reduce", dict(axes="size1", prologue=True, op="mean"))]),
    "size-1 argmax": dict(size1=True, steps=[("argmax", dict(argmax_axis="size1"))]),
    "gemm shared": dict(steps=[("gemm", dict(gemm_shared=True, gemm_direct=True, square=True))]),
    "row op on a constant": dict(steps=[("rows", dict(
        row_input="const", row_neighbour=True, row_form=_SOFTMAXES + ("log_softmax_lse",)))]),
    "primitive norms": dict(steps=[("rows", dict(row_input="value", row_form=("rms_norm",))),
                                   ("rows", dict(row_form=("layer_norm",)))]),
    "primitive softmax": dict(steps=[
        ("rows", dict(row_input="value", row_form=_SOFTMAXES)),
        ("rows", dict(row_form=("log_softmax", "log_softmax_lse", "logsumexp")))]),
    "row ops": dict(steps=[("rows", dict(row_form=("op",))), ("rows", dict(row_form=("op",)))]),
    "updated param output": dict(update=True, update_output=True, steps=[]),
    "axis=() prologue": dict(steps=[("reduce", dict(axes="()", prologue=True))]),
    "views": dict(steps=[("view", dict(view=("slice",))), ("view", dict(view=("concat",))),
                         ("view", dict(view=("broadcast_to", "reshape", "permute")))]),
    "no-ops": dict(steps=[("view", dict(view=("noop_broadcast",))),
                          ("view", dict(view=("cast",))), ("view", dict(view=("cast64",)))]),
    "loss": dict(steps=[("loss", {})]),
    "free": dict(steps=[]),
}


class _Gen:
    def __init__(self, ch, mode, max_steps, big=False, focus="free"):
        self.ch, self.mode, self.max_steps, self.big = ch, mode, max_steps, big
        self.focus = FOCI[focus]
        self.gforced = {k: v for k, v in self.focus.items() if k != "steps"}
        self.forced = {}
        self.g = jg.Graph("fuzz")
        self.pool = []            # float values
        self.ints = []            # i32 values (argmax)
        self.int_high = {}
        self.counts = Counter()

    # names and leaves
    def name(self, kind):
        self.counts[kind] += 1
        return f"{kind}{self.counts[kind] - 1}"

    def input(self, shape, dtype="f32"):
        return self.g.input(self.name("x"), shape, dtype)

    def param(self, shape, std=1.0, trainable=True, kind="p"):
        return self.g.param(self.name(kind), shape, init=jg.init.normal(0.0, std),
                            trainable=trainable)

    def pick(self, pred=None, recent=True):
        cands = [v for v in self.pool if pred is None or pred(v)]
        if not cands:
            return None
        if recent and self.ch.coin(0.5):
            cands = cands[-3:]
        return self.ch.choice(cands)

    def add(self, v):
        self.pool.append(v)
        return v

    def force(self, key, draw):
        """The focus's value for `key` (used once), else draw()."""
        for d in (self.forced, self.gforced):
            if key in d:
                return d.pop(key)
        return draw()

    # the graph
    def build(self):
        ch = self.ch
        rank = ch.choice((1, 2, 2, 3, 3))
        sizes = (1, 1, 2, 3, 4, 5) + ((17, 40, 64) if self.big else ())
        self.base = tuple(ch.choice(sizes) for _ in range(rank))
        while math.prod(self.base) > 700:
            self.base = self.base[1:]
        if all(d == 1 for d in self.base) and ch.coin(0.7):
            self.base = self.base[:-1] + (3,)
        if self.force("size1", lambda: False) and 1 not in self.base:
            i = ch.int(0, len(self.base))
            self.base = (self.base[:i] + (1,) + self.base[i:])[-3:]
            if 1 not in self.base:
                self.base = (1,) + self.base[1:]
        x0 = self.add(self.input(self.base))
        p0 = self.param(self.relative(self.base), std=0.5)
        self.add(x0 * p0 if ch.coin(0.5) else x0 + p0)   # the loss always reaches a param
        if ch.coin(0.5):
            self.add(self.input(self.relative(self.base)))
        if ch.coin(0.4):
            self.add(self.param(self.relative(self.base), std=0.5))
        if ch.coin(0.3):
            self.add(jg.full_like(x0, ch.choice((0.5, -1.5, 2.0))))
        n = ch.int(2, self.max_steps)
        templates = ("unary", "binary", "reduce", "view", "gemm", "rows", "const", "argmax",
                     "loss")
        weights = (4, 4, 3, 3, 2.5, 2.5, 0.7, 0.7, 0.5)
        steps = list(self.focus["steps"])
        for k in range(max(n, len(steps))):
            t, self.forced = steps[k] if k < len(steps) else \
                (ch.choice(templates, weights), {})
            self.forced = dict(self.forced)
            try:
                getattr(self, "t_" + t)()
            except ShapeError:
                pass                   # a draw that does not type-check is skipped
        self.finish()
        return Case(self.g, self.mode, int_high=dict(self.int_high))

    def relative(self, shape):
        """A shape that broadcasts against `shape`: itself, its trailing part, or 1s here and
        there."""
        ch = self.ch
        r = ch.int(0, 3)
        if r == 0 or not shape:
            return shape
        if r == 1:
            return shape[ch.int(0, len(shape) - 1):] if len(shape) > 1 else shape
        if r == 2:
            return tuple(1 if ch.coin(0.4) else d for d in shape)
        return shape

    # templates ---------------------------------------------------------------------------
    def unary(self, v, op=None):
        ch = self.ch
        op = op or ch.choice(UNARY)
        if op == "scale":
            return jg.scale(v, ch.choice((0.5, -2.0, 3.0)))
        if op == "leaky_relu":
            return jg.leaky_relu(v, 0.1)
        if op == "log":
            return jg.log(jg.abs(v) + 0.5) if ch.coin() else jg.log(jg.softplus(v) + 0.1)
        if op == "sqrt":
            return jg.sqrt(jg.sqr(v) + 0.25) if ch.coin() else jg.sqrt(jg.abs(v) + 0.1)
        if op == "pow":
            p = ch.choice((2.0, 3.0, 0.5, -1.0))
            return jg.pow(v, p) if p in (2.0, 3.0) else jg.pow(jg.abs(v) + 0.5, p)
        if op == "clamp":
            return jg.clamp(v, -0.5, 0.75) if ch.coin() else jg.clamp(v, lo=0.0)
        if op == "exp":
            return jg.exp(v) if ch.coin(0.5) else jg.exp(jg.tanh(v))
        return getattr(jg, op)(v)

    def t_unary(self):
        v = self.pick()
        self.add(self.unary(v))

    def partner(self, a):
        """Something a binary op can combine with `a`: a pool value that broadcasts with it
        (result a's shape or larger, rank <= 3), a python number or a full_like constant."""
        ch = self.ch
        r = ch.int(0, 9)
        if r == 0:
            return ch.choice((0.5, -1.0, 2.0, 0.0))
        if r == 1:
            return jg.full_like(a, ch.choice((0.25, -1.0, 3.0)))

        def ok(b):
            try:
                s = np.broadcast_shapes(a.shape, b.shape)
            except ValueError:
                return False
            return len(s) <= 3 and math.prod(s) <= (800 if self.big else 150)
        b = self.pick(ok)
        if b is None or (b is a and ch.coin(0.5)):
            return self.param(self.relative(a.shape), std=0.5) if ch.coin(0.5) else \
                self.input(self.relative(a.shape))
        return b

    def binary(self, a, b, op=None):
        ch = self.ch
        op = op or ch.choice(BINARY)
        if op == "div":
            if not isinstance(b, jg.Tensor):
                b = 1.0 + abs(b)
            else:
                b = jg.abs(b) + 0.5 if ch.coin() else jg.sqr(b) + 1.0
            return a / b if ch.coin(0.8) or not isinstance(b, jg.Tensor) else \
                jg.div(jg.full_like(a, 1.0) if ch.coin() else 1.0, b) * a
        if op == "where":
            bt = b if isinstance(b, jg.Tensor) else jg.full_like(a, b)
            return jg.where(jg.step(bt if ch.coin() else a), a, bt)
        if op in ("maximum", "minimum"):
            bt = b if isinstance(b, jg.Tensor) else jg.full_like(a, b)
            return getattr(jg, op)(a, bt)
        if not isinstance(b, jg.Tensor) and ch.coin(0.5):
            return getattr(jg, op)(b, a)           # number on the left
        return getattr(jg, op)(a, b)

    def t_binary(self):
        a = self.pick()
        self.add(self.binary(a, self.partner(a)))

    def axes_for(self, v):
        ch = self.ch
        nd = v.ndim
        ones = tuple(i for i, d in enumerate(v.shape) if d == 1)
        forced = self.force("axes", lambda: None)
        if forced == "()":
            return ()
        if forced == "size1" and ones:
            return ones
        opts = [(), None, (nd - 1,) if nd else ()]
        if ones:
            opts += [ones, ones]
        if nd >= 2:
            opts.append(tuple(sorted(set(ch.int(0, nd - 1) for _ in range(2)))))
        return ch.choice(opts)

    def t_reduce(self):
        ch = self.ch
        if self.forced.get("axes") == "size1":
            v = self.pick(lambda t: 1 in t.shape)
            v = self.pick() if v is None else v
        else:
            v = self.pick()
        if self.force("prologue", lambda: ch.coin(0.4)):
            v = self.unary(v)                      # a prologue to fuse
        op = self.force("op", lambda: ch.choice(("sum", "mean", "max", "logsumexp")))
        r = getattr(jg, op)(v, axis=self.axes_for(v), keepdims=ch.coin())
        if ch.coin(0.4):
            r = self.unary(r)                      # an epilogue
        self.add(r)
        if ch.coin(0.3) and r.shape != v.shape:
            try:
                self.add(self.binary(v, r, ch.choice(("sub", "mul", "add"))))   # broadcast back
            except ShapeError:
                pass

    def t_argmax(self):
        ch = self.ch
        size1 = self.force("argmax_axis", lambda: None) == "size1"
        v = self.pick(lambda t: 1 in t.shape) if size1 else None
        v = self.pick(lambda t: t.ndim >= 1) if v is None else v
        if v is None:
            return
        if ch.coin(0.4):
            v = self.unary(v)
        ones = [i for i, d in enumerate(v.shape) if d == 1]
        axis = ch.choice(ones) if ones and (size1 or ch.coin(0.6)) else ch.int(0, v.ndim - 1)
        a = jg.argmax(v, axis=axis, keepdims=ch.coin())
        self.ints.append(a)
        if ch.coin(0.5):
            self.add(jg.cast(a, "f32"))

    def t_view(self):
        ch = self.ch
        v = self.pick()
        s = v.shape
        kind = ch.choice(self.force("view", lambda: (
            "reshape", "permute", "transpose", "slice", "broadcast_to", "cast", "cast64",
            "concat", "noop_broadcast")))
        if kind == "reshape":
            opts = [s]
            if len(s) >= 2:
                opts.append(s[:-2] + (s[-2] * s[-1],))
            if len(s) < 3:
                i = ch.int(0, len(s))
                opts.append(s[:i] + (1,) + s[i:])
            if 1 in s:
                i = s.index(1)
                opts.append(s[:i] + s[i + 1:])
            if s and s[-1] == 4:
                opts.append(s[:-1] + (2, 2))
            opts.append((-1,))
            r = v.reshape(ch.choice(opts))
        elif kind == "permute":
            if len(s) < 2:
                return
            perm = list(range(len(s)))
            for i in range(len(perm) - 1, 0, -1):
                j = ch.int(0, i)
                perm[i], perm[j] = perm[j], perm[i]
            r = jg.permute(v, tuple(perm))
        elif kind == "transpose":
            r = v.T
        elif kind == "slice":
            if not s:
                r = jg.slice(v)                    # the whole of a 0-d value
                self.add(r)
                return
            ax = ch.int(0, len(s) - 1)
            d = s[ax]
            st = ch.choice((1, 1, 2, -1))
            start = ch.int(0, d - 1)
            sl = slice(start, None, st) if ch.coin(0.7) else slice(None, None, st)
            r = jg.slice(v, *([slice(None)] * ax + [sl]))
        elif kind == "broadcast_to":
            opts = [s, (ch.choice((1, 2, 3)),) + s] if len(s) < 3 else [s]
            if 1 in s:
                opts.append(tuple(ch.choice((2, 3)) if d == 1 else d for d in s))
            r = jg.broadcast_to(v, ch.choice(opts))
        elif kind == "noop_broadcast":
            r = jg.broadcast_to(v, s)
        elif kind == "cast":
            r = jg.cast(v, "f32")
        elif kind == "cast64":
            r = jg.cast(self.unary(jg.cast(v, "f64"), ch.choice(("tanh", "sqr", "neg"))), "f32")
        else:
            if not s:
                return
            ax = ch.int(0, len(s) - 1)
            w = self.pick(lambda t: t.ndim == len(s) and all(
                t.shape[i] == s[i] for i in range(len(s)) if i != ax))
            r = jg.concat([v, w if w is not None else v], axis=ax)
        if math.prod(r.shape) <= (900 if self.big else 200):
            self.add(r)

    def t_gemm(self):
        ch = self.ch
        v = self.pick(lambda t: t.ndim >= 1 and math.prod(t.shape) <= (700 if self.big else 60))
        if v is None:
            return
        if v.ndim == 1:
            v = v.reshape((1,) + v.shape) if ch.coin() else v.reshape(v.shape + (1,))
        shared = self.force("gemm_shared", lambda: ch.coin(0.5))
        if shared:
            v = self.add(self.unary(v, ch.choice(("relu", "tanh", "sigmoid", "scale", "abs"))))
        k = v.shape[-1]
        n = k if self.force("square", lambda: ch.coin(0.7)) else ch.choice((1, 2, 3, 4))
        form = ch.int(0, 6) if not self.forced.get("gemm_direct") else ch.choice((0, 1, 3))
        if form == 0:                              # a computed right operand, read elsewhere
            w = self.pick(lambda t: t.ndim == 2 and t.shape[0] == k)
            if w is None:
                w = self.unary(self.param((k, n), std=0.6), "tanh")
            r = v @ w
        elif form == 1:                            # w.T: the simplify pass sets tb
            r = v @ self.param((n, k), std=0.6).T
        elif form == 2 and v.ndim == 2:            # a param on the left
            r = self.param((ch.choice((1, 2, 3)), v.shape[0]), std=0.6) @ v
        else:
            r = v @ self.param((k, n), std=0.6)
        direct = shared and self.force("gemm_direct", lambda: ch.coin(0.5))   # t@w + t
        if not direct and ch.coin(0.4):
            r = r + self.param((r.shape[-1],), std=0.3)      # bias epilogue
        if not direct and ch.coin(0.3):
            r = self.unary(r, ch.choice(("relu", "tanh", "gelu")))
        self.add(r)
        if shared and r.shape == v.shape and (direct or ch.coin(0.8)):
            self.add(self.binary(r, v, ch.choice(("add", "mul", "sub"))))   # t@w + t

    def t_rows(self):
        ch = self.ch
        v = self.pick(lambda t: t.ndim >= 1)
        if v is None:
            return
        r = {"const": 0, "value": 2}.get(self.force("row_input", lambda: None), None)
        r = ch.int(0, 5) if r is None else r
        if r == 0:
            x = jg.full_like(v, ch.choice((0.5, -1.25, 2.0)))          # a constant row
        elif r == 1:
            x = jg.scale(v, ch.choice((0.5, 2.0)))
        else:
            x = v
        form = ch.choice(self.force("row_form", lambda: ROW_FORMS + ("op",)))
        y = self.row_form(x, form)
        if y is None:
            return
        if self.force("row_neighbour", lambda: ch.coin(0.5)) and y.shape == v.shape:
            y = y + v if ch.coin() else y * v                         # + the row's neighbour
        self.add(y)

    def row_form(self, x, form):
        ch = self.ch

        def red(op, t):
            return getattr(jg, op)(t, axis=-1, keepdims=True)

        def ms(t):
            q = ch.choice(("sqr", "mul", "pow"))
            q = jg.sqr(t) if q == "sqr" else t * t if q == "mul" else jg.pow(t, 2.0)
            if ch.coin(0.7):
                return red("mean", q)
            return red("sum", q) * (1.0 / t.shape[-1])

        def norm(t):
            eps = ch.choice((1e-5, 1e-3))
            m = ms(t) + eps
            f = ch.int(0, 2)
            if f == 0:
                return t / jg.sqrt(m)
            if f == 1:
                return t * (1.0 / jg.sqrt(m))
            return t * jg.pow(m, -0.5)

        if form == "softmax":
            e = jg.exp(x - red("max", x))
            return e / red("sum", e)
        if form == "softmax_lse":
            return jg.exp(x - red("logsumexp", x))
        if form == "log_softmax":
            s = x - red("max", x)
            return s - jg.log(red("sum", jg.exp(s)))
        if form == "log_softmax_lse":
            return x - red("logsumexp", x)
        if form == "logsumexp":
            return jg.logsumexp(x, axis=-1, keepdims=ch.coin())
        if form == "rms_norm":
            return norm(x)
        if form == "layer_norm":
            return norm(x - red("mean", x))
        op = ch.choice(("softmax", "log_softmax", "rms_norm", "layer_norm"))
        if op in ("softmax", "log_softmax"):
            return getattr(jg, op)(x, axis=ch.int(0, x.ndim - 1))
        w = self.param((x.shape[-1],), std=0.5) if ch.coin() else None
        if op == "rms_norm":
            return jg.rms_norm(x, w)
        return jg.layer_norm(x, w, self.param((x.shape[-1],), std=0.5) if ch.coin() else None)

    def t_const(self):
        v = self.pick()
        c = jg.full_like(v, self.ch.choice((0.5, -2.0, 1.0)))
        self.add(self.binary(c, v) if self.ch.coin(0.3) else c)

    def t_loss(self):
        ch = self.ch
        v = self.pick(lambda t: 1 <= t.ndim <= 2)
        if v is None:
            return
        z = v.reshape((1,) + v.shape) if v.ndim == 1 else v
        n, c = z.shape
        if ch.coin(0.5):
            y = self.g.input(self.name("lab"), (n,), "i32")
            self.int_high[y.label] = c
        else:
            y = jg.softmax(self.input((n, c)))
        self.add(jg.cross_entropy(z, y))

    # outputs, updates, loss --------------------------------------------------------------
    def finish(self):
        ch, g = self.ch, self.g
        users = g.users()
        sinks = [v for v in self.pool if not users[v.id]]
        outs = {}
        for v in (sinks[-2:] if sinks else self.pool[-1:]):
            outs[self.name("o")] = v
        for _ in range(ch.int(0, 2)):
            outs[self.name("o")] = self.pick(recent=False)
        if self.ints and ch.coin(0.7):
            outs[self.name("o")] = ch.choice(self.ints)
        params = [g.tensor(i) for i in g.params.values()]
        if ch.coin(0.25):
            outs[self.name("o")] = ch.choice(params)             # a param as output
        if ch.coin(0.05):
            outs[self.name("o")] = g.tensor(next(iter(g.inputs.values())))   # an input
        if ch.coin(0.1):
            outs[self.name("o")] = ch.choice(list(outs.values()))  # one value, two names
        if self.force("update", lambda: ch.coin(0.4)):             # running statistics
            v = self.pick(recent=False)
            shape = v.shape if ch.coin(0.6) else v.shape[-1:]
            s = self.param(shape, std=1.0, trainable=False, kind="s")
            fit = v if v.shape == shape else jg.mean(v, axis=tuple(range(v.ndim - 1)))
            g.update(**{s.label: s + fit if ch.coin() else s * 0.9 + fit * 0.1})
            if self.force("update_output", lambda: ch.coin(0.6)):
                outs[self.name("o")] = s                          # its pre-update value
            if ch.coin(0.3):
                outs[self.name("o")] = s * 2.0
        if self.mode == "train":
            terms = []
            for name, v in outs.items():
                if v.type.is_float and v.dtype == "f32":
                    terms.append(jg.sum(v * self.input(v.shape)))
            loss = terms[0]
            for t in terms[1:]:
                loss = loss + t
            outs["loss"] = loss
        g.output(**outs)


def generate(chooser, mode=None, max_steps=8, seed=0, check=True, big=False, focus=None):
    """A random Case, or None when its float64 reference overflows or leaves [-LIMIT, LIMIT]
    on the first two steps' inputs (the caller draws again). big: dims up to 64 as well (long
    reductions: the triage's ill-conditioned sums)."""
    mode = mode or chooser.choice(("forward", "forward", "train"))
    focus = focus or chooser.choice(list(FOCI))
    case = _Gen(chooser, mode, max_steps, big, focus).build()
    case.label = f"focus {focus}"
    case.seed = seed
    if check and not sane(case):
        return None
    return case


def sane(case, steps=2):
    """Every value of the float64 reference finite and within LIMIT on the first steps. (An
    interpreter that raises keeps the case: check_case reports it as a "reference" failure.)"""
    try:
        g64 = _reference_graph(case)
        params = _to64(case.graph.init_params(0))
        if case.mode == "train":
            params = {**params, **_to64({k: v for k, v in g64.init_params(0).items()
                                         if k not in params})}
        for step in range(steps):
            feeds = _to64({**feeds_for(case, step), **_runtime(case, step)})
            _, upd, vals = _run(g64, feeds, params)
            for v in vals:
                a = np.asarray(v)
                if a.dtype.kind == "f" and (not np.all(np.isfinite(a)) or
                                            (a.size and np.max(np.abs(a)) > LIMIT)):
                    return False
            params = {**params, **upd}
    except FloatingPointError:
        return False
    except Exception:  # noqa: BLE001 - the interpreter's own failure: a finding
        return True
    return True


# ---- graph features (what the CI run must have covered) --------------------------------------
def features(g):
    """Names of the bug-prone shapes a graph contains (computed from the IR)."""
    f = set()
    users = g.users()
    nodes = g.nodes
    elementwise = lambda n: n.op not in ("input", "param", "full") and \
        get_op(n.op).kind == "elementwise"
    for n in nodes:
        a = n.attr
        shape_in = nodes[n.inputs[0]].type.shape if n.inputs else ()
        if n.op in ("sum", "mean", "max", "logsumexp"):
            f.add("reduce")
            if a["axes"] == ():
                f.add("axis=()")
                if n.inputs and elementwise(nodes[n.inputs[0]]):
                    f.add("axis=() with prologue")
            elif all(shape_in[i] == 1 for i in a["axes"]):
                f.add("reduce over size-1 axes")
                if n.op == "mean":
                    f.add("mean over size-1 axes")
        if n.op == "argmax":
            f.add("argmax")
            if shape_in[a["axis"]] == 1:
                f.add("argmax over a size-1 axis")
        if n.op in ("reshape", "permute", "slice", "broadcast_to", "concat"):
            f.add(n.op)
        if n.op == "broadcast_to" and n.type.shape == shape_in:
            f.add("no-op broadcast_to")
        if n.op == "cast" and n.type.dtype == nodes[n.inputs[0]].type.dtype:
            f.add("no-op cast")
        if n.op == "cast" and n.type.dtype == "f64":
            f.add("cast f64")
        if n.op == "full":
            f.add("constant")
        if n.op not in ("input", "param") and len(users[n.id]) >= 2:
            f.add("several consumers")
        if n.op == "matmul":
            f.add("gemm")
            for i in n.inputs:                 # an operand's elementwise producer that an
                p = nodes[i]                   # elementwise reader of the result also reads
                if elementwise(p) and any(elementwise(nodes[u]) and i in nodes[u].inputs
                                          for u in users[n.id]):
                    f.add("gemm result and operand producer read together")
                if elementwise(p) and len(users[i]) >= 2:
                    f.add("gemm operand shared")
        if n.op in ("softmax", "log_softmax", "rms_norm", "layer_norm"):
            f.add("row op")
        if n.op == "cross_entropy":
            f.add("cross_entropy")
    try:
        from jitgraph.passes.patterns import recognise_patterns
        pg, rep = recognise_patterns(g)
        if rep.stats.get("rewritten"):
            f.add("primitive row op")
            for n in pg.nodes:
                if n.op in ("softmax", "log_softmax", "rms_norm", "layer_norm"):
                    f.add(f"primitive {n.op}")
                    if pg.nodes[n.inputs[0]].op == "full":
                        f.add("primitive row op on a constant")
    except Exception:   # noqa: BLE001 - the pass itself may be what is broken
        pass
    if any(n.op == "logsumexp" for n in nodes):
        f.add("logsumexp")
    outs = list(g.outputs.values())
    if len(outs) >= 2:
        f.add("several outputs")
    if len(set(outs)) < len(outs):
        f.add("one value, two outputs")
    if any(nodes[i].op == "param" for i in outs):
        f.add("param output")
    if any(nodes[i].op == "input" for i in outs):
        f.add("input output")
    if g.updates:
        f.add("update")
        if any(g.params[p] in outs for p in g.updates):
            f.add("updated param output")
    return f


# ---- the float64 reference and its noise spread ------------------------------------------------
def _cast_like(g, d):
    """Arrays cast to the dtypes of g's inputs and params of the same names."""
    out = {}
    for k, v in d.items():
        nid = g.inputs.get(k, g.params.get(k))
        out[k] = np.asarray(v, g.nodes[nid].type.np_dtype) if nid is not None else v
    return out


def _to64(d):
    return {k: (np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else np.asarray(v))
            for k, v in d.items()}


def _runtime(case, step):
    opt = case.optimizer
    return opt.runtime_inputs(step) if opt is not None else {}


def _reference_graphs(case):
    """(float32, float64) graphs the interpreter runs for a step: the case's graph, or in
    train mode jg.training_graph of it."""
    from jitgraph.passes.precision import cast_graph
    g = case.graph
    if case.mode == "train":
        g = jg.training_graph(g, loss="loss", optimizer=case.optimizer)
    return g, cast_graph(g, "f64")


def _reference_graph(case):
    return _reference_graphs(case)[1]


def _run(g, inputs, params, rng=None, delta=0.0):
    """The interpreter, optionally multiplying every rounded value by (1 + delta * u). Returns
    (outputs, updates, values); `params` is not modified."""
    vals = []
    for n in g.nodes:
        if n.op == "input":
            v = np.asarray(inputs[n.attr["name"]])
        elif n.op == "param":
            v = np.asarray(params[n.attr["name"]])
        else:
            with np.errstate(all="ignore"):
                v = np.asarray(get_op(n.op).ref(n.attr, *[vals[i] for i in n.inputs]))
            if v.shape != n.type.shape:             # as jg.interp.run checks
                raise AssertionError(f"{n.op} %{n.id}: reference returned shape {v.shape}, "
                                     f"shape rule says {n.type}")
            v = v.astype(n.type.np_dtype, copy=False)
        if rng is not None and v.dtype.kind == "f" and (n.op not in _EXACT or n.op in (
                "input", "param")):
            v = v * (1.0 + delta * rng.uniform(-1.0, 1.0, v.shape))
        vals.append(v)
    return ({k: vals[i] for k, i in g.outputs.items()},
            {k: vals[i] for k, i in g.updates.items()}, vals)


def reference(g64, feeds, params, samples=4, delta=DELTA, seed=0, g32=None):
    """(values, spread): the float64 outputs and post-step params (`param:<name>`), and per
    element the largest deviation of `samples` noisy runs from them and, given the float32
    graph g32, of the float32 interpreter (the rounding inside one op: log(sum) of a sum
    next to 1 in log_softmax, say, that noise between ops does not show)."""
    def flat(out, upd):
        d = dict(out)
        for k, v in params.items():
            d["param:" + k] = upd.get(k, v)
        return d
    with np.errstate(all="ignore"):
        ref = flat(*_run(g64, feeds, params)[:2])
        spread = {k: np.zeros(np.shape(v)) for k, v in ref.items()}
        rng = np.random.default_rng(seed)
        runs = [lambda: _run(g64, feeds, params, rng, delta)] * samples
        if g32 is not None:
            runs.append(lambda: _run(g32, _cast_like(g32, feeds), _cast_like(g32, params)))
        for run in runs:
            noisy = flat(*run()[:2])
            for k, v in noisy.items():
                d = np.abs(np.asarray(v, np.float64) - np.asarray(ref[k], np.float64))
                spread[k] = np.fmax(spread[k], np.where(np.isnan(d), np.inf, d))
    return ref, spread


def compare(got, ref, spread, c=C_TOL):
    """Indices where float32 `got` is beyond float32 rounding of the float64 `ref`."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return np.ones(ref.shape, bool), f"shape {list(got.shape)}, expected {list(ref.shape)}"
    with np.errstate(all="ignore"):
        err = np.abs(got - ref)
        tol = c * spread + U32 * np.abs(ref) + 1e-30
        bad = ~(err <= tol)
        bad &= ~(np.isnan(got) & np.isnan(ref))
        bad &= ~((got == ref) & np.isinf(ref))
    return bad, ""


# ---- running a case -----------------------------------------------------------------------
@dataclass
class Failure:
    kind: str               # "error" | "mismatch" | "grad" | "reference" | "checker error"
    config: tuple | None    # (fuse, plan_memory)
    step: int
    where: str              # the output/param, or the exception type
    detail: str
    at: str = ""            # where an exception was raised: file:line
    op: str = ""            # mismatch: the op computing the wrong value ("param": the leaf)

    def signature(self):
        """What the shrinker preserves: the kind and, for an exception, its type and message
        without numbers."""
        if self.kind in ("error", "reference", "checker error"):
            return (self.kind, self.where, re.sub(r"[0-9]+", "", self.detail)[:60], self.at)
        if self.kind == "mismatch":
            return ("mismatch", self.op)
        return (self.kind,)

    def __str__(self):
        cfg = "" if self.config is None else \
            f" fuse={self.config[0]} plan_memory={self.config[1]}"
        at = f" (at {self.at})" if self.at else ""
        return f"{self.kind}{cfg} step {self.step} {self.where}: {self.detail}{at}"


@dataclass
class Result:
    failures: list
    programs: int = 0
    steps: int = 0


def _compile(case, fuse, plan):
    return jg.compile(case.graph, loss="loss" if case.mode == "train" else None,
                      optimizer=case.optimizer, fuse=fuse, plan_memory=plan)


def check_case(case, configs=CONFIGS, steps=None, grad_check=True, compile_fn=_compile,
               raise_on_fail=False):
    """Compile `case` under each (fuse, plan_memory) config and run `steps` steps (default 3,
    2 in train mode) on fresh inputs, each checked against the float64 reference started from
    the program's own parameters. Returns a Result; raise_on_fail raises AssertionError."""
    steps = steps if steps is not None else (2 if case.mode == "train" else 3)
    res = Result([])
    g32, g64 = _reference_graphs(case)
    init = case.graph.init_params(0)
    try:                         # the interpreters themselves (float64, float32) on step 0
        ps = {**init, **{k: v for k, v in g32.init_params(0).items() if k not in init}}
        feeds = {**feeds_for(case, 0), **_runtime(case, 0)}
        jg.interp.run(g32, feeds, dict(ps))
        _run(g64, _to64(feeds), _to64(ps))
    except Exception as e:  # noqa: BLE001
        f = _error(None, 0, e)
        res.failures.append(replace(f, kind="reference", where=f"interpreter {f.where}"))
        if raise_on_fail:
            raise AssertionError(str(res.failures[0])) from e
        return res
    if case.mode == "train" and grad_check:
        res.failures += _check_grad(case, init)
        res.failures += _check_sgd_reference(case, g64, init)
    for cfg in configs:
        try:
            prog = compile_fn(case, *cfg)
        except Exception as e:  # noqa: BLE001 - any exception is a finding
            res.failures.append(_error(cfg, -1, e))
            continue
        res.programs += 1
        for step in range(steps):
            pre = _to64({**prog.params, **getattr(prog, "state", {})})
            feeds = feeds_for(case, step)
            try:
                got = prog.step(**feeds)
            except Exception as e:  # noqa: BLE001
                res.failures.append(_error(cfg, step, e))
                break
            res.steps += 1
            post = {**{"param:" + k: np.array(v) for k, v in prog.params.items()},
                    **{"param:" + k: np.array(v) for k, v in getattr(prog, "state", {}).items()}}
            f = _compare_step(case, (g32, g64), cfg, step, feeds, pre, {**got, **post})
            if f is not None:
                res.failures.append(f)
                break
    if raise_on_fail and res.failures:
        raise AssertionError("\n".join(map(str, res.failures)))
    return res


def _error(cfg, step, e):
    tb = traceback.extract_tb(e.__traceback__)
    ours = [f for f in tb if "/jitgraph/" in f.filename or "/passes/" in f.filename or
            "/runtime/" in f.filename]
    at = f"{tb[-1].filename.split('/')[-1]}:{tb[-1].lineno}" if tb else ""
    if ours and ours[-1] is not tb[-1]:         # the deepest frame of jitgraph's own code
        at += f" from {ours[-1].filename.split('/')[-1]}:{ours[-1].lineno}"
    elif len(ours) >= 2:                        # and who called it
        at += f" from {ours[-2].filename.split('/')[-1]}:{ours[-2].name}"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return Failure("error", cfg, step, type(e).__name__, msg[:300], at)


def _compare_step(case, graphs, cfg, step, feeds, pre, got):
    g32, g64 = graphs
    feeds64 = _to64({**feeds, **_runtime(case, step)})
    for confirm in (False, True):
        try:
            ref, spread = reference(g64, feeds64, pre, samples=24 if confirm else 4,
                                    delta=DELTA * (2 if confirm else 1), seed=step, g32=g32)
        except Exception as e:  # noqa: BLE001 - the interpreter, on the program's own state
            f = _error(cfg, step, e)
            return replace(f, kind="reference", where=f"interpreter {f.where}")
        worst = None
        for k, r in ref.items():
            if k not in got:
                if k.startswith("param:"):
                    continue
                worst = (k, f"output missing from the program (has {sorted(got)})")
                break
            bad, why = compare(got[k], r, spread[k])
            if why:
                worst = (k, why)
                break
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0]) if np.ndim(r) else ()
                gv, rv = np.asarray(got[k], np.float64)[idx], np.asarray(r, np.float64)[idx]
                worst = (k, f"{int(bad.sum())}/{bad.size} elements wrong, at {list(idx)} got "
                            f"{gv:.6g} expected {rv:.6g} (float32 rounding allows "
                            f"{C_TOL * spread[k][idx] + U32 * abs(rv):.2g})")
                break
        if worst is None:
            return None
    g, k = case.graph, worst[0]
    nid = g.updates.get(k[6:], g.params.get(k[6:])) if k.startswith("param:") else \
        g.outputs.get(k)
    op = g.nodes[nid].op if nid is not None else "?"
    return Failure("mismatch", cfg, step, k, worst[1], op=op)


def _check_grad(case, init):
    """autodiff against central differences in float64 (jitgraph.testing.check_grad)."""
    from jitgraph.testing import check_grad
    feeds = feeds_for(case, 0)
    g = case.graph.copy()
    g.updates = {}          # the interpreter would move updated state between the probes
    try:
        r = check_grad(g, feeds, init, loss="loss", eps=1e-6, rtol=1e-4, atol=1e-6,
                       max_elements=6, raise_on_fail=False)
    except Exception as e:  # noqa: BLE001
        return [_error(None, 0, e)]
    if r.ok:
        return []
    return [Failure("grad", None, 0, "check_grad", "; ".join(r.failures[:3]))]


def _check_sgd_reference(case, g64, init):
    """The reference's own training step is p - lr * grad (float64 autodiff + interpreter)."""
    from jitgraph.passes.precision import cast_graph
    gg = cast_graph(jg.grad(case.graph, "loss"), "f64")
    feeds = feeds_for(case, 0)
    params = _to64(dict(init))
    state = {k: v for k, v in _to64(g64.init_params(0)).items() if k not in params}
    grads = _run(gg, _to64(feeds), params)[0]
    _, upd, _ = _run(g64, _to64({**feeds, **_runtime(case, 0)}), {**params, **state})
    for p in case.graph.trainable_params():
        gp = grads.get(f"grad/{p}")
        lr = float(_runtime(case, 0)["opt/lr"])      # the float32 value the graph is fed
        want = params[p] - lr * (gp if gp is not None else 0.0)
        have = upd.get(p, params[p])
        if not np.allclose(have, want, rtol=1e-9, atol=1e-12):
            return [Failure("reference", None, 0, p, "training_graph's SGD step is not "
                            "p - lr * grad")]
    return []


# ---- the shrinker ----------------------------------------------------------------------------
def _rebuild(case, cut=(), bypass=None, drop_outputs=(), drop_updates=(), dims=None,
             params_to_inputs=(), retarget=None):
    """A new Case: nodes in `cut` become fresh inputs, `bypass` maps a node to an operand that
    replaces it, outputs/updates dropped, every dim size d -> dims[d], dead nodes removed.
    Raises ShapeError when the result does not type-check."""
    g = case.graph
    bypass = bypass or {}
    dims = dims or {}
    outputs = {k: (retarget or {}).get(k, v) for k, v in g.outputs.items()
               if k not in drop_outputs}
    updates = {k: v for k, v in g.updates.items() if k not in drop_updates}

    def resolve(i):
        while i in bypass:
            i = bypass[i]
        return i
    live, stack = set(), [resolve(i) for i in list(outputs.values()) + list(updates.values())]
    stack += [g.params[p] for p in updates]
    while stack:
        i = resolve(stack.pop())
        if i in live:
            continue
        live.add(i)
        if i not in cut:
            stack.extend(g.nodes[i].inputs)

    def dim(d):
        return dims.get(d, d)

    def shape(s):
        return tuple(dim(d) for d in s)

    new = jg.Graph(g.name)
    m, int_high = {}, {}
    for n in g.nodes:
        if n.id not in live:
            continue
        if n.id in cut or (n.op == "param" and n.attr["name"] in params_to_inputs):
            name = n.attr["name"] if n.op in ("input", "param") else f"c{n.id}"
            m[n.id] = new.input(name, shape(n.type.shape), n.type.dtype)
            if not n.type.is_float:
                int_high[name] = 2
        elif n.op == "input":
            m[n.id] = new.input(n.attr["name"], shape(n.type.shape), n.type.dtype)
            if n.attr["name"] in case.int_high:
                int_high[n.attr["name"]] = case.int_high[n.attr["name"]]
        elif n.op == "param":
            name = n.attr["name"]
            m[n.id] = new.param(name, shape(n.type.shape), n.type.dtype, init=g.inits[name],
                                trainable=n.attr["trainable"])
        else:
            a = dict(n.attrs)
            if dims:
                for key in ("shape",):
                    if key in a:
                        a[key] = shape(a[key])
                if "slices" in a:
                    src = g.nodes[n.inputs[0]].type.shape
                    a["slices"] = tuple(_reslice(sl, d, dim(d))
                                        for sl, d in zip(a["slices"], src))
            m[n.id] = new.add(n.op, [m[resolve(i)] for i in n.inputs], a)
    new.outputs = {k: m[resolve(v)].id for k, v in outputs.items()}
    for k, v in updates.items():
        if k in new.params:
            new.update(**{k: m[resolve(v)]})
    for k, v in case.int_high.items():
        if k in new.inputs and k not in int_high:
            int_high[k] = v
    for name in int_high:                           # labels: below the shrunk class count
        if name in new.inputs and name in case.int_high:
            int_high[name] = max(1, dim(case.int_high[name]))
    new.validate()
    return replace(case, graph=new, int_high=int_high)


def _reslice(sl, d, nd):
    """The (start, stop, step) triple of a slice of an axis of size d, for size nd."""
    st, sp, step = sl
    if nd == d:
        return sl
    stop = None if (step > 0 and sp >= d) or (step < 0 and sp < 0) else min(sp, nd)
    r = range(nd)[slice(min(st, nd - 1), stop, step)]
    return (r.start, r.stop, r.step)


def _size(case):
    g = case.graph
    return (sum(n.op not in ("input", "param") for n in g.nodes), len(g.nodes),
            sum(n.type.size for n in g.nodes))


def shrink(case, failure, budget_s=120.0, steps=None, log=None, compile_fn=_compile):
    """A smaller Case that still fails like `failure` (same kind; for exceptions the same type
    and message shape), for the failing config only. Returns (case, failure, steps)."""
    configs = [failure.config] if failure.config is not None else []
    steps = steps or (failure.step + 1 if failure.step >= 0 else 1)
    grad = failure.kind == "grad"
    deadline = time.monotonic() + budget_s
    sig = failure.signature()

    def fails(c, nsteps):
        if time.monotonic() > deadline:
            return None
        if not sane(c, steps=max(1, nsteps)):
            return None
        try:
            r = check_case(c, configs=configs, steps=nsteps, grad_check=grad,
                           compile_fn=compile_fn)
        except Exception:  # noqa: BLE001 - the reference itself failed: not the same bug
            return None
        for f in r.failures:
            if f.signature() == sig:
                return f
        return None

    best, best_f = case, failure
    if best.mode == "train" and failure.kind != "grad":        # fails without training?
        fwd = replace(best, mode="forward")
        f = fails(fwd, steps)
        if f is not None:
            best, best_f = fwd, f
    for s in range(1, steps):                       # fewer steps first
        f = fails(best, s)
        if f is not None:
            steps, best_f = s, f
            break

    def candidates(c):
        g = c.graph
        must = {"loss"} if c.mode == "train" else set()
        if len(g.outputs) > 2:
            for k in list(g.outputs):
                yield dict(drop_outputs=set(g.outputs) - {k} - must)
        for k in list(g.outputs):
            if k not in must and len(g.outputs) > 1:
                yield dict(drop_outputs={k})
        for k in list(g.updates):
            yield dict(drop_updates={k})
        for k, i in g.outputs.items():              # an output moves to an operand
            if k not in must:
                for j in dict.fromkeys(g.nodes[i].inputs):
                    yield dict(retarget={k: j})
        comp = [n for n in g.nodes if n.op not in ("input", "param")]
        for n in reversed(comp):
            for i in dict.fromkeys(n.inputs):
                if g.nodes[i].type == n.type:
                    yield dict(bypass={n.id: i})
            yield dict(cut={n.id})
        for p in list(g.params):
            if p not in g.updates:
                yield dict(params_to_inputs={p})
        sizes = sorted({d for n in g.nodes for d in n.type.shape if d > 1}, reverse=True)
        for d in sizes:
            for smaller in range(1, d):
                yield dict(dims={d: smaller})

    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for kw in candidates(best):
            try:
                cand = _rebuild(best, **kw)
            except (ShapeError, ValueError, KeyError, IndexError):
                continue
            if _size(cand) >= _size(best):
                continue
            f = fails(cand, steps)
            if f is not None:
                best, best_f, improved = cand, f, True
                if log:
                    log(f"  shrink: {_size(best)[0]} nodes ({kw})")
                break
    return best, best_f, steps


def _py(v):
    if isinstance(v, float):
        if math.isinf(v):
            return "float('inf')" if v > 0 else "-float('inf')"
        if math.isnan(v):
            return "float('nan')"
        return repr(v)
    if isinstance(v, tuple):
        inner = ", ".join(_py(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    return repr(v)


_SIMPLE = {"relu", "tanh", "sigmoid", "neg", "sqr", "abs", "gelu", "silu", "softplus", "exp",
           "log", "sqrt", "step", "sgn", "add", "sub", "mul", "div", "maximum", "minimum",
           "where", "matmul"}


def to_python(case, failure=None, steps=None, configs=None):
    """A runnable script: builds `case.graph` and checks it with check_case."""
    g = case.graph
    var = {}
    lines = ["import numpy as np", "import jitgraph as jg",
             "from jitgraph.testing_graphs import Case, check_case", "",
             f"g = jg.Graph({g.name!r})"]
    for n in g.nodes:
        v = var[n.id] = (n.attr["name"].replace("/", "_") if n.op in ("input", "param")
                         else f"t{n.id}")
        if n.op == "input":
            lines.append(f"{v} = g.input({n.attr['name']!r}, {_py(n.type.shape)}, "
                         f"{n.type.dtype!r})")
        elif n.op == "param":
            spec = g.inits[n.attr["name"]].spec()
            lines.append(f"{v} = g.param({n.attr['name']!r}, {_py(n.type.shape)}, "
                         f"{n.type.dtype!r}, init=jg.init.from_spec({spec!r}), "
                         f"trainable={n.attr['trainable']})")
        else:
            args = ", ".join(var[i] for i in n.inputs)
            a = n.attr
            if n.op in _SIMPLE and (not a or a == {"ta": False, "tb": False}):
                lines.append(f"{v} = jg.{n.op}({args})")
            else:
                attrs = "{" + ", ".join(f"{k!r}: {_py(x)}" for k, x in n.attrs) + "}"
                lines.append(f"{v} = g.add({n.op!r}, [{args}], {attrs})")
    outs = ", ".join(f"{k!r}: {var[i]}" for k, i in g.outputs.items())
    lines.append(f"g.output(**{{{outs}}})")
    if g.updates:
        ups = ", ".join(f"{k!r}: {var[i]}" for k, i in g.updates.items())
        lines.append(f"g.update(**{{{ups}}})")
    cfgs = configs or ([failure.config] if failure and failure.config else list(CONFIGS))
    st = steps or (failure.step + 1 if failure and failure.step >= 0 else 1)
    if failure is not None:
        lines.append(f"# observed: {failure}")
    lines.append(f"case = Case(g, mode={case.mode!r}, lr={case.lr!r}, "
                 f"int_high={case.int_high!r}, seed={case.seed!r})")
    lines.append(f"check_case(case, configs={cfgs!r}, steps={st}, raise_on_fail=True)")
    return "\n".join(lines) + "\n"


# ---- the fuzzer ----------------------------------------------------------------------------
@dataclass
class Summary:
    graphs: int = 0
    programs: int = 0
    steps: int = 0
    redrawn: int = 0
    seconds: float = 0.0
    shrink_seconds: float = 0.0
    failures: list = field(default_factory=list)    # (signature, first Failure, repro, count)
    features: Counter = field(default_factory=Counter)
    modes: Counter = field(default_factory=Counter)

    def report(self):
        out = [f"{self.graphs} graphs ({dict(self.modes)}), {self.programs} programs, "
               f"{self.steps} steps, {self.redrawn} redrawn, {self.seconds:.1f} s "
               f"({self.shrink_seconds:.1f} s shrinking)"]
        if not self.failures:
            out.append("no failures")
        for sig, f, repro, count in self.failures:
            out.append(f"\n=== {count} graph(s) fail as {sig}\nfirst: {f}\n--- shrunk repro:\n"
                       f"{repro}")
        return "\n".join(out)


def case_at(seed, i, max_steps=8, big_every=0):
    """The i-th case fuzz(seed=seed) draws (None: redrawn)."""
    big = bool(big_every) and i % big_every == big_every - 1
    focus = list(FOCI)[i % len(FOCI)]
    case = generate(RandomChooser([seed, i]), max_steps=max_steps, seed=seed + i, big=big,
                    focus=focus)
    if case is not None:
        case.label = f"seed [{seed}, {i}] ({focus}" + (", big)" if big else ")")
    return case


def fuzz(graphs=None, seed=0, time_budget=None, configs=CONFIGS, max_steps=8, do_shrink=True,
         shrink_budget=120.0, log=None, stop_after=None, big_every=0, compile_fn=_compile):
    """Generate and check `graphs` cases (or until `time_budget` seconds pass) drawn from
    seeds [seed, 0], [seed, 1], ... (every big_every-th with big dims); failures are grouped by
    signature and the first of each is shrunk to a repro."""
    t0 = time.monotonic()
    s = Summary()
    by_sig = {}
    i = 0
    while (graphs is None or s.graphs < graphs) and \
            (time_budget is None or time.monotonic() - t0 < time_budget):
        case = case_at(seed, i, max_steps, big_every)
        i += 1
        if case is None:
            s.redrawn += 1
            continue
        s.graphs += 1
        s.modes[case.mode] += 1
        s.features.update(features(case.graph))
        try:
            r = check_case(case, configs=configs, compile_fn=compile_fn)
        except Exception as e:  # noqa: BLE001 - the checker itself (reference, autodiff)
            r = Result([_error(None, -1, e)])
            r.failures[0].kind = "checker error"
        s.programs += r.programs
        s.steps += r.steps
        for sig, f in {f.signature(): f for f in reversed(r.failures)}.items():
            if sig in by_sig:
                by_sig[sig][3] += 1
                continue
            if log:
                log(f"graph {case.label} ({case.mode}): {f}")
            repro = to_python(case, f)
            if do_shrink:
                t1 = time.monotonic()
                small, sf, st = shrink(case, f, budget_s=shrink_budget, log=log,
                                       compile_fn=compile_fn)
                repro = to_python(small, sf, steps=st)
                s.shrink_seconds += time.monotonic() - t1
            by_sig[sig] = [sig, f, repro, 1]
        if log and s.graphs % 10 == 0:
            log(f"{s.graphs} graphs, {s.programs} programs, {time.monotonic() - t0:.0f} s")
        if stop_after is not None and len(by_sig) >= stop_after:
            break
    s.failures = list(map(tuple, by_sig.values()))
    s.seconds = time.monotonic() - t0
    return s

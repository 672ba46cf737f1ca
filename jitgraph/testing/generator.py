"""Generator (`generate(chooser)`; fuzz.case_at(seed, i) draws the fuzzer's i-th case): leaves are
inputs and params of one random base shape (dims in 1..5, size-1 axes often; `big`: up to 64)
and broadcastable relatives. Each graph opens with a focus (FOCI: the shapes that broke the
compiler before, forced; the fuzzer cycles through them) and goes on with templates: unary and
binary elementwise ops (domain-safe forms of log/sqrt/div/pow), python-number and full_like
constants, reductions sum/mean/max/logsumexp over axis=(), one axis, the size-1 axes, several
or all axes (keepdims or not), argmax, views (reshape merge/split/unit axes/no-op, permute,
transpose, slice with steps 1/2/-1, broadcast_to incl. the no-op, cast to the same dtype, f64
round trips and, in forward mode, stretches in f16 / bf16, concat), GEMMs (square weights so the result meets its operand again; the
operand computed by an elementwise producer that others read too; batched; transposed), the
primitive forms of softmax / log_softmax / logsumexp / rms_norm / layer_norm (the ones
passes/patterns.py rewrites, on values, on constants and on values read elsewhere), the row ops
themselves and cross_entropy. Outputs: sinks plus random values, params and inputs themselves,
one value under two names; params updated with Graph.update (running statistics) whose
pre-update value is also an output. Two modes: "forward" (outputs and updates) and "train"
(loss = sum of outputs weighted by random inputs; compiled with SGD).

A drawn graph whose float64 values exceed LIMIT (or overflow) is redrawn (`sane`)."""
from __future__ import annotations

import math
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

import jitgraph as jg
from jitgraph.ops.common import apply
from jitgraph.registry import OPS
from jitgraph.types import ShapeError

from .reference import _reference_graph, _run, _runtime, _to64


LIMIT = 1e4                 # graphs whose float64 values exceed this (or overflow) are redrawn


LR = 0.05


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


# Registered ops the generator leaves out, and why; every other op that `drawn` selects is
# fuzzed as soon as it is registered.
NOT_FUZZED = {"round_f16": "rounds to float16: the float64 reference cannot tell a rounding "
                           "step (an f16 ulp) from an error"}


def drawn(kind, arities) -> tuple:
    """The registered ops of `kind` with an arity in `arities` that graphs are drawn from: ops
    with a gradient (a vjp), not a gradient op themselves (`*_back`, reached through autodiff
    of their forward op in "train" mode), whose attributes are all numbers with defaults (a
    dtype or a shape is the view template's business), in registration order."""
    return tuple(name for name, d in OPS.items()
                 if d.kind == kind and d.arity in arities and d.vjp is not None
                 and not name.endswith("_back") and name not in NOT_FUZZED
                 and all(k in ("float", "int") for k, _ in d.attrs.values()))


def call(op, *operands, **attrs):
    """op's user function (jg.<op>) if it has one, else the op itself (ops.common.apply)."""
    fn = getattr(jg, op, None)
    return fn(*operands, **attrs) if callable(fn) else apply(op, *operands, **attrs)


UNARY = drawn("elementwise", (1,))
BINARY = drawn("elementwise", (2, 3))       # a third operand: where's condition
ROW_OPS = drawn("rows", (1,))


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
    "half": dict(steps=[("view", dict(view=("half",))), ("view", dict(view=("half",)))]),
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
        return call(op, v)

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
        if OPS[op].arity == 3:                     # a new ternary op: a third operand like b
            return call(op, a, b, b)
        if not isinstance(b, jg.Tensor) and ch.coin(0.5):
            return call(op, b, a)                  # number on the left
        return call(op, a, b)

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
        elif kind == "cast64" or kind == "half" and (self.mode != "forward" or v.dtype != "f32"):
            r = jg.cast(self.unary(jg.cast(v, "f64"), ch.choice(("tanh", "sqr", "neg"))), "f32")
        elif kind == "half":
            # a stretch in f16 or bf16 (forward only: finite differences cannot cross its
            # roundings): unary ops, a product, a reduction, back to f32
            h = jg.cast(v, ch.choice(("bf16", "f16")))
            r = self.unary(h)
            if ch.coin():
                r = r * h
            if s and ch.coin(0.3):
                r = jg.sum(r, axis=-1, keepdims=True)
            r = jg.cast(r, "f32")
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
        op = ch.choice(ROW_OPS)
        if "axis" in OPS[op].attrs:
            return call(op, x, axis=ch.int(0, x.ndim - 1))
        if op not in ("rms_norm", "layer_norm"):
            return call(op, x)
        w = self.param((x.shape[-1],), std=0.5) if ch.coin() else None     # their affine forms
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

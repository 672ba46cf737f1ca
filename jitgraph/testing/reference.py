"""Triage: the float64 reference is run again with every computed value (and leaf) multiplied by
(1 + d*u), u uniform in [-1, 1], d a few float32 ulps, and once as the float32 interpreter
(rounding inside one op: log of a sum next to 1 in log_softmax). The spread s of those runs is
how far float32 rounding can move each element (a cancelling sum spreads by about d * sum|x|,
a value next to a kink such as relu, step or an argmax tie flips). An element is wrong only
when |got - ref| > C_TOL * s + ulp * |ref|; a mismatch is confirmed with 24 samples at twice
the noise before it counts. On the fuzzer's graphs, correct programs stay below 0.05 of that
tolerance (the largest err / s seen: 0.9, with dims up to 64), wrong ones exceed it by orders
of magnitude."""
from __future__ import annotations

import numpy as np

import jitgraph as jg
from jitgraph.half import round_to, to_f32
from jitgraph.registry import get_op


U32 = 2.0 ** -24            # float32 unit roundoff


DELTA = 8 * U32             # relative noise per value in the sensitivity runs

# unit roundoff of the half types: a half value's noise (at `delta` = DELTA) is one of it, the
# most its rounding moves it, so C_TOL of spread is 16 of them (bf16: 3 %, f16: 0.4 %)
HALF_U = {"bf16": 2.0 ** -9, "f16": 2.0 ** -12}


C_TOL = 16.0                # an error must exceed C_TOL times the noise spread to count


# ops whose result only moves values (no rounding of their own: no noise on them; leaves do
# get noise, which stands for the rounding of whatever computed them)
_EXACT = {"input", "param", "reshape", "permute", "slice", "broadcast_to", "concat", "pad",
          "slice_back", "get_rows", "argmax", "count_equal"}


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
            # a half value is held as its float value (f32), rounded as jitgraph/half.py does
            v = to_f32(round_to(v, n.type.dtype), n.type.dtype) if n.type.is_half else \
                v.astype(n.type.np_dtype, copy=False)
        if rng is not None and v.dtype.kind == "f" and (n.op not in _EXACT or n.op in (
                "input", "param")):
            d = delta * HALF_U[n.type.dtype] / DELTA if n.type.is_half else delta
            v = v * (1.0 + d * rng.uniform(-1.0, 1.0, v.shape))
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

"""Gradient checkpointing: recompute chosen activations in the backward instead of keeping them.

Runs after autodiff and the optimizer. Forward nodes are the ancestors of the loss; every other
computing node is "backward" (gradients and the update). Activations are forward values that
backward nodes read. A plan is the set S of forward nodes to recompute: a backward node reading a
value in S reads a clone of it instead, emitted right before the first backward node that needs
it, whose operands are clones themselves when in S and the kept originals otherwise. The
originals then die at their last forward use, so the memory planner frees them early. Clones run
the same ops on the same operands: results equal the unchecked graph's (bitwise in the
interpreter).

Policies:
  None             keep everything (jg.checkpoint marks are removed)
  "marks"          keep the values marked with jg.checkpoint(x); recompute every other one from
                   the nearest kept values (segments between marks)
  "sqrt"           keep about sqrt(n) cut points of the forward chain (values every later forward
                   node can be computed from; half to twice that many segments are tried) and
                   recompute the segments between them; the segments either split the
                   activation bytes evenly or shrink going up by the kept cuts live beneath
                   them (`_Forward.balanced`), whichever plans less arena
  "budget:BYTES"   (or "budget:0.5", a fraction of the unchecked peak) the plan that fits the
                   budget at the least recomputation: first only cheap ops are recomputed (never
                   a matmul or conv2d while that suffices), cheapest per byte first; then segments
The automatic policies ignore jg.checkpoint marks (and remove them).
The memory measure is the caller's `measure(graph) -> arena bytes`: the pipeline hands in the
arena the rest of it will plan (passes/pipeline.py's `arena_peak`: fuse -> schedule -> memory
with the program's options), so this pass never runs the pipeline itself.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from jitgraph.ir import LEAF_OPS, copy_node, live_nodes, op_kind, rebuild
from jitgraph.registry import cost as op_cost, get_op

from .report import Report

def expensive(n) -> bool:
    """Whether node n's op is not cheap to recompute (a GEMM, a convolution): such nodes are
    recomputed only when recomputing cheap ops cannot fit."""
    return n.op not in LEAF_OPS and not get_op(n.op).cheap


def flops(graph, n) -> int:
    """Estimated cost of computing node n: its op's flops (jitgraph/registry.py `cost`:
    2MNK per GEMM, one per element otherwise)."""
    return n.type.size if n.op in LEAF_OPS else op_cost(graph, n).flops


def checkpoint(graph, policy=None, loss: str = "loss", measure=None):
    """Return (graph with recomputation in the backward, Report). See the module docstring;
    `measure(graph)` gives the arena bytes a candidate graph will be planned (the pipeline's
    `arena_peak` with the program's options: fusion and memory planning change the arena); every
    policy but None needs it."""
    kind, arg = _parse(policy)
    g, marked = _strip_marks(graph)
    if kind == "none":
        return g.validate(), Report("checkpoint", {"policy": "none", "marks_removed":
                                                   len(graph.nodes) - len(g.nodes)})
    if measure is None:
        raise TypeError(f"checkpoint: policy {policy!r} needs measure=<graph -> arena bytes>, "
                        f"e.g. jitgraph.passes.pipeline.arena_peak")
    fw = _Forward(g, loss, measure)
    peak0 = measure(g)
    if kind == "marks":
        plan = fw.candidates - marked
    elif kind == "sqrt":
        plans = [plan(k) for k in fw.sqrt_ks() for plan in (fw.segments, fw.balanced)]
        plan = min(plans, key=lambda s: (fw.evaluate(s).peak, fw.evaluate(s).flops))
    else:
        budget = int(arg * peak0) if isinstance(arg, float) else arg
        plan = fw.fit(budget, peak0)
    out, clones = fw.rebuild(plan)
    return out.validate(), _report(policy, fw, out, clones, peak0)


def _parse(policy):
    if policy is None:
        return "none", None
    if policy in ("marks", "explicit", "sqrt"):
        return ("sqrt" if policy == "sqrt" else "marks"), None
    if isinstance(policy, str) and policy.startswith("budget:"):
        v = policy[len("budget:"):]
        try:
            return "budget", int(v)
        except ValueError:
            pass
        try:
            f = float(v)
        except ValueError:
            f = 0.0
        if 0 < f <= 1:
            return "budget", f
    raise ValueError(f"checkpoint: unknown policy {policy!r}; expected None, 'marks', 'sqrt', "
                     f"'budget:BYTES' or 'budget:FRACTION' (0 < FRACTION <= 1 of the unchecked "
                     f"peak)")


def _strip_marks(graph):
    """A copy without checkpoint marks (readers read the marked value); the marked value ids."""
    marked = set()

    def unmark(g, n, new):
        if n.op != "checkpoint":
            return copy_node(g, n, new)
        marked.add(new[n.inputs[0]])
        return new[n.inputs[0]]

    return rebuild(graph, unmark)[0], marked


class Cost(NamedTuple):
    """What a plan costs; orders plans by the partitioner rule, then FLOPs, then memory."""
    expensive: bool    # recomputes a GEMM or a convolution
    flops: int
    peak: int


class _Forward:
    """The forward/backward split of a training graph and the plans over it."""

    def __init__(self, g, loss, measure):
        if loss not in g.outputs:
            raise ValueError(f"checkpoint: graph {g.name} has no output {loss!r} (outputs: "
                             f"{', '.join(g.outputs) or 'none'}); run it after autodiff")
        self.g, self.live, self.measure = g, live_nodes(g), measure
        fwd, todo = set(), [g.outputs[loss]]
        while todo:
            i = todo.pop()
            if i not in fwd and g.nodes[i].op not in LEAF_OPS:
                fwd.add(i)
                todo.extend(g.nodes[i].inputs)
        self.forward = fwd
        self.backward = [n.id for n in g.nodes if n.id in self.live and n.id not in fwd
                         and n.op not in LEAF_OPS]
        self.acts = sorted({i for b in self.backward for i in g.nodes[b].inputs if i in fwd})
        kept = set(g.outputs.values()) | set(g.updates.values())
        self.candidates = frozenset(fwd - kept)
        self.cuts = self._cuts()
        self._cache = {}
        self._flops, self._segment_flops = {}, {}
        self._rebuilt = {}      # plan -> ((expensive, flops), its graph) not yet measured

    def _cuts(self):
        """Forward values (not views) after which no earlier forward value is read again."""
        g, last, reach = self.g, {}, -1
        for i in sorted(self.forward):
            for j in g.nodes[i].inputs:
                if g.nodes[j].inputs:            # leaves and constants are always available
                    last[j] = i
        out = []
        for i in sorted(self.forward):
            if reach <= i and i in self.candidates and op_kind(g.nodes[i].op) != "view":
                out.append(i)
            reach = max(reach, last.get(i, i))
        return out

    def rebuild(self, plan):
        """(graph, {clone id: original id}) for recompute set `plan`."""
        g, plan = self.g, frozenset(plan)
        need = set(g.outputs.values()) | set(g.updates.values())
        cloned = set()
        for n in reversed(g.nodes):                  # readers come after what they read
            if n.id in self.forward:
                if n.id in need:
                    need.update(n.inputs)
                if n.id not in cloned:
                    continue
            elif n.id not in self.live:
                continue
            for i in n.inputs:                       # backward nodes and clones
                (cloned if i in plan else need).add(i)
        clone, origin = {}, {}

        def fetch(out, new, i):
            todo = [i]
            while todo:
                j = todo[-1]
                if j not in plan or j in clone:
                    todo.pop()
                    continue
                missing = [k for k in g.nodes[j].inputs if k in plan and k not in clone]
                if missing:
                    todo.extend(missing)
                    continue
                todo.pop()
                clone[j] = copy_node(out, g.nodes[j], {k: clone[k] if k in plan else new[k]
                                                       for k in g.nodes[j].inputs})
                origin[clone[j]] = j
            return clone[i] if i in plan else new[i]

        def recompute(out, n, new):
            """Leaves and needed forward nodes are copied; a backward node reads clones."""
            if n.op in LEAF_OPS or (n.id in self.forward and n.id in need):
                return copy_node(out, n, new)
            if n.id in self.live and n.id not in self.forward:
                return copy_node(out, n, {i: fetch(out, new, i) for i in n.inputs})
            return None

        return rebuild(g, recompute)[0], origin

    def flops(self, i) -> int:
        """flops() of node i of the graph, computed once (plans sum them many times over)."""
        f = self._flops.get(i)
        if f is None:
            f = self._flops[i] = flops(self.g, self.g.nodes[i])
        return f

    def recomputation(self, plan) -> tuple:
        """(expensive, flops) of `plan`'s clones and the graph it makes: a plan's cost but its
        peak, which only `evaluate` measures (the pipeline's planning, the dear part)."""
        key = frozenset(plan)
        if key not in self._rebuilt:
            out, origin = self.rebuild(key)
            nodes = [self.g.nodes[i] for i in origin.values()]
            self._rebuilt[key] = (any(expensive(n) for n in nodes),
                                  sum(self.flops(n.id) for n in nodes)), out
        return self._rebuilt[key]

    def evaluate(self, plan) -> "Cost":
        key = frozenset(plan)
        if key not in self._cache:
            (dear, cost), out = self.recomputation(key)
            self._cache[key] = Cost(dear, cost, self.measure(out))
            self._rebuilt.pop(key)      # its graph is not needed again
        return self._cache[key]

    def _running_bytes(self):
        """(activation bytes, {forward node: activation bytes up to and including it})."""
        acts, total, at = set(self.acts), 0, {}
        for i in sorted(self.forward):
            total += self.g.nodes[i].type.nbytes if i in acts else 0
            at[i] = total
        return total, at

    def segments(self, k):
        """Keep k - 1 cut points that split the activation bytes evenly (of equally good ones the
        costliest to recompute, e.g. a matmul's output); recompute the rest."""
        g, cuts = self.g, self.cuts
        total, at = self._running_bytes()
        keep = {min(cuts, key=lambda c: (abs(at[c] - j * total / k), -self.flops(c)))
                for j in range(1, k)} if cuts else set()
        return self.candidates - keep

    def balanced(self, k):
        """The plan of at most k segments with the least modelled peak, then the least
        recomputation. While a segment is recomputed and differentiated, the cuts kept at or
        below its base are live too, so its peak is about their bytes plus the activation bytes
        inside it: lower segments may hold more than upper ones, which the even split of
        `segments` ignores. Exact over the cuts by dynamic programming, twice: the least largest
        segment peak, then (with as many segments as that peak allows) the fewest FLOPs."""
        g, cuts, acts = self.g, self.cuts, set(self.acts)
        total, at = self._running_bytes()
        at[None] = 0
        size = {c: g.nodes[c].type.nbytes for c in cuts}
        inside = {c: at[c] - (size[c] if c in acts else 0) for c in cuts}   # bytes before c
        inside[None] = total
        cost = self._segment_flops      # (b, c) -> FLOPs: the same for every k

        def recompute(b, c):
            """FLOPs of the clones the backward reads between cuts b and c (None: start, end)."""
            if (b, c) not in cost:
                lo, hi = -1 if b is None else b, math.inf if c is None else c
                need = {i for i in self.acts if lo < i < hi and i in self.candidates}
                for i in sorted(need, reverse=True):
                    need.update(j for j in g.nodes[i].inputs
                                if lo < j and j in self.candidates)
                cost[b, c] = sum(map(self.flops, need))
            return cost[b, c]

        def run(bound):
            """(score, kept cuts) of the best plan: score is its largest segment peak (bound
            None), else its recomputed FLOPs among the plans whose segments peak within bound."""
            states = {c: {} for c in cuts}
            states[None] = {(0, 0): (0, ())}   # last cut -> (segments, kept bytes) -> best
            best = None
            for b in [None] + cuts:
                for (m, kept), (score, path) in states[b].items():
                    for c in [x for x in cuts if b is None or x > b] + [None]:
                        peak = kept + inside[c] - at[b]
                        if bound is None:      # at most k segments
                            new = max(score, peak)
                            if (c is not None and m + 1 >= k) or (best and new >= best[0]):
                                continue
                        elif peak > bound:     # any number of segments
                            break
                        else:
                            new = score + recompute(b, c)
                        if c is None:
                            best = min(best or (new, path), (new, path))
                            continue
                        key = (m + 1 if bound is None else 0, kept + size[c])
                        if key not in states[c] or new < states[c][key][0]:
                            states[c][key] = (new, path + (c,))
            return best

        if not cuts or k <= 1:
            return self.segments(k)
        return self.candidates - set(run(run(None)[0])[1])

    def sqrt_ks(self):
        """Segment counts from half to twice sqrt(activation bytes / typical cut bytes) (Chen et
        al. 2016): the arena does not follow the count smoothly (deep_mlp, 16 relu layers whose
        backward reads only their outputs: 2-10 segments plan 54.6 / 50.4 / 46.2 / 46.2 / 42.0
        / 46.2 ... MB, sqrt(n) being 4), and a plan is cheap to evaluate."""
        if not self.cuts:
            return [1]
        total = sum(self.g.nodes[i].type.nbytes for i in self.acts)
        cut = sorted(self.g.nodes[i].type.nbytes for i in self.cuts)[len(self.cuts) // 2]
        k = max(1, round(math.sqrt(total / max(cut, 1))))
        ks = {k - 1, k, k + 1, round(k / 2), round(1.5 * k), 2 * k}
        return sorted({max(1, min(x, len(self.cuts) + 1)) for x in ks})

    def _first_fit(self, prefixes, budget) -> list:
        """[the shortest of `prefixes` (each holding the one before it) whose peak is within
        budget] or []: recomputing more never raises the peak, so a doubling search, then
        bisection, finds it with a logarithmic number of measures."""
        def fits(m):
            return self.evaluate(prefixes[m]).peak <= budget
        lo, hi = -1, 0              # lo: the last index known not to fit (-1: none)
        while hi < len(prefixes) and not fits(hi):
            lo, hi = hi, 2 * hi + 1
        if hi >= len(prefixes):
            if lo == len(prefixes) - 1 or not fits(len(prefixes) - 1):
                return []
            hi = len(prefixes) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return [prefixes[hi]]

    def fit(self, budget, peak0):
        """The cheapest plan whose peak is within budget, or a ValueError naming the least."""
        g = self.g
        if peak0 <= budget:
            return frozenset()
        cheap = sorted((i for i in self.candidates if not expensive(g.nodes[i])),
                       key=lambda i: (self.flops(i) / max(g.nodes[i].type.nbytes, 1), i))
        prefixes = [frozenset(cheap[:m]) for m in range(1, len(cheap) + 1)]
        fits = self._first_fit(prefixes, budget)
        segments = [plan(k) for k in range(1, len(self.cuts) + 2)
                    for plan in (self.segments, self.balanced)]
        # a plan costlier to recompute than a fitting one cannot be chosen: it is not measured
        # (the measure plans the whole graph; a deep model has hundreds of candidates)
        for p in sorted(set(map(frozenset, segments)), key=lambda p: (self.recomputation(p)[0], len(p))):
            best = min(fits, key=self.evaluate) if fits else None
            if best is None or self.recomputation(p)[0] <= tuple(self.evaluate(best))[:2]:
                if self.evaluate(p).peak <= budget:
                    fits.append(p)
        if fits:      # GEMMs and convolutions only when no plan without them fits
            return min(fits, key=self.evaluate)
        # the longest prefix recomputes the most, so it peaks the least of them
        least = min(self.evaluate(p).peak for p in prefixes[-1:] + segments)
        raise ValueError(f"checkpoint: budget {budget} B is infeasible for graph {g.name}: the "
                         f"smallest peak reachable by recomputation is {least} B "
                         f"({100 * least / peak0:.0f} % of the unchecked {peak0} B); use "
                         f"budget:{least} or more")


def _report(policy, fw, out, clones, peak0):
    g = fw.g
    extra = sum(flops(g, g.nodes[i]) for i in clones.values())
    peak = fw.measure(out)
    rep = Report("checkpoint", {
        "policy": policy, "activations": len(fw.acts),
        "activation_bytes": sum(g.nodes[i].type.nbytes for i in fw.acts),
        "recomputed": len(clones), "extra_flops": extra,
        "peak_before": peak0, "peak_after": peak,
        "peak_ratio": round(peak / peak0, 3) if peak0 else 1.0})
    for c, i in clones.items():
        n = out.nodes[c]
        rep.lines.append(f"%{c} = {n.op} : {n.type}  recompute (+{flops(g, g.nodes[i])} flops)")
    return rep

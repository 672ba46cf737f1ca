"""The patterns pass: row ops written from primitives become the row op itself.

A user writing numpy-style code gets one node per primitive; this pass finds, over the LAST
axis with keepdims reductions, the forms below and replaces each root by one row op on x, so
the fusion pass can put it, with any elementwise prologue on x (a scale) and epilogue on the
result (* w + b), into one rows kernel. It runs only when fusion is on, before autodiff, so
the backward uses softmax_back / layer_norm_back / rms_norm_back.

  softmax      e / sum(e)                   e = exp(x - max(x))
               exp(x - logsumexp(x))
  log_softmax  (x - max(x)) - log(sum(exp(x - max(x))))
               x - logsumexp(x)
  rms_norm     x / sqrt(ms + eps)           ms = mean(x * x)  (x * x: mul(x, x), sqr(x) or
               x * (1 / sqrt(ms + eps))        pow(x, 2); mean: mean(q) or sum(q) * (1/n);
               x * pow(ms + eps, -0.5)         "+ eps" optional, eps a constant >= 0)
  layer_norm   the rms_norm forms on xc = x - mean(x)

A repeated subexpression may be one node or several structurally equal ones (the user wrote
exp(x - m) twice). A match is rewritten only when every value inside it other than x and the
root is read by nothing but the match (no other node, output or update), so no value anyone
else reads disappears; the root keeps its readers and outputs. exp(x) / sum(exp(x)) (no max)
is left alone: it overflows where softmax does not. Results change by float rounding only.
"""
from __future__ import annotations

from collections import Counter

from jitgraph.ir import LEAF_OPS, copy_node, rebuild

from .report import Report


def recognise_patterns(graph):
    """Return (graph with recognised row ops, Report: how many of each, and where)."""
    m = _Matcher(graph)
    rewrites, claimed, counts, lines, sizes = {}, set(), Counter(), [], {}
    for n in reversed(graph.nodes):              # outermost first: exp(x - logsumexp(x)) is
        if n.op in LEAF_OPS or n.id in claimed:  # one softmax, not exp(log_softmax(x))
            continue
        for name, rule in RULES:
            hit = rule(m, n)
            if hit is None:
                continue
            x, attrs, inner = hit
            if not m.private(inner, n.id) or inner & claimed:
                continue
            node = graph.make_node(name, (x,), attrs, node_id=n.id)
            if node.type != n.type:
                continue
            rewrites[n.id] = node
            claimed |= inner | {n.id}
            counts[name] += 1
            sizes[n.id] = len(inner) + 1
            break
    if not rewrites:
        return graph, Report("patterns", {"rewritten": 0})
    dropped = claimed - set(rewrites)
    read = {i for n in graph.nodes if n.id not in dropped for i in rewrites.get(n.id, n).inputs}
    dropped |= {n.id for n in graph.nodes if n.op == "full" and n.id not in m.pinned
                and m.users[n.id] and n.id not in read}   # constants only the matches read
    g, new = rebuild(graph, lambda g, n, new: None if n.id in dropped else
                     copy_node(g, rewrites.get(n.id, n), new))
    for old, k in sorted(sizes.items()):
        r = g.nodes[new[old]]
        attrs = ", ".join(f"{a}={v}" for a, v in r.attrs)
        lines.append(f"%{r.id} = {r.op}({g.label(r.inputs[0])}) [{attrs}] from {k} nodes")
    stats = {"rewritten": len(rewrites), **counts,
             "nodes_before": len(graph.nodes), "nodes_after": len(g.nodes)}
    return g.validate(), Report("patterns", stats, lines)


class _Matcher:
    """Structural queries over one graph: node lookup, equal values, last-axis reductions."""

    def __init__(self, graph):
        self.g = graph
        self.users = graph.users()
        self.pinned = set(graph.outputs.values()) | set(graph.updates.values())
        self.vn, seen = [], {}            # value numbers: equal for structurally equal nodes
        for n in graph.nodes:
            key = n.id if n.op in LEAF_OPS else \
                (n.op, tuple(self.vn[i] for i in n.inputs), n.attrs, n.type)
            self.vn.append(seen.setdefault(key, n.id))

    def node(self, i):
        return self.g.nodes[i]

    def same(self, a, b) -> bool:
        """a and b compute the same value: one node, or equal ops over the same values."""
        return self.vn[a] == self.vn[b]

    def reduce_last(self, i, op):
        """The operand x of `op(x, axes=(last,), keepdims=True)` at node i, else None."""
        n = self.node(i)
        if n.op != op or not n.type.is_float:
            return None
        x = self.node(n.inputs[0])
        if x.type.ndim == 0 or n.attr["axes"] != (x.type.ndim - 1,) or not n.attr["keepdims"]:
            return None
        return n.inputs[0]

    def mean_last(self, i):
        """(q, nodes) for a last-axis keepdims mean of q, also written sum(q) * (1/n)."""
        q = self.reduce_last(i, "mean")
        if q is not None:
            return q, {i}
        n = self.node(i)
        if n.op == "scale":
            q = self.reduce_last(n.inputs[0], "sum")
            if q is not None and abs(n.attr["s"] * self.node(q).type.shape[-1] - 1) <= 1e-6:
                return q, {i, n.inputs[0]}
        return None

    def const(self, i):
        n = self.node(i)
        return float(n.attr["value"]) if n.op == "full" else None

    def private(self, inner, root) -> bool:
        """Every node of `inner` is read only by nodes of inner | {root}, and is no output."""
        ok = inner | {root}
        return all(i not in self.pinned and all(u in ok for u in self.users[i]) for i in inner)


# ---- rules: (matcher, root node) -> None | (x, attrs of the row op, interior node ids) --------
def _shifted(m, i, op):
    """(x, nodes) for x - op(x) at node i (op a last-axis keepdims reduction)."""
    d = m.node(i)
    if d.op != "sub":
        return None
    x, r = d.inputs
    y = m.reduce_last(r, op)
    if y is None or not m.same(y, x) or d.type != m.node(x).type:
        return None
    return x, {i, r}


def _axis(m, x):
    return {"axis": m.node(x).type.ndim - 1}


def _softmax(m, n):
    if n.op == "exp":                            # exp(x - logsumexp(x))
        hit = _shifted(m, n.inputs[0], "logsumexp")
        return None if hit is None else (hit[0], _axis(m, hit[0]), hit[1])
    if n.op != "div":                            # e / sum(e), e = exp(x - max(x))
        return None
    e, s = n.inputs
    e2 = m.reduce_last(s, "sum")
    if e2 is None or not m.same(e, e2) or m.node(e).op != "exp":
        return None
    inner = {s}
    for ei in (e, e2):                           # both copies of e (one node if e was shared)
        hit = _shifted(m, m.node(ei).inputs[0], "max")
        if hit is None:
            return None
        inner |= {ei} | hit[1]
    return hit[0], _axis(m, hit[0]), inner


def _log_softmax(m, n):
    hit = _shifted(m, n.id, "logsumexp")         # x - logsumexp(x)
    if hit is not None:
        return hit[0], _axis(m, hit[0]), hit[1] - {n.id}
    if n.op != "sub":                            # d - log(sum(exp(d))), d = x - max(x)
        return None
    d, lg = n.inputs
    hit = _shifted(m, d, "max")
    if hit is None or m.node(lg).op != "log":
        return None
    s = m.node(lg).inputs[0]
    e = m.reduce_last(s, "sum")
    if e is None or m.node(e).op != "exp" or not m.same(m.node(e).inputs[0], d):
        return None
    d2 = _shifted(m, m.node(e).inputs[0], "max")
    return hit[0], _axis(m, hit[0]), hit[1] | d2[1] | {lg, s, e}


def _square(m, i):
    """The operands (one or two equal values) of x * x, sqr(x) or pow(x, 2), else None."""
    n = m.node(i)
    if n.op == "sqr" or (n.op == "pow" and n.attr["p"] == 2.0):
        return set(n.inputs)
    if n.op == "mul" and m.same(*n.inputs) and n.type == m.node(n.inputs[0]).type:
        return set(n.inputs)
    return None


def _mean_square(m, i):
    """(operands of the square, eps, nodes) for mean(x * x) [+ eps] at node i."""
    n, eps, inner = m.node(i), 0.0, {i}
    if n.op == "add":
        for side in (0, 1):
            c = m.const(n.inputs[side])
            if c is not None and m.node(n.inputs[1 - side]).type == n.type:
                eps, i = c, n.inputs[1 - side]
                break
        else:
            return None
    mean = m.mean_last(i)
    if mean is None or not eps >= 0:
        return None
    xs = _square(m, mean[0])
    return None if xs is None else (xs, eps, inner | mean[1] | {mean[0]})


def _rsqrt_of(m, i):
    """(v, nodes) for 1 / sqrt(v) or pow(v, -0.5) at node i."""
    n = m.node(i)
    if n.op == "pow" and n.attr["p"] == -0.5:
        return n.inputs[0], {i}
    if n.op == "div" and m.const(n.inputs[0]) == 1.0 and m.node(n.inputs[1]).op == "sqrt" \
            and m.node(n.inputs[1]).type == n.type:
        return m.node(n.inputs[1]).inputs[0], {i, n.inputs[1]}
    return None


def _normalised(m, n):
    """(x, operands of the square, eps, nodes) for x / sqrt(v), x * (1 / sqrt(v)) or
    x * pow(v, -0.5), v = mean(x * x) + eps."""
    hit = None
    if n.op == "div" and m.node(n.inputs[1]).op == "sqrt":
        hit = n.inputs[0], m.node(n.inputs[1]).inputs[0], {n.inputs[1]}
    elif n.op == "mul":
        for x, r in (n.inputs, n.inputs[::-1]):
            rs = _rsqrt_of(m, r)
            if rs is not None:
                hit = x, *rs
                break
    if hit is None:
        return None
    x, v, inner = hit
    ms = _mean_square(m, v)
    if ms is None or not all(m.same(c, x) for c in ms[0]) or m.node(x).type != n.type:
        return None
    return x, ms[0], ms[1], inner | ms[2]


def _rms_norm(m, n):
    hit = _normalised(m, n)
    return None if hit is None else (hit[0], {"eps": hit[2]}, hit[3])


def _layer_norm(m, n):
    hit = _normalised(m, n)                      # rms_norm of xc = x - mean(x)
    if hit is None:
        return None
    xc, squared, eps, inner = hit
    xs = []
    for c in {xc} | squared:                     # every copy of xc
        cx = _shifted(m, c, "mean")
        if cx is None:
            return None
        xs.append(cx[0])
        inner = inner | cx[1]
    return xs[0], {"eps": eps}, inner


RULES = [("softmax", _softmax), ("log_softmax", _log_softmax), ("layer_norm", _layer_norm),
         ("rms_norm", _rms_norm)]

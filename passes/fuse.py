"""Kernel grouping: which nodes run together in one kernel.

This pass only decides grouping; the backends lower each group (runtime/cpu/fused.py). Views
(reshape, checkpoint marks) get no kernel: they alias their operand's buffer (passes/memory.py).
With `fuse=False` every live computing node is its own kernel ("node"). With fusion, nodes are
grouped greedily in graph order into these kinds (the kernel's `anchor` is its non-elementwise
member, if any), by the facts each op declares (jitgraph/registry.py: its kind and the
fusion roles it takes, never its name):

  elementwise  elementwise nodes of one shape (the domain), operands broadcast into it; the
               optimizer update kernel holds several domains, one loop each (the scalars
               it reads, bias corrections, are one tiny kernel of their own)
  gemm         a 2-D matmul (a contraction taking the epilogue and prologue roles) followed
               by elementwise nodes over its output (bias, activation, residual, scale),
               applied right after the GEMM while its output is in cache;
               and preceded by the elementwise group computing an operand (a prologue,
               e.g. relu(x) @ w or x @ (w * mask)) when nothing but the GEMM reads that
               group's values: the prologue writes the operand once into scratch space
               and the GEMM reads it there (BLAS needs it in memory), one kernel for two
               (a half value's conversion to f32 for the GEMM takes with it the rounding
               that made the value when nothing else reads it, unless the backend runs
               GEMMs on that half type's buffers: kind "gemm_bf16");
               and (`accumulate`, where the backend lowers it: "gemm_accumulate" in its
               kinds) further 2-D matmuls summed into the product, a @ b + c @ d, when
               nothing else reads either product: the second GEMM adds into the first's
               output (beta = 1) instead of writing its own for the epilogue to read (its
               operands' conversions, if any, join the first's prologue)
               (a LoRA projection's W x + B (A x), and every input gradient that sums the
               products of several weights: x feeding q, k and v)
  rows         an op of kind rows over the last axis (softmax, log_softmax, rms_norm,
               layer_norm and their *_back ops) with an elementwise prologue on its operands
               and an elementwise epilogue on its result, all of the same shape
  reduce       a reduction (sum, mean, max, ...) whose operand is an elementwise prologue
  <op>         an op with its `pairs_with` op of the same first operands, the kernel named
               after the latter: cross_entropy with its cross_entropy_back (same logits and
               target), the loss and its gradient from one pass over the logits
  node         anything else, one node

A value computed inside a kernel needs no buffer unless it is read outside it: `outputs` lists
the members that are (graph outputs, updates, or operands of other kernels or of views);
`KernelGraph.outputs_of(kernel)` is what the memory planner allocates. Intermediates are never
recomputed across kernels, with one exception: constants (`full`) are inlined as literals into
every fused kernel that reads them (they cost nothing) and get a kernel of their own only when
some reader needs a buffer. Fusion never merges two groups when a node outside them lies on a
path between them (that would need the group to run both before and after that node, or
two groups to run each before the other); a path may pass through views and other groups.
A backward node (not needed by the non-gradient outputs) never joins a group holding forward
nodes: it would be saved from the forward pass to the backward as an extra output.
With an update boundary (passes/boundary.py) no group holds nodes of both phases (the update
stays out of the GEMM epilogues), and every phase-1 kernel comes before every phase-2 one:
`KernelGraph.boundary` is the number of phase-1 kernels (None without a boundary).
With the finite-step guard (passes/guard.py) no group holds both a gated update's own nodes
(`gated_nodes`) and others: the update runs after the flag, reading the gradient once.
"""
from __future__ import annotations

from jitgraph.ir import base, live_nodes, op_kind
from jitgraph.registry import get_op, row_axis
from jitgraph.plan import ACCUMULATE, Kernel, KernelGraph, rows_flags

from .boundary import boundary_values, phase_two
from .guard import FLAG as GUARD_FLAG, gated_nodes
from .report import Report


def forward_nodes(graph) -> frozenset:
    """Nodes the non-gradient outputs need (the forward pass): ancestors of every output except
    `grad/*` (passes/autodiff.py), the finite-step guard's flags, which read the gradients
    (passes/guard.py), and the updates."""
    return live_nodes(graph, [i for k, i in graph.outputs.items()
                              if not k.startswith("grad/") and not k.startswith(GUARD_FLAG)])


def roles(graph, nid) -> frozenset:
    """The fusion roles node nid's op can take (jitgraph/registry.py FUSION_ROLES)."""
    return get_op(graph.nodes[nid].op).fusion


def is_direct_gemm(graph, n) -> bool:
    """A contraction taking an epilogue (matmul) that the CPU backend runs as one 2-D GEMM (2-D
    w; x 2-D or batched rows)."""
    if op_kind(n.op) != "contraction" or "epilogue" not in roles(graph, n.id):
        return False
    x, w = (graph.nodes[i].type for i in n.inputs)
    return w.ndim == 2 and (x.ndim == 2 or not n.attr["ta"]) and n.type.size > 0


class _Grouping:
    """Greedy grouping state: groups of node ids, each with a kind, domain and anchor."""

    def __init__(self, graph, live, accumulate=False, native=frozenset()):
        self.g, self.live, self.forward = graph, live, forward_nodes(graph)
        self.accumulate = accumulate    # the backend lowers gemm groups with accumulated GEMMs
        self.native = native            # half types whose GEMMs the backend runs on buffers
        self.users = {i: [u for u in us if u in live] for i, us in graph.users().items()}
        self.kept = set(graph.outputs.values()) | set(graph.updates.values())   # read after
        self.phase2 = phase_two(graph, live)     # update boundary: never fused with phase 1
        self.gated = gated_nodes(graph, live)    # the guard's gated updates: apart too
        self.group_of = {}          # node id -> group id
        self.groups = {}            # group id -> dict(members, kind, domain, anchor)

    def new(self, nid, kind, domain, anchor=None):
        gid = max(self.groups, default=-1) + 1
        self.groups[gid] = {"members": [nid], "kind": kind, "domain": domain, "anchor": anchor}
        self.group_of[nid] = gid

    def producers(self, nid):
        """Groups of nid's computed operands that nid may join, in operand order, without
        repeats. A backward node never joins a group holding forward nodes: it would become
        an output of the forward kernel, saved until the backward reads it (e.g. relu's mask
        step(x), or a checkpointed activation's recomputation), while its operand would be
        saved instead at no greater cost (the same domain) or recomputed from a kept value."""
        out = []
        for i in self.g.nodes[nid].inputs:
            gid = self.group_of.get(i)
            if gid is not None and gid not in out and (nid in self.forward or not any(
                    m in self.forward for m in self.groups[gid]["members"])) and \
                    i not in self.groups[gid].get("prologue", ()):
                out.append(gid)      # a GEMM's prologue values live only in scratch space
        return out

    def convex(self, members) -> bool:
        """No path leaves `members` and comes back through other nodes or groups: a group runs
        as one kernel, so reaching one of its members reaches all its readers."""
        mem = set(members)
        last = max(mem)
        seen, todo = set(), [u for m in mem for u in self.users[m] if u not in mem]
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            gid = self.group_of.get(u)
            block = self.groups[gid]["members"] if gid is not None else [u]
            if block[0] > last:                 # runs after every member: not an ancestor
                continue
            seen.update(block)
            todo.extend(v for b in block for v in self.users[b] if v not in mem)
        return not any(i in seen for m in mem for i in self.g.nodes[m].inputs)

    def merge(self, nid, gids, kind, domain, anchor) -> bool:
        members = sorted({nid, *[m for gid in gids for m in self.groups[gid]["members"]]})
        for part in (self.phase2, self.gated):
            if part and len({m in part for m in members}) > 1:
                return False
        if not self.convex(members):
            return False
        pro = set().union(*(self.groups[gid].get("prologue", ()) for gid in gids))
        acc = tuple(a for gid in gids for a in self.groups[gid].get("accumulate", ()))
        for gid in gids:
            del self.groups[gid]
        self.new(nid, kind, domain, anchor)
        gid = self.group_of[nid]
        self.groups[gid]["members"] = members
        if pro:
            self.groups[gid]["prologue"] = pro
        if acc:
            self.groups[gid]["accumulate"] = acc
        for m in members:
            self.group_of[m] = gid
        return True


def _rows_ok(grouping, members, domain):
    """Every operand a rows kernel loads broadcasts as a row index and/or a column index."""
    g, mem = grouping.g, set(members)
    for m in members:
        for i in g.nodes[m].inputs:
            if i not in mem and rows_flags(domain, g.nodes[i].type.shape) is None:
                return False
    return True


def _product(gr, gid):
    """The value a gemm group's GEMMs leave in its output: the anchor's product, or the last
    sum it accumulated into it."""
    grp = gr.groups[gid]
    return grp["accumulate"][-1][1] if grp.get("accumulate") else grp["anchor"]


def _accumulate(gr, n) -> bool:
    """n = P + m: P the product of a gemm group, m a direct GEMM alone in its group but for
    its prologue (a half operand's conversion: passes/precision.py `sums_in_f32`), both read
    by n only, all three of one type: m joins P's group, accumulated into its output
    (beta = 1), its prologue computed with P's, and n is the group's product. Not when m's
    prologue converts a half type the backend runs GEMMs on (gemm_bf16): m keeps its kernel,
    which reads the half buffers."""
    g = gr.g
    if not gr.accumulate or "accumulate" not in roles(g, n.id) or len(set(n.inputs)) != 2:
        return False
    for p, m in (n.inputs, n.inputs[::-1]):
        gp, gm = gr.group_of.get(p), gr.group_of.get(m)
        if gp is None or gm is None or gp == gm:
            continue
        host, lone = gr.groups[gp], gr.groups[gm]
        pro = lone.get("prologue", set())
        if host["kind"] != "gemm" or _product(gr, gp) != p or lone["kind"] != "gemm" or \
                lone["anchor"] != m or set(lone["members"]) != {m, *pro} or \
                any(_from_native(gr, x) for x in pro):
            continue
        if gr.users[p] != [n.id] or gr.users[m] != [n.id] or {p, m} & gr.kept or \
                not g.nodes[p].type == g.nodes[m].type == n.type or \
                {i for x in lone["members"] for i in g.nodes[x].inputs} & set(host["members"]):
            continue
        if n.id not in gr.forward and any(x in gr.forward for x in host["members"] + [m]):
            continue                    # a backward sum never joins a forward kernel
        acc = host.get("accumulate", ()) + ((m, n.id),)
        if gr.merge(n.id, [gp, gm], "gemm", n.type.shape, host["anchor"]):
            gr.groups[gr.group_of[n.id]]["accumulate"] = acc
            return True
    return False


def _gemm_operand_conversion(gr, n) -> bool:
    """Whether n is a conversion (OpDef.half "convert": a half value's f32 cast) read only by
    GEMMs that take prologues: it starts a group of its own, which becomes that GEMM's prologue
    (converted into its scratch space), instead of joining its operand's group, which would
    write the f32 copy into a buffer of its own (passes/half.py casts once per reader)."""
    g = gr.g
    users = gr.users.get(n.id, ())
    return get_op(n.op).half == "convert" and bool(users) and n.id not in gr.kept and all(
        is_direct_gemm(g, g.nodes[u]) and "prologue" in roles(g, u) for u in users)


def _from_native(gr, nid) -> bool:
    """Whether node nid (a conversion) reads a value of a half type the backend runs GEMMs on
    as buffers (kinds gemm_bf16 / gemm_f16): the GEMM reads that value itself."""
    return gr.g.nodes[gr.g.nodes[nid].inputs[0]].type.dtype in gr.native


def _read_only_by(gr, gid, nid) -> bool:
    """Whether node nid is the only reader of group gid's values outside it (none kept)."""
    mem = set(gr.groups[gid]["members"])
    return not mem & gr.kept and all(u == nid or u in mem for m in mem for u in gr.users[m])


def _join_elementwise(gr, n):
    """Put elementwise node n into an operand's group of the same domain, or a new group."""
    if _accumulate(gr, n):
        return
    shape = n.type.shape
    cands = [gid for gid in gr.producers(n.id) if gr.groups[gid]["domain"] == shape and (
        gr.groups[gid]["kind"] == "elementwise" or gr.groups[gid]["anchor"] is not None and
        "epilogue" in roles(gr.g, gr.groups[gid]["anchor"]))]
    if n.type.size == 0:
        cands = []
    elif _gemm_operand_conversion(gr, n):
        # the GEMM's prologue-to-be may take the elementwise groups only n reads (the f32 -> half
        # rounding of a weight or input, cast back here: one pass over the f32 value into the
        # GEMM's scratch, no half copy in a buffer of its own), unless the backend runs GEMMs
        # on that half type's buffers ("gemm_bf16")
        cands = [] if _from_native(gr, n.id) else [
            gid for gid in cands if gr.groups[gid]["kind"] == "elementwise" and
            _read_only_by(gr, gid, n.id)]
    anchors = [gid for gid in cands if gr.groups[gid]["anchor"] is not None]
    for gids in ([*anchors[:1], *[c for c in cands if c not in anchors]], anchors[:1],
                 cands[:1]):
        if not gids:
            continue
        kind = gr.groups[gids[0]]["kind"]
        anchor = gr.groups[gids[0]]["anchor"]
        members = [n.id] + [m for gid in gids for m in gr.groups[gid]["members"]]
        if kind == "rows" and not _rows_ok(gr, members, shape):
            continue
        if gr.merge(n.id, gids, kind, shape, anchor):
            return
    gr.new(n.id, "elementwise", shape)


def _gemm(gr, n):
    """A GEMM group for matmul n, with the elementwise groups computing its operands as its
    prologue when n is the only reader of their values outside them."""
    g = gr.g
    pro, gids = set(), []
    for gid in gr.producers(n.id) if "prologue" in roles(g, n.id) else ():
        grp = gr.groups[gid]
        mem = set(grp["members"])
        ops = [i for i in n.inputs if i in mem]
        if grp["kind"] == "elementwise" and _read_only_by(gr, gid, n.id) and \
                all(grp["domain"] == g.nodes[i].type.shape for i in ops):
            gids.append(gid)
            pro |= mem
    gr.new(n.id, "gemm", n.type.shape, n.id)
    if gids and gr.merge(n.id, gids + [gr.group_of[n.id]], "gemm", n.type.shape, n.id):
        gr.groups[gr.group_of[n.id]]["prologue"] = pro


def _row_op(gr, n):
    shape = n.type.shape
    if not shape or row_axis(n) != n.type.ndim - 1 or n.type.size == 0:
        gr.new(n.id, "node", shape)
        return
    cands = [gid for gid in gr.producers(n.id) if "prologue" in roles(gr.g, n.id) and
             gr.groups[gid]["kind"] == "elementwise" and gr.groups[gid]["domain"] == shape]
    members = [n.id] + [m for gid in cands for m in gr.groups[gid]["members"]]
    if cands and _rows_ok(gr, members, shape) and gr.merge(n.id, cands, "rows", shape, n.id):
        return
    gr.new(n.id, "rows", shape, n.id)


def _reduction(gr, n):
    x = gr.g.nodes[n.inputs[0]]
    gid = gr.group_of.get(x.id)
    if "prologue" in roles(gr.g, n.id) and gid in gr.producers(n.id) and \
            gr.groups[gid]["kind"] == "elementwise" \
            and gr.groups[gid]["domain"] == x.type.shape and len(x.type.shape) > 0 \
            and gr.merge(n.id, [gid], "reduce", x.type.shape, n.id):
        return
    gr.new(n.id, "node", n.type.shape)


def _pair(gr, n, op):
    """n joins the node of `op` (its `pairs_with`) that reads the same first operands, in a
    kernel of kind `op`: cross_entropy_back and the cross_entropy of the same logits and target
    are one pass over the logits computing the loss and its gradient."""
    g = gr.g
    fwd = [u for u in gr.users[n.inputs[0]]
           if g.nodes[u].op == op and g.nodes[u].inputs == n.inputs[:len(g.nodes[u].inputs)]]
    gid = gr.group_of.get(fwd[0]) if fwd else None
    if gid is None or not gr.merge(n.id, [gid], op, n.type.shape, n.id):
        gr.new(n.id, "node", n.type.shape)


def _merge_updates(gr):
    """One kernel for the optimizer update: every elementwise group holding an update op (the
    updates of weights whose gradient is a GEMM sit in that GEMM's epilogue instead: the gradient
    never reaches memory). The scalar groups feeding updates (bias corrections, which depend
    only on the step counter) become one tiny kernel of their own, so no update waits for more
    than its own operands: each GEMM + update kernel can run as soon as its gradient is done."""
    upd = [gid for gid, grp in gr.groups.items() if grp["kind"] == "elementwise" and
           any("update" in roles(gr.g, m) for m in grp["members"])]
    members = {m for gid in upd for m in gr.groups[gid]["members"]} | \
        {m for grp in gr.groups.values() if grp["kind"] == "gemm" for m in grp["members"]
         if "update" in roles(gr.g, m)}
    scalars = [gid for gid, grp in gr.groups.items() if grp["kind"] == "elementwise" and
               grp["domain"] == () and gid not in upd and
               any(u in members for m in grp["members"] for u in gr.users[m])]
    parts = [([gid for gid in gids if (gr.groups[gid]["members"][0] in gr.phase2) == phase],
              domain) for gids, domain in ((upd, None), (scalars, ()))
             for phase in (False, True)]    # an update boundary: one kernel per phase
    for part, domain in parts:
        if len(part) > 1:
            last = max(m for gid in part for m in gr.groups[gid]["members"])
            gr.merge(last, part, "elementwise", domain, None)


def _group_fused(graph, live, accumulate=False, native=frozenset()):
    gr = _Grouping(graph, live, accumulate, native)
    consts = []
    for n in graph.nodes:
        if n.id not in live:
            continue
        kind = op_kind(n.op)
        if kind in ("leaf", "view"):
            continue
        pairs_with = get_op(n.op).pairs_with
        if "constant" in roles(graph, n.id):
            consts.append(n.id)
        elif kind == "elementwise":
            _join_elementwise(gr, n)
        elif kind == "rows":
            _row_op(gr, n)
        elif pairs_with:
            _pair(gr, n, pairs_with)
        elif kind == "reduction":
            _reduction(gr, n)
        elif is_direct_gemm(graph, n):
            _gemm(gr, n)
        else:
            gr.new(n.id, "node", n.type.shape)
    _merge_updates(gr)
    inlined = set()
    for c in consts:
        readers = gr.users[c]
        if c in gr.kept or any(gr.group_of.get(u) is None or
                              gr.groups[gr.group_of[u]]["kind"] == "node" or
                              op_kind(graph.nodes[u].op) == "contraction" and
                              gr.groups[gr.group_of[u]]["kind"] == "gemm" for u in readers):
            gr.new(c, "node", graph.nodes[c].type.shape)
        else:
            inlined.add(c)
    return gr, frozenset(inlined)


def _order(gr):
    """Groups in a topological order (by first member among the ready ones)."""
    g = gr.g
    deps = {gid: {gr.group_of[b] for m in grp["members"] for b in
                  (base(g, i) for i in g.nodes[m].inputs)
                  if b in gr.group_of and gr.group_of[b] != gid}
            for gid, grp in gr.groups.items()}
    order, done = [], set()
    # phase 1 first (its groups read no phase-2 group), then by first member
    pending = sorted(gr.groups, key=lambda gid: (gr.groups[gid]["members"][0] in gr.phase2,
                                                 min(gr.groups[gid]["members"])))
    while pending:
        gid = next((x for x in pending if deps[x] <= done), None)
        if gid is None:
            raise ValueError(f"fuse: the groups of graph {g.name} with nodes "
                             f"{[gr.groups[x]['members'] for x in pending][:4]} read each "
                             f"other's outputs (a cycle)")
        pending.remove(gid)
        order.append(gid)
        done.add(gid)
    return order


def _outputs(gr, members, gid):
    """Members read outside the group: by another group, a view, or as a graph output/update."""
    return tuple(m for m in members
                 if m in gr.kept or any(gr.group_of.get(u) != gid for u in gr.users[m]))


def group_kernels(graph, fuse: bool = True, kinds=None):
    """Group the live computing nodes into kernels. Returns (KernelGraph, Report). `kinds`:
    what the target backend lowers (runtime/backend.py; None: everything this pass forms)."""
    live = live_nodes(graph)
    phase2 = phase_two(graph, live)
    if not fuse:
        kernels = sorted((n.id for n in graph.nodes
                          if n.id in live and op_kind(n.op) not in ("leaf", "view")),
                         key=lambda nid: nid in phase2)     # phase 1 first, else node order
        kg = KernelGraph(graph, [Kernel(k, (nid,), "node", (nid,)) for k, nid in
                                 enumerate(kernels)], live)
        inlined = frozenset()
    else:
        native = frozenset(dt for dt in ("bf16", "f16") if kinds and f"gemm_{dt}" in kinds)
        gr, inlined = _group_fused(graph, live, kinds is None or ACCUMULATE in kinds, native)
        kernels = []
        for gid in _order(gr):
            grp = gr.groups[gid]
            members = tuple(grp["members"])
            outs = _outputs(gr, members, gid)
            kind = grp["kind"] if len(members) > 1 or grp["kind"] in ("rows", "elementwise") \
                else "node"
            kernels.append(Kernel(len(kernels), members, kind, outs, grp["anchor"],
                                  grp.get("accumulate", ())))
        kg = KernelGraph(graph, kernels, live, inlined)
    if phase2 or boundary_values(graph):
        kg.boundary = sum(k.root not in phase2 for k in kg.kernels)
    n_nodes = sum(len(k.nodes) for k in kg.kernels)
    rep = Report("fuse", {"kernels": len(kg.kernels), "fused_nodes": n_nodes - len(kg.kernels),
                          "inlined_constants": len(inlined), "bytes_moved": kg.bytes_moved(),
                          "dead_nodes": len(graph.nodes) - len(live)})
    if fuse:
        kinds = {}
        for k in kg.kernels:
            kinds[k.kind] = kinds.get(k.kind, 0) + 1
        rep.lines.append("kernels by kind: " + ", ".join(f"{k}={v}" for k, v in kinds.items()))
    if kg.boundary is not None:
        rep.stats["phase_1_kernels"] = kg.boundary
        rep.stats["phase_2_kernels"] = len(kg.kernels) - kg.boundary
    return kg, rep

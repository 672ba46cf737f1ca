"""An independent check of a memory plan: no two values live at the same time share bytes.

It recomputes what it needs from the kernels and the slots alone (not from the planner's
intervals): a value in the arena is live from the kernel that writes it (program inputs: from
the start of the step) to the last kernel that reads it or a view of it (outputs and values
copied into params: to the end of the step). Two live values may share bytes only as an
in-place reuse the backends support: the same slot, the root of an all-elementwise kernel over
an operand of exactly its type that the kernel reads last and that is no output or update, or
a GEMM's sum (an add of its product) accumulated into such an operand (MemoryPlan.sums), and
the one value of that operand's type the GEMM's epilogue stores over that sum, and a paired
kernel's root (cross_entropy_back) over its first operand (the logits) dying there.
A param's slot may take its update only after the param's last read, or in that last reading
kernel when the update alone reads it there, elementwise and without broadcasting it, or as the
operand whose buffer its op may take (OpDef.inplace: set_rows); and the param must be no output.
Inputs are read where the caller's arrays lie (region "input", one pointer each) and no kernel
writes there; a value in region "output" owns its pointer alone and is the graph output
`plan.outputs` names.
Every slot must lie inside its region. Errors name the values, their slots and live steps.
`JITGRAPH_CHECK_PLANS=1` makes the executor run this on every program it builds.
"""
from __future__ import annotations

from jitgraph.ir import LEAF_OPS, feeding, view_offset
from jitgraph.registry import get_op


def _kind(graph, nid):
    op = graph.nodes[nid].op
    return "leaf" if op in LEAF_OPS else get_op(op).kind


def _root(graph, nid):
    while _kind(graph, nid) == "view":
        nid = graph.nodes[nid].inputs[0]
    return nid


def check_plan(kg, plan) -> None:
    """Raise AssertionError naming the first conflict in `plan` (a MemoryPlan for `kg`)."""
    g = kg.graph
    n_steps = len(kg.kernels)
    written, last = {}, {}
    for t, k in enumerate(kg.kernels):
        for nid in k.nodes:
            written[nid] = t
            for i in g.nodes[nid].inputs:
                b = _root(g, i)
                last[b] = max(last.get(b, -1), t)
    kept = {_root(g, i) for i in list(g.outputs.values()) + list(g.updates.values())}
    span = {}
    caller = {s.pointer: s for s in [*plan.inputs.values(), *plan.outputs.values()]}
    for nid, s in plan.slots.items():
        if s.region in ("input", "output"):
            assert s.pointer in caller and caller[s.pointer].region == s.region, \
                f"{g.label(nid)}: slot {s} is no entry of the plan's {s.region}s"
            size = caller[s.pointer].nbytes
        else:
            size = {"arena": plan.arena_bytes, "persist": plan.persist_bytes}[s.region]
        assert 0 <= s.offset and s.offset + s.nbytes <= size and \
            s.nbytes >= g.nodes[nid].type.nbytes, \
            f"{g.label(nid)}: slot {s} outside its region ({size} B) or too small"
        if _kind(g, nid) == "view":
            b = plan.slots.get(_root(g, nid))
            assert b is not None and (s.region, s.pointer) == (b.region, b.pointer) and \
                s.offset == b.offset + view_offset(g, nid) and \
                s.offset + s.nbytes <= b.offset + b.nbytes, \
                f"{g.label(nid)}: view slot {s} is not its range of its operand's slot {b}"
            continue
        if s.region != "arena":
            continue
        first = 0 if g.nodes[nid].op == "input" else written[nid]
        end = n_steps - 1 if nid in kept else last.get(nid, first)
        span[nid] = (first, max(first, end))
    _check_buckets(g, plan)
    _check_caller(g, kg, plan, written)
    _check_arena(g, kg, plan, span)
    _check_persist(g, kg, plan, written, last)


def _check_buckets(g, plan):
    """Update boundary: every gradient lies inside one bucket of its dtype, in the arena."""
    for name, s in plan.gradients.items():
        dt = g.nodes[g.params[name]].type.dtype
        assert s.region == "arena" and any(
            d == dt and off <= s.offset and s.offset + s.nbytes <= off + nb
            for d, off, nb in plan.buckets), \
            f"memory plan: the gradient of {name} {s} lies in no {dt} bucket {plan.buckets}"
    for _, off, nb in plan.buckets:
        assert 0 <= off and off + nb <= plan.arena_bytes, \
            f"memory plan: bucket at {off} +{nb} outside the arena ({plan.arena_bytes} B)"


def _check_caller(g, kg, plan, written):
    """Inputs are read where they lie and never written; an output pointer has one owner."""
    assert len({s.pointer for s in [*plan.inputs.values(), *plan.outputs.values()]}) == \
        plan.pointers, "memory plan: two inputs or outputs share a pointer"
    for name, nid in g.inputs.items():
        if nid in kg.live:
            assert plan.slots.get(nid) == plan.inputs.get(name), \
                f"memory plan: input {name} is not read where the caller's array lies"
    for nid in written:
        s = plan.slots.get(nid)
        assert s is None or s.region != "input", \
            f"memory plan: {g.label(nid)} is written into input {s}: a caller's array"
    owners = {}
    for nid, s in plan.slots.items():
        if s.region == "output" and _kind(g, nid) != "view":
            assert s.pointer not in owners, f"memory plan: {g.label(owners.get(s.pointer))} " \
                f"and {g.label(nid)} share output {s}"
            owners[s.pointer] = nid
    for name, s in plan.outputs.items():
        assert _root(g, g.outputs[name]) == owners.get(s.pointer) and \
            _root(g, g.outputs[name]) in written, \
            f"memory plan: output {name} is not the value computed into {s}"


def _inplace_ok(g, kg, plan, old, new, span):
    """May `new` share `old`'s bytes? Only as an in-place elementwise reuse."""
    t = span[new][0]
    k = kg.kernels[t]
    if plan.slots[old] != plan.slots[new] or span[old][1] != t or k.nodes[-1] != new:
        return False
    if any(_kind(g, m) != "elementwise" for m in k.nodes):
        return False
    if any(m in plan.slots for m in k.nodes[:-1]):
        return False
    reads = [i for m in k.nodes for i in g.nodes[m].inputs if _root(g, i) == old]
    kept = {_root(g, i) for i in list(g.outputs.values()) + list(g.updates.values())}
    return bool(reads) and old not in kept and \
        all(g.nodes[i].type == g.nodes[new].type and
            g.nodes[i].type.nbytes == g.nodes[old].type.nbytes for i in reads)


def _sum_ok(g, kg, plan, old, new, span):
    """May `new` share `old`'s bytes as a GEMM's sum accumulated into a dying operand? `new`,
    in a gemm kernel, adds the kernel's product (read by nothing else there) and `old`, all of
    one type; `old` dies in that kernel, no other member reads it, and it is no output or
    update."""
    t = span[new][0]
    k = kg.kernels[t]
    n = g.nodes[new]
    p = k.product
    if k.kind != "gemm" or plan.slots[old] != plan.slots[new] or span[old][1] != t or \
            span[new] != (t, t) or "accumulate" not in get_op(n.op).fusion or \
            sorted(n.inputs) != sorted((p, old)) or p == old or old in k.nodes:
        return False
    kept = {_root(g, i) for i in list(g.outputs.values()) + list(g.updates.values())}
    readers = {m for m in k.nodes for i in g.nodes[m].inputs if _root(g, i) in (p, old)}
    return readers == {new} and old not in kept and new not in kept and \
        g.nodes[old].type == g.nodes[p].type == n.type


def _paired_ok(g, kg, plan, old, new, span):
    """May `new` share `old`'s bytes as the root of a paired kernel (cross_entropy_back in the
    kernel of its cross_entropy) over its first operand, which dies there, of its exact type,
    no output or update, read by the kernel's members as their first operand only?"""
    t = span[new][0]
    k = kg.kernels[t]
    n = g.nodes[new]
    if _kind(g, new) in ("leaf", "view") or k.kind != get_op(n.op).pairs_with or \
            k.nodes[-1] != new or plan.slots[old] != plan.slots[new] or span[old][1] != t or \
            not n.inputs or n.inputs[0] != old or g.nodes[old].type != n.type:
        return False
    kept = {_root(g, i) for i in list(g.outputs.values()) + list(g.updates.values())}
    return old not in kept and \
        not any(_root(g, i) == old for m in k.nodes for i in g.nodes[m].inputs[1:])


def _over_sum_ok(g, kg, plan, old, new, span):
    """May `new` share `old`'s bytes as the value a gemm kernel's epilogue stores over the sum it
    accumulated into `old` (MemoryPlan.sums)? `new` is written by that kernel, of old's exact
    type, no output or update; the loop reads element i of the sum before storing element i."""
    t = span[new][0]
    k = kg.kernels[t]
    if k.kind != "gemm" or plan.slots[old] != plan.slots[new] or span[old][1] != t or \
            new not in k.nodes or old not in plan.sums.values() or \
            g.nodes[new].type != g.nodes[old].type or _kind(g, new) != "elementwise":
        return False
    total = next(s for s, o in plan.sums.items() if o == old)
    kept = {_root(g, i) for i in list(g.outputs.values()) + list(g.updates.values())}
    return total in k.nodes and _sum_ok(g, kg, plan, old, total, span) and new not in kept


def _check_arena(g, kg, plan, span):
    """Sweep the steps; at each, sort the live values by offset and compare neighbours."""
    n = max((e for _, e in span.values()), default=-1) + 1
    starting = [[] for _ in range(n)]
    for nid, (s, _) in span.items():
        starting[s].append(nid)
    live = []
    for t in range(n):
        live = [v for v in live if span[v][1] >= t] + starting[t]
        live.sort(key=lambda v: plan.slots[v].offset)
        reach = None                           # the value reaching furthest so far
        for v in live:
            sv = plan.slots[v]
            if sv.nbytes == 0:
                continue
            if reach is not None:
                sr = plan.slots[reach]
                if sv.offset < sr.offset + sr.nbytes:
                    assert _inplace_ok(g, kg, plan, reach, v, span) or \
                        _inplace_ok(g, kg, plan, v, reach, span) or \
                        _sum_ok(g, kg, plan, reach, v, span) or \
                        _sum_ok(g, kg, plan, v, reach, span) or \
                        _over_sum_ok(g, kg, plan, reach, v, span) or \
                        _over_sum_ok(g, kg, plan, v, reach, span) or \
                        _paired_ok(g, kg, plan, reach, v, span) or \
                        _paired_ok(g, kg, plan, v, reach, span), \
                        f"memory plan: {g.label(reach)} {sr} live {span[reach]} and " \
                        f"{g.label(v)} {sv} live {span[v]} overlap"
            if reach is None or sv.offset + sv.nbytes > plan.slots[reach].offset + \
                    plan.slots[reach].nbytes:
                reach = v


def _before_epilogue(g, kernel) -> set:
    """A gemm kernel's GEMMs and the members they read (directly or through others): they run
    before the loop over the product."""
    roots = {kernel.anchor, *(m for m, _ in kernel.accumulate)}
    return roots | feeding(g, roots, kernel.nodes)


def _check_persist(g, kg, plan, written, last):
    params = {s for s in plan.params.values()}
    assert len(params) == len(plan.params), "memory plan: two params share a slot"
    ordered = sorted(params, key=lambda s: s.offset)
    for a, b in zip(ordered, ordered[1:]):
        assert a.offset + a.nbytes <= b.offset, f"memory plan: param slots {a} and {b} overlap"
    outs = {_root(g, i) for i in g.outputs.values()}
    assert len(set(plan.inplace.values())) == len(plan.inplace), \
        "memory plan: one value is written in place into two params"
    for name, uid in plan.inplace.items():
        pid = g.params[name]
        assert plan.slots[uid] == plan.params[name] and pid not in outs, \
            f"memory plan: update {name} <- {g.label(uid)} in place, but the param is an output"
        t = written[uid]
        readers = [m for m in kg.kernels[t].nodes
                   if any(_root(g, i) == pid for i in g.nodes[m].inputs)]
        # every reader in the writing kernel loads the element the same iteration writes (a
        # gemm kernel's GEMMs and their prologue read before its epilogue's loop runs)
        ptype = g.nodes[pid].type
        kern = kg.kernels[t]
        before = _before_epilogue(g, kern) if kern.kind == "gemm" else set()
        same_kernel = (readers == [uid] or kern.kind in ("elementwise", "gemm")) and \
            uid not in before and \
            all(m in before or
                _kind(g, m) == "elementwise" and g.nodes[m].type.shape == ptype.shape and
                all(g.nodes[i].type == ptype for i in g.nodes[m].inputs if _root(g, i) == pid)
                for m in readers)
        # or the update alone reads it, as the operand its op takes the buffer of (OpDef.inplace)
        k = get_op(g.nodes[uid].op).inplace if _kind(g, uid) not in ("leaf", "view") else None
        same_kernel = same_kernel or (
            readers == [uid] and k is not None and g.nodes[uid].inputs[k] == pid and
            all(_root(g, i) != pid for j, i in enumerate(g.nodes[uid].inputs) if j != k))
        assert last.get(pid, -1) < t or (last[pid] == t and same_kernel), \
            f"memory plan: update {name} <- {g.label(uid)} (kernel {t}) overwrites the param " \
            f"while it is still read (last read in kernel {last.get(pid)})"

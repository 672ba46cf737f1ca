"""Buffer assignment: where every value lives.

The plan here is the naive one: one arena buffer per live value, no reuse. Views (reshape) share
their operand's slot. Params and optimizer state live in a persistent region that survives steps.
An update whose kernel can write straight into its param's slot (nothing reads the old value
afterwards) does so; the others are copied into the param at the end of the step.
Real liveness-based reuse is a later pass that returns the same structure.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .fuse import op_kind
from .report import Report

ALIGN = 64   # bytes; every slot starts on a cache line


@dataclass(frozen=True)
class Slot:
    region: str    # "arena" (per-step values) or "persist" (params and optimizer state)
    offset: int
    nbytes: int


@dataclass
class MemoryPlan:
    slots: dict                 # node id -> Slot (views share their operand's slot)
    arena_bytes: int
    persist_bytes: int
    params: dict                # param name -> Slot in the persistent region
    copies: list = field(default_factory=list)    # (param name, node id) copied after the step
    inplace: dict = field(default_factory=dict)   # param name -> node id written into its slot

    def describe(self, graph) -> str:
        lines = [f"memory {graph.name}: arena {self.arena_bytes} B, persistent "
                 f"{self.persist_bytes} B"]
        for nid, s in sorted(self.slots.items()):
            n = graph.nodes[nid]
            lines.append(f"  {graph.label(nid):>12} {s.region}@{s.offset} +{s.nbytes} : {n.type}")
        lines += [f"  update {p} <- %{i} in place" for p, i in self.inplace.items()]
        lines += [f"  update {p} <- {graph.label(i)} copied after the step" for p, i in self.copies]
        return "\n".join(lines)


def _align(n):
    return -(-n // ALIGN) * ALIGN


def _base(graph, nid):
    """The node whose buffer a value lives in (follows views)."""
    while op_kind(graph.nodes[nid].op) == "view":
        nid = graph.nodes[nid].inputs[0]
    return nid


def _can_write_in_place(kg, pid, uid, order, taken):
    """True if update node `uid` may overwrite param node `pid`'s buffer while it runs."""
    g = kg.graph
    u = g.nodes[uid]
    if uid in taken or uid not in order or _base(g, uid) != uid:
        return False
    if any(_base(g, o) == pid for o in g.outputs.values()):
        return False
    for r in kg.live:
        rn = g.nodes[r]
        if op_kind(rn.op) == "view" or not any(_base(g, i) == pid for i in rn.inputs):
            continue
        if r == uid:
            same = all(g.nodes[i].type.shape == u.type.shape for i in rn.inputs if i == pid)
            if op_kind(u.op) != "elementwise" or not same or \
                    any(_base(g, i) == pid and i != pid for i in rn.inputs):
                return False
        elif order.get(r, -1) >= order[uid]:
            return False
    return True


def plan_memory(kg, params=None):
    """Naive plan for a KernelGraph: returns (MemoryPlan, Report). `params` (name -> Slot) places
    the params in an existing persistent region instead (a program sharing another's params)."""
    g = kg.graph
    order = {nid: k.id for k in kg.kernels for nid in k.nodes}
    if params is None:
        params, persist = {}, 0
        for name, nid in g.params.items():
            params[name] = Slot("persist", persist, g.nodes[nid].type.nbytes)
            persist += _align(g.nodes[nid].type.nbytes)
    else:
        params = {name: params[name] for name in g.params}
        persist = max((s.offset + _align(s.nbytes) for s in params.values()), default=0)
    slots = {g.params[name]: s for name, s in params.items()}
    inplace, copies = {}, []
    for name, uid in g.updates.items():
        if _can_write_in_place(kg, g.params[name], uid, order, set(inplace.values())):
            inplace[name] = uid
            slots[uid] = params[name]
        elif uid != g.params[name]:
            copies.append((name, uid))
    arena = 0
    for n in g.nodes:
        if n.id not in kg.live or n.id in slots or n.op == "param":
            continue
        if op_kind(n.op) == "view":
            slots[n.id] = slots[_base(g, n.id)]
            continue
        slots[n.id] = Slot("arena", arena, n.type.nbytes)
        arena += _align(n.type.nbytes)
    plan = MemoryPlan(slots, arena, persist, params, copies, inplace)
    rep = Report("memory", {"arena_bytes": arena, "persistent_bytes": persist,
                            "buffers": len({s for s in slots.values()}),
                            "updates_in_place": len(inplace), "updates_copied": len(copies)})
    return plan, rep

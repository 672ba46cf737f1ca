"""The CUDA program: every kernel of the KernelGraph lowered to its launches, in order (a lone
node by its op's rule, a fused kernel by the rule of the op anchoring it: runtime/cuda/table.py),
the pads and param copies, and the listing Program.ir("kernels") shows.

The same kernel graph the CPU backend gets (passes/fuse.py), the same memory plan: every value
lives at its slot in the device arena, the device persistent region, or (inputs and outputs) at
an entry of the per-call io table. Kernel writing: runtime/cuda/kernel.py; the fused kinds'
writers: fused.py; a lone op's: lower.py, conv.py, attention.py.
"""
from __future__ import annotations

from jitgraph.plan import CALLER

from .kernel import HEADER, Context, Generated, copy_words, fill_words, words
from .rules import ELEMENTWISE
from .table import lowering


def rule_of(ctx, n):
    """The rule of node n's op; an op without one is Unsupported, naming the op and the node."""
    rule = lowering(n.op)
    if rule is None:
        raise ctx.unsupported(n)
    return rule


def lower_node(ctx, n, note=""):
    """The launches running node n alone."""
    return rule_of(ctx, n).node(ctx, n, note)


def lower_kernel(ctx, k) -> list:
    """The launches running KernelGraph kernel `k`: a node by its op's rule, an elementwise
    kernel by ELEMENTWISE, any other by the rule of the op anchoring it."""
    note = f"k{k.id}"
    if k.kind == "node":
        return lower_node(ctx, ctx.g.nodes[k.root], note)
    if k.kind == "elementwise":
        return ELEMENTWISE.kernel(ctx, k, note)
    return rule_of(ctx, ctx.g.nodes[k.anchor]).kernel(ctx, k, note)


def generate(kg, plan, tpb=128, tile=16, max_blocks=4096) -> Generated:
    ctx = Context(kg, plan, tpb, tile, max_blocks)
    g = kg.graph
    launches = []
    split = kg.boundary is not None
    for k in kg.kernels:
        phase = 2 if split and k.id >= kg.boundary else 1
        for ln in lower_kernel(ctx, k):
            ln.phase, ln.kg_kernel = phase, k.id
            launches.append(ln)
    if split:
        for off, nbytes in plan.pads:
            ln = fill_words(ctx, words("arena", off, nbytes), "pads")
            ln.phase = 1
            launches.append(ln)
    for name, nid in plan.copies:
        s, d = plan.slots[nid], plan.params[name]
        base = s.pointer if s.region in CALLER else s.region
        ln = copy_words(ctx, words(base, s.offset, d.nbytes), words("persist", d.offset,
                                                                       d.nbytes), "copy")
        ln.phase = 2 if split else 1
        launches.append(ln)
    src = HEADER + f"TPB = {tpb}\n\n\n" + "\n\n".join(ctx.kernels[k] for k in
                                                     sorted(ctx.kernels))
    work = ctx.work_at + ctx.work - plan.arena_bytes if ctx.work else 0
    gen = Generated(dict(ctx.kernels), launches, src, work, 2 if split else 1, tpb, tile)
    gen.plan_bytes = {"arena": plan.arena_bytes + work, "persist": plan.persist_bytes,
                      "outputs": sum(s.nbytes for s in plan.outputs.values())}
    for k, s in plan.inputs.items():
        t = g.nodes[g.inputs[k]].type
        gen.inputs[s.pointer] = (s.nbytes, t.np_dtype, t.shape)
    for k, s in plan.outputs.items():
        t = g.nodes[g.outputs[k]].type
        gen.outputs[s.pointer] = (s.nbytes, t.np_dtype, t.shape)
    return gen


def listing(gen: Generated, g) -> str:
    """The text Program.ir("kernels") shows: the launch sequence, then the kernels' source."""
    lines = [f"# jitgraph CUDA step for graph {g.name}: {len(gen.launches)} launches, "
             f"{len(gen.kernels)} kernels"]
    for ln in gen.launches:
        args = ", ".join(a if isinstance(a, str) else
                         f"{'io[%d]' % a.base if isinstance(a.base, int) else a.base}"
                         f"+{a.offset}:{a.dtype}{list(a.shape)}" for a in ln.args)
        lines.append(f"# {ln.note} phase {ln.phase}: {ln.kernel}[{ln.grid}, {ln.block}]({args})")
    return "\n".join(lines) + "\n\n" + gen.source

"""Memory planning: where every value lives, ggml-allocator style, as a pass with a report.

Regions. Params and optimizer state live in a persistent region that survives steps; an update
whose kernel can write straight into its param's slot (nothing reads the old value afterwards)
does so, the others are copied into the param at the end of the step. Program inputs live where
the caller's arrays lie: region "input", one entry of the driver's per-call pointer table each
(the executor fills it every call); no kernel ever writes there, so no value takes an input's
buffer. Graph outputs computed by a kernel live in region "output", one pointer each (the
program's own buffer, or the caller's array when it asks for one: `Program.step_into`). Every
other value (activations, gradients) lives in one arena.

Arena plan (`reuse=True`), over the kernel order of passes/fuse.py:
  1. liveness (passes/liveness.py): each value is live from the kernel that writes it to the
     last kernel that reads it; outputs and update sources to the end of the step; views alias
     their base; fused intermediates need no buffer; inputs and outputs take no arena bytes;
  2. in-place reuse: an elementwise kernel's root takes the buffer of an operand that dies in
     that kernel when it has the root's exact type (the generated loop reads element i of every
     full-shape operand before it writes element i); outputs and update sources are never
     overwritten, inputs never written. Chains of such kernels share one buffer. So does a
     paired kernel's root and its first operand (cross_entropy_back over the logits it dies
     with: the kernels read a row before they write its gradient);
  2b. a GEMM whose product one add reads, with an operand dying there (the tied embedding's
     gradient): the sum takes that operand's slot, and the backend accumulates the GEMM into
     it (`MemoryPlan.sums`) instead of carrying the product in scratch space; the one value
     of that type the kernel's epilogue stores then takes the same buffer (the f32 update of
     a bf16 master weight over the tied embedding's gradient);
  3. offsets: buffers (a chain is one buffer, live over the union of its values) are placed
     largest first, each at the lowest-waste gap among the already placed buffers it is live
     with (greedy by size, best fit).
`reuse=False` is the naive baseline: one buffer per value, no sharing.
Update boundary (passes/boundary.py): the boundary values of each dtype are one buffer of the
packing above (a bucket: each value on a cache line, in param order, live from the first of
them to the end of the step), neither taking nor giving a buffer in place; `gradients` gives
their slots, `buckets` the flat ranges a hook reads as one array, `pads` the bytes between them
the driver zeroes at the end of phase 1.
The report gives the naive bytes, the planned arena, the lower bound (largest live set of the
same values; in-place reuse can go below it) and the in-place reuses; `MemoryPlan.describe`
lists every buffer's offset, size, live steps and the value it reuses.
passes/memory_check.py verifies a plan independently.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from jitgraph.ir import LEAF_OPS, base, feeding, op_kind, view_offset
from jitgraph.registry import get_op
from jitgraph.plan import ALIGN, MemoryPlan, Slot

from .boundary import PREFIX, boundary_values
from .liveness import intervals, live_bytes
from .report import Report

def _align(n):
    return -(-n // ALIGN) * ALIGN


def _readers(kg):
    """(value -> the live non-view nodes reading its buffer, in kg.live's order; the buffers
    the outputs live in): what _can_write_in_place asks, computed once per plan."""
    g = kg.graph
    readers = {}
    for r in kg.live:
        rn = g.nodes[r]
        if op_kind(rn.op) != "view":
            for b in dict.fromkeys(base(g, i) for i in rn.inputs):
                readers.setdefault(b, []).append(r)
    return readers, {base(g, o) for o in g.outputs.values()}


def _can_write_in_place(kg, pid, uid, order, taken, reads):
    """True if update node `uid` may overwrite param node `pid`'s buffer while it runs: nothing
    reads the param after it, and uid reads it elementwise without broadcasting, or as the
    operand whose buffer its op may take (OpDef.inplace: set_rows writing a KV cache's rows).
    reads: _readers(kg)."""
    g = kg.graph
    u = g.nodes[uid]
    readers, output_bases = reads
    if uid in taken or uid not in order or base(g, uid) != uid:
        return False
    if pid in output_bases:
        return False
    for r in readers.get(pid, ()):
        rn = g.nodes[r]
        if r == uid:
            if _takes_operand(g, u, pid):      # its op writes only what changes (set_rows)
                continue
            same = all(g.nodes[i].type.shape == u.type.shape for i in rn.inputs if i == pid)
            if op_kind(u.op) != "elementwise" or not same or \
                    any(base(g, i) == pid and i != pid for i in rn.inputs):
                return False
        elif order.get(r, -1) > order[uid] or \
                (order.get(r) == order[uid] and not _same_iteration(kg, r, uid, pid)):
            return False
    return True


def _takes_operand(g, u, pid):
    """True if node u's op may take the buffer of its `inplace` operand (OpDef.inplace) and that
    operand is param pid itself, read by u nowhere else (not even through a view)."""
    k = get_op(u.op).inplace
    return k is not None and k < len(u.inputs) and u.inputs[k] == pid and \
        all(base(g, i) != pid for j, i in enumerate(u.inputs) if j != k)


def _same_iteration(kg, r, uid, pid):
    """True if r, a member of update uid's kernel, reads param pid only in the loop iteration
    that writes the same element: an elementwise kernel loads its operands at the start of each
    iteration, so a member over the param's own shape (a guarded update's candidate, say)
    never sees a value the iteration wrote. A gemm kernel's epilogue is such a loop, and
    its GEMMs and their prologue have read everything they read before it starts."""
    g = kg.graph
    kernel = next(k for k in kg.kernels if uid in k.nodes)
    shape = g.nodes[pid].type.shape
    if kernel.kind == "gemm" and (r == kernel.anchor or r in _gemm_inputs(g, kernel)):
        return uid not in _gemm_inputs(g, kernel)     # read before the epilogue writes
    return kernel.kind in ("elementwise", "gemm") and g.nodes[r].type.shape == shape and \
        g.nodes[uid].type.shape == shape and \
        all(g.nodes[i].type.shape == shape for i in g.nodes[r].inputs if base(g, i) == pid)


def _gemm_inputs(g, kernel) -> set:
    """The members of gemm kernel `kernel` its GEMMs read, directly or through other members
    (its prologue): all of them run before the epilogue, the loop over the product after the
    GEMMs, which reads each operand's element in the iteration that writes it."""
    return feeding(g, [kernel.anchor, *(m for m, _ in kernel.accumulate)], kernel.nodes)


PAGE = 4096     # bytes; the unit in which a file's pages can be mapped into the region
MAP_ALIGN = 32  # bytes; the least alignment of a slot placed at its file's page offset


def _persistent(g, params, page_offsets=None):
    """(param name -> Slot, persistent bytes): fresh, or the given slots of another program.
    page_offsets: param -> the offset within a page its slot starts at, so that a region
    starting on a page holds it at the same place in its pages as its file does, and the
    file's whole pages can be mapped there (formats/tensors.py); a multiple of MAP_ALIGN (GGUF's
    default alignment: such a slot may start half a cache line in, which kernels allow)."""
    if params is not None:
        params = {name: params[name] for name in g.params}
        return params, max((s.offset + _align(s.nbytes) for s in params.values()), default=0)
    out, persist = {}, 0
    page_offsets = page_offsets or {}
    for name, nid in g.params.items():
        want = page_offsets.get(name)
        if want is not None and want % MAP_ALIGN == 0 and 0 <= want < PAGE:
            persist += (want - persist) % PAGE
        out[name] = Slot("persist", persist, g.nodes[nid].type.nbytes)
        persist = _align(persist + g.nodes[nid].type.nbytes)
    return out, persist


def caller_outputs(kg, persistent=()) -> dict:
    """output name -> the value it reads, for the outputs living in region "output" (written
    where the caller's array lies): a value a kernel writes, read by this output alone (one
    pointer per buffer), neither an update's source nor written into a param (`persistent`),
    and the whole of it. Other outputs (an input, a param, a value two outputs or an update
    share, a window of a value: part of it) stay where they
    are and are copied out; update boundary values (`boundary/<param>`) live in their bucket."""
    g = kg.graph
    written = {nid for k in kg.kernels for nid in kg.outputs_of(k)}
    updates = {base(g, u) for u in g.updates.values()}
    bases = [base(g, nid) for nid in g.outputs.values()]
    return {name: b for name, b in zip(g.outputs, bases)
            if not name.startswith(PREFIX) and b in written and b not in updates and
            b not in persistent and bases.count(b) == 1
            and g.nodes[b].op not in LEAF_OPS
            and g.nodes[b].type.nbytes == g.nodes[g.outputs[name]].type.nbytes}  # no window


def arena_intervals(kg, persistent=()) -> dict:
    """Live steps of every value in the arena: liveness over the kernel order; inputs (read
    where the caller's arrays lie), the outputs of `caller_outputs`, params and `persistent`
    values (updates written into their params) take no arena bytes."""
    g = kg.graph
    persistent = set(persistent)
    persistent |= set(caller_outputs(kg, persistent).values())
    ivs = intervals(g, [k.nodes for k in kg.kernels], persistent=persistent,
                    outputs=[kg.outputs_of(k) for k in kg.kernels], inlined=kg.inlined)
    return {nid: (s, max(s, e)) for nid, (s, e) in ivs.items()}


def _inplace_operand(kg, kernel, t, ivs, kept):
    """The operand (a buffer-owning value dying at step t) whose buffer the root of `kernel` can
    take, or None. Only all-elementwise kernels whose root is their only buffered value, and
    only an operand every member reads with the root's exact type (no broadcasting)."""
    g = kg.graph
    root = g.nodes[kernel.root]
    if kernel.kind == get_op(root.op).pairs_with and len(kernel.nodes) > 1:
        return _paired_operand(kg, kernel, t, ivs, kept)
    if any(op_kind(g.nodes[m].op) != "elementwise" for m in kernel.nodes) or \
            tuple(kg.outputs_of(kernel)) != (kernel.root,) or kernel.root not in ivs:
        return None
    same = {}
    for m in kernel.nodes:
        for i in g.nodes[m].inputs:
            b = base(g, i)              # the whole buffer, read as the root's type (a
            same[b] = same.get(b, True) and g.nodes[i].type == root.type and \
                g.nodes[i].type.nbytes == g.nodes[b].type.nbytes   # window: part of it)
    for b, ok in same.items():
        if ok and b in ivs and ivs[b][1] == t and b not in kept:
            return b
    return None


def _paired_operand(kg, kernel, t, ivs, kept):
    """The first operand of a paired kernel's root (cross_entropy_back with its cross_entropy:
    the logits) when the root, of its exact type, may take its buffer: it dies here and is no
    output or update. The kernels read a row's logits (its maximum, its sum of exponentials,
    the label's logit) before they write that row's gradient, element i of the row read
    before element i is written."""
    g = kg.graph
    root = g.nodes[kernel.root]
    x = root.inputs[0]
    if kernel.root not in ivs or base(g, x) != x or x not in ivs or ivs[x][1] != t or \
            x in kept or g.nodes[x].type != root.type or \
            any(i == x for m in kernel.nodes for i in g.nodes[m].inputs[1:]):
        return None
    return x


def _gemm_sum(kg, kernel, t, ivs, kept):
    """(sum, operand) when the GEMM of `kernel` can accumulate into a dying operand's buffer:
    its product is read by one member alone, an add (fusion role "accumulate") of the product
    and an arena value of their exact type that dies here and that no other member reads. The
    sum then lives in that buffer and the product takes no scratch space of its own (the tied
    embedding's gradient: the output projection's dW added to get_rows' scatter, vocab x dim
    each). None otherwise."""
    g = kg.graph
    p = kernel.product
    if kernel.kind != "gemm" or p is None or p in kg.outputs_of(kernel):
        return None
    readers = [m for m in kernel.nodes if any(base(g, i) == p for i in g.nodes[m].inputs)]
    if len(readers) != 1:
        return None
    m = g.nodes[readers[0]]
    if "accumulate" not in get_op(m.op).fusion or len(m.inputs) != 2 or \
            m.id in kg.outputs_of(kernel) or p not in m.inputs:
        return None
    x = m.inputs[1] if m.inputs[0] == p else m.inputs[0]
    same = g.nodes[x].type == g.nodes[p].type == m.type
    others = any(base(g, i) == x for r in kernel.nodes if r != m.id for i in g.nodes[r].inputs)
    if not same or x == p or base(g, x) != x or x in kernel.nodes or x not in ivs or \
            ivs[x][1] != t or x in kept or others:
        return None
    return m.id, x


def _over_sum(kg, kernel, t, ivs, kept):
    """(value, operand) when the epilogue of gemm `kernel`, accumulating into a dying operand's
    buffer (_gemm_sum), stores one value of that operand's exact type: the value takes the
    buffer too. The epilogue's loop reads element i of the sum before it stores element i of
    anything, and nothing else reads the sum (a bf16 master weight's update: its f32 value
    over the tied embedding's gradient, vocab x dim each). None otherwise."""
    found = _gemm_sum(kg, kernel, t, ivs, kept)
    if found is None:
        return None
    g, (total, x) = kg.graph, found
    outs = [o for o in kg.outputs_of(kernel) if o in ivs]
    if len(outs) != 1 or outs[0] in kept or outs[0] in (total, x) or \
            g.nodes[outs[0]].type != g.nodes[x].type or \
            op_kind(g.nodes[outs[0]].op) != "elementwise":
        return None
    return outs[0], x


def _pack(sizes, starts, ends):
    """Offsets for buffers live over [start, end] steps: largest first, each in the smallest
    gap that fits among the placed buffers live at the same time (else on top of them)."""
    n = len(sizes)
    offs = np.zeros(n, np.int64)
    placed = np.zeros(n, bool)
    s, e, z = np.asarray(starts), np.asarray(ends), np.asarray(sizes, np.int64)
    for j in sorted(range(n), key=lambda j: (-sizes[j], starts[j], j)):
        hit = placed & (s <= ends[j]) & (starts[j] <= e)
        lo = offs[hit]
        idx = np.argsort(lo, kind="stable")
        lo, hi = lo[idx], (lo + z[hit])[idx]
        best, best_gap, top = None, None, 0
        for a, b in zip(lo.tolist(), hi.tolist()):
            gap = a - top
            if gap >= sizes[j] and (best_gap is None or gap < best_gap):
                best, best_gap = top, gap
            top = max(top, b)
        offs[j] = top if best is None else best
        placed[j] = True
    return offs.tolist()


def _boundary(kg, ivs) -> dict:
    """param -> the buffer-owning value its boundary value lives in (passes/boundary.py), in
    param order; a ValueError names a value that cannot have a bucket slot of its own."""
    g = kg.graph
    out, owner = {}, {}
    values = boundary_values(g)
    for name in g.params:
        if name not in values:
            continue
        b = base(g, values[name])
        if b not in ivs:
            what = "a program input" if g.nodes[b].op == "input" else \
                "a param" if g.nodes[b].op == "param" else "not computed by a kernel"
            raise ValueError(f"update boundary: the gradient of param {name!r} is "
                             f"{g.label(b)} ({g.nodes[b].op}), {what}; it needs a buffer of its "
                             f"own in the gradient region; compile without hook=")
        if b in owner:
            raise ValueError(f"update boundary: params {owner[b]!r} and {name!r} have the same "
                             f"gradient value {g.label(b)}; the gradient region needs one "
                             f"buffer per param; compile without hook=")
        owner[b] = name
        out[name] = b
    return out


def plan_memory(kg, params=None, reuse=True, page_offsets=None):
    """Memory plan for a KernelGraph: returns (MemoryPlan, Report). `params` (name -> Slot)
    places the params in an existing persistent region (a program sharing another's params);
    `reuse=False` gives the naive plan (one buffer per value); `page_offsets`: see
    _persistent."""
    g = kg.graph
    order = {nid: k.id for k in kg.kernels for nid in k.nodes}
    params, persist = _persistent(g, params, page_offsets)
    slots = {g.params[name]: s for name, s in params.items()}
    inplace, copies = {}, []
    reads = _readers(kg)
    for name, uid in g.updates.items():
        if _can_write_in_place(kg, g.params[name], uid, order, set(inplace.values()), reads):
            inplace[name] = uid
            slots[uid] = params[name]
        elif uid != g.params[name]:
            copies.append((name, uid))
    ivs = arena_intervals(kg, persistent=set(inplace.values()))
    live_inputs = [(k, i) for k, i in g.inputs.items() if i in kg.live]
    ins = {k: Slot("input", 0, g.nodes[i].type.nbytes, j) for j, (k, i) in enumerate(live_inputs)}
    outs = {k: Slot("output", 0, g.nodes[b].type.nbytes, len(ins) + j)
            for j, (k, b) in enumerate(caller_outputs(kg, set(inplace.values())).items())}
    for k, i in live_inputs:
        slots[i] = ins[k]
    for k, s in outs.items():
        slots[base(g, g.outputs[k])] = s
    kept = {base(g, i) for i in list(g.outputs.values()) + list(g.updates.values())}
    owner = {nid: nid for nid in ivs}            # value -> first value of its buffer chain
    reuses = {}
    grads = _boundary(kg, ivs)
    if reuse:
        for t, k in enumerate(kg.kernels):
            b = _inplace_operand(kg, k, t, ivs, kept)
            if b is not None and k.root not in grads.values():
                reuses[k.root] = b
                owner[k.root] = owner[b]
            u = _over_sum(kg, k, t, ivs, kept | set(grads.values()))
            if u is not None:
                reuses[u[0]] = u[1]
                owner[u[0]] = owner[u[1]]
    chains = {}
    for nid in sorted(ivs, key=lambda i: ivs[i]):
        chains.setdefault(owner[nid], []).append(nid)
    heads = [h for h in chains if h not in grads.values()]
    sizes = [_align(max(g.nodes[i].type.nbytes for i in chains[h])) for h in heads]
    starts = [ivs[chains[h][0]][0] for h in heads]
    ends = [ivs[chains[h][-1]][1] for h in heads]
    buckets = {}                      # dtype -> [(param, value, offset in the bucket)]
    for name, nid in grads.items():
        b = buckets.setdefault(g.nodes[nid].type.dtype, [])
        b.append((name, nid, b[-1][2] + _align(g.nodes[b[-1][1]].type.nbytes) if b else 0))
    for b in buckets.values():
        heads.append(b)
        sizes.append(b[-1][2] + _align(g.nodes[b[-1][1]].type.nbytes))
        starts.append(min(ivs[nid][0] for _, nid, _ in b))
        ends.append(max(ivs[nid][1] for _, nid, _ in b))
    if reuse:
        offs = _pack(sizes, starts, ends)
    else:
        offs = np.cumsum([0] + sizes[:-1]).tolist()
    arena = max((o + z for o, z in zip(offs, sizes)), default=0)
    gradients, flat, pads = {}, [], []
    for h, off in zip(heads, offs):
        if isinstance(h, list):                      # a bucket of boundary values
            for name, nid, at in h:
                n = g.nodes[nid].type.nbytes
                slots[nid] = gradients[name] = Slot("arena", int(off + at), n)
                if _align(n) > n:
                    pads.append((int(off + at + n), _align(n) - n))
            flat.append((g.nodes[h[0][1]].type.dtype, int(off),
                         h[-1][2] + _align(g.nodes[h[-1][1]].type.nbytes)))
            continue
        for nid in chains[h]:
            slots[nid] = Slot("arena", int(off), g.nodes[nid].type.nbytes)
    sums = {}
    for t, k in enumerate(kg.kernels):
        found = _gemm_sum(kg, k, t, ivs, kept | set(grads.values())) if reuse else None
        if found is not None:
            sums[found[0]] = found[1]
            slots[found[0]] = slots[found[1]]
    for nid in kg.live:
        if op_kind(g.nodes[nid].op) == "view" and base(g, nid) in slots:
            s = slots[base(g, nid)]     # a window starts its offset further in (ir.view_offset)
            slots[nid] = replace(s, offset=s.offset + view_offset(g, nid),
                                 nbytes=g.nodes[nid].type.nbytes)
    prof = live_bytes(g, ivs, max(len(kg.kernels), 1))
    plan = MemoryPlan(slots, int(arena), persist, params, copies, inplace, reuses, ivs,
                      naive_bytes=sum(_align(g.nodes[i].type.nbytes) for i in ivs),
                      lower_bound=max(prof, default=0), inputs=ins, outputs=outs,
                      gradients=gradients, buckets=flat, pads=pads, sums=sums)
    return plan, Report("memory", {"plan": "reuse" if reuse else "naive", **plan.summary()})

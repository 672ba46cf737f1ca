"""The IR as a picture: graphviz dot text of a graph, its kernels and its memory plan.

`to_dot(graph, kernels=None, memory=None)`: a node per value (op and type; inputs and params by
name), an edge per operand (labelled with the operand's type); with a KernelGraph
(jitgraph/plan.py, after `fuse`) each kernel a cluster; with a MemoryPlan (after `memory`) each
value coloured by its buffer's arena slot. Identical layers (the values computed from params
named blk.N. / layers.N.) are drawn once, their cluster labelled "xK", so a deep model stays a
readable picture. Plain text only: rendering (graphviz's `dot` program) is the caller's.
"""
from __future__ import annotations

import re

from .ir import base

# fills of arena slots, cycled: one per distinct offset
PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
           "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")
PARAM_FILL = {"trainable": "#e8e8e8", "frozen": "#f4f4f4", "state": "#fff4e0"}
# a layer's params: blk.N. (GGUF), layers.N. / layer.N. / h.N. (other conventions)
LAYER_NAME = re.compile(r"(?<![A-Za-z0-9])(?:blk|layers|layer|h)\.(\d+)\.")


def _q(text) -> str:
    """A dot string literal of any text: backslashes and quotes escaped, line breaks as dot's
    \\n, other control characters shown as \\xNN (dot reads its input as C strings)."""
    out = []
    for line in re.split(r"\r\n|\r|\n", str(text)):
        line = line.replace("\\", "\\\\").replace('"', '\\"')
        out.append("".join(f"\\\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c
                           for c in line))
    return '"' + "\\n".join(out) + '"'


def _layers(graph, kernels=None) -> dict:
    """{node id: layer number} for the values of numbered layers: a param by its name, a node
    reading such params by the latest of them, any other node by its latest operand that has a
    layer (the residual stream, forward and backward, moves on to a layer where an op of that
    layer reads it); with kernels, every member takes its
    kernel root's layer, so no kernel straddles two layers."""
    names = {nid: name for name, nid in graph.params.items()}
    out = {}
    for n in graph.nodes:
        if n.op == "param":
            m = LAYER_NAME.search(names.get(n.id, ""))
            if m:
                out[n.id] = int(m.group(1))
            continue
        direct = [i for i in n.inputs if i in out and graph.nodes[i].op == "param"]
        layered = direct or [i for i in n.inputs if i in out]
        if layered:
            out[n.id] = out[max(layered)]
    if kernels is not None:
        for k in kernels.kernels:
            lay = out.get(k.root)
            for nid in k.nodes:
                if lay is None:
                    out.pop(nid, None)
                else:
                    out[nid] = lay
    return out


def _signature(graph, members, layer_of, lay, kernel_of, names):
    """What a layer computes, independent of its number: each member's op, type, attributes,
    param name (its number blanked) and operands (members by position, others by op, type
    and layer distance), and its kernel by position."""
    pos = {nid: p for p, nid in enumerate(members)}
    kpos = {}
    sig = []
    for nid in members:
        n = graph.nodes[nid]
        refs = []
        for i in n.inputs:
            if i in pos:
                refs.append(("in", pos[i]))
            else:
                other = layer_of.get(i)
                refs.append(("out", None if other is None else other - lay, graph.nodes[i].op,
                             graph.nodes[i].type))
        k = kernel_of.get(nid)
        kk = None if k is None else (k.kind, kpos.setdefault(k.id, len(kpos)))
        attrs = tuple((k, LAYER_NAME.sub("N.", v) if isinstance(v, str) else v)
                      for k, v in n.attrs)          # a param's name, its number blanked
        sig.append((n.op, n.type, attrs, tuple(refs), kk))
    return tuple(sig)


def _fold(graph, layer_of, kernel_of, names):
    """Runs of consecutive identical layers: ({folded node: its representative}, [(first,
    last) layer numbers of each run drawn once])."""
    by_layer = {}
    for nid, lay in layer_of.items():
        by_layer.setdefault(lay, []).append(nid)
    order = sorted(by_layer)
    sigs = {lay: _signature(graph, sorted(by_layer[lay]), layer_of, lay, kernel_of, names)
            for lay in order}
    rep, runs = {}, []
    i = 0
    while i < len(order):
        j = i
        while (j + 1 < len(order) and order[j + 1] == order[j] + 1
               and sigs[order[j + 1]] == sigs[order[i]]):
            j += 1
        if j > i:
            first = sorted(by_layer[order[i]])
            for lay in order[i + 1:j + 1]:
                for a, b in zip(sorted(by_layer[lay]), first):
                    rep[a] = b
            runs.append((order[i], order[j]))
        i = j + 1
    return rep, runs


def _slot_fill(graph, memory, nid, colours):
    """(fill colour, where) of a value in `memory`: where its own slot lies (a view's range of
    its base's), coloured by its base's buffer."""
    slot, home = memory.slots.get(nid), memory.slots.get(base(graph, nid))
    slot = slot or home
    if slot is None:
        return None, None
    if slot.region == "arena":
        return colours[(home or slot).offset], f"arena@{slot.offset} +{slot.nbytes}"
    if slot.region == "persist":
        return "#e8e8e8", f"persist@{slot.offset}"
    return "#ffffff", f"{slot.region}#{slot.pointer}"


def to_dot(graph, kernels=None, memory=None, *, fold=True, title=None) -> str:
    """Graphviz dot text of `graph` (with its KernelGraph and MemoryPlan when given)."""
    from .printer import param_roles
    names = {nid: name for name, nid in graph.params.items()}
    inputs = {nid: name for name, nid in graph.inputs.items()}
    roles = param_roles(graph)
    if kernels is not None:
        drawn = set(kernels.live) - set(kernels.inlined)
        for k in kernels.kernels:
            drawn.update(k.nodes)
            drawn.update(kernels.inputs_of(k))
    else:
        drawn = {n.id for n in graph.nodes}
    kernel_of = {} if kernels is None else {nid: k for k in kernels.kernels for nid in k.nodes}
    layer_of = {nid: lay for nid, lay in _layers(graph, kernels).items() if nid in drawn}
    rep, runs = _fold(graph, layer_of, kernel_of, names) if fold else ({}, [])
    offsets = sorted({s.offset for nid, s in (memory.slots.items() if memory else ())
                      if s.region == "arena" and base(graph, nid) == nid})   # buffers, no views
    colours = {off: PALETTE[i % len(PALETTE)] for i, off in enumerate(offsets)}

    def node_line(nid):
        n = graph.nodes[nid]
        if nid in inputs:
            label = _q(inputs[nid] + "\n" + str(n.type))
            return f"n{nid} [label={label}, shape=invhouse, style=filled, fillcolor=\"#dbe9f6\"];"
        if nid in names:
            label, fill = _q(names[nid] + "\n" + str(n.type)), _q(PARAM_FILL[roles[names[nid]]])
            return f"n{nid} [label={label}, shape=box, style=filled, fillcolor={fill}];"
        label = f"%{nid} {n.op}\n{n.type}"
        fill = "#ffffff"
        if memory is not None:
            colour, where = _slot_fill(graph, memory, nid, colours)
            if where:
                label += f"\n{where}"
                fill = colour
        return f"n{nid} [label={_q(label)}, shape=box, style=\"rounded,filled\", " \
               f"fillcolor={_q(fill)}];"

    def group_lines(members, indent):
        """Members' node lines, each kernel's in a cluster."""
        lines, seen = [], set()
        pad = "  " * indent
        for nid in sorted(members):
            k = kernel_of.get(nid)
            if k is None:
                lines.append(pad + node_line(nid))
            elif k.id not in seen:
                seen.add(k.id)
                label = _q(f"k{k.id}" + ("" if k.kind == "node" else f" {k.kind}"))
                lines.append(f"{pad}subgraph cluster_k{k.id} {{ label={label}; style=rounded; "
                             f"color=\"#555555\";")
                lines += [pad + "  " + node_line(m) for m in k.nodes if m in drawn]
                lines.append(pad + "}")
        return lines

    head = title or graph.name
    if memory is not None:
        head += f"\narena {memory.arena_bytes} B: fill = arena slot"
    out = [f"digraph {_q(graph.name)} {{",
           f"  graph [label={_q(head)}, labelloc=t, fontsize=18, rankdir=TB, newrank=true];",
           "  node [fontname=\"Helvetica\", fontsize=10];",
           "  edge [fontname=\"Helvetica\", fontsize=8, color=\"#666666\"];"]
    run_of = {}
    for first, last in runs:
        run_of.update({nid: (first, last) for nid, lay in layer_of.items() if lay == first})
    shown = [nid for nid in sorted(drawn) if nid not in rep]
    for first, last in runs:
        members = [nid for nid in shown if run_of.get(nid) == (first, last)]
        label = _q(f"layers {first}-{last} (x{last - first + 1}, identical: drawn once)")
        out.append(f"  subgraph cluster_layers_{first} {{ label={label}; style=dashed; "
                   f"color=\"#3366aa\"; fontcolor=\"#3366aa\";")
        out += group_lines(members, 2)
        out.append("  }")
    out += group_lines([nid for nid in shown if nid not in run_of], 1)
    edges = set()
    for nid in shown:
        for i in graph.nodes[nid].inputs:
            if i not in drawn:
                continue
            src = rep.get(i, i)
            if (src, nid) in edges:
                continue
            edges.add((src, nid))
            style = ", style=dashed" if src != i else ""     # from a layer drawn folded
            out.append(f"  n{src} -> n{nid} [label={_q(graph.nodes[i].type)}{style}];")
    for name, nid in graph.outputs.items():
        if nid in rep or nid not in drawn:
            continue
        out.append(f"  out_{len(edges)} [label={_q(name)}, shape=house, style=filled, "
                   f"fillcolor=\"#dbf6e0\"];")
        out.append(f"  n{nid} -> out_{len(edges)};")
        edges.add(("out", name))
    for name, nid in graph.updates.items():
        target = graph.params.get(name)
        if nid in rep or target in rep or nid not in drawn or target not in drawn:
            continue
        out.append(f"  n{nid} -> n{target} [label=\"update\", style=dotted, constraint=false];")
    out.append("}")
    return "\n".join(out)

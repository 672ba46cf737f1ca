"""The IR validator: every pass may call it on the graph it returns."""
from __future__ import annotations

from .types import ShapeError


def validate(graph) -> None:
    """Check ids, topological order, leaf tables, names and every node's type (re-inferred)."""
    names = set()
    for pos, n in enumerate(graph.nodes):
        if n.id != pos:
            raise ShapeError(f"graph {graph.name}: node at position {pos} has id %{n.id}")
        for i in n.inputs:
            if not (isinstance(i, int) and 0 <= i < pos):
                raise ShapeError(f"graph {graph.name}: %{n.id} = {n.op} reads %{i}, which is not "
                                 f"an earlier node")
        if n.op in ("input", "param"):
            name = n.attr.get("name")
            table = graph.inputs if n.op == "input" else graph.params
            if table.get(name) != n.id or name in names:
                raise ShapeError(f"graph {graph.name}: {n.op} %{n.id} named {name!r} is not "
                                 f"registered once in the {n.op}s table")
            names.add(name)
            if n.inputs:
                raise ShapeError(f"graph {graph.name}: {n.op} {name} must have no operands")
            continue
        again = graph.make_node(n.op, n.inputs, n.attr, node_id=n.id)
        if again.type != n.type:
            raise ShapeError(f"graph {graph.name}: %{n.id} = {n.op} is typed {n.type}, its "
                             f"shape rule gives {again.type}")
        if again.attrs != n.attrs:
            raise ShapeError(f"graph {graph.name}: %{n.id} = {n.op} has attributes {n.attrs}, "
                             f"not in normal form {again.attrs}")
    for table, kind in ((graph.inputs, "input"), (graph.params, "param")):
        for name, i in table.items():
            if not (0 <= i < len(graph.nodes)) or graph.nodes[i].op != kind or \
                    graph.nodes[i].attr["name"] != name:
                raise ShapeError(f"graph {graph.name}: {kind} {name!r} points at %{i}, "
                                 f"which is not the {kind} node named {name!r}")
    for name in graph.params:
        if name not in graph.inits:
            raise ShapeError(f"graph {graph.name}: param {name!r} has no initializer")
    for name, i in graph.updates.items():
        if name not in graph.params or not (isinstance(i, int) and 0 <= i < len(graph.nodes)) or \
                graph.nodes[i].type != graph.nodes[graph.params[name]].type:
            raise ShapeError(f"graph {graph.name}: update of {name!r} points at %{i}, which is not "
                             f"a node of the param's type")
    for name, i in graph.outputs.items():
        if not (isinstance(i, int) and 0 <= i < len(graph.nodes)):
            raise ShapeError(f"graph {graph.name}: output {name!r} points at missing node %{i}")


# ops that move or repeat values without changing them: an index read through one is still a
# value of the input below
_VALUE_PRESERVING = ("reshape", "permute", "transpose", "broadcast_to")


def index_inputs(graph) -> dict:
    """{input name: (bound, [(op, node id)])} for every integer input whose values index
    (class labels, token ids, get_rows rows: the ops' `index` facts), directly or through a
    reshape/permute/transpose/broadcast_to: each must lie in [0, bound), the smallest bound of
    the ops that read it."""
    from .registry import OPS, Arg
    out = {}
    for n in graph.nodes:
        rule = OPS[n.op].index if n.op in OPS else None     # leaves (input, param) index nothing
        if rule is None:
            continue
        args = [Arg(graph.label(i), graph.nodes[i].type) for i in n.inputs]
        for pos, bound in rule(args, n.attr):
            src = graph.nodes[n.inputs[pos]]
            while src.op in _VALUE_PRESERVING:
                src = graph.nodes[src.inputs[0]]
            if src.op != "input":
                continue
            name = src.attr["name"]
            b, users = out.get(name, (bound, []))
            out[name] = (min(b, bound), users + [(n.op, n.id)])
    return out

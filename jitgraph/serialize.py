"""Graphs to JSON and back. Loading validates everything and evaluates nothing from the file.

Importing this module gives jitgraph.ir.Graph its `to_json()` and static `from_json(text)`
methods (the IR does not import its file format; jitgraph/__init__.py imports this module)."""
from __future__ import annotations

import json

from . import init as _init
from .ir import Graph, Node
from .types import ShapeError, TensorType

FORMAT, VERSION = "jitgraph-graph", 1
MAX_ELEMENTS = 2 ** 48      # per tensor: far beyond any real graph, far from int64 overflow
MAX_NDIM = 64               # dimensions per tensor (numpy's own limit)


class GraphFormatError(ValueError):
    """A JSON graph that is malformed, inconsistent or of an unknown version."""


def _attr_json(v):
    return [_attr_json(x) for x in v] if isinstance(v, tuple) else v


def graph_to_json(graph) -> str:
    """Deterministic text: keys in a fixed order, tables in the graph's order (output and
    update order is part of the graph, so it is kept, not sorted away)."""
    nodes = [{"op": n.op, "inputs": list(n.inputs), "attrs": {k: _attr_json(v) for k, v in n.attrs},
              "type": {"dtype": n.type.dtype, "shape": list(n.type.shape)}} for n in graph.nodes]
    inits = {}
    for name, ini in graph.inits.items():
        if not isinstance(ini, _init.Initializer):
            raise ValueError(f"param {name}: initializer {ini!r} is not serialisable; use one "
                             f"from jitgraph.init")
        inits[name] = ini.spec()
    doc = {"format": FORMAT, "version": VERSION, "name": graph.name, "inputs": graph.inputs,
           "params": graph.params, "outputs": graph.outputs, "updates": graph.updates,
           "inits": inits, "nodes": nodes}
    return json.dumps(doc, separators=(",", ":"))


def _expect(cond, msg):
    if not cond:
        raise GraphFormatError(msg)


def _name(name, what, empty=False):
    """Names are data: any string of Unicode text (no lone surrogates, so it can be written out as
    UTF-8), non-empty where the builder asks for that; whatever prints or compiles them escapes
    them."""
    _expect(isinstance(name, str) and (empty or name != ""),
            f"{what} must be a non-empty string, got {name!r:.80}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise GraphFormatError(f"{what} {name!r:.80} is not valid Unicode text") from None
    return name


def _int_table(doc, key, what):
    t = doc.get(key, {} if key == "updates" else None)
    _expect(isinstance(t, dict), f"field {key!r} must be an object of name -> node id")
    for k, v in t.items():
        _name(k, f"{what} name", empty=key == "outputs")
        _expect(isinstance(v, int) and not isinstance(v, bool), f"{key}[{k!r}] must be a node id")
    return t


def graph_from_json(text) -> Graph:
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8", errors="strict")
        except UnicodeDecodeError as e:
            raise GraphFormatError(f"not UTF-8 text: {e}") from None
    _expect(isinstance(text, str), f"expected JSON text, got {type(text).__name__}")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise GraphFormatError(f"not valid JSON: {e}") from None
    _expect(isinstance(doc, dict), "top level must be an object")
    _expect(doc.get("format") == FORMAT, f"not a jitgraph graph (format={doc.get('format')!r})")
    _expect(doc.get("version") == VERSION, f"unsupported version {doc.get('version')!r}; "
                                           f"this jitgraph reads version {VERSION}")
    _expect(isinstance(doc.get("nodes"), list), "field 'nodes' must be a list")
    g = Graph(_name(doc.get("name"), "the graph name"))
    inputs, params, outputs, updates = (_int_table(doc, k, k[:-1]) for k in
                                        ("inputs", "params", "outputs", "updates"))
    inits = doc.get("inits")
    _expect(isinstance(inits, dict), "field 'inits' must be an object")
    try:
        for pos, nd in enumerate(doc["nodes"]):
            _expect(isinstance(nd, dict), f"node {pos} must be an object")
            op, ins, attrs, ty = nd.get("op"), nd.get("inputs"), nd.get("attrs"), nd.get("type")
            _expect(isinstance(op, str), f"node {pos}: 'op' must be a string")
            _expect(isinstance(ins, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                  and 0 <= i < pos for i in ins),
                    f"node {pos} ({op}): inputs must be ids of earlier nodes, got {ins!r}")
            _expect(isinstance(attrs, dict), f"node {pos} ({op}): 'attrs' must be an object")
            _expect(isinstance(ty, dict) and isinstance(ty.get("shape"), list)
                    and isinstance(ty.get("dtype"), str) and set(ty) == {"dtype", "shape"},
                    f"node {pos} ({op}): 'type' must be {{dtype, shape}}")
            _expect(len(ty["shape"]) <= MAX_NDIM, f"node {pos} ({op}): {len(ty['shape'])} "
                                                  f"dimensions (at most {MAX_NDIM})")
            t = TensorType(ty["dtype"], tuple(ty["shape"]))
            _expect(t.size <= MAX_ELEMENTS, f"node {pos} ({op}): {t} is too large")
            if op in ("input", "param"):
                name = attrs.get("name")
                table = inputs if op == "input" else params
                _name(name, f"node {pos}: the {op} name")
                _expect(table.get(name) == pos and not ins,
                        f"node {pos}: {op} {name!r} does not match the {op}s table")
                a = {"name": name}
                if op == "param":
                    _expect(isinstance(attrs.get("trainable"), bool) and set(attrs) == {"name", "trainable"},
                            f"node {pos}: param {name!r} needs exactly name and trainable")
                    a["trainable"] = attrs["trainable"]
                    _expect(name in inits, f"param {name!r} has no initializer")
                    g.inits[name] = _init.from_spec(inits[name])
                else:
                    _expect(set(attrs) == {"name"}, f"node {pos}: input {name!r} has extra attributes")
                g.nodes.append(Node(pos, op, (), tuple(sorted(a.items())), t))
                table_g = g.inputs if op == "input" else g.params
                table_g[name] = pos
                continue
            node = g.make_node(op, ins, attrs)
            _expect(node.type == t, f"node {pos} ({op}): declared type {t} but the shape rule "
                                    f"gives {node.type}")
            g.nodes.append(node)
        _expect(set(g.inputs) == set(inputs) and set(g.params) == set(params),
                "inputs/params tables name nodes that do not exist")
        _expect(set(inits) == set(params), "initializers given for names that are not params")
        for k, i in outputs.items():
            _expect(0 <= i < len(g.nodes), f"output {k!r} points at missing node {i}")
            g.outputs[k] = i
        for k, i in updates.items():
            _expect(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(g.nodes),
                    f"update {k!r} points at missing node {i!r}")
            g.updates[k] = i
        g.validate()
    except GraphFormatError:
        raise
    except (ShapeError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            ArithmeticError, RecursionError) as e:     # shape rules fed attrs no builder passes
        raise GraphFormatError(f"invalid graph: {type(e).__name__}: {e}") from None
    return g


Graph.to_json = graph_to_json
Graph.from_json = staticmethod(graph_from_json)

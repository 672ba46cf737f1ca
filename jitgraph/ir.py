"""The IR: immutable nodes in a static SSA graph, the symbolic tensors users build it with, and
the graph queries and the one rebuild every pass uses (`rebuild`, `live_nodes`, `base`)."""
from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, replace

import numpy as np

from .registry import Arg, get_op
from .types import ShapeError, TensorType, dtype_name


def _freeze(v):
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, np.generic):
        return v.item()
    return v


@dataclass(frozen=True)
class Node:
    """One value of the graph: op applied to earlier nodes (by id) with frozen attributes."""
    id: int
    op: str
    inputs: tuple
    attrs: tuple          # sorted (key, value) pairs, values frozen (tuples, not lists)
    type: TensorType

    @property
    def attr(self) -> dict:
        return dict(self.attrs)

    @property
    def key(self):
        """Structural identity without the id: equal keys compute equal values (CSE)."""
        return (self.op, self.inputs, self.attrs, self.type)


LEAF_OPS = ("input", "param")


def _storage_init(fn, t, rng):
    """A storage-typed param's first value: its init quantized where jitgraph writes the type
    (quant.QUANTIZE), else zeros (a K-quant weight is loaded from its file)."""
    from .quant import QUANTIZE, quantize
    if t.dtype in QUANTIZE:
        return quantize(np.asarray(fn(t.shape, rng), np.float32), t.dtype).reshape(
            t.storage_shape)
    return np.zeros(t.storage_shape, t.np_dtype)


class Graph:
    """A static graph: named inputs and params, computed nodes in topological order, named outputs.

    Nodes are appended by the op functions (jg.relu, x @ w, ...); a pass builds its new graph
    with `rebuild` (or appends to a `copy()`). Node ids are positions in `nodes`.
    """

    def __init__(self, name: str = "graph"):
        if not isinstance(name, str) or not name:
            raise ShapeError(f"graph name must be a non-empty string, got {name!r}")
        self.name = name
        self.nodes: list[Node] = []
        self.inputs: dict[str, int] = {}
        self.params: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.updates: dict[str, int] = {}   # param name -> node whose value it takes after a run
        self.inits: dict[str, object] = {}

    # ---- building -----------------------------------------------------------------------
    def _check_new_name(self, name):
        if not isinstance(name, str) or not name:
            raise ShapeError(f"names must be non-empty strings, got {name!r}")
        if name in self.inputs or name in self.params:
            raise ShapeError(f"graph {self.name}: name {name!r} is already used")

    def input(self, name: str, shape, dtype="f32") -> "Tensor":
        self._check_new_name(name)
        t = TensorType(dtype_name(dtype), tuple(shape))
        if t.is_block:
            raise ShapeError(f"input {name}: {t.dtype} is a storage type, for frozen params "
                             f"(graph.param(..., trainable=False)); inputs are f32, f64, f16, "
                             f"bf16 or i32")
        node = self._append("input", (), {"name": name}, t)
        self.inputs[name] = node.id
        return Tensor(self, node.id)

    def param(self, name: str, shape, dtype="f32", init=None, trainable=True) -> "Tensor":
        from . import init as _init
        self._check_new_name(name)
        t = TensorType(dtype_name(dtype), tuple(shape))
        if not t.is_float and trainable:
            raise ShapeError(f"param {name}: trainable params must be f32, f64, f16 or bf16, "
                             f"got {t}")
        node = self._append("param", (), {"name": name, "trainable": bool(trainable)}, t)
        self.params[name] = node.id
        self.inits[name] = init if init is not None else _init.zeros()
        return Tensor(self, node.id)

    def output(self, **named) -> None:
        for name, t in named.items():
            if not isinstance(t, Tensor) or t.graph is not self:
                raise ShapeError(f"output {name!r}: expected a tensor of graph {self.name}, got {t!r}")
            self.outputs[name] = t.id

    def update(self, **named) -> None:
        """After each run, param `name` takes the value of the given tensor (optimizer updates,
        accumulators, step counters). The tensor must have the param's type."""
        for name, t in named.items():
            if name not in self.params:
                raise ShapeError(f"update: {name!r} is not a param of graph {self.name}")
            if not isinstance(t, Tensor) or t.graph is not self:
                raise ShapeError(f"update {name!r}: expected a tensor of graph {self.name}, got {t!r}")
            pt = self.nodes[self.params[name]].type
            if t.type != pt:
                raise ShapeError(f"update {name!r}: param is {pt}, new value {t.label} is {t.type}")
            self.updates[name] = t.id

    def add(self, op: str, inputs, attrs=None) -> "Tensor":
        """Append op(inputs) after checking arity, attributes, shapes and dtypes."""
        opdef = get_op(op)
        if opdef.kind == "leaf":
            raise ShapeError(f"{op}: use Graph.input / Graph.param to create {op} nodes")
        ids = []
        for t in inputs:
            if not isinstance(t, Tensor):
                raise ShapeError(f"{op}: operands must be tensors, got {t!r}")
            if t.graph is not self:
                raise ShapeError(f"{op}: operand {t.label} belongs to graph {t.graph.name}, "
                                 f"not {self.name}")
            ids.append(t.id)
        return Tensor(self, self.emit(op, ids, attrs or {}))

    def emit(self, op: str, ids, attrs) -> int:
        """Append op over existing node ids, type-checked as `add`; returns the new node's id."""
        node = self.make_node(op, ids, attrs)
        self.nodes.append(node)
        return node.id

    def make_node(self, op, ids, attrs, node_id=None) -> Node:
        """Type-check op over existing node ids; returns the Node without appending it."""
        opdef = get_op(op)
        opdef.check_arity(len(ids))
        attrs = opdef.check_attrs({k: _freeze(v) for k, v in attrs.items()})
        args = [Arg(self.label(i), self.nodes[i].type) for i in ids]
        nid = len(self.nodes) if node_id is None else node_id
        try:
            for pos, a in enumerate(args):
                if a.type.is_half and pos not in opdef.storage and opdef.half is None:
                    raise ShapeError(f"operand {pos + 1} ({a}) is {a.dtype}, and {op} takes no "
                                     f"half-precision operands; cast it to f32 first (jg.cast)")
                if a.type.is_block and pos not in opdef.storage:
                    where = (f"only as operand {', '.join(str(p + 1) for p in opdef.storage)}"
                             if opdef.storage else "not at all")
                    raise ShapeError(f"operand {pos + 1} ({a}) is of storage type {a.dtype}, "
                                     f"which {op} reads {where}; a frozen weight in its file's "
                                     f"type is read by matmul (second operand) and get_rows")
            t = opdef.infer(args, attrs)
        except ShapeError as e:
            msg = str(e)
            if not msg.startswith(op + ":"):
                msg = f"{op}: {msg}"
            raise ShapeError(f"{msg} (building %{nid} in graph {self.name})") from None
        return Node(nid, op, tuple(ids), tuple(sorted(attrs.items())), t)

    def _append(self, op, ids, attrs, t) -> Node:
        node = Node(len(self.nodes), op, tuple(ids), tuple(sorted(attrs.items())), t)
        self.nodes.append(node)
        return node

    # ---- reading ------------------------------------------------------------------------
    def tensor(self, node_id: int) -> "Tensor":
        return Tensor(self, node_id)

    def label(self, node_id: int) -> str:
        n = self.nodes[node_id]
        if n.op in LEAF_OPS:
            return n.attr["name"]
        return f"%{node_id}"

    def trainable_params(self) -> list[str]:
        return [k for k, i in self.params.items() if self.nodes[i].attr["trainable"]]

    def copy(self, name=None) -> "Graph":
        g = Graph(name or self.name)
        g.nodes = list(self.nodes)
        g.inputs, g.params = dict(self.inputs), dict(self.params)
        g.outputs, g.inits = dict(self.outputs), dict(self.inits)
        g.updates = dict(self.updates)
        return g

    def users(self) -> dict:
        """node id -> list of node ids that read it."""
        out = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.id)
        return out

    def init_params(self, seed: int = 0, skip=()) -> dict:
        """Fresh parameter arrays; each param's stream depends only on (seed, its name);
        `skip`: names left out (their values come from elsewhere)."""
        return {name: self.init_param(name, seed) for name in self.params if name not in skip}

    def init_param(self, name: str, seed: int = 0) -> np.ndarray:
        """Param `name`'s fresh array (its stream depends only on (seed, name)): one at a time,
        so a program fills its params without holding all of them twice."""
        t = self.nodes[self.params[name]].type
        rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
        if t.is_storage:
            return _storage_init(self.inits[name], t, rng)
        if t.dtype == "bf16":           # bf16 bits (uint16) of the init's values, rounded
            from .half import round_to
            return np.ascontiguousarray(round_to(self.inits[name](t.shape, rng), "bf16"))
        return np.asarray(self.inits[name](t.shape, rng), dtype=t.np_dtype, order="C")

    def validate(self) -> "Graph":
        from .validate import validate
        validate(self)
        return self

    def fingerprint(self) -> str:
        """Structural hash: equal for graphs that compute the same thing the same way."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def __str__(self) -> str:
        from .printer import format_graph
        return format_graph(self)

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self.inputs)} inputs, {len(self.params)} params, " \
               f"{len(self.nodes)} nodes, outputs {list(self.outputs)}>"

    # to_json() and the static from_json(text) are installed by jitgraph/serialize.py (the JSON
    # format sits above the IR: ir.py does not import it).


# ---- rebuilding: how a pass makes a new graph --------------------------------------------------
def rebuild(graph: Graph, rule=None, name=None) -> tuple[Graph, dict]:
    """A new graph made from `graph` node by node, in order; returns it and the map old id ->
    new id.

    `rule(g, node, new)` decides each node: `g` is the graph being built, `new` the map so far.
    It returns the id in `g` that holds the node's value from now on (a node it appended:
    `copy_node`, `g.emit`; or one already there, e.g. an equal node or an operand the node was a
    no-op of) or None to leave the node out. The default rule copies every node. Inits are
    copied; outputs and updates follow the map, so they must not point at a node left out.
    """
    rule = rule or copy_node
    g = Graph(name or graph.name)
    g.inits = dict(graph.inits)
    new = {}
    for n in graph.nodes:
        nid = rule(g, n, new)
        if nid is not None:
            new[n.id] = nid
    for src, dst in ((graph.outputs, g.outputs), (graph.updates, g.updates)):
        for k, i in src.items():
            if i not in new:
                raise ValueError(f"rebuild {graph.name}: {k!r} reads %{i}, which was left out")
            dst[k] = new[i]
    return g, new


def copy_node(g: Graph, n: Node, new: dict) -> int:
    """The default `rebuild` rule: append node `n` of another graph to `g` with its operands
    mapped by `new` (same op, attributes and type; leaves keep their names). Returns its id."""
    missing = [i for i in n.inputs if i not in new]
    if missing:
        raise ValueError(f"rebuild {g.name}: %{n.id} = {n.op} reads %{missing[0]}, which was "
                         f"left out")
    node = replace(n, id=len(g.nodes), inputs=tuple(new[i] for i in n.inputs))
    g.nodes.append(node)
    if n.op in LEAF_OPS:
        (g.inputs if n.op == "input" else g.params)[n.attr["name"]] = node.id
    return node.id


# ---- graph queries ------------------------------------------------------------------------------
def op_kind(op: str) -> str:
    """The op's kernel form (jitgraph/registry.py); "leaf" for inputs and params."""
    return "leaf" if op in LEAF_OPS else get_op(op).kind


def base(graph: Graph, nid: int) -> int:
    """The node whose buffer value `nid` lives in (follows views)."""
    while op_kind(graph.nodes[nid].op) == "view":
        nid = graph.nodes[nid].inputs[0]
    return nid


def view_offset(graph: Graph, nid: int) -> int:
    """Bytes from the start of base(graph, nid)'s buffer to value `nid` (views: a window
    starts `offset` elements in; reshape and marks start where their operand does)."""
    off = 0
    while op_kind(graph.nodes[nid].op) == "view":
        n = graph.nodes[nid]
        if n.op == "window":
            off += n.attr["offset"] * n.type.np_dtype.itemsize
        nid = n.inputs[0]
    return off


def feeding(graph: Graph, roots, members) -> set:
    """The nodes among `members` that `roots` read, directly or through other members (a
    kernel's members feeding its GEMMs: their prologue)."""
    mem, out, todo = set(members), set(), list(roots)
    while todo:
        for i in graph.nodes[todo.pop()].inputs:
            if i in mem and i not in out:
                out.add(i)
                todo.append(i)
    return out


def live_nodes(graph: Graph, roots=None) -> frozenset:
    """Nodes reachable backwards from `roots` (default: the outputs and the updates)."""
    todo = list(graph.outputs.values()) + list(graph.updates.values()) if roots is None else \
        list(roots)
    seen = set()
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo.extend(graph.nodes[i].inputs)
    return frozenset(seen)


def _graph_of(*xs):
    for x in xs:
        if isinstance(x, Tensor):
            return x.graph
    raise ShapeError("expected at least one tensor operand")


class Tensor:
    """A symbolic value: a node of a graph. Operators append nodes to that graph."""
    __slots__ = ("graph", "id")
    __array_priority__ = 1000   # make numpy scalars defer to our reflected operators

    def __init__(self, graph: Graph, node_id: int):
        self.graph, self.id = graph, node_id

    @property
    def node(self) -> Node:
        return self.graph.nodes[self.id]

    @property
    def type(self) -> TensorType:
        return self.node.type

    @property
    def shape(self) -> tuple:
        return self.node.type.shape

    @property
    def dtype(self) -> str:
        return self.node.type.dtype

    @property
    def ndim(self) -> int:
        return self.node.type.ndim

    @property
    def label(self) -> str:
        return self.graph.label(self.id)

    def __repr__(self):
        return f"<Tensor {self.label} : {self.type}>"

    def __bool__(self):
        raise TypeError("a symbolic Tensor has no truth value; use jg.where / jg.step instead")

    __hash__ = object.__hash__

    # Operators and numpy-style methods (x + y, x @ w, x.T, x.reshape, x.sum, ...) are
    # installed by jitgraph/ops/tensor_methods.py: the IR imports no op module.

"""The reference interpreter: runs any graph with numpy. It is the oracle for every backend."""
from __future__ import annotations

import numpy as np

from .half import as_value, round_to
from .quant import as_storage, dequantize
from .registry import get_op
from .types import ShapeError


def check_feed(graph, inputs: dict, params: dict):
    """Validate input/param names, shapes and dtypes; returns (inputs, params) as arrays."""
    def one(kind, table, given):
        missing = [k for k in table if k not in given]
        if missing:
            raise ShapeError(f"graph {graph.name}: missing {kind} {', '.join(missing)}")
        extra = [k for k in given if k not in table]
        if extra:
            raise ShapeError(f"graph {graph.name}: unknown {kind} {', '.join(extra)}; "
                             f"expected {', '.join(table) or 'none'}")
        out = {}
        for k, nid in table.items():
            t = graph.nodes[nid].type
            if t.is_half:
                out[k] = as_value(given[k], t, f"{kind[:-1]} {k}")
                continue
            if t.is_storage:
                out[k] = as_storage(given[k], t)
                continue
            a = np.asarray(given[k])
            if a.shape != t.shape:
                raise ShapeError(f"{kind[:-1]} {k}: expected shape {t}, got {list(a.shape)}")
            if a.dtype != t.np_dtype:
                if t.is_float and np.issubdtype(a.dtype, np.floating) or \
                        (not t.is_float and np.issubdtype(a.dtype, np.integer)):
                    a = a.astype(t.np_dtype)
                else:
                    raise ShapeError(f"{kind[:-1]} {k}: expected dtype {t.dtype}, got {a.dtype}")
            out[k] = a
        return out
    return one("inputs", graph.inputs, inputs), one("params", graph.params, params)


def run(graph, inputs: dict, params: dict | None = None, *, values=False) -> dict:
    """Execute `graph` on numpy arrays. Returns its named outputs (and, with values=True, the list
    of every node's value as a second result). If the graph has updates (a training graph), the
    `params` dict is updated in place with the new values, so calling run again takes a step."""
    given = params if params is not None else {}
    inputs, params = check_feed(graph, inputs, given)
    vals = [None] * len(graph.nodes)
    for n in graph.nodes:
        if n.op == "input":
            vals[n.id] = inputs[n.attr["name"]]
        elif n.op == "param":
            vals[n.id] = params[n.attr["name"]]
        else:
            args = [dequantize(vals[i], graph.nodes[i].type) if graph.nodes[i].type.is_storage
                    else vals[i] for i in n.inputs]
            r = np.asarray(get_op(n.op).ref(n.attr, *args))
            if r.shape != n.type.shape:
                raise AssertionError(f"{n.op} %{n.id}: reference returned shape {r.shape}, "
                                     f"shape rule says {n.type}")
            # a half result: computed in f32 (its half operands were read as f32), rounded
            vals[n.id] = round_to(r, n.type.dtype) if n.type.is_half else \
                r.astype(n.type.np_dtype, copy=False)
    out = {k: vals[i] for k, i in graph.outputs.items()}
    for name, i in graph.updates.items():
        given[name] = vals[i].copy()
    return (out, vals) if values else out

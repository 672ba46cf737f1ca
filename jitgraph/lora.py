"""LoRA as a graph transform: `lora(graph, targets, rank, alpha)` (jg.lora).

Every matmul whose operand is a target weight W computes

    W x + (alpha / rank) * B (A x)

with two new trainable params per W, `<W>.lora_a` A [rank, in] and `<W>.lora_b` B [out, rank]
(numpy order; `in` is the dimension W contracts, `out` the one it produces, whichever way the
matmul reads W): two thin GEMMs through a [.., rank] intermediate beside the base GEMM, never a
materialised W + B A. Every other param of the graph becomes frozen (trainable=False; adapters a
previous lora() call added keep their flag), so autodiff computes no weight gradient for the
base model (passes/autodiff.py) and the optimizer keeps no state for it.

Initialisation as PEFT's: A Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in));
B zero, so the adapted graph computes exactly what the base graph does until B moves.

W may be either operand, with any transpose flags: llama's projections `x @ W^T` (matmul
tb=True, W [out, in]), a plain `x @ W` (W [in, out]), or `W @ x^T` (generate.py's V
projection, W [out, in] on the left).
"""
from __future__ import annotations

import math

import numpy as np

from . import init as _init
from .init import LoraA
from .ir import Graph, LEAF_OPS, copy_node, rebuild
from .ops import matmul, scale
from .types import ShapeError

# llama shorthands (`--lora-targets q,k,v,o,...`) -> the GGUF weight name part they stand for
# (".weight": a qwen2 bias beside the weight is not matched; phi3's fused weights: the roles
# of jitgraph/models/arch.py)
SHORTHANDS = {"q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
              "o": "attn_output.weight", "gate": "ffn_gate.weight", "up": "ffn_up.weight",
              "down": "ffn_down.weight"}
SUFFIX_A, SUFFIX_B = ".lora_a", ".lora_b"




def targets_of(targets) -> list:
    """The target list: a comma-separated string or a sequence of names; llama shorthands
    (q k v o gate up down) become the tensor name parts they stand for."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",")]
    try:
        targets = list(targets)
    except TypeError:
        raise ShapeError(f"lora: targets must be a string or a sequence of names, got "
                         f"{targets!r}") from None
    if not targets or any(not isinstance(t, str) or not t for t in targets):
        raise ShapeError(f"lora: targets must be non-empty names (a substring of a param name, "
                         f"or one of {', '.join(SHORTHANDS)}), got {targets!r}")
    return list(dict.fromkeys(SHORTHANDS.get(t, t) for t in targets))


def lora(graph: Graph, targets=("attn_q", "attn_v"), rank=8, alpha=None, seed: int = 0) -> Graph:
    """A new graph where every matmul reading a target weight W computes W x + (alpha/rank) B (A x)
    (see the module docstring). targets: param name parts (a target equal to a param's name
    matches that param only, any other target every param whose name contains it; llama
    shorthands q, k, v, o, gate, up, down); rank: an int >= 1, or {param name: rank} for
    per-weight ranks (every matched weight must be listed); alpha: the scale's numerator
    (default: rank, a scale of 1; 0 turns the adapters off); seed: with the compile seed, A's
    initial values. Raises ShapeError naming what is wrong: a target that matches no matmul
    weight, a matched param read by another op than matmul, a rank < 1 or > min(in, out)."""
    if not isinstance(graph, Graph):
        raise ShapeError(f"lora: expected a jitgraph Graph, got {type(graph).__name__}")
    tlist = targets_of(targets)
    ranks = dict(rank) if isinstance(rank, dict) else None
    if ranks is None:
        _check_rank(rank, "rank")
    else:
        for k, r in ranks.items():
            _check_rank(r, f"rank of {k}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(
            alpha, (int, float, np.integer, np.floating)) or not math.isfinite(alpha)):
        raise ShapeError(f"lora: alpha must be a finite number (default: the rank), got {alpha!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ShapeError(f"lora: seed must be an integer >= 0, got {seed!r}")

    weights = _matmul_weights(graph)          # param name -> [(matmul node id, operand index)]
    chosen = {}
    for t in tlist:
        hits = [t] if t in graph.params else [k for k in graph.params if t in k]
        hits = [k for k in hits if not k.endswith((SUFFIX_A, SUFFIX_B))]
        usable = [k for k in hits if k in weights]
        if not usable:
            avail = sorted(weights)
            raise ShapeError(
                f"lora: target {t!r} matches no matmul weight of graph {graph.name}"
                + (f" (it matches params {hits[:4]}, which no matmul reads as a 2-D weight)"
                   if hits else "")
                + f"; weights: {', '.join(avail[:12]) or 'none'}"
                + (" ..." if len(avail) > 12 else ""))
        for k in usable:
            chosen[k] = None
    readers = graph.users()
    for k in chosen:
        if k in graph.updates:
            raise ShapeError(f"lora: param {k} is updated by graph {graph.name} (a training "
                             f"graph?); apply lora to the forward graph, then compile it")
        nid = graph.params[k]
        other = [graph.nodes[u] for u in readers[nid] if graph.nodes[u].op != "matmul"]
        if other:
            raise ShapeError(f"lora: param {k} is read by {other[0].op} (%{other[0].id}) as "
                             f"well as by matmul; LoRA adapts weights only matmuls read (e.g. not a tied "
                             f"token embedding)")
        for name in (k + SUFFIX_A, k + SUFFIX_B):
            if name in graph.params or name in graph.inputs:
                raise ShapeError(f"lora: graph {graph.name} already has {name!r} (lora applied "
                                 f"twice to {k}?)")
    if ranks is not None:
        missing = [k for k in chosen if k not in ranks]
        if missing:
            raise ShapeError(f"lora: rank is a dict but names no rank for {missing[:4]}")
        extra = [k for k in ranks if k not in chosen]
        if extra:
            raise ShapeError(f"lora: rank names {extra[:4]}, which no target matched")

    dims = {}                                 # param -> (in, out, rank)
    for k in chosen:
        uses = weights[k]
        io = {_in_out(graph, graph.nodes[m], op) for m, op in uses}
        if len(io) != 1:
            raise ShapeError(f"lora: param {k} is read as weights of different orientations "
                             f"{sorted(io)} (in, out) by its matmuls")
        (i, o), = io
        r = ranks[k] if ranks is not None else int(rank)
        if r > min(i, o):
            raise ShapeError(f"lora: rank {r} for {k} exceeds min(in={i}, out={o}); an adapter "
                             f"of that rank is no cheaper than the weight")
        dims[k] = (i, o, int(r))
    a_init = {k: LoraA(bound=1.0 / math.sqrt(i), seed=float(seed)) for k, (i, _, _) in dims.items()}

    adapters = {}                             # base param name -> (A id, B id, scale)

    def rule(g, n, new):
        if n.op == "param":
            name = n.attr["name"]
            t = n.type
            adapter = name.endswith((SUFFIX_A, SUFFIX_B))
            trainable = n.attr["trainable"] if adapter else False
            p = g.param(name, t.shape, t.dtype, init=graph.inits[name], trainable=trainable)
            if name in dims:
                i, o, r = dims[name]
                dt = "f32" if t.is_storage else t.dtype     # a base kept in its file's type
                a = g.param(name + SUFFIX_A, (r, i), dt, init=a_init[name])
                b = g.param(name + SUFFIX_B, (o, r), dt, init=_init.zeros())
                s = float(r if alpha is None else alpha) / r
                adapters[name] = (a.id, b.id, s)
            return p.id
        if n.op in LEAF_OPS:
            return copy_node(g, n, new)
        nid = copy_node(g, n, new)
        if n.op != "matmul":
            return nid
        out = g.tensor(nid)
        for idx, src in enumerate(n.inputs):
            w = graph.nodes[src]
            if w.op != "param" or w.attr["name"] not in adapters:
                continue
            a_id, b_id, s = adapters[w.attr["name"]]
            a, b = g.tensor(a_id), g.tensor(b_id)
            ta, tb = n.attr["ta"], n.attr["tb"]
            if idx == 1:                      # op(x) @ op(W): op(x) A^T [.., r], then @ B^T
                x = g.tensor(new[n.inputs[0]])
                ax = matmul(x, a, ta=ta, tb=True)
                ax = scale(ax, s) if s != 1.0 else ax
                delta = matmul(ax, b, tb=True)
            else:                             # op(W) @ op(x): A op(x) [.., r, N], then B @
                x = g.tensor(new[n.inputs[1]])
                ax = matmul(a, x, tb=tb)
                ax = scale(ax, s) if s != 1.0 else ax
                delta = matmul(b, ax)
            out = out + delta
        return out.id

    g, _ = rebuild(graph, rule)
    return g.validate()


def _check_rank(r, what):
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1:
        raise ShapeError(f"lora: {what} must be an integer >= 1, got {r!r}")


def _matmul_weights(graph) -> dict:
    """{param name: [(matmul node id, operand index)]} for float (or storage-typed) params read
    as a 2-D operand of a matmul (the adapter's shapes follow from the matmul's transpose flags)."""
    out = {}
    for n in graph.nodes:
        if n.op != "matmul":
            continue
        for idx, src in enumerate(n.inputs):
            w = graph.nodes[src]
            if w.op == "param" and w.type.ndim == 2 and (w.type.is_float or w.type.is_storage):
                out.setdefault(w.attr["name"], []).append((n.id, idx))
    return out


def _in_out(graph, n, idx) -> tuple:
    """(in, out) of weight operand `idx` of matmul node n: the dimension it contracts and the one
    it produces."""
    shape = graph.nodes[n.inputs[idx]].type.shape
    if idx == 1:                              # op(W) is [in, out]; tb: W is [out, in]
        return (shape[1], shape[0]) if n.attr["tb"] else (shape[0], shape[1])
    return (shape[0], shape[1]) if n.attr["ta"] else (shape[1], shape[0])   # op(W) [out, in]


def adapter_names(graph) -> list:
    """The adapter params (`<W>.lora_a`, `<W>.lora_b`) of a graph lora() made."""
    return [k for k in graph.params if k.endswith((SUFFIX_A, SUFFIX_B))]

"""The CPU backend's lowering table: op -> rule (runtime/cpu/rules.py), how this backend runs it.

codegen.py lowers every node and every fused kernel through `lowering(op)`; nothing else in the
backend looks an op up by name. Elementwise ops and row ops have no entry: their scalar
expression (OpDef.expr) or row formula (OpDef.rows, rendered by runtime/cpu/spelling.py) is all
the backend needs; a row op over another axis than the last runs the library kernel of its
name (runtime/cpu/library.py) if there is one. A new reduction is one Reduction entry (its loop
bodies in runtime/cpu/lower.py).
"""
from __future__ import annotations

from jitgraph.registry import get_op

from . import fused, lower, spelling
from .rules import ELEMENTWISE, Gemm, Library, Own, Reduction, Rows


def _slices(n):
    sl = n.attr["slices"]
    return [tuple(s for s, _, _ in sl), tuple(st for _, _, st in sl)]


def _rope(n):
    return [n.attr["theta"], n.attr["mode"] == "neox"]


def _rope_work(lib, shapes, n):
    return lib.workspace_size_rope(*shapes[:2])


def _conv(n):
    a = n.attr
    return [*a["stride"], *a["padding"], *a["dilation"]]


def _conv_work(x, w, y):
    """Scratch elements of a conv2d kernel; x, w, y: where the forward conv's input, kernel and
    output shapes are among the node's (operands..., result)."""
    return lambda lib, shapes, n: lib.workspace_size_conv2d(shapes[x], shapes[w], shapes[y],
                                                            *_conv(n))


def _pool(n):
    a = n.attr
    return [*a["kernel"], *a["stride"], *a["padding"]]


TABLE = {
    # reductions: generated loops (runtime/cpu/lower.py)
    "sum": Reduction(lower.sum_rows, lower.sum_memory),
    "mean": Reduction(lower.mean_rows, lower.mean_memory),
    "max": Reduction(lower.max_rows, lower.max_memory),
    "argmax": Reduction(lower.argmax_rows, axes=lambda a: (a["axis"],), fastmath=False),
    "logsumexp": Reduction(lower.logsumexp_rows, cost=2),
    "count_equal": Own(lower.count_equal),
    # contractions
    "matmul": Gemm(),
    "conv2d": Library("conv2d", _conv, _conv_work(0, 1, 2)),
    "conv2d_back_input": Library("conv2d_back_input", _conv, _conv_work(2, 0, 1)),
    "conv2d_back_weight": Library("conv2d_back_weight", _conv, _conv_work(0, 2, 1)),
    # data movement and the rest: hand-written kernels (runtime/cpu/library.py)
    "permute": Library("permute", lambda n: [n.attr["axes"]]),
    "slice": Library("slice", _slices),
    "slice_back": Library("slice_back", _slices),
    "pad": Library("pad", lambda n: [tuple(b for b, _ in n.attr["pads"]), n.attr["value"]]),
    "concat": Own(lower.concat, library="embed"),
    "get_rows": Own(lower.get_rows),
    "get_rows_back": Library("get_rows_back"),
    # a third operand (frequency factors) picks the *_freqs_work kernel
    "rope": Library(lambda n: "rope_freqs_work" if len(n.inputs) == 3 else "rope_work", _rope,
                    _rope_work),
    "rope_back": Library(lambda n: "rope_back_freqs_work" if len(n.inputs) == 3
                         else "rope_back_work", _rope, _rope_work),
    "causal_mask": Library("causal_mask", lambda n: [n.attr["n_past"], n.attr["value"]]),
    "set_rows": Library("set_rows", lambda n: [n.attr["axis"], n.attr["f16"]]),
    "kv_attention": Library("kv_attention", lambda n: [n.attr["scale"], n.attr["f16"]],
                            lambda lib, shapes, n: lib.workspace_size_kv_attention(*shapes[:2])),
    "attention": Library("attention", lambda n: [n.attr["scale"]],
                         lambda lib, shapes, n: lib.workspace_size_attention(*shapes[:2])),
    "attention_back": Library(
        "attention_back", lambda n: [n.attr["scale"]],
        lambda lib, shapes, n: lib.workspace_size_attention_back(*shapes[:2])),
    "attention_store": Library(
        "attention_store", lambda n: [n.attr["scale"]],
        lambda lib, shapes, n: lib.workspace_size_attention_store(*shapes[:2])),
    "attention_back_stored": Library(
        "attention_back_stored", lambda n: [n.attr["scale"]],
        lambda lib, shapes, n: lib.workspace_size_attention_back_stored(*shapes[:2])),
    "max_pool2d": Library("max_pool2d", _pool),
    "max_pool2d_back": Library("max_pool2d_back", _pool),
    "avg_pool2d": Library("avg_pool2d", _pool),
    "avg_pool2d_back": Library("avg_pool2d_back", _pool),
    "cross_entropy": Library("cross_entropy"),
    "sround_bf16": Own(lower.sround_bf16, library="sround_bf16"),
    "cross_entropy_back": Library("cross_entropy_back", paired=fused.cross_entropy),
}


def _row_params(n):
    """A row op's attributes, in its declared order, as its library kernel takes them (an axis
    normalised to non-negative)."""
    return [n.attr[k] % max(n.type.ndim, 1) if k == "axis" else n.attr[k]
            for k in get_op(n.op).attrs]


_ROWS = {}


def rows_rule(op) -> Rows:
    """The Rows rule of a row op, rendered from its formula (OpDef.rows) once."""
    if op not in _ROWS:
        f = get_op(op).rows
        passes, final = spelling.row_templates(f)
        _ROWS[op] = Rows(passes, final, Library(op, _row_params),
                         stored=spelling.row_templates(f.stored) if f.stored else None,
                         imports=lower.FMAX_IMPORTS if spelling.uses_max(f) else ())
    return _ROWS[op]


def lowering(op):
    """op's rule: its entry, ELEMENTWISE for an elementwise op, its formula's Rows for a row
    op, else None (no CPU lowering)."""
    rule = TABLE.get(op)
    if rule is None:
        kind = get_op(op).kind
        if kind == "elementwise":
            return ELEMENTWISE
        if kind == "rows":
            return rows_rule(op)
    return rule

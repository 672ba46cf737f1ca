"""The CPU backend's lowering table: op -> rule (runtime/cpu/rules.py), how this backend runs it.

codegen.py lowers every node and every fused kernel through `lowering(op)`; nothing else in the
backend looks an op up by name. Elementwise ops have no entry: their scalar expression
(OpDef.expr, jitgraph/ops) is all the backend needs. A new row op is its op file plus one Rows
entry here; a new reduction, one Reduction entry (its loop bodies in runtime/cpu/lower.py).

Row templates: (passes over the row: (setup, per element, after), the element's value). {0},
{1}: the operands at (r, j); accumulators are float64, factors used per element are cast to {T};
{D} is the row length, {eps} the op's attribute, {buf} the output row, {exp} e^x in {T}
(runtime/cpu/approx.py: vectorises, where math.exp, a libm call, keeps the row loop scalar).
"""
from __future__ import annotations

from jitgraph.registry import get_op

from . import fused, lower
from .rules import ELEMENTWISE, Gemm, Library, Own, Reduction, Rows


def _axis(n):
    return [n.attr["axis"] % max(n.type.ndim, 1)]


def _eps(n):
    return [n.attr["eps"]]


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


# ---- row templates -------------------------------------------------------------------------
_SOFTMAX = (
    (["m = {T}(-math.inf)"], ["m = fmaximum(m, {0})"],       # vectorises (runtime/cpu/minmax.py)
     ["if not math.isfinite(m):", "    m = {T}(0.0)", "mt = m"]),
    (["s = 0.0"], ["s += {exp}({0} - mt)"], ["inv = {T}(1.0 / s)", "lg = {T}(math.log(s))"]))
# softmax storing exp(x - m) in its output row (one exp per element)
_SOFTMAX_STORED = ((_SOFTMAX[0], (["s = 0.0"], ["e = {exp}({0} - mt)", "{buf}[r, j] = e",
                                             "s += e"], ["inv = {T}(1.0 / s)"])),
                   "{buf}[r, j] * inv")
_LN_MEAN = (["mu = 0.0"], ["mu += {0}"], ["mu = mu / {D}", "mut = {T}(mu)"])
_RMS = (["ss = 0.0"], ["ss += {0} * {0}"], ["rs = {T}(1.0 / math.sqrt(ss / {D} + {eps}))"])
_LN_VAR = (["var = 0.0"], ["xc = {0} - mut", "var += xc * xc"],
           ["rs = {T}(1.0 / math.sqrt(var / {D} + {eps}))"])
_RMS_BACK = (["ss = 0.0", "gx = 0.0"], ["ss += {0} * {0}", "gx += {1} * {0}"],
             ["q = 1.0 / math.sqrt(ss / {D} + {eps})", "rs = {T}(q)", "k = {T}(q * q * gx / {D})"])
_LN_BACK = (["var = 0.0", "sg = 0.0", "sgx = 0.0"],
            ["xc = {0} - mut", "var += xc * xc", "sg += {1}", "sgx += {1} * xc"],
            ["q = 1.0 / math.sqrt(var / {D} + {eps})", "rs = {T}(q)", "mg = {T}(sg / {D})",
             "k = {T}(sgx * q * q / {D})"])

TABLE = {
    # rows: fused.rows over the last axis, the library kernel otherwise
    "softmax": Rows(_SOFTMAX, "{exp}({0} - mt) * inv", Library("softmax", _axis),
                    stored=_SOFTMAX_STORED, imports=lower.FMAX_IMPORTS),
    "log_softmax": Rows(_SOFTMAX, "({0} - mt) - lg", Library("log_softmax", _axis),
                        imports=lower.FMAX_IMPORTS),
    "softmax_back": Rows(((["dot = 0.0"], ["dot += {1} * {0}"], ["dt = {T}(dot)"]),),
                         "{0} * ({1} - dt)", Library("softmax_back", _axis)),
    "rms_norm": Rows((_RMS,), "{0} * rs", Library("rms_norm", _eps)),
    "layer_norm": Rows((_LN_MEAN, _LN_VAR), "({0} - mut) * rs", Library("layer_norm", _eps)),
    "rms_norm_back": Rows((_RMS_BACK,), "rs * ({1} - {0} * k)", Library("rms_norm_back", _eps)),
    "layer_norm_back": Rows((_LN_MEAN, _LN_BACK), "rs * ({1} - mg - ({0} - mut) * k)",
                            Library("layer_norm_back", _eps)),
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
    "cross_entropy_back": Library("cross_entropy_back", paired=fused.cross_entropy),
}


def lowering(op):
    """op's rule: its entry, ELEMENTWISE for an elementwise op, else None (no CPU lowering)."""
    rule = TABLE.get(op)
    if rule is None and get_op(op).kind == "elementwise":
        return ELEMENTWISE
    return rule

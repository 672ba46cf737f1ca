"""The CUDA backend's lowering table: op -> rule (runtime/cuda/rules.py), how this backend runs
it alone and the fused kernels it anchors. Elementwise ops and row ops need no entry: their
scalar expression (OpDef.expr) or row formula (OpDef.rows) is all the backend needs. An op with
no rule is a compile-time NotImplementedError naming the op and the node, never a silent wrong
result.

GEMM: the matmul rule lowers to the tiled numba kernel of fused.gemm_launch (runs on the
simulator, FP32 accumulate), each GEMM launch marked with a GemmSpec: on a GPU with nvmath-python
and CuPy the driver runs those through cuBLASLt instead (runtime/cuda/gemm.py: a stateful
`nvmath.linalg.advanced.Matmul` planned once per launch binding; the epilogues stay numba
kernels for now).
"""
from __future__ import annotations

from jitgraph.registry import get_op

from . import attention, conv, fused, lower
from .rules import ELEMENTWISE, ROWS, CrossEntropy, Gemm, Own, Reduction

TABLE = {
    # reductions
    "sum": Reduction("sum"),
    "mean": Reduction("sum", mean=True),
    "max": Reduction("max"),
    "argmax": Reduction(None, serial=fused.argmax_tail, axes=lambda a: (a["axis"],)),
    "logsumexp": Reduction(None, serial=fused.logsumexp_tail),
    "count_equal": Own(lower.count_equal),
    "cross_entropy": CrossEntropy(),
    "cross_entropy_back": CrossEntropy(back=True),
    # contractions
    "matmul": Gemm(),
    "conv2d": Own(conv.conv2d),
    "conv2d_back_input": Own(conv.conv2d_back_input),
    "conv2d_back_weight": Own(conv.conv2d_back_weight),
    "max_pool2d": Own(conv.pool2d, {"mx": True}),
    "avg_pool2d": Own(conv.pool2d),
    "max_pool2d_back": Own(conv.max_pool2d_back),
    "avg_pool2d_back": Own(conv.avg_pool2d_back),
    # data movement and the llama ops
    "permute": Own(lower.permute),
    "causal_mask": Own(lower.causal_mask),
    "get_rows": Own(lower.get_rows),
    "get_rows_back": Own(lower.get_rows_back),
    "rope": Own(lower.rope),
    "rope_back": Own(lower.rope, {"back": True}),
    "concat": Own(lower.concat),
    "slice": Own(lower.slice_),
    "slice_back": Own(lower.slice_back),
    "pad": Own(lower.pad),
    "set_rows": Own(lower.set_rows),
    "kv_attention": Own(attention.kv_attention),
    "sround_bf16": Own(lower.sround_bf16),
    "attention": Own(attention.attention),
    "attention_back": Own(attention.attention_back),
}


def lowering(op):
    """op's rule: its entry, ELEMENTWISE for an elementwise op, ROWS for a row op, else None
    (no CUDA lowering)."""
    rule = TABLE.get(op)
    if rule is None:
        kind = get_op(op).kind
        if kind == "elementwise":
            return ELEMENTWISE
        if kind == "rows":
            return ROWS
    return rule

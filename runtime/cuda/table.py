"""The CUDA backend's lowering table: op -> how a node of it runs alone (runtime/cuda/codegen.py
lowers the fused kinds). Elementwise ops need no entry: their scalar expression (OpDef.expr) is
all the backend needs. An op with no entry is a compile-time NotImplementedError naming the op
and the node, never a silent wrong result.

GEMM: the matmul entry lowers to the tiled numba kernel of codegen.gemm_launch (runs on the
simulator, FP32 accumulate), each GEMM launch marked with a GemmSpec: on a GPU with nvmath-python
and CuPy the driver runs those through cuBLASLt instead (runtime/cuda/gemm.py: a stateful
`nvmath.linalg.advanced.Matmul` planned once per launch binding; the epilogues stay numba
kernels for now).
"""
from __future__ import annotations

from jitgraph.registry import get_op

from . import codegen


def _matmul(ctx, n, note):
    return codegen.matmul_node(ctx, n, note)


def _reduce(ctx, n, note):
    return codegen.reduction(ctx, n, note=note)


def _ce(ctx, n, note):
    return codegen.cross_entropy(ctx, n, None, note)


def _ce_back(ctx, n, note):
    return codegen.cross_entropy(ctx, None, n, note)


TABLE = {
    "matmul": _matmul,
    "sum": _reduce, "mean": _reduce, "max": _reduce, "argmax": _reduce, "logsumexp": _reduce,
    "count_equal": codegen.count_equal,
    "cross_entropy": _ce,
    "cross_entropy_back": _ce_back,
    "conv2d": codegen.conv2d, "conv2d_back_input": codegen.conv2d,
    "conv2d_back_weight": codegen.conv2d,
    "max_pool2d": codegen.pool2d, "max_pool2d_back": codegen.pool2d,
    "avg_pool2d": codegen.pool2d, "avg_pool2d_back": codegen.pool2d,
    "permute": codegen.permute,
    "causal_mask": codegen.causal_mask,
    "get_rows": codegen.get_rows,
    "get_rows_back": codegen.get_rows_back,
    "rope": codegen.rope,
    "rope_back": codegen.rope,
    "concat": codegen.concat,
    "slice": codegen.slice_,
    "slice_back": codegen.slice_back,
    "pad": codegen.pad,
    "set_rows": codegen.set_rows,
    "kv_attention": codegen.kv_attention,
    "attention": codegen.attention,
    "attention_back": codegen.attention_back,
    **{op: (lambda ctx, n, note: codegen.rows(ctx, n, note=note)) for op in codegen.ROWS},
}


def lower_node(ctx, n, note=""):
    """The launches running node n alone."""
    rule = TABLE.get(n.op)
    if rule is not None:
        return rule(ctx, n, note)
    if get_op(n.op).kind == "elementwise":
        return codegen.elementwise(ctx, [n.id], [n.id], note)
    raise ctx.unsupported(n)

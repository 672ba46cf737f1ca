"""The CUDA backend's lowering table: op -> how a node of it runs alone (runtime/cuda/codegen.py
lowers the fused kinds). Elementwise ops need no entry: their scalar expression (OpDef.expr) is
all the backend needs. An op with no entry is a compile-time NotImplementedError naming the op
and the node, never a silent wrong result.

GEMM: the matmul entry is the seam for a GEMM library. Here it is the tiled numba kernel of
codegen.gemm_launch (runs on the simulator, FP32 accumulate). On a real GPU it is to be
cuBLASLt through nvmath-python (`nvmath.linalg.advanced.Matmul`, planned once per GEMM at build
time with its epilogue: BIAS / RELU / GELU and the backward forms DRELU_BGRAD, BGRADA/B where
the fusion pass's epilogue is one of them), called by the driver on the program's stream in
place of the launch: a Launch whose `kernel` names a planned library call.
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

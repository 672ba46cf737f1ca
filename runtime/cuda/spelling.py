"""The CUDA backend's spelling of elementwise ops: each op's portable expression (OpDef.expr;
numba-cuda lowers math.* to libdevice), or this backend's own where it has one (EXPR)."""
from __future__ import annotations

from jitgraph.registry import get_op

from .. import kernelgen

# round_f16 (llama.cpp's F16 KV cache): one cvt.rn.f16.f32 / .f64 and back on the device (ties
# to even, overflow to inf), numpy's float16 cast on the simulator
EXPR = {"round_f16": "np.float16({0})"}


def half(expr, dt) -> str:
    """`expr` rounded to the nearest float16, in dtype dt (as round_f16)."""
    return f"{kernelgen.NP_DTYPE[dt]}(np.float16({expr}))"


def expr(op) -> str | None:
    """Op's scalar expression template as this backend spells it (None: it has none)."""
    return EXPR.get(op) or get_op(op).expr

"""The CUDA backend's spelling of elementwise ops: each op's portable expression (OpDef.expr;
numba-cuda lowers math.* to libdevice), or this backend's own where it has one (EXPR), and of
the conversions to and from the half types (the one computation over half values a kernel
does: passes/half.py rewrites every other op over f32 between casts)."""
from __future__ import annotations

from jitgraph.registry import get_op

from .. import kernelgen

# round_f16 (llama.cpp's F16 KV cache): one cvt.rn.f16.f32 / .f64 and back on the device (ties
# to even, overflow to inf), numpy's float16 cast on the simulator
EXPR = {"round_f16": "np.float16({0})"}

# the type a kernel holds a value of each dtype in (the scalar a load gives, what a store
# takes): kernelgen's, except f16, numba-cuda's float16 (a half value's array is float16 here;
# bf16 stays its bits, uint16: runtime/cuda/halfconv.py)
DTYPE = {**kernelgen.NP_DTYPE, "f16": "np.float16"}

# a half value read as float32, and a value rounded to a half type (through float32: a float64
# is rounded to f32 first, as jitgraph/half.py's reference)
FROM_HALF = {"f16": "np.float32({0})", "bf16": "halfconv.bf16_f32({0})"}
TO_HALF = {"f16": "np.float16(np.float32({0}))", "bf16": "halfconv.f32_bf16(np.float32({0}))"}


def half(expr, dt) -> str:
    """`expr` rounded to the nearest float16, in dtype dt (as round_f16)."""
    return f"{kernelgen.NP_DTYPE[dt]}(np.float16({expr}))"


def from_half(expr, dt) -> str:
    """`expr`, a value of dtype dt as a kernel holds it, as float32 when dt is a half type (else
    unchanged)."""
    return FROM_HALF[dt].format(expr) if dt in FROM_HALF else expr


def is_conversion(op) -> bool:
    """Whether op is an elementwise conversion between float types (cast: OpDef.half
    "convert")."""
    d = get_op(op)
    return d.half == "convert" and d.kind == "elementwise"


def expr(op, dtype=None, sources=()) -> str | None:
    """Op's scalar expression template in `dtype` over operands of dtypes `sources` as this
    backend spells it (None: it has none): EXPR's or the op's portable OpDef.expr; with a half
    type among them, the op must be a conversion (OpDef.half "convert"), spelled through
    float32."""
    d = get_op(op)
    if dtype in TO_HALF or any(s in FROM_HALF for s in sources):
        if not is_conversion(op):
            raise NotImplementedError(
                f"target cuda: {op} over {', '.join(sources) or '()'} -> {dtype}: the CUDA "
                f"backend computes half types only by conversion (cast; passes/half.py "
                f"rewrites the others over f32)")
        src = FROM_HALF.get(sources[0], "{0}")
        return TO_HALF[dtype].format(src) if dtype in TO_HALF else src
    return EXPR.get(op) or d.expr

"""fmaximum(a, b) for generated kernels: LLVM's `llvm.maximum` (IEEE 754-2019 maximum: NaN if
either operand is NaN, -0 < +0).

A row maximum written `m = max(m, x)` stays scalar: LLVM vectorises a max reduction only under
no-NaN fastmath, which the row kernels leave off. `llvm.maximum` has NaN semantics of its own,
so the loop vectorises without it (softmax's first pass; bench/README.md: "Figures behind the
code", fmaximum).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def fmaximum(typingctx, a, b):
    if not (isinstance(a, types.Float) and isinstance(b, types.Float)):
        return None
    t = a if a.bitwidth >= b.bitwidth else b

    def codegen(context, builder, sig, args):
        ty = context.get_value_type(t)
        x, y = (context.cast(builder, v, s, t) for v, s in zip(args, sig.args))
        fn = builder.module.declare_intrinsic(f"llvm.maximum.f{t.bitwidth}",
                                              fnty=ir.FunctionType(ty, [ty, ty]))
        return builder.call(fn, [x, y])
    return t(a, b), codegen

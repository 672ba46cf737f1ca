"""Raw addresses in generated code: kernels are C-callable entry points taking buffer addresses."""
from __future__ import annotations

from numba import types
from numba.extending import intrinsic


@intrinsic
def ptr(typingctx, addr):
    """The integer address `addr` as a void pointer (for numba.carray)."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))
    return types.voidptr(addr), codegen

"""Raw addresses in generated code: kernels are C-callable entry points taking buffer addresses."""
from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic


@intrinsic
def ptr(typingctx, addr):
    """The integer address `addr` as a void pointer (for numba.carray)."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))
    return types.voidptr(addr), codegen


@njit(nogil=True, cache=True)
def copy_bytes(dst, src, nbytes):
    """Copy `nbytes` bytes from address `src` to address `dst` (a driver's update copy from a
    caller's array)."""
    carray(ptr(dst), (nbytes,), np.uint8)[:] = carray(ptr(src), (nbytes,), np.uint8)


@njit(nogil=True, cache=True)
def address(a):
    """Where array `a`'s first element lies, a fraction of the cost of `a.ctypes.data` or
    `a.__array_interface__` from Python (the io table's entries, every call)."""
    return a.ctypes.data

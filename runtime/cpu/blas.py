"""BLAS GEMM callable from @njit code: scipy's cython_blas sgemm/dgemm through ctypes pointers.

Row-major trick (DESIGN.md "Numba facts"): for C[M,N] = op(A) @ op(B) on row-major arrays, BLAS
(column-major) computes C^T = op(B)^T op(A)^T, so B is passed first with m=N, n=M, lda = B's row
stride, ldb = A's row stride, ldc = N. Transposes are BLAS flags; nothing is ever copied. beta=1
accumulates into C. Scalar arguments go by reference through stack slots (`_ref`), so a call
allocates nothing.
"""
from __future__ import annotations

from llvmlite import binding as llvm
from numba import njit, types
from numba.core import cgutils
from numba.extending import get_cython_function_address, intrinsic


def _bind(name, real):
    """Declare scipy's `name` as an external symbol: calls to it are cacheable (the address is
    registered with LLVM in every process instead of being baked into the machine code)."""
    symbol = f"jitgraph_{name}"
    llvm.add_symbol(symbol, get_cython_function_address("scipy.linalg.cython_blas", name))
    i8p, i32p, rp = types.CPointer(types.int8), types.CPointer(types.int32), types.CPointer(real)
    return types.ExternalFunction(symbol, types.void(i8p, i8p, i32p, i32p, i32p, rp, rp, i32p,
                                                     rp, i32p, rp, rp, i32p))


_sgemm = _bind("sgemm", types.float32)
_dgemm = _bind("dgemm", types.float64)


@intrinsic
def _ref(typingctx, val):
    """Pointer to a stack copy of `val` (Fortran passes every scalar by reference)."""
    def codegen(context, builder, sig, args):
        return cgutils.alloca_once_value(builder, args[0])
    return types.CPointer(val)(val), codegen


_N, _T = 78, 84   # ord("N"), ord("T")


@njit(cache=True, nogil=True)
def _flags(ta, tb):
    return (_T if tb else _N), (_T if ta else _N)


@njit(cache=True, nogil=True)
def gemm_f32(ta, tb, alpha, a, b, beta, c):
    """c[M,N] = alpha * op(a) @ op(b) + beta * c for C-contiguous 2-D float32 arrays."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    if m == 0 or n == 0:
        return
    fb, fa = _flags(ta, tb)
    _sgemm(_ref(types.int8(fb)), _ref(types.int8(fa)), _ref(types.int32(n)), _ref(types.int32(m)),
           _ref(types.int32(k)), _ref(types.float32(alpha)), b.ctypes, _ref(types.int32(max(b.shape[1], 1))),
           a.ctypes, _ref(types.int32(max(a.shape[1], 1))), _ref(types.float32(beta)), c.ctypes,
           _ref(types.int32(max(n, 1))))


@njit(cache=True, nogil=True)
def gemm_f64(ta, tb, alpha, a, b, beta, c):
    """c[M,N] = alpha * op(a) @ op(b) + beta * c for C-contiguous 2-D float64 arrays."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    if m == 0 or n == 0:
        return
    fb, fa = _flags(ta, tb)
    _dgemm(_ref(types.int8(fb)), _ref(types.int8(fa)), _ref(types.int32(n)), _ref(types.int32(m)),
           _ref(types.int32(k)), _ref(types.float64(alpha)), b.ctypes, _ref(types.int32(max(b.shape[1], 1))),
           a.ctypes, _ref(types.int32(max(a.shape[1], 1))), _ref(types.float64(beta)), c.ctypes,
           _ref(types.int32(max(n, 1))))

"""Vectorisable float32 exp and tanh for generated kernels (numba has no SVML here: a scalar
`math.exp` call in a loop stops LLVM from vectorising it).

Branch-free (selects only), float32 throughout, no libm call; f64 kernels keep libm.
  fexp(x)   Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, Cephes' degree-6 polynomial for
            e^r, 2^n added to the exponent bits (integer arithmetic: no float reassociation can
            overflow it). Max relative error against float64 exp 1 ulp over the normal range
            (tests/test_runtime_ops.py); results below FLT_MIN (x < -87.34) are flushed to 0
            (absolute error < 1.2e-38); exp(-inf) = 0, exp(x > 88.72) = inf, NaN propagates.
  ftanh(x)  Cephes tanhf: odd polynomial for |x| < 0.625, 1 - 2 / (e^{2|x|} + 1) above (no
            cancellation there: the result is >= 0.55); max relative error 2 ulp.
Under fastmath reassociation (row kernels) LLVM may fold the Cody-Waite split into one
product with float32(ln2): n <= 127 then adds at most 127 * 1.9e-9 to r (< 2 ulp).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

F = np.float32
INF = np.float32(np.inf)


@intrinsic
def _bits(typingctx, x):
    """The int32 bit pattern of float32 `x`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.int32))
    return types.int32(types.float32), codegen


@intrinsic
def _from_bits(typingctx, i):
    """The float32 whose bit pattern is int32 `i`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.int32), codegen


@njit(inline="always", error_model="numpy")
def fexp(x):
    x = F(x)
    xc = F(-88.0) if x < F(-88.0) else x
    xc = F(88.8) if xc > F(88.8) else xc
    # n = round(x / ln2), by truncation of a positive number (x / ln2 >= -127)
    n = np.int32(xc * F(1.44269504088896341) + F(127.5)) - np.int32(127)
    nf = F(n)
    r = (xc - nf * F(0.693359375)) + nf * F(2.12194440e-4)
    p = F(1.9875691500e-4)
    p = p * r + F(1.3981999507e-3)
    p = p * r + F(8.3334519073e-3)
    p = p * r + F(4.1665795894e-2)
    p = p * r + F(1.6666665459e-1)
    p = p * r + F(5.0000001201e-1)
    y = p * (r * r) + r + F(1.0)
    y = _from_bits(_bits(y) + (n << np.int32(23)))  # y * 2^n, exact while the result is normal
    y = F(0.0) if x < F(-87.33654) else y          # below FLT_MIN: flushed to 0
    y = INF if x > F(88.7228) else y
    return y if x == x else x                      # NaN


@njit(inline="always", error_model="numpy")
def ftanh(x):
    x = F(x)
    a = -x if x < F(0.0) else x
    big = F(1.0) - F(2.0) / (fexp(F(2.0) * a) + F(1.0))
    big = -big if x < F(0.0) else big
    z = x * x
    p = F(-5.70498872745e-3)
    p = p * z + F(2.06390887954e-2)
    p = p * z - F(5.37397155531e-2)
    p = p * z + F(1.33314422036e-1)
    p = p * z - F(3.33332819422e-1)
    small = p * z * x + x
    return big if a >= F(0.625) else small

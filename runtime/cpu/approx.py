"""Vectorisable transcendental functions for generated kernels, float32 (f*) and float64 (d*).

numba has no SVML here and LLVM is given no vector math library, so a scalar `math.exp` /
`math.log` / `math.tanh` call in a loop (float32 or float64) is a libm call per element and stops
LLVM from vectorising the loop (checked: numba 0.68 / LLVM 20, znver4). These functions are
branch-free (selects only), call no libm function, and inline into the caller's loop.

  name      f32 / f64 / generic      definition                    max error (tests/test_approx.py)
  exp       fexp  dexp  vexp         e^x                           1 ulp   / 1 ulp
  log       flog  dlog  vlog         ln x                          1 ulp   / 1 ulp
  tanh      ftanh dtanh vtanh        tanh x                        2 ulp   / 2 ulp
  sigmoid   fsigmoid ...             1 / (1 + e^-x)                2 ulp   / 2 ulp
  softplus  fsoftplus ...            ln(1 + e^x)                   2 ulp   / 2 ulp
  silu      fsilu ...                x / (1 + e^-x)                2 ulp   / 2 ulp
  gelu      fgelu ...                x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
                                     (= 0.5 x (1 + tanh u), jitgraph/ops/elementwise.py)
  silu_back fsilu_back(x, g) ...     g s (1 + x (1 - s)), s = sigmoid(x)
  gelu_back fgelu_back(x, g) ...     g s (1 + 2 x (1 - s) c (1 + 3 k x^2)), s = sigmoid(2u)
  pow       fpow(x, p)               x^p, as C's powf                 0.5 ulp (f32 only)
The ulp figures are measured against float64 (f32) / np.longdouble (f64) references over the
whole float range (every binade, both signs, subnormals, the overflow / underflow thresholds,
±0, ±inf, NaN); see tests/test_approx.py for the exact bounds asserted per function.
The float32 gelu / silu_back / gelu_back evaluate in float64 inside (one rounding at the end):
in float32 the rounding of gelu's exp argument alone costs |u| ulps, and the backward helpers
cancel near their roots. The float64 gelu / silu_back / gelu_back have no such extra precision:
their error is 2 ulp plus the conditioning of the formula (|u| ulps in the gelu tail, a
cancellation near the roots of the backward brackets); see the test for the measured bounds.

Generated kernels call the f* / d* function of their dtype (runtime/cpu/rules.py EXPR): numba
inlines a generic v* name with an SSA warning (NumbaIRAssumptionWarning, a pedantic check) when
one function inlines the same v* name twice; the f* / d* names inline without it.

Underflow: results below the smallest normal are gradual (correctly scaled subnormals, one
rounding), not flushed to 0: exp scales by 2^n (_ldexp) with llvm.ldexp where numba compiles
for AVX-512 (one vscalefps / vscalefpd a vector, faster; bench/README.md: "Figures behind the
code", approx), elsewhere in two exact power-of-two steps; both give the same bits
(tests/test_approx.py compiles both).
This keeps every function within its ulp bound measured in the subnormal spacing too (flushing
exp(-88) to 0 would be 2^23 ulps off under that rule, although only 1.2e-38 absolute).
Overflow: exp(x > 88.72) = inf (f32), exp(x > 709.78) = inf (f64); exp(-inf) = 0; NaN -> NaN.

Fast-math safety: the generated row kernels compile with fastmath {reassoc, nsz, contract}, and
numba's fastmath pass tags every float binop that has no flags. The operations whose order
matters (Cody-Waite reduction, polynomial, the 2^n scaling, compensated sums) are emitted here
as llvm.fmuladd calls and as binops already tagged `contract` alone, so reassociation cannot
fold them (e.g. x - n*ln2_hi - n*ln2_lo into x - n*ln2, or (y*s1)*s2 into y*(s1*s2), which
overflows). fmuladd is one FMA instruction on FMA hardware and a multiply-add pair without it;
every bound here holds for both.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

F = np.float32
INF = np.float32(np.inf)
NAN = np.float32(np.nan)
DINF = math.inf
DNAN = math.nan


# ---- LLVM-level helpers ------------------------------------------------------------------
def _float_sig(*args):
    """The float type shared by all args, or None (intrinsic typing)."""
    t = args[0]
    if isinstance(t, types.Float) and all(a == t for a in args):
        return t
    return None


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


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c as llvm.fmuladd (one FMA where the target has it), immune to fastmath."""
    t = _float_sig(a, b, c)
    if t is None:
        return None

    def codegen(context, builder, sig, args):
        ty = context.get_value_type(t)
        fn = builder.module.declare_intrinsic("llvm.fmuladd", [ty], ir.FunctionType(ty, [ty] * 3))
        return builder.call(fn, args)
    return t(t, t, t), codegen


def _binary_intrinsic(emit, doc=None):
    """An intrinsic of two floats of one type, its LLVM value emit(builder, a, b)."""
    @intrinsic
    def _op(typingctx, a, b):
        t = _float_sig(a, b)
        if t is None:
            return None

        def codegen(context, builder, sig, args):
            return emit(builder, *args)
        return t(t, t), codegen
    _op.__doc__ = doc
    return _op


def _strict_binop(op):
    # tagged `contract` so numba's fastmath pass leaves it alone (it only tags binops without
    # flags): no reassociation, no nsz; contraction needs a tagged partner
    return _binary_intrinsic(lambda builder, a, b: getattr(builder, op)(a, b, flags=("contract",)))


_add = _strict_binop("fadd")
_sub = _strict_binop("fsub")
_mul = _strict_binop("fmul")


@intrinsic
def _rint(typingctx, x):
    """x rounded to the nearest integer (ties to even), as a float (llvm.rint: one instruction)."""
    t = _float_sig(x)
    if t is None:
        return None

    def codegen(context, builder, sig, args):
        ty = context.get_value_type(t)
        fn = builder.module.declare_intrinsic("llvm.rint", [ty], ir.FunctionType(ty, [ty]))
        return builder.call(fn, args)
    return t(t), codegen


def native_ldexp() -> bool:
    """Whether numba compiles for a CPU with AVX-512F, where LLVM (20 and later) turns
    llvm.ldexp in a vectorised loop into one vscalefps / vscalefpd. Without it llvm.ldexp is a
    libm call per element (no vectorising), so _ldexp scales in integer steps instead. Numba's
    cache keys compiled code by CPU name and features, so the choice travels with the code."""
    from numba.core import config
    if (config.CPU_NAME or "host") != "host":
        return "avx512f" in (config.CPU_FEATURES or "") and "-avx512f" not in config.CPU_FEATURES
    import llvmlite.binding as llvm
    try:
        return bool(llvm.get_host_cpu_features().get("avx512f"))
    except RuntimeError:                   # the host's features cannot be read
        return False


_NATIVE_LDEXP = native_ldexp()


@intrinsic
def _ldexp(typingctx, y, nf):
    """y * 2^n for the integer n held in float nf, one rounding: gradual underflow, overflow to
    inf. With AVX-512, llvm.ldexp (vscalef: one instruction, bit for bit the same results);
    elsewhere two exact power-of-two steps and
    one rounding, n in [-252, 254] (f32) / [-2044, 2046] (f64)."""
    t = _float_sig(y, nf)
    if t is None:
        return None
    f32 = t == types.float32

    def codegen(context, builder, sig, args):
        fy, fn = args
        i32 = ir.IntType(32)
        n = builder.fptosi(fn, i32)
        if _NATIVE_LDEXP:
            fnty = ir.FunctionType(fy.type, [fy.type, i32])
            return builder.call(builder.module.declare_intrinsic(
                "llvm.ldexp", [fy.type, i32], fnty), [fy, n])
        it = i32 if f32 else ir.IntType(64)
        bias, shift = (127, 23) if f32 else (1023, 52)
        if not f32:
            n = builder.sext(n, it)
        n1 = builder.ashr(n, it(1))
        n2 = builder.sub(n, n1)
        s1 = builder.bitcast(builder.shl(builder.add(n1, it(bias)), it(shift)), fy.type)
        s2 = builder.bitcast(builder.shl(builder.add(n2, it(bias)), it(shift)), fy.type)
        r = builder.fmul(fy, s1, flags=("contract",))
        return builder.fmul(r, s2, flags=("contract",))
    return t(t, t), codegen


def _select_cmp(builder, op, x, c):
    """x if x <op> c else c, as one fcmp and one select (NaN x: c). Written as Python's
    `x if x >= c else c`, numba's branches reach LLVM in a form its x86 lowering no longer
    maps to vmaxps / vminps: exp's two clamps became three compares, two ands and two
    blends a vector instead of one max and one min."""
    return builder.select(builder.fcmp_ordered(op, x, c), x, c)


_atleast = _binary_intrinsic(lambda builder, x, lo: _select_cmp(builder, ">", x, lo),
                             "max(x, lo), lo for a NaN x (one vmaxps).")
_atmost = _binary_intrinsic(lambda builder, x, hi: _select_cmp(builder, "<", x, hi),
                            "min(x, hi), hi for a NaN x (one vminps).")


@njit(inline="always", error_model="numpy")
def _clamp(x, lo, hi):
    """x clamped to [lo, hi], lo for a NaN x (one vmaxps and one vminps)."""
    return _atmost(_atleast(x, lo), hi)


@intrinsic
def _copysign(typingctx, a, b):
    """|a| with the sign of b (llvm.copysign)."""
    t = _float_sig(a, b)
    if t is None:
        return None

    def codegen(context, builder, sig, args):
        ty = context.get_value_type(t)
        fn = builder.module.declare_intrinsic("llvm.copysign", [ty], ir.FunctionType(ty, [ty, ty]))
        return builder.call(fn, args)
    return t(t, t), codegen


@intrinsic
def _pow2(typingctx, nf):
    """2^n for the integer n <= 0 held in float nf, as one exact float; 0 below the smallest
    normal (a flush: only for values that feed 1 + e or a correction term)."""
    t = _float_sig(nf)
    if t is None:
        return None
    f32 = t == types.float32

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        it = i32 if f32 else ir.IntType(64)
        bias, shift = (127, 23) if f32 else (1023, 52)
        n = builder.fptosi(args[0], i32)
        ok = builder.icmp_signed(">", n, i32(-bias))
        if not f32:
            n = builder.sext(n, it)
        b = builder.shl(builder.add(n, it(bias)), it(shift))
        return builder.select(ok, builder.bitcast(b, args[0].type), args[0].type(0.0))
    return t(t), codegen


@intrinsic
def _frexp(typingctx, x):
    """(m, k) with x = m * 2^k, m in [sqrt(1/2), sqrt(2)), k a float, for positive normal
    finite x (musl's offset: the exponent field of x + (1 - sqrt(1/2)) bits)."""
    t = _float_sig(x)
    if t is None:
        return None
    f32 = t == types.float32

    def codegen(context, builder, sig, args):
        it = ir.IntType(32 if f32 else 64)
        mbits, one, half, shift, bias = (
            (0x7FFFFF, 0x3F800000, 0x3F3504F3, 23, 127) if f32 else
            (0xFFFFFFFFFFFFF, 0x3FF0000000000000, 0x3FE6A09E667F3BCD, 52, 1023))
        b = builder.add(builder.bitcast(args[0], it), it(one - half))
        k = builder.sub(builder.lshr(b, it(shift)), it(bias))
        m = builder.bitcast(builder.add(builder.and_(b, it(mbits)), it(half)), args[0].type)
        kf = builder.sitofp(k, args[0].type)
        return context.make_tuple(builder, sig.return_type, [m, kf])
    return types.UniTuple(t, 2)(t), codegen


# ---- float32 -----------------------------------------------------------------------------
_LOG2E = 1.4426950408889634


@njit(inline="always", error_model="numpy")
def _fexp_parts(x):
    """e^x = p * 2^nf for float32 x clamped to [-110, 89] (NaN -> -110): p in [0.70, 1.42]
    with a max relative error of 1.4e-8 (0.12 ulp) before its last rounding, nf an integer.
    Below -110 even |x| e^x (silu) is under half the smallest subnormal."""
    return _fexp_core(_clamp(x, F(-110.0), F(89.0)))


@njit(inline="always", error_model="numpy")
def _fexp_core(xc):
    """_fexp_parts for xc already in [-110, 89]."""
    nf = _rint(xc * F(_LOG2E))
    r = _fma(nf, F(-0.693359375), xc)            # exact: nf * 0.693359375 has <= 17 bits
    r = _fma(nf, F(2.12194440e-4), r)
    # e^r = 1 + r + r^2 q(r), q Chebyshev-fitted on |r| <= 1.02 ln2/2 (abs error 7.2e-8)
    q = _fma(F(0.0013927684616575004), r, F(0.00836438069329107))
    q = _fma(q, r, F(0.04166654542109553))
    q = _fma(q, r, F(0.16666569628115477))
    q = _fma(q, r, F(0.5))
    t = _fma(q, _mul(r, r), r)                    # e^r - 1
    return _add(t, F(1.0)), nf, t


@njit(inline="always", error_model="numpy")
def fexp(x):
    x = F(x)
    p, nf, t = _fexp_parts(x)
    y = _ldexp(p, nf)
    return y if x == x else x                      # NaN


@njit(inline="always", error_model="numpy")
def _fsig_parts(x):
    """(num, den, nf, e): sigmoid(x) = ldexp(num / den, nf), e = e^-|x|, all float32."""
    a = -abs(x)
    p, nf, t = _fexp_parts(a)
    e = _mul(p, _pow2(nf))                         # feeds 1 + e only
    neg = x < F(0.0)
    num = p if neg else F(1.0)
    k = nf if neg else F(0.0)
    return num, _add(F(1.0), e), k, e


@njit(inline="always", error_model="numpy")
def fsigmoid(x):
    x = F(x)
    num, den, k, e = _fsig_parts(x)
    y = _ldexp(num / den, k)
    return y if x == x else x


@njit(inline="always", error_model="numpy")
def fsilu(x):
    """x * sigmoid(x); silu(-inf) = NaN like x * sigmoid(x) (the op's reference)."""
    x = F(x)
    num, den, k, e = _fsig_parts(x)
    xc = _atleast(x, F(-110.0))
    y = _ldexp(_mul(xc, num) / den, k)
    y = y if x == x else x
    return y if x != -INF else NAN


@njit(inline="always", error_model="numpy")
def _flog1p_small(e):
    """ln(1 + e) for float32 e in [0, 1]: 2 atanh(s), s = e / (2 + e) in [0, 1/3]."""
    t = _add(e, e) / _add(F(2.0), e)              # 2s, relative error 0.5 ulp
    z = _mul(F(0.25), _mul(t, t))                  # s^2 <= 1/9
    # atanh(s)/s = 1 + z R(z), R Chebyshev-fitted on [0, 1/9] (abs error 3.6e-9)
    R = _fma(F(0.11612164612011674), z, F(0.10853287900440187))
    R = _fma(R, z, F(0.14296178997151418))
    R = _fma(R, z, F(0.1999985316596486))
    R = _fma(R, z, F(0.3333333366026371))
    return _fma(t, _mul(z, R), t)


@njit(inline="always", error_model="numpy")
def fsoftplus(x):
    """ln(1 + e^x) = max(x, 0) + ln(1 + e^-|x|)."""
    x = F(x)
    a = -abs(x)
    p, nf, t = _fexp_parts(a)
    L = _flog1p_small(_ldexp(p, nf))
    m = _atleast(x, F(0.0))
    y = _add(m, L)
    return y if x == x else x


@njit(inline="always", error_model="numpy")
def flog(x):
    """Cephes logf: x = m 2^k, m in [sqrt(1/2), sqrt(2)), ln(1 + f) = f - f^2/2 + f^3 P(f)."""
    x = F(x)
    sub = x < F(1.1754943508222875e-38)
    xs = _mul(x, F(8388608.0)) if sub else x      # subnormals scaled by 2^23
    m, kf = _frexp(xs)
    kf = kf - F(23.0) if sub else kf
    f = _sub(m, F(1.0))                            # exact
    z = _mul(f, f)
    P = _fma(F(7.0376836292e-2), f, F(-1.1514610310e-1))
    P = _fma(P, f, F(1.1676998740e-1))
    P = _fma(P, f, F(-1.2420140846e-1))
    P = _fma(P, f, F(1.4249322787e-1))
    P = _fma(P, f, F(-1.6668057665e-1))
    P = _fma(P, f, F(2.0000714765e-1))
    P = _fma(P, f, F(-2.4999993993e-1))
    P = _fma(P, f, F(3.3333331174e-1))
    y = _mul(_mul(P, f), z)
    y = _fma(kf, F(-2.12194440e-4), y)
    y = _fma(z, F(-0.5), y)
    y = _fma(kf, F(0.693359375), _add(f, y))
    y = -INF if x == F(0.0) else y
    y = x if x == INF else y
    return y if x >= F(0.0) else NAN               # x < 0 and NaN


@njit(inline="always", error_model="numpy")
def ftanh(x):
    """tanh |x| = E / (E + 2), E = e^{2|x|} - 1 = 2^n t + (2^n - 1) (t = e^r - 1: no
    cancellation at any |x|, one division); |x| clamped to 9 (tanh = 1 in float32 beyond)."""
    x = F(x)
    a = _atmost(abs(x), F(9.0))                    # NaN -> 9
    p, nf, t = _fexp_core(_add(a, a))
    s2 = _pow2(nf)                                 # n in [0, 26]: exact
    E = _fma(s2, t, _sub(s2, F(1.0)))
    y = _copysign(E / _add(E, F(2.0)), x)
    return y if x == x else x


# ---- float64 -----------------------------------------------------------------------------
_LN2_HI = 6.93147180369123816490e-01     # 32 significant bits: n * _LN2_HI exact for |n| < 2^21
_LN2_LO = 1.90821492927058770002e-10


@njit(inline="always", error_model="numpy")
def _dexp_parts(x):
    return _dexp_parts_dd(x, 0.0)


@njit(inline="always", error_model="numpy")
def _dexp_parts_dd(x, xl):
    """e^(x + xl) = (p + pl) * 2^nf for float64 x (|xl| <= ulp(x)) clamped to [-760, 710] (NaN -> -760); p + pl (pl the
    rounding error of p = 1 + t) is e^r to ~0.2 ulp. Below -760, |x| e^x underflows too."""
    xc = _clamp(x, -760.0, 710.0)
    nf = _rint(xc * _LOG2E)
    r = _fma(nf, -_LN2_HI, xc)
    r = _add(_fma(nf, -_LN2_LO, r), xl)
    # e^r = 1 + r + r^2 q(r), q Chebyshev-fitted (degree 9) on |r| <= 1.02 ln2/2
    q = _fma(2.5102327723609146e-08, r, 2.762261407861969e-07)
    q = _fma(q, r, 2.7557264294679126e-06)
    q = _fma(q, r, 2.4801515879478315e-05)
    q = _fma(q, r, 0.00019841269865788537)
    q = _fma(q, r, 0.0013888888920770123)
    q = _fma(q, r, 0.008333333333329503)
    q = _fma(q, r, 0.041666666666616864)
    q = _fma(q, r, 0.16666666666666669)
    q = _fma(q, r, 0.5000000000000001)
    t = _fma(q, _mul(r, r), r)
    p = _add(t, 1.0)
    pl = _add(_sub(1.0, p), t)                        # exact (Fast2Sum, |t| < 1)
    return p, pl, nf


@njit(inline="always", error_model="numpy")
def dexp(x):
    x = np.float64(x)
    p, pl, nf = _dexp_parts(x)
    y = _ldexp(p, nf)
    return y if x == x else x


@njit(inline="always", error_model="numpy")
def _dsig_parts(x):
    return _dsig_parts_dd(x, 0.0)


@njit(inline="always", error_model="numpy")
def _dsig_parts_dd(x, xl):
    """sigmoid(x) = ldexp(q0 + ql, k): the quotient of the double-length numerator and
    denominator, q0 rounded and ql its residual correction; e = e^-|x| (rounded),
    r0 = 1 / (1 + e) rounded."""
    a = -x if x >= 0.0 else x
    al = -xl if x >= 0.0 else xl
    p, pl, nf = _dexp_parts_dd(a, al)
    s2 = _pow2(nf)                                 # e, el feed 1 + e and s_c only
    e = _mul(p, s2)
    el = _mul(pl, s2)
    dh = _add(1.0, e)
    dl = _add(_add(_sub(1.0, dh), e), el)
    r0 = 1.0 / dh
    neg = x < 0.0
    nh = p if neg else 1.0
    nl = pl if neg else 0.0
    q0 = _mul(nh, r0)
    rho = _add(_fma(-q0, dh, nh), _fma(-q0, dl, nl))
    k = nf if neg else 0.0
    return q0, _mul(rho, r0), k, e, r0


@njit(inline="always", error_model="numpy")
def dsigmoid(x):
    x = np.float64(x)
    q0, ql, k, e, r0 = _dsig_parts(x)
    y = _ldexp(_add(q0, ql), k)
    return y if x == x else x


@njit(inline="always", error_model="numpy")
def _mul_q(x, q0, ql):
    """x (q0 + ql), rounded once (nearly)."""
    ph, pl = _two_prod(x, q0)
    return _add(ph, _fma(x, ql, pl))


@njit(inline="always", error_model="numpy")
def _two_prod(a, b):
    """a * b = h + l exactly (with a fused multiply-add; l = 0 without one)."""
    h = _mul(a, b)
    return h, _fma(a, b, -h)


@njit(inline="always", error_model="numpy")
def dsilu(x):
    x = np.float64(x)
    q0, ql, k, e, r0 = _dsig_parts(x)
    xc = _atleast(x, -760.0)
    y = _ldexp(_mul_q(xc, q0, ql), k)
    y = y if abs(x) < DINF else _mul(x, 1.0 - k)  # inf, NaN
    return y if x != -DINF else DNAN


@njit(inline="always", error_model="numpy")
def _dlog1p_small(e, el):
    """ln(1 + e + el) for float64 e in [0, 1]: 2 atanh(s), s = e / (2 + e) in [0, 1/3],
    t = 2s from the double-length quotient corrected by its residual."""
    dh = _add(2.0, e)
    dl = _add(_add(_sub(2.0, dh), e), el)
    r0 = 1.0 / dh
    n = _add(e, e)
    t0 = _mul(n, r0)
    rho = _add(_fma(-t0, dh, n), _fma(-t0, dl, _add(el, el)))
    t = _fma(rho, r0, t0)
    z = _mul(0.25, _mul(t, t))
    R = _fma(0.08082022805971766, z, 0.04400369243072337)
    R = _fma(R, z, 0.06000536404795356)
    R = _fma(R, z, 0.06657072104827468)
    R = _fma(R, z, 0.07692785032479312)
    R = _fma(R, z, 0.09090894718066429)
    R = _fma(R, z, 0.11111111358713932)
    R = _fma(R, z, 0.1428571428355438)
    R = _fma(R, z, 0.20000000000007292)
    R = _fma(R, z, 0.3333333333333333)
    return _fma(t, _mul(z, R), t)


@njit(inline="always", error_model="numpy")
def dsoftplus(x):
    x = np.float64(x)
    a = -abs(x)
    p, pl, nf = _dexp_parts(a)
    L = _dlog1p_small(_ldexp(p, nf), _mul(pl, _pow2(nf)))
    m = _atleast(x, 0.0)
    y = _add(m, L)
    return y if x == x else x


@njit(inline="always", error_model="numpy")
def dlog(x):
    """fdlibm's log: x = m 2^k, m in [sqrt(1/2), sqrt(2)), f = m - 1, s = f / (2 + f),
    ln(1 + f) = f - f^2/2 + s (f^2/2 + R(s^2))."""
    x = np.float64(x)
    sub = x < 2.2250738585072014e-308
    xs = _mul(x, 18014398509481984.0) if sub else x     # 2^54
    m, kf = _frexp(xs)
    kf = kf - 54.0 if sub else kf
    f = _sub(m, 1.0)
    s = f / _add(2.0, f)
    z = _mul(s, s)
    w = _mul(z, z)
    t1 = _mul(w, _fma(w, _fma(w, 1.531383769920937332e-01, 2.222219843214978396e-01),
                      3.999999999940941908e-01))
    t2 = _mul(z, _fma(w, _fma(w, _fma(w, 1.479819860511658591e-01, 1.818357216161805012e-01),
                              2.857142874366239149e-01), 6.666666666666735130e-01))
    R = _add(t2, t1)
    hfsq = _mul(_mul(0.5, f), f)
    y = _sub(hfsq, _fma(s, _add(hfsq, R), _mul(kf, _LN2_LO)))
    y = _fma(kf, _LN2_HI, _sub(f, y))
    y = -DINF if x == 0.0 else y
    y = x if x == DINF else y
    return y if x >= 0.0 else DNAN


@njit(inline="always", error_model="numpy")
def dtanh(x):
    """Cephes tanh: x + x z P(z) / Q(z) (z = x^2) for |x| < 0.625, 1 - 2 / (e^{2|x|} + 1)
    above; both quotients share one division."""
    x = np.float64(x)
    a = -x if x < 0.0 else x
    p, pl, nf = _dexp_parts(_add(a, a))
    e = _ldexp(p, nf)
    z = _mul(x, x)
    P = _fma(_fma(-9.64399179425052238628e-1, z, -9.92877231001918586564e1), z,
             -1.61468768441708447952e3)
    Q = _fma(_fma(_add(z, 1.12811678491632931402e2), z, 2.23548839060100448583e3), z,
             4.84406305325125486048e3)
    small = a < 0.625
    num = _mul(_mul(x, z), P) if small else 2.0
    den = Q if small else _add(e, 1.0)
    q = num / den
    y = _add(x, q) if small else _sub(1.0, q)
    y = _copysign(y, x)
    return y if x == x else x


# ---- composite helpers (float64 inside; the float32 versions round once at the end) --------
_C = 0.7978845608028654          # sqrt(2/pi) as jitgraph/ops/elementwise.py spells it
_K = 0.044715
_C2 = 2.0 * _C                   # exact


@njit(inline="always", error_model="numpy")
def _dsig_pair(z, zl):
    """sigmoid(z + zl) = ldexp(q, k) and 1 - sigmoid(z + zl) = s_c, float64, to ~1.5 ulp."""
    q0, ql, k, e, r0 = _dsig_parts_dd(z, zl)
    s_c = r0 if z < 0.0 else _mul(e, r0)
    return _add(q0, ql), k, s_c


@njit(inline="always", error_model="numpy")
def _scaled(g, t, k):
    """g t 2^k with one rounding into the subnormals; g 2^k t if g t overflows."""
    y = _ldexp(_mul(g, t), k)
    return y if abs(y) < DINF else _mul(g, _ldexp(t, k))


@njit(inline="always", error_model="numpy")
def dsilu_back(x, g):
    x = np.float64(x)
    g = np.float64(g)
    xc = _clamp(x, -800.0, 800.0)                 # beyond +-800: 0 or g exactly, for
    #                                               |g| < 2e21 (larger g: g x e^x at -800)
    q, k, s_c = _dsig_pair(xc, 0.0)
    y = _scaled(g, _mul(q, _fma(xc, s_c, 1.0)), k)
    return y if abs(x) < DINF else DNAN            # +-inf, NaN: NaN like the formula


@njit(inline="always", error_model="numpy")
def _dsig_pair_fast(z):
    """(q, k, s_c): sigmoid(z) = q 2^k and 1 - sigmoid(z) = s_c to ~2 float64 ulps, for the
    float32 helpers (float64 underflow is below their range: s_c flushes there)."""
    a = -abs(z)
    p, pl, nf = _dexp_parts(a)
    e = _mul(p, _pow2(nf))
    r0 = 1.0 / _add(1.0, e)
    neg = z < 0.0
    q = _mul(p, r0) if neg else r0
    k = nf if neg else 0.0
    s_c = r0 if neg else _mul(e, r0)
    return q, k, s_c


@njit(inline="always", error_model="numpy")
def fsilu_back(x, g):
    """float32 silu_back, in float64 inside: the bracket 1 + x (1 - s) cancels to 0 near
    x = -1.2785, where a float32 evaluation loses every digit."""
    xd = np.float64(x)
    xc = _clamp(xd, -200.0, 200.0)                # beyond: 0 (or g) in float32, for any
    #                                               float32 g (|g x| e^x < 2^-150 below -200)
    # e = e^-|x| >= e^-200 is a normal float64, so sigmoid and 1 - sigmoid are e / (1 + e) and
    # 1 / (1 + e) directly (no exponent carried apart as _dsig_pair_fast does, which is slower;
    # the same bits on test_approx's inputs)
    p, _, nf = _dexp_parts(-abs(xc))
    e = _ldexp(p, nf)
    r0 = 1.0 / _add(1.0, e)
    er = _mul(e, r0)
    neg = xc < 0.0
    s = er if neg else r0
    s_c = r0 if neg else er
    y = _mul(_mul(np.float64(g), s), _fma(xc, s_c, 1.0))
    return F(y if abs(xd) < DINF else DNAN)


@njit(inline="always", error_model="numpy")
def _gelu_z_dd(x):
    """z = 2 sqrt(2/pi) x (1 + 0.044715 x^2) as a double-double (zh, zl) to ~2^-100: gelu's
    sigmoid(z) needs z to |z| 2^-53 absolute (z reaches -745 before gelu underflows)."""
    x2, x2l = _two_prod(x, x)
    u, ul = _two_prod(_K, x2)
    ul = _fma(_K, x2l, ul)
    v = _add(1.0, u)                               # TwoSum(1, u)
    bv = _sub(v, 1.0)
    vl = _add(_add(_sub(1.0, _sub(v, bv)), _sub(u, bv)), ul)
    w, wl = _two_prod(x, v)
    wl = _fma(x, vl, wl)
    z, zl = _two_prod(_C2, w)
    zl = _fma(_C2, wl, zl)
    zh = _add(z, zl)                               # renormalise
    return zh, _add(_sub(z, zh), zl)


@njit(inline="always", error_model="numpy")
def dgelu(x):
    x = np.float64(x)
    xc = _clamp(x, -40.0, 1e10)                   # gelu(x < -40) underflows: z < -4600;
    #                                               gelu(x) = x beyond; no overflow in x^3
    zh, zl = _gelu_z_dd(xc)
    q0, ql, k, e, r0 = _dsig_parts_dd(zh, zl)
    y = _ldexp(_mul_q(xc, q0, ql), k)
    y = y if x <= 1e10 else x
    y = y if x >= -40.0 else _mul(x, 0.0)         # -0.0, and NaN for -inf as x * sigmoid
    return y if x != -DINF else DNAN


@njit(inline="always", error_model="numpy")
def _fexp_parts_d(z):
    """e^z = p * 2^nf (float32 p, nf, t = p - 1) for a float64 z clamped to [-110, 89]: the
    reduction in float64, so z need not be a float32 (gelu's argument, exact to 2^-50)."""
    zc = _clamp(z, -110.0, 89.0)
    nf = _rint(zc * _LOG2E)
    r = F(_fma(nf, -_LN2_LO, _fma(nf, -_LN2_HI, zc)))
    q = _fma(F(0.0013927684616575004), r, F(0.00836438069329107))
    q = _fma(q, r, F(0.04166654542109553))
    q = _fma(q, r, F(0.16666569628115477))
    q = _fma(q, r, F(0.5))
    t = _fma(q, _mul(r, r), r)
    return _add(t, F(1.0)), F(nf), t


@njit(inline="always", error_model="numpy")
def fgelu(x):
    """float32 gelu: the argument z = 2u in float64 (in float32 its rounding alone would cost
    |z| ulps in the tail), the rest as fsilu."""
    x = F(x)
    xc = _clamp(x, F(-40.0), F(1e10))             # gelu(x < -40) underflows: z < -4600;
    #                                               gelu(x) = x beyond; no overflow in x^3
    xd = np.float64(xc)
    z = _mul(_mul(_C2, xd), _fma(_mul(_K, xd), xd, 1.0))
    a = -abs(z)
    p, nf, t = _fexp_parts_d(a)
    e = _mul(p, _pow2(nf))
    neg = z < 0.0
    num = _mul(xc, p) if neg else xc
    k = nf if neg else F(0.0)
    y = _ldexp(num / _add(F(1.0), e), k)
    y = y if x <= F(1e10) else x
    y = y if x >= F(-40.0) else _mul(x, F(0.0))   # -0.0, and NaN for -inf as x * sigmoid
    return y if x != -INF else NAN


@njit(inline="always", error_model="numpy")
def dgelu_back(x, g):
    x = np.float64(x)
    g = np.float64(g)
    xc = _clamp(x, -40.0, 40.0)                   # beyond +-40: 0 or g exactly, no overflow
    x2 = _mul(xc, xc)
    zh, zl = _gelu_z_dd(xc)
    q, k, s_c = _dsig_pair(zh, zl)
    inner = _mul(_mul(_mul(2.0 * _C, xc), s_c), _fma(3.0 * _K, x2, 1.0))
    y = _scaled(g, _mul(q, _add(1.0, inner)), k)
    return y if abs(x) < DINF else DNAN


@njit(inline="always", error_model="numpy")
def fgelu_back(x, g):
    """float32 gelu_back, in float64 inside (its bracket cancels near x = -0.7518)."""
    xd = np.float64(x)
    xc = _clamp(xd, -40.0, 40.0)
    x2 = _mul(xc, xc)
    z = _mul(_mul(_C2, xc), _fma(_K, x2, 1.0))
    q, k, s_c = _dsig_pair_fast(z)
    inner = _mul(_mul(_mul(2.0 * _C, xc), s_c), _fma(3.0 * _K, x2, 1.0))
    y = _mul(_mul(np.float64(g), _mul(q, _add(1.0, inner))), _pow2(k))
    return F(y if abs(xd) < DINF else DNAN)


@njit(inline="always", error_model="numpy")
def fpow(x, p):
    """x^p for float32 x and p (the pow op's attribute, a constant in generated code: what
    depends on p alone folds away), as C's powf: |x|^p = e^(p ln|x|) in float64 (relative
    error below 2^-44 before the one rounding to float32), the sign (-1)^p for an odd integer
    p, NaN for a finite x < 0 and a non-integer p, x^0 = 1 (NaN included); x^0.5 = sqrt(x), as
    numpy computes it (sqrt(-inf) = NaN, sqrt(-0) = -0, where powf gives inf and 0)."""
    xd = np.float64(F(x))
    pd = np.float64(F(p))
    y = dexp(_mul(pd, dlog(abs(xd))))             # 0^p, inf^p: dexp(+-inf), 1^p: dexp(0)
    half = _mul(pd, 0.5)
    whole = _rint(pd) == pd
    y = -y if whole & (_rint(half) != half) & (_copysign(1.0, xd) < 0.0) else y
    y = DNAN if (xd < 0.0) & (xd > -DINF) & ~whole else y
    y = math.sqrt(xd) if pd == 0.5 else y         # llvm.sqrt: vectorises, correctly rounded
    return F(1.0 if pd == 0.0 else y)


# ---- dtype-generic names: float32 arguments -> f*, anything else -> d* ----------------------
def _generic(name, f32, f64, arity=1):
    def stub(*args):
        raise NotImplementedError(f"{name} is for numba-compiled code")
    stub.__name__ = name

    if arity == 1:
        @overload(stub, inline="always")
        def _ov(x):
            if x == types.float32:
                return lambda x: f32(x)
            if isinstance(x, (types.Float, types.Integer, types.Boolean)):
                return lambda x: f64(x)
    else:
        @overload(stub, inline="always")
        def _ov(x, g):
            if x == types.float32 and g == types.float32:
                return lambda x, g: f32(x, g)
            if all(isinstance(t, (types.Float, types.Integer, types.Boolean)) for t in (x, g)):
                return lambda x, g: f64(x, g)
    return stub


vexp = _generic("vexp", fexp, dexp)
vlog = _generic("vlog", flog, dlog)
vtanh = _generic("vtanh", ftanh, dtanh)
vsigmoid = _generic("vsigmoid", fsigmoid, dsigmoid)
vsoftplus = _generic("vsoftplus", fsoftplus, dsoftplus)
vsilu = _generic("vsilu", fsilu, dsilu)
vgelu = _generic("vgelu", fgelu, dgelu)
vsilu_back = _generic("vsilu_back", fsilu_back, dsilu_back, arity=2)
vgelu_back = _generic("vgelu_back", fgelu_back, dgelu_back, arity=2)

__all__ = ["fexp", "flog", "ftanh", "fsigmoid", "fsoftplus", "fsilu", "fgelu", "fsilu_back",
           "fgelu_back", "fpow", "dexp", "dlog", "dtanh", "dsigmoid", "dsoftplus", "dsilu", "dgelu",
           "dsilu_back", "dgelu_back", "vexp", "vlog", "vtanh", "vsigmoid", "vsoftplus", "vsilu",
           "vgelu", "vsilu_back", "vgelu_back"]

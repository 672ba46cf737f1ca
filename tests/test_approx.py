"""Ulp error of runtime/cpu/approx.py's vectorisable functions over the whole float range.

References: float64 for the float32 functions, np.longdouble (x87 extended, 64-bit mantissa)
for the float64 ones, each formula evaluated in the reference precision at the exact input.
Error unit: the spacing of the target dtype at the correctly rounded reference (the subnormal
spacing below the smallest normal, so flushing a subnormal result to 0 counts in full); an
overflowing reference counts as 2^128 / 2^1024. Inputs: a bit-pattern sweep of every binade of
both signs (subnormals included), dense grids over each function's interesting range, the
overflow / underflow thresholds, and ±0, ±inf, NaN. Each function also runs inside a loop
compiled with the row kernels' fastmath flags (runtime/cpu/lower.py) and inside one fused
expression, and must give the same bound there. Wired into compiled programs (runtime/cpu/rules.py
EXPR), each op keeps its bound as a kernel of its own, in one fused kernel with the others, and
in a fused chain where each reads the one before (the f32 bounds are <= 3 ulp, within the 4 ulp
issue 16 sets; f64 <= 2 ulp).

`python tests/test_approx.py` prints the max ulp error per function and dtype.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from jitgraph.runtime.cpu import approx

LD = np.longdouble
C, K = 0.7978845608028654, 0.044715          # jitgraph/ops/elementwise.py's gelu constants


# ---- references (xp: float64 or longdouble arrays) -----------------------------------------
def _sig(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _sig_c(x):                      # 1 - sigmoid(x), without the cancellation
    return _sig(-x)


def _gelu_z(x):
    one = np.ones((), x.dtype)
    return 2 * x.dtype.type(C) * x * (one + x.dtype.type(K) * x * x)


def _ref(name, x, g=None):
    t = x.dtype.type
    with np.errstate(all="ignore"):
        if name == "exp":
            return np.exp(x)
        if name == "log":
            return np.log(x)
        if name == "tanh":
            return np.tanh(x)
        if name == "sqrt":
            return np.sqrt(x)
        if name == "sigmoid":
            return _sig(x)
        if name == "softplus":
            return np.maximum(x, t(0)) + np.log1p(np.exp(-np.abs(x)))
        if name == "silu":
            return x * _sig(x)
        if name == "gelu":
            return x * _sig(_gelu_z(x))
        if name == "silu_back":
            return g * _sig(x) * (1 + x * _sig_c(x))
        if name == "gelu_back":
            z = _gelu_z(x)
            return g * _sig(z) * (1 + 2 * t(C) * x * _sig_c(z) * (1 + 3 * t(K) * x * x))
    raise KeyError(name)


# ---- inputs ---------------------------------------------------------------------------------
def _sweep(dtype, n, seed=0):
    """Every binade of both signs: evenly strided bit patterns (f32) / random bit patterns (f64),
    plus dense grids over [-800, 800], [-30, 30], [-2, 2], tiny and near-1 values."""
    rng = np.random.default_rng(seed)
    if dtype == np.float32:
        bits = np.arange(0, 2**32, 2**32 // n, dtype=np.uint64).astype(np.uint32)
        bits = bits + rng.integers(0, 2**32 // n, bits.size, dtype=np.uint32)
        every = bits.view(np.float32)
    else:
        every = rng.integers(0, 2**64, n, dtype=np.uint64).view(np.float64)
    every = every[np.isfinite(every)]
    grids = [rng.uniform(-800, 800, n // 4), rng.uniform(-30, 30, n // 4),
             rng.uniform(-2, 2, n // 8), rng.uniform(0.5, 2, n // 8),
             np.exp(rng.uniform(-20, 0, n // 8)) * rng.choice([-1, 1], n // 8)]
    return np.concatenate([every] + [g.astype(dtype) for g in grids]).astype(dtype)


def _specials(dtype):
    fi = np.finfo(dtype)
    tiny, sub = fi.tiny, fi.smallest_subnormal
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 2.0, 0.5, fi.max, -fi.max, tiny, -tiny,
            sub, -sub, tiny / 2, -tiny / 2, fi.eps, 1 - fi.epsneg, 1 + fi.eps, 0.625, -0.625]
    # thresholds: exp overflow, exp normal/subnormal boundary, exp underflow to 0 (and past them)
    hi = np.log(fi.max.astype(np.float64))
    lo_norm = np.log(float(tiny))
    lo_sub = np.log(float(sub)) - np.log(2.0)
    for c in (hi, lo_norm, lo_sub, -hi, -lo_norm, -lo_sub, hi / 2, 20.0, 40.0, 100.0, -100.0):
        v = dtype(c)
        vals += [np.nextafter(v, dtype(-np.inf)), v, np.nextafter(v, dtype(np.inf))]
    vals += list(dtype(c) * dtype(s) for c in (88.0, 104.0, 709.0, 745.0, 750.0, 1e4, 1e30)
                 for s in (1, -1))
    return np.array(vals, dtype=dtype)


# ---- error ------------------------------------------------------------------------------------
def ulp_error(got, ref, dtype):
    """|got - ref| in spacings of dtype at ref rounded to dtype; NaN must match NaN."""
    fi = np.finfo(dtype)
    big = LD(2) ** (128 if dtype == np.float32 else 1024)
    ref = np.asarray(ref, LD)
    g = np.asarray(got).astype(LD)
    nan_r, nan_g = np.isnan(ref), np.isnan(g)
    err = np.zeros(ref.shape, LD)
    err[nan_r != nan_g] = np.inf
    ok = ~(nan_r | nan_g)
    r = np.clip(np.where(np.isinf(ref), np.sign(ref) * big, ref[...]), -big, big)[ok]
    gg = np.where(np.isinf(g), np.sign(g) * big, g)[ok]
    with np.errstate(over="ignore"):
        rt = np.abs(r).astype(dtype)
    rt = np.minimum(rt, np.nextafter(fi.max, dtype(0)))   # spacing(max) overflows
    sp = np.spacing(rt).astype(LD)
    err[ok] = np.abs(gg - r) / sp
    return err.astype(np.float64)


# ---- compiled loops ------------------------------------------------------------------------
FASTMATH = {"reassoc", "nsz", "contract"}     # runtime/cpu/lower.py's FASTMATH
UNARY = ["exp", "log", "tanh", "sigmoid", "softplus", "silu", "gelu"]
BINARY = ["silu_back", "gelu_back"]


def _loop(fn, binary, fastmath):
    if binary:
        @njit(error_model="numpy", fastmath=fastmath)
        def run(x, g, out):
            for i in range(x.shape[0]):
                out[i] = fn(x[i], g[i])
    else:
        @njit(error_model="numpy", fastmath=fastmath)
        def run(x, g, out):
            for i in range(x.shape[0]):
                out[i] = fn(x[i])
    return run


_LOOPS = {}


def evaluate(name, dtype, x, g=None, fastmath=False, generic=False):
    prefix = "v" if generic else ("f" if dtype == np.float32 else "d")
    fn = getattr(approx, prefix + name)
    key = (prefix + name, fastmath)
    if key not in _LOOPS:
        _LOOPS[key] = _loop(fn, name in BINARY, FASTMATH if fastmath else False)
    out = np.empty_like(x)
    _LOOPS[key](x, x if g is None else g, out)
    return out


def _root(f, lo, hi):
    """Bisection in longdouble for the sign change of f on [lo, hi]."""
    lo, hi = LD(lo), LD(hi)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.sign(f(mid)) == np.sign(f(lo)) else (lo, mid)
    return lo


# the zeros of the backward brackets, where the result cancels to 0
ROOTS = {"silu_back": _root(lambda x: 1 + x * _sig_c(x), -2, -1),
         "gelu_back": _root(lambda x: 1 + 2 * LD(C) * x * _sig_c(_gelu_z(x)) *
                            (1 + 3 * LD(K) * x * x), -2, -1)}


def _near(dtype, x0, n):
    """The n consecutive floats of dtype on each side of x0."""
    v = dtype(x0)
    if dtype == np.float32:
        b = np.array([v]).view(np.uint32)[0].astype(np.int64)
        return (b + np.arange(-n, n + 1)).astype(np.uint32).view(np.float32)
    b = np.array([v]).view(np.uint64)[0].astype(np.int64)
    return (b + np.arange(-n, n + 1)).astype(np.uint64).view(np.float64)


def _inputs(name, dtype, n):
    x = np.concatenate([_sweep(dtype, n), _specials(dtype)])
    if name in ROOTS:
        x = np.concatenate([x, _near(dtype, ROOTS[name], 50_000)])
    g = None
    if name in BINARY:   # the backward helpers: g = 1 and g = random (sign, scale)
        g = np.ones_like(x)
        g[1::2] = np.random.default_rng(1).uniform(-3, 3, g[1::2].size).astype(dtype)
    return x, g


def reference(name, x, g):
    xp = x.astype(np.float64 if x.dtype == np.float32 else LD)
    gp = None if g is None else g.astype(xp.dtype)
    return _ref(name, xp, gp)


def _terms(name, x, g):
    """The magnitude of the backward formula's largest term, |g s| (1 + |x (1 - s) ...|): the
    float64 helpers lose accuracy to cancellation near their roots relative to this."""
    xp = x.astype(LD)
    gp = np.abs(g.astype(LD))
    with np.errstate(all="ignore"):
        if name == "silu_back":
            return gp * _sig(xp) * (1 + np.abs(xp) * _sig_c(xp))
        z = _gelu_z(xp)
        return gp * _sig(z) * (1 + 2 * LD(C) * np.abs(xp) * _sig_c(z) * (1 + 3 * LD(K) * xp * xp))


def max_error(name, dtype, n=1 << 18, fastmath=False, generic=False):
    """Max ulp error and where; see `errors`."""
    x, g = _inputs(name, dtype, n)
    err = errors(name, x, g, evaluate(name, dtype, x, g, fastmath, generic))
    i = int(np.argmax(err))
    return float(err[i]), x[i]


def errors(name, x, g, got):
    """Ulp error of `got` (name at x, g); for the float64 backward helpers, the error minus
    2 eps |terms| (the cancellation allowance of MIXED_F64), in ulps."""
    dtype = x.dtype.type
    ref = reference(name, x, g)
    err = ulp_error(got, ref, dtype)
    if dtype == np.float64 and name in BINARY:
        allow = MIXED_F64 * np.finfo(dtype).eps * _terms(name, x, g)
        with np.errstate(all="ignore"):
            absdiff = np.abs(got.astype(LD) - ref)
            sp = np.spacing(np.abs(ref).astype(dtype)).astype(LD)
            mixed = np.maximum(absdiff - allow, 0) / sp
        err = np.where(np.isfinite(absdiff), mixed.astype(np.float64), err)
    return err


MIXED_F64 = 2     # f64 silu_back / gelu_back: |err| <= bound ulp + MIXED_F64 eps |terms|
# bounds asserted (ulp); the measured maxima (python tests/test_approx.py) are lower
BOUND = {np.float32: dict(exp=1.5, log=1, tanh=3, sigmoid=3, softplus=3, silu=3, gelu=3,
                          silu_back=1, gelu_back=1),
         np.float64: dict(exp=1.5, log=1, tanh=1.5, sigmoid=1.5, softplus=2, silu=1.5, gelu=2,
                          silu_back=1, gelu_back=1.5)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", UNARY + BINARY)
def test_ulp_error_over_the_whole_range(name, dtype):
    err, at = max_error(name, dtype)
    assert err <= BOUND[dtype][name], f"{name} {dtype.__name__}: {err:.2f} ulp at x={at!r}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", UNARY + BINARY)
def test_same_bound_under_fastmath_and_generic_names(name, dtype):
    err, at = max_error(name, dtype, n=1 << 15, fastmath=True, generic=True)
    assert err <= BOUND[dtype][name], f"{name} {dtype.__name__}: {err:.2f} ulp at x={at!r}"


SCALED = ["exp", "sigmoid", "silu", "softplus", "gelu", "silu_back", "gelu_back"]  # use _ldexp


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", SCALED)
def test_both_ldexp_codegens_agree(name, dtype, monkeypatch):
    """_ldexp has two code paths: llvm.ldexp (one vscalef under AVX-512, chosen where numba
    compiles for it) and integer power-of-two steps (elsewhere). Both are compiled here and
    must agree bit for bit over the inputs of the bound tests (so the bounds, asserted on this
    host's path, hold for the other); NaN where the other has NaN."""
    x, g = _inputs(name, dtype, 1 << 15)
    fn = getattr(approx, ("f" if dtype == np.float32 else "d") + name)
    got = {}
    for native in (True, False):
        monkeypatch.setattr(approx, "_NATIVE_LDEXP", native)
        out = np.empty_like(x)
        _loop(fn, name in BINARY, False)(x, x if g is None else g, out)   # compiled afresh
        got[native] = out
    a, b = got[True], got[False]
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    assert same.all(), f"{name}: {int((~same).sum())} differ, e.g. x={x[~same][:3]!r}"


def test_native_ldexp_is_one_instruction_on_avx512():
    """Where the native path is chosen, the vectorised exp loop scales with vscalefps (no libm
    call, no integer steps); elsewhere it must not be chosen."""
    loop = _loop(approx.fexp, False, False)
    x = np.linspace(-100, 90, 64, dtype=np.float32)
    loop(x, x, np.empty_like(x))
    asm = "".join(loop.inspect_asm().values())
    assert ("vscalefps" in asm) == approx._NATIVE_LDEXP
    assert "ldexp" not in asm           # never a libm call


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_special_values(dtype):
    inf, nan = np.inf, np.nan
    x = np.array([0.0, -0.0, inf, -inf, nan, 1.0, -1.0], dtype)
    want = dict(exp=[1, 1, inf, 0, nan, np.e, 1 / np.e],
                log=[-inf, -inf, inf, nan, nan, 0, nan],
                tanh=[0, -0.0, 1, -1, nan, np.tanh(1.0), -np.tanh(1.0)],
                sigmoid=[0.5, 0.5, 1, 0, nan, None, None],
                softplus=[np.log(2), np.log(2), inf, 0, nan, None, None],
                silu=[0, 0, inf, nan, nan, None, None],
                gelu=[0, 0, inf, nan, nan, None, None])
    for name, w in want.items():
        got = evaluate(name, dtype, x)
        for xi, gi, wi in zip(x, got, w):
            if wi is None:
                continue
            if np.isnan(wi):
                assert np.isnan(gi), (name, xi, gi)
            else:
                assert gi == pytest.approx(float(dtype(wi)), rel=4 * float(np.finfo(dtype).eps), abs=0), \
                    (name, xi, gi)
    # signed zeros where the function is odd
    assert np.signbit(evaluate("tanh", dtype, np.array([-0.0], dtype)))[0]


def test_exp_subnormal_results_are_gradual_not_flushed():
    x = np.array([-88.0, -95.0, -103.0], np.float32)
    got = evaluate("exp", np.float32, x)
    assert (got > 0).all() and ulp_error(got, np.exp(x.astype(np.float64)), np.float32).max() <= 1
    x = np.array([-710.0, -740.0, -745.0], np.float64)
    got = evaluate("exp", np.float64, x)
    assert (got > 0).all()


def test_inside_a_fused_expression():
    """Several functions inlined into one loop body (as a fused kernel does) keep their bounds."""
    @njit(error_model="numpy", fastmath=FASTMATH)
    def fused(x, out):
        for i in range(x.shape[0]):
            v = x[i]
            out[0, i] = approx.vsigmoid(v) * approx.vexp(-v) + approx.vtanh(v) * approx.vtanh(v)
            out[1, i] = approx.vlog(approx.vsoftplus(v) + 2)
    for dtype in (np.float32, np.float64):
        x = np.linspace(-20, 20, 40_001).astype(dtype)
        out = np.empty((2, x.size), dtype)
        fused(x, out)
        xl = x.astype(LD)
        s, t, e = _sig(xl), np.tanh(xl), np.exp(-xl)
        sp = np.maximum(xl, 0) + np.log1p(np.exp(-np.abs(xl)))
        eps = np.finfo(dtype).eps
        # each function within its bound, then one rounding per operation (no cancellation)
        np.testing.assert_allclose(out[0], (s * e + t * t).astype(np.float64), rtol=8 * eps,
                                   atol=8 * eps)
        np.testing.assert_allclose(out[1], np.log(sp + 2).astype(np.float64), rtol=8 * eps,
                                   atol=np.finfo(dtype).tiny)


def test_sqrt_is_libm_exact():
    """math.sqrt is llvm.sqrt (vectorised, correctly rounded): no approximation is needed."""
    import math

    @njit(error_model="numpy")
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = math.sqrt(x[i])
    for dtype in (np.float32, np.float64):
        x = np.abs(_sweep(dtype, 1 << 14))
        out = np.empty_like(x)
        run(x, out)
        assert ulp_error(out, np.sqrt(x.astype(LD)), dtype).max() <= 0.5


# ---- wired into compiled programs (runtime/cpu/rules.py EXPR) ---------------------------------
def _program_inputs(dtype, n=1 << 15):
    """Every binade, the specials, the backward helpers' roots; g: ones and random values."""
    x = np.concatenate([_sweep(dtype, n), _specials(dtype)] +
                       [_near(dtype, r, 2000) for r in ROOTS.values()])
    g = np.ones_like(x)
    g[1::2] = np.random.default_rng(1).uniform(-3, 3, g[1::2].size).astype(dtype)
    return x, g


def _run(g, feeds, fuse):
    import jitgraph as jg
    prog = jg.compile(g, fuse=fuse)
    return prog.run(**feeds), prog.stats()["kernels"]


@pytest.mark.parametrize("fuse", [False, True], ids=["alone", "fused"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_compiled_ops_within_the_bounds(dtype, fuse):
    """Each transcendental op compiled as a kernel of its own (unfused), and all nine in one
    fused kernel (their sum makes them one): every result within the function's bound (<= 3 ulp
    in f32, <= 2 in f64) of the float64 (f32) / long double (f64) reference."""
    import jitgraph as jg
    x, gr = _program_inputs(dtype)
    dt = np.dtype(dtype).name.replace("float", "f")
    graph = jg.Graph(f"transcendentals_{dt}")
    xv, gv = graph.input("x", x.shape, dt), graph.input("g", x.shape, dt)
    vals = {nm: jg.apply(nm, xv, gv) if nm in BINARY else jg.apply(nm, xv)
            for nm in UNARY + BINARY}
    total = vals["exp"]
    for nm in UNARY[1:] + BINARY:
        total = total + vals[nm]
    graph.output(total=total, **vals)
    out, kernels = _run(graph, {"x": x, "g": gr}, fuse)
    assert kernels == (1 if fuse else 2 * len(UNARY + BINARY) - 1)
    for nm in UNARY + BINARY:
        err = errors(nm, x, gr if nm in BINARY else None, out[nm])
        i = int(np.argmax(err))
        assert err[i] <= BOUND[dtype][nm], f"{nm} {dt}: {err[i]:.2f} ulp at x={x[i]!r}"


@pytest.mark.parametrize("fuse", [False, True], ids=["alone", "fused"])
def test_compiled_f32_pow_within_half_an_ulp(fuse):
    """float32 pow (approx.fpow) for integer, half-integer and other exponents, both signs and
    every special of x: within 0.5 ulp of float64 np.power and NaN exactly where numpy's float32
    np.power (the interpreter) is NaN; alone and fused with the exponents' sum. Fused, one
    exponent for each of fpow's cases (x^0, an odd and an even integer, sqrt, a non-integer,
    overflow and underflow): 13 copies of its float64 exp and log inlined in one kernel took
    LLVM 90 s of CI."""
    import jitgraph as jg
    ps = ((0.0, 3.0, -2.0, 0.5, -2.5, 100.0) if fuse else
          (0.0, 1.0, 2.0, 3.0, -1.0, -2.0, 0.5, -0.5, 1.7, -2.5, 7.0, 0.1, 100.0))
    x = np.concatenate([_sweep(np.float32, 1 << 14), _specials(np.float32)])
    graph = jg.Graph("pow_f32")
    xv = graph.input("x", x.shape, "f32")
    vals = {f"p{i}": jg.pow(xv, p) for i, p in enumerate(ps)}
    total = vals["p0"]
    for i in range(1, len(ps)):
        total = total + vals[f"p{i}"]
    graph.output(total=total, **vals)
    out, kernels = _run(graph, {"x": x}, fuse)
    assert (kernels == 1) == fuse
    for i, p in enumerate(ps):
        with np.errstate(all="ignore"):
            want = np.power(x.astype(np.float64), np.float64(np.float32(p)))   # p as the op has it
            interp = np.power(x, np.float32(p))
        got = out[f"p{i}"]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(interp), err_msg=f"p={p}")
        ok = ~np.isnan(interp)
        err = ulp_error(got[ok], want[ok], np.float32)
        assert err.max() <= 0.5, f"p={p}: {err.max():.2f} ulp at x={x[ok][np.argmax(err)]!r}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_fused_chain_against_float64(dtype):
    """A chain of the nine functions, each reading the one before, fused into one kernel: each
    member's value (every member is an output, so the kernel stores it) is within its bound of
    the reference evaluated at the operands the kernel stored (the backward helpers where their
    gradient operand is finite, and in float64 below 2e21: dsilu_back's tail beyond -800 is 0,
    g x e^x rounded, only below that)."""
    import jitgraph as jg
    dt = np.dtype(dtype).name.replace("float", "f")
    rng = np.random.default_rng(2)
    n = 1 << 16
    x = np.concatenate([rng.standard_normal(n) * 4, _specials(dtype)]).astype(dtype)
    y = np.concatenate([rng.standard_normal(n) * 2, _specials(dtype)[::-1]]).astype(dtype)
    graph = jg.Graph(f"chain_{dt}")
    xv, yv = graph.input("x", x.shape, dt), graph.input("y", y.shape, dt)
    v = {"x": xv, "y": yv}
    chain = [("sigmoid", "s", ("x",)), ("sub", "d", ("y", "s")), ("tanh", "t", ("d",)),
             ("mul", "m", ("x", "t")), ("softplus", "p", ("m",)), ("log", "l", ("p",)),
             ("sub", "e_in", ("l", "y")), ("exp", "e", ("e_in",)), ("sub", "u", ("e", "x")),
             ("silu", "si", ("u",)), ("gelu", "ge", ("si",)), ("silu_back", "sb", ("x", "ge")),
             ("gelu_back", "gb", ("y", "sb"))]
    for op, name, args in chain:
        v[name] = jg.apply(op, *(v[a] for a in args))
    graph.output(**{name: v[name] for _, name, _ in chain})
    out, kernels = _run(graph, {"x": x, "y": y}, True)
    assert kernels == 1
    vals = {"x": x, "y": y, **out}
    for op, name, args in chain:
        if op in UNARY + BINARY:
            a, got = [vals[k] for k in args], vals[name]
            if op in BINARY:
                ok = np.abs(a[1]) < (np.inf if dtype == np.float32 else 2e21)
                a, got = [t[ok] for t in a], got[ok]
            err = errors(op, a[0], a[1] if op in BINARY else None, got)
            i = int(np.argmax(err))
            assert err[i] <= BOUND[dtype][op], \
                f"{op} {dt} in the chain: {err[i]:.2f} ulp at {[float(t[i]) for t in a]}"


if __name__ == "__main__":
    for dtype in (np.float32, np.float64):
        for name in UNARY + BINARY:
            e, at = max_error(name, dtype, n=1 << 20)
            ef, atf = max_error(name, dtype, n=1 << 16, fastmath=True, generic=True)
            print(f"{dtype.__name__:8s} {name:10s} max {e:6.3f} ulp at {at!r:>14}   "
                  f"fastmath+generic {ef:6.3f} ulp at {atf!r}")

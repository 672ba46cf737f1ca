"""Elementwise ops against closed forms evaluated element by element with Python's math module,
broadcasting against an explicit index loop, and each op's kernel `expr` against its reference."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jitgraph as jg
from jitgraph.registry import OPS

RTOL = {"f32": 2e-6, "f64": 1e-12}
X = np.array([-40.0, -3.5, -1.0, -0.25, 0.0, 0.3, 1.0, 2.0, 7.5, 30.0, -1e-3, 1e-3, 0.5])  # 13


def evaluate(fn, *arrays, dtype=None):
    """Build a graph with one input per array, apply fn, run the interpreter."""
    g = jg.Graph("t")
    ins = [g.input(f"a{i}", a.shape, dtype or a.dtype) for i, a in enumerate(arrays)]
    g.output(out=fn(*ins))
    return jg.interp.run(g, {f"a{i}": a for i, a in enumerate(arrays)})["out"]


def per_element(f, *arrays, shape=None):
    """f applied to Python floats with numpy-style broadcasting done by hand (the oracle)."""
    shape = shape or _bshape([a.shape for a in arrays])
    out = np.empty(shape)
    for idx in np.ndindex(*shape):
        out[idx] = f(*(float(a[_pick(idx, a.shape)]) for a in arrays))
    return out


def _bshape(shapes):
    nd = max(len(s) for s in shapes)
    out = []
    for i in range(nd):
        dims = {s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0} - {1}
        assert len(dims) <= 1, shapes
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _pick(idx, shape):
    idx = idx[len(idx) - len(shape):]
    return tuple(0 if d == 1 else i for i, d in zip(idx, shape))


def _sigmoid(v):
    if v >= 0:
        return 1 / (1 + math.exp(-v))
    e = math.exp(v)
    return e / (1 + e)


def _gelu(v):
    return 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))


UNARY = {   # name -> (jitgraph call, closed form, domain filter)
    "neg": (jg.neg, lambda v: -v, None),
    "sqr": (jg.sqr, lambda v: v * v, None),
    "sqrt": (jg.sqrt, math.sqrt, lambda v: v >= 0),
    "exp": (jg.exp, math.exp, None),
    "log": (jg.log, math.log, lambda v: v > 0),
    "abs": (jg.abs, lambda v: -v if v < 0 else v, None),
    "sgn": (jg.sgn, lambda v: (v > 0) - (v < 0), None),
    "step": (jg.step, lambda v: 1.0 if v > 0 else 0.0, None),
    "relu": (jg.relu, lambda v: v if v > 0 else 0.0, None),
    "leaky_relu": (lambda x: jg.leaky_relu(x, 0.2), lambda v: v if v > 0 else 0.2 * v, None),
    "sigmoid": (jg.sigmoid, _sigmoid, None),
    "tanh": (jg.tanh, math.tanh, None),
    "softplus": (jg.softplus, lambda v: max(v, 0) + math.log1p(math.exp(-abs(v))), None),
    "gelu": (jg.gelu, _gelu, None),
    "silu": (jg.silu, lambda v: v * _sigmoid(v), None),
    "clamp": (lambda x: jg.clamp(x, -1.0, 2.0), lambda v: min(max(v, -1.0), 2.0), None),
    "scale": (lambda x: jg.scale(x, -2.5), lambda v: -2.5 * v, None),
    "pow": (lambda x: x ** 3, lambda v: v ** 3, None),
    "pow_frac": (lambda x: jg.pow(x, 0.5), lambda v: v ** 0.5, lambda v: v >= 0),
}


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_closed_form(name, dtype):
    fn, f, domain = UNARY[name]
    x = np.array([v for v in X if domain is None or domain(v)], jg.TensorType(dtype, ()).np_dtype)
    x = x.reshape(-1, 1) if name in ("exp", "tanh") else x   # a 2-D case too
    out = evaluate(fn, x)
    assert out.dtype == x.dtype and out.shape == x.shape
    np.testing.assert_allclose(out, per_element(f, x), rtol=RTOL[dtype], atol=1e-30)


BINARY = {
    "add": (jg.add, lambda a, b: a + b), "sub": (jg.sub, lambda a, b: a - b),
    "mul": (jg.mul, lambda a, b: a * b), "div": (jg.div, lambda a, b: a / b),
    "maximum": (jg.maximum, max), "minimum": (jg.minimum, min),
}
SHAPES = [((7, 13), (13,)), ((7, 1), (1, 13)), ((), (7, 13)), ((1,), (13,)),
          ((7, 1, 13), (1, 5, 1)), ((1, 1), (1, 1)), ((5, 3), (5, 3)), ((0, 3), (1, 3))]


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_broadcasting(name, shapes, dtype):
    fn, f = BINARY[name]
    rng = np.random.default_rng(len(shapes[0]) * 10 + len(shapes[1]))
    npdt = jg.TensorType(dtype, ()).np_dtype
    a, b = ((rng.uniform(0.5, 2.0, s) * rng.choice([-1, 1], s)).astype(npdt) for s in shapes)
    out = evaluate(fn, a, b)
    assert out.dtype == npdt
    np.testing.assert_allclose(out, per_element(f, a, b), rtol=RTOL[dtype])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 7]), min_size=0, max_size=4),
       st.lists(st.booleans(), min_size=4, max_size=4), st.integers(0, 3))
def test_broadcast_property(shape, ones, drop):
    """Random broadcast-compatible shape pairs: add and mul agree with numpy."""
    other = [1 if o else d for d, o in zip(shape, ones)][drop:]
    rng = np.random.default_rng(len(shape))
    a, b = rng.standard_normal(shape), rng.standard_normal(other)
    np.testing.assert_allclose(evaluate(jg.add, a, b), np.add(a, b), rtol=1e-15)
    np.testing.assert_allclose(evaluate(lambda x, y: y * x, a, b), np.multiply(a, b), rtol=1e-15)


def test_ops_with_python_scalars_keep_dtype():
    x = np.array([1.5, -2.0, 4.0], np.float32)
    out = evaluate(lambda t: (2 - t) * 3 + 1.0 / t - t / 4, x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, per_element(lambda v: (2 - v) * 3 + 1 / v - v / 4, x), rtol=1e-6)


def test_integer_dtype_behaviour():
    a = np.array([[3, -7, 0], [12, 5, -1]], np.int32)
    b = np.array([2, -3, 13], np.int32)
    for fn, f in [(jg.add, lambda p, q: p + q), (jg.sub, lambda p, q: p - q),
                  (jg.mul, lambda p, q: p * q), (jg.maximum, max), (jg.minimum, min)]:
        out = evaluate(fn, a, b)
        assert out.dtype == np.int32
        np.testing.assert_array_equal(out, per_element(f, a, b))
    out = evaluate(lambda t: jg.abs(-t) + jg.sgn(t) + jg.step(t) + t * 2 - 1, a)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, per_element(
        lambda v: abs(v) + (v > 0) - (v < 0) + (v > 0) + 2 * v - 1, a))
    for fn in (jg.exp, jg.relu, jg.sigmoid, lambda t: t / t, jg.sqrt):
        with pytest.raises(jg.ShapeError, match="must be a float"):
            evaluate(fn, a)


def test_mixed_dtypes_rejected():
    g = jg.Graph("t")
    x, y = g.input("x", (3,), "f32"), g.input("y", (3,), "f64")
    with pytest.raises(jg.ShapeError, match=r"add: dtypes differ: x f32\[3\], y f64\[3\]"):
        x + y


def test_cast():
    x = np.array([-2.7, -0.5, 0.0, 0.49, 1.5, 1e10 + 0.3, 123.456], np.float64)
    to32 = evaluate(lambda t: jg.cast(t, "f32"), x)
    assert to32.dtype == np.float32
    assert [float(v) for v in to32] == [float(np.float32(v)) for v in x]   # round to nearest
    xi = x[np.abs(x) < 1e9]
    toi = evaluate(lambda t: jg.cast(t, np.int32), xi)
    assert toi.dtype == np.int32 and list(toi) == [int(v) for v in xi]   # truncate toward zero
    i = np.array([-5, 0, 2 ** 24 + 1, 7], np.int32)
    back = evaluate(lambda t: jg.cast(t, "f64"), i)
    assert back.dtype == np.float64 and list(back) == [float(v) for v in i]
    same = evaluate(lambda t: jg.cast(t, "f64"), x)
    np.testing.assert_array_equal(same, x)


def test_where():
    c = np.array([[0.0, 1.0, -2.0], [0.5, 0.0, 0.0]], np.float32)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([-1.0, -2.0, -3.0], np.float32)
    out = evaluate(jg.where, c, a, b)
    np.testing.assert_array_equal(out, per_element(lambda k, p, q: p if k != 0 else q, c, a, b))
    out = evaluate(lambda k, p: jg.where(k, p, 9.0), c, a)
    np.testing.assert_array_equal(out, per_element(lambda k, p: p if k != 0 else 9.0, c, a))
    ci = np.array([1, 0, 3], np.int32)
    out = evaluate(lambda k, q: jg.where(k, 7.0, q), ci, b)
    np.testing.assert_array_equal(out, [7.0, -2.0, 7.0])


def test_full_and_full_like():
    g = jg.Graph("t")
    x = g.input("x", (2, 3), "f64")
    g.output(a=jg.full_like(x, 2.5), b=jg.const(g, -1, "i32", (4,)))
    out = jg.interp.run(g, {"x": np.zeros((2, 3))})
    assert out["a"].dtype == np.float64 and out["a"].shape == (2, 3) and (out["a"] == 2.5).all()
    assert out["b"].dtype == np.int32 and list(out["b"]) == [-1] * 4


def _numeric_derivative(f, v, h=1e-6):
    return (f(v + h) - f(v - h)) / (2 * h)


@pytest.mark.parametrize("name,f", [("silu_back", lambda v: v * _sigmoid(v)), ("gelu_back", _gelu)])
def test_back_ops_are_derivatives(name, f):
    x = np.array([v for v in X if abs(v) < 20])
    gr = np.linspace(-2.0, 3.0, x.size)
    out = evaluate(lambda t, u: jg.apply(name, t, u), x, gr)
    np.testing.assert_allclose(out, gr * per_element(lambda v: _numeric_derivative(f, v), x),
                               rtol=1e-7, atol=1e-9)


def test_clamp_back():
    x = np.array([-3.0, -1.0, 0.0, 1.9, 2.0, 2.1])
    gr = np.arange(1.0, 7.0)
    out = evaluate(lambda t, u: jg.apply("clamp_back", t, u, lo=-1.0, hi=2.0), x, gr)
    np.testing.assert_array_equal(out, [0.0, 2.0, 3.0, 4.0, 5.0, 0.0])


def test_back_op_shape_check():
    g = jg.Graph("t")
    x, gr = g.input("x", (3,)), g.input("g", (2, 3))
    with pytest.raises(jg.ShapeError, match=r"silu_back: gradient g f32\[2,3\] does not match"):
        jg.apply("silu_back", x, gr)


def _expr_value(op, attrs, args):
    """Evaluate an op's kernel expression on Python floats, attributes as literals."""
    m = SimpleNamespace(**{k: getattr(math, k) for k in dir(math) if not k.startswith("_")})
    m.exp = lambda v: math.exp(v) if v < 709.0 else math.inf   # numba's numpy error model
    env = {"math": m, "inf": math.inf, "max": max, "min": min, "abs": abs}
    lits = {k: repr(float(v)) for k, v in attrs.items() if isinstance(v, (int, float))}
    return eval(OPS[op].expr.format(*[repr(a) for a in args], **lits), env)  # noqa: S307


EXPR_ATTRS = {"scale": {"s": -2.5}, "pow": {"p": 3.0}, "leaky_relu": {"slope": 0.2},
              "clamp": {"lo": -1.0, "hi": 2.0}, "clamp_back": {"lo": -1.0, "hi": 2.0},
              "cast": {"dtype": "f64"}}


ELEMENTWISE = sorted(n for n, d in OPS.items() if d.ref.__module__ == "jitgraph.ops.elementwise")


@pytest.mark.parametrize("op", [n for n in ELEMENTWISE if OPS[n].arity])
def test_expr_matches_reference(op):
    """The scalar expression the code generators lower must compute what `ref` computes."""
    d = OPS[op]
    attrs = d.check_attrs(EXPR_ATTRS.get(op, {}))
    rng = np.random.default_rng(0)
    n = d.arity
    vals = [X[rng.permutation(X.size)] for _ in range(n)]
    if op in ("log", "sqrt"):
        vals = [np.abs(v) + 0.1 for v in vals]
    if op == "div":
        vals[1] = np.where(vals[1] == 0, 1.0, vals[1])
    ref = np.asarray(d.ref(attrs, *vals), np.float64)
    for i in range(X.size):
        want = ref[i]
        got = _expr_value(op, attrs, [float(v[i]) for v in vals])
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-300), (op, i, got, want)

"""vjp rules of the elementwise, reduction and shape ops against central differences (float64)."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph.registry import OPS
from jitgraph.testing import check_grad

CORE = ("jitgraph.ops.elementwise", "jitgraph.ops.reduce", "jitgraph.ops.shape")
NO_VJP = {"full", "silu_back", "gelu_back"}   # no operands / second derivatives not provided


def normal(rng, shape):
    return rng.standard_normal(shape)


def positive(rng, shape):
    return rng.uniform(0.5, 2.0, shape)


def away_from_zero(rng, shape):
    return rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)


# Every probed element must agree to a relative 1e-6; central differences with eps=1e-6 have an
# absolute noise floor of ~|loss| * 1e-10, so gradients below ~1e-2 are held to ATOL instead.
ATOL = 1e-8


def grad_check(build, *shapes, gen=normal, inputs=None, expect=None, min_checked=1.0):
    """check_grad of build(params...) w.r.t. every param; returns the report after asserting that
    at least min_checked of the probed elements were really checked (not skipped at kinks).
    With `expect` the loss is the plain sum of the output, so that the derivatives are the op's
    own (ggml's grad_expect); otherwise check_grad weights every output element randomly."""
    g = jg.Graph("grad")
    ps = [g.param(f"p{i}", s) for i, s in enumerate(shapes)]
    out = build(*ps)
    g.output(out=out if expect is None else jg.sum(out))
    rng = np.random.default_rng(sum(len(s) + 1 for s in shapes))
    vals = {f"p{i}": gen(rng, s) for i, s in enumerate(shapes)}
    rep = check_grad(g, inputs or {}, vals, expect=expect, rtol=1e-6, atol=ATOL)
    for i, s in enumerate(shapes):
        _, _, checked, _ = rep.errors[f"p{i}"]
        probed = min(int(np.prod(s)), 64)
        assert checked > 0 and checked >= min_checked * probed, str(rep)
    return rep


BCAST = [((7, 13), (13,)), ((7, 1), (1, 13)), ((), (3, 4)), ((1,), (5,)), ((2, 1, 3), (4, 1))]


@pytest.mark.parametrize("shapes", BCAST, ids=str)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_grads(op, shapes):
    fn = getattr(jg, op)
    grad_check(fn, *shapes, gen=away_from_zero)
    grad_check(lambda a, b: fn(b, a), *shapes, gen=away_from_zero)


UNARY = {
    "neg": (jg.neg, normal), "sqr": (jg.sqr, normal), "sqrt": (jg.sqrt, positive),
    "exp": (jg.exp, normal), "log": (jg.log, positive), "sigmoid": (jg.sigmoid, normal),
    "tanh": (jg.tanh, normal), "softplus": (jg.softplus, normal), "gelu": (jg.gelu, normal),
    "silu": (jg.silu, normal), "scale": (lambda x: jg.scale(x, -1.75), normal),
    "pow3": (lambda x: x ** 3, normal), "pow_half": (lambda x: jg.pow(x, 0.5), positive),
    "pow_neg": (lambda x: jg.pow(x, -1.5), positive),
    "cast": (lambda x: jg.cast(x, "f32") * x, normal),
    "rsub_rdiv": (lambda x: (2.0 - x) / (3.0 + x * x), normal),
}


@pytest.mark.parametrize("shape", [(7, 13), (1,), (), (3, 1, 2)], ids=str)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_grads(name, shape):
    fn, gen = UNARY[name]
    grad_check(fn, shape, gen=gen)


def test_where_grads():
    cond = np.array([[1.0, 0.0, 2.0], [0.0, 0.0, -1.0]])
    g = jg.Graph("w")
    c = g.input("c", (2, 3), "f64")
    a, b = g.param("a", (2, 3), "f64"), g.param("b", (3,), "f64")
    g.output(out=jg.where(c, a, b) * jg.where(c, 2.0, b))
    rng = np.random.default_rng(0)
    rep = check_grad(g, {"c": cond}, {"a": rng.standard_normal((2, 3)), "b": rng.standard_normal(3)})
    assert rep.errors["a"][2] == 6 and rep.errors["b"][2] == 3


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("shape,axis", [((7, 13), None), ((7, 13), 0), ((7, 13), 1),
                                        ((3, 1, 5), (0, 2)), ((3, 1, 5), 1), ((2, 3), ())], ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "logsumexp", "max"])
def test_reduction_grads(op, shape, axis, keepdims):
    fn = getattr(jg, op)
    # random normals have no ties, so max is differentiable at every probed point
    grad_check(lambda x: jg.sqr(fn(x, axis=axis, keepdims=keepdims)), shape)


def test_max_splits_gradient_among_ties():
    g = jg.Graph("m")
    x = g.param("x", (3, 4), "f64")
    g.output(loss=jg.sum(jg.max(x, axis=1) * jg.const(g, 1.0, "f64", (3,)) * 6.0))
    gg = jg.grad(g, "loss")
    xv = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, 2.0], [-5.0, -4.0, -9.0, -4.5]])
    d = jg.interp.run(gg, {}, {"x": xv})["grad/x"]
    np.testing.assert_array_equal(d, [[0, 3, 3, 0], [1.5, 1.5, 1.5, 1.5], [0, 6, 0, 0]])


def test_shape_op_grads():
    grad_check(lambda x: jg.reshape(x, (13, 1, 7)), (7, 13))
    grad_check(lambda x: jg.permute(x, (2, 0, 1)), (2, 3, 5))
    grad_check(lambda x: x.T, (7, 13))
    grad_check(lambda x: jg.broadcast_to(x, (2, 7, 13)), (7, 1))
    grad_check(lambda x: jg.broadcast_to(x, (4, 3)), ())
    grad_check(lambda a, b, c: jg.concat([a, b, c], axis=1), (3, 2), (3, 1), (3, 4))
    grad_check(lambda a, b: jg.concat([a, b, a], axis=0), (1, 5), (2, 5))
    grad_check(lambda x: jg.pad(x, [(1, 2), (0, 3)], value=5.0), (3, 4))


@pytest.mark.parametrize("specs", [[(1, 4)], [(2, 2)], [(None, None, -1)], [(11, 1, -3)],
                                   [(1, None, 4)], [(1, 4), (None, None, -2)],
                                   [(-2, None), (4, 0, -1)]], ids=str)
def test_slice_grads(specs):
    shape = (13,) if len(specs) == 1 else (5, 6)
    grad_check(lambda x: jg.slice(x, *specs) * 1.0, shape)


def test_slice_vjp_uses_pad_for_unit_steps_and_scatter_otherwise():
    for specs, back in [([(1, 4)], "pad"), ([(None, None, -1)], "slice_back"), ([(0, 7, 2)], "slice_back")]:
        g = jg.Graph("s")
        x = g.param("x", (7,))
        g.output(loss=jg.sum(jg.slice(x, *specs)))
        ops = [n.op for n in jg.grad(g).nodes]
        assert back in ops, (specs, ops)


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_grads(ta, tb):
    sa, sb = ((4, 3) if ta else (3, 4)), ((5, 4) if tb else (4, 5))
    grad_check(lambda a, b: jg.matmul(a, b, ta=ta, tb=tb), sa, sb)


def test_batched_matmul_grads():
    grad_check(jg.matmul, (2, 1, 3, 4), (5, 4, 2))
    grad_check(jg.matmul, (3, 4), (2, 4, 1))


def test_get_rows_grads_accumulate_repeats():
    idx = np.array([[4, 0, 4], [1, 4, 2]], np.int32)

    def build(w):
        return jg.get_rows(w, w.graph.input("idx", idx.shape, "i32"))
    grad_check(build, (6, 3), inputs={"idx": idx})
    grad_check(build, (6,), inputs={"idx": idx})


def test_scatter_op_grads():
    """slice_back, get_rows_back and clamp_back are linear in their gradient operand."""
    grad_check(lambda gr: jg.apply("slice_back", gr, shape=(5, 3), slices=((4, -1, -3), (0, 3, 2))),
               (2, 2))
    idx = np.array([3, 0, 3], np.int32)
    grad_check(lambda gr: jg.apply("get_rows_back", gr, gr.graph.input("idx", (3,), "i32"),
                                   n_rows=4), (3, 2), inputs={"idx": idx})
    xv = np.array([-3.0, -1.0, 0.5, 2.5])
    grad_check(lambda gr: jg.apply("clamp_back", gr.graph.input("x", (4,)), gr, lo=-1.5,
                                   hi=2.0), (4,), inputs={"x": xv})


KINKED = {   # name -> (fn, valid gradients at the kinks, values planted exactly on kinks)
    "relu": (jg.relu, (0.0, 1.0), 0.0),
    "leaky_relu": (lambda x: jg.leaky_relu(x, 0.1), (0.1, 1.0), 0.0),
    "abs": (jg.abs, (-1.0, 1.0), 0.0),
    "step": (lambda x: jg.step(x) * 3.0 + x, (1.0,), 0.0),
    "sgn": (lambda x: jg.sgn(x) * 3.0 + x, (1.0,), 0.0),
    "clamp": (lambda x: jg.clamp(x, -0.5, 0.5), (0.0, 1.0), 0.5),
    "max": (lambda x: jg.max(x, axis=1), (0.0, 1.0), None),
}


@pytest.mark.parametrize("shape", [(7, 13), (3, 1)], ids=str)
@pytest.mark.parametrize("name", sorted(KINKED))
def test_nondifferentiable_grads(name, shape):
    fn, expect, kink = KINKED[name]

    def gen(rng, s):
        x = rng.standard_normal(s)
        if kink is not None:
            x.reshape(-1)[::5] = kink      # every fifth element sits exactly on the kink
        return x
    grad_check(fn, shape, gen=gen, expect=expect, min_checked=0.6)


@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_maximum_minimum_grads(op):
    fn = getattr(jg, op)
    tie = lambda rng, s: np.round(rng.standard_normal(s), 1)  # noqa: E731  (some exact ties)
    rep = grad_check(fn, (7, 13), (7, 13), gen=tie, expect=(0.0, 1.0), min_checked=0.8)
    assert sum(rep.errors[k][3] for k in rep.errors) > 0       # the ties were seen and skipped
    grad_check(fn, (7, 13), (13,), min_checked=0.8)            # broadcast: kinks still skipped


def test_back_ops_appear_in_backward_graphs():
    for fn, back in [(jg.silu, "silu_back"), (jg.gelu, "gelu_back"),
                     (lambda x: jg.clamp(x, -1.0, 1.0), "clamp_back")]:
        g = jg.Graph("b")
        x = g.param("x", (4,))
        g.output(loss=jg.sum(fn(x)))
        assert back in [n.op for n in jg.grad(g).nodes]


def test_integer_results_get_no_gradient():
    g = jg.Graph("i")
    x = g.param("x", (3, 4), "f64")
    y = g.input("y", (3,), "i32")
    hits = jg.cast(jg.count_equal(jg.argmax(x, axis=1), y), "f64")
    g.output(loss=jg.sum(x * x) + hits)
    gg = jg.grad(g, "loss")
    xv = np.arange(12.0).reshape(3, 4)
    d = jg.interp.run(gg, {"y": np.array([3, 0, 3], np.int32)}, {"x": xv})["grad/x"]
    np.testing.assert_array_equal(d, 2 * xv)


def test_every_core_op_has_a_vjp():
    core = {n for n, d in OPS.items() if d.ref.__module__ in CORE}
    assert {"max", "logsumexp", "argmax", "count_equal", "concat", "slice", "pad", "get_rows",
            "slice_back", "get_rows_back"} <= core
    missing = sorted(n for n in core - NO_VJP if OPS[n].vjp is None)
    assert not missing

"""Regressions of issue 14, each in every configuration (fuse x plan_memory), each program run
several times with different inputs against the reference interpreter (outputs and params):
  1. fused mean / argmax (and the other reductions) over axes all of size 1;
  2. a GEMM epilogue reading a value of the GEMM's prologue (residual over an activation);
  3. the patterns pass keeping a constant that is the row op's own operand;
  4. an output that is an updated param (or a view or no-op of it) is its pre-update value;
  5. a reduction over no axes fused with its prologue."""
import numpy as np
import pytest

import jitgraph as jg

CONFIGS = [pytest.param(f, p, id=f"fuse={f}-plan={p}") for f in (True, False)
           for p in (True, False)]
TOL = dict(rtol=2e-5, atol=2e-6)


def feeds_for(g, seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(g.nodes[i].type.shape).astype(g.nodes[i].type.np_dtype)
            for k, i in g.inputs.items()}


def check(g, fuse, plan, steps=3, loss=None, optimizer=None, feeds=None, params=None):
    """Compile g, run it `steps` times with fresh inputs, and compare every output and every
    param after each step with the interpreter on the same (training) graph. Returns the
    program and the list of its outputs."""
    prog = jg.compile(g, loss=loss, optimizer=optimizer, fuse=fuse, plan_memory=plan)
    ref_g = g if optimizer is None else jg.training_graph(g, loss, optimizer)
    ref_p = ref_g.init_params(0)
    ref_p.update(params or {})
    for k in g.params:
        prog.params[k] = ref_p[k]
    got_all = []
    for step in range(steps):
        feed = feeds[step] if feeds else feeds_for(g, step)
        extra = optimizer.runtime_inputs(step) if optimizer is not None else {}
        ref = jg.interp.run(ref_g, {**feed, **extra}, ref_p)
        got = prog.step(**feed)
        assert set(got) == set(g.outputs)
        for k, v in got.items():
            assert v.dtype == ref[k].dtype and v.shape == ref[k].shape, k
            np.testing.assert_allclose(v, ref[k], err_msg=f"step {step}: {k}", **TOL)
        for k in g.params:
            np.testing.assert_allclose(prog.params[k], ref_p[k], err_msg=f"step {step}: {k}",
                                       **TOL)
        got_all.append(got)
    return prog, got_all


def kinds(prog):
    return [(k.kind, len(k.nodes)) for k in prog._products.kernels.kernels]


# ---- 1. reductions over size-1 axes ----------------------------------------------------------
@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_mean_over_a_size_one_axis(fuse, plan):
    g = jg.Graph("a")
    x = g.input("x", (1,))
    g.output(y=jg.mean(jg.exp(x)))
    feeds = [{"x": np.array([0.5], np.float32)}, {"x": np.array([-1.5], np.float32)}]
    _, got = check(g, fuse, plan, steps=2, feeds=feeds)
    np.testing.assert_allclose(got[0]["y"], np.exp(0.5), rtol=1e-6)


@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_reductions_with_prologues_over_size_one_axes(fuse, plan):
    g = jg.Graph("a")
    x = g.input("x", (3, 1))
    z = g.input("z", (1, 4, 1))
    g.output(i=jg.argmax(jg.exp(x), axis=1), m=jg.mean(jg.sqr(x), axis=1),
             s=jg.sum(jg.tanh(z), axis=(0, 2), keepdims=True), mx=jg.max(jg.exp(z), axis=0),
             l=jg.logsumexp(jg.sigmoid(z), axis=2))
    prog, _ = check(g, fuse, plan)
    assert not fuse or ("reduce", 2) in kinds(prog), prog.ir("fuse")


@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_training_losses_over_size_one_outputs(fuse, plan):
    g = jg.Graph("a")
    x, t = g.input("x", (1, 3)), g.input("t", (1, 1))
    w = g.param("w", (3, 1), init=jg.init.normal(0.0, 0.5))
    v = g.param("v", (1,), init=jg.init.normal(0.0, 0.5))
    g.output(loss=jg.mse(jg.tanh(x @ w), t) + jg.mean(jg.sqr(v * 2.0)))
    check(g, fuse, plan, loss="loss", optimizer=jg.optim.SGD(lr=0.1))


# ---- 2. GEMM epilogue reading the GEMM's prologue ----------------------------------------------
@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_gemm_epilogue_reads_its_prologue(fuse, plan):
    g = jg.Graph("a")
    x = g.input("x", (3, 5))
    w = g.param("w", (5, 5), init=jg.init.normal(0.0, 1.0))
    t = jg.relu(x)
    u = jg.sigmoid(x) * 2.0        # a prologue value the epilogue reads, no GEMM operand
    v = u + 1.0
    g.output(z=t @ w + t, r=jg.tanh((v * x) @ w) * u)
    prog, _ = check(g, fuse, plan)
    assert not fuse or sum(k == "gemm" for k, _ in kinds(prog)) == 2, prog.ir("fuse")


@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_training_a_residual_layer(fuse, plan):
    g = jg.Graph("a")
    p = g.param("p", (4, 6), init=jg.init.normal(0.0, 1.0))
    w = g.input("w", (6, 6))
    g.output(loss=jg.mean(jg.sqr(jg.tanh(p @ w + p))))
    check(g, fuse, plan, loss="loss", optimizer=jg.optim.SGD(lr=0.1))


# ---- 3. a constant as the row op's operand ----------------------------------------------------
def _keep(f, c):
    return f(c, axis=-1, keepdims=True)


ROW_FORMS = {
    "softmax_lse": lambda c: jg.exp(c - _keep(jg.logsumexp, c)),
    "softmax_max": lambda c: jg.exp(c - _keep(jg.max, c)) / _keep(
        jg.sum, jg.exp(c - _keep(jg.max, c))),
    "log_softmax_lse": lambda c: c - _keep(jg.logsumexp, c),
    "log_softmax_max": lambda c: (c - _keep(jg.max, c)) - jg.log(
        _keep(jg.sum, jg.exp(c - _keep(jg.max, c)))),
    "layer_norm": lambda c: (c - _keep(jg.mean, c)) / jg.sqrt(
        _keep(jg.mean, jg.sqr(c - _keep(jg.mean, c))) + 1e-5),
}


@pytest.mark.parametrize("form", ROW_FORMS)
@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_row_op_of_a_constant(form, fuse, plan):
    g = jg.Graph("a")
    x = g.input("x", (3, 4))
    c = jg.full_like(x, 0.5)
    g.output(y=ROW_FORMS[form](c) + x)
    prog, _ = check(g, fuse, plan, steps=2)
    assert not fuse or prog._products.reports[0].stats["rewritten"] == 1, prog.ir("patterns")


# ---- 4. outputs that are updated params ----------------------------------------------------------
@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_output_of_an_updated_param_is_its_value_before_the_update(fuse, plan):
    g = jg.Graph("a")
    x = g.input("x", (3,))
    c = g.param("c", (3,), trainable=False)
    g.update(c=c + x)
    g.output(c_now=c, y=c * 2.0, c_cast=jg.cast(c, "f32"), c_b=jg.broadcast_to(c, (3,)),
             c_view=c.reshape(3, 1))
    feeds = [{"x": np.array([1, 2, 3], np.float32)}, {"x": np.array([-4, 0.5, 2], np.float32)},
             {"x": np.array([0, 1, -1], np.float32)}]
    _, got = check(g, fuse, plan, feeds=feeds)
    np.testing.assert_array_equal(got[0]["c_now"], [0, 0, 0])
    np.testing.assert_array_equal(got[1]["c_now"], [1, 2, 3])
    for out in got:
        for k in ("c_cast", "c_b"):
            np.testing.assert_array_equal(out[k], out["c_now"])
        np.testing.assert_array_equal(out["y"], out["c_now"] * 2)


@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_output_of_a_trained_param(fuse, plan):
    g = jg.Graph("a")
    x, t = g.input("x", (4, 3)), g.input("t", (4, 2))
    w = g.param("w", (3, 2), init=jg.init.normal(0.0, 0.5))
    b = g.param("b", (2,), init=jg.init.normal(0.0, 0.5))
    g.output(loss=jg.mse(jg.tanh(x @ w + b), t), b_out=b, w_out=jg.cast(w, "f32"))
    check(g, fuse, plan, loss="loss", optimizer=jg.optim.Adam(lr=0.05))


# ---- 5. reductions over no axes --------------------------------------------------------------
@pytest.mark.parametrize("both", [True, False])
@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_reduction_over_no_axes_with_a_prologue(both, fuse, plan):
    g = jg.Graph("a")
    x = g.input("x", (2, 2))
    q = jg.sqr(x)
    outs = dict(a=jg.sum(q, axis=()), m=jg.max(jg.exp(x), axis=()),
                l=jg.logsumexp(jg.tanh(x), axis=()), n=jg.mean(jg.sigmoid(x), axis=()))
    if both:
        outs["b"] = jg.sum(q, axis=1)
    g.output(**outs)
    feeds = [{"x": np.array([[1, -2], [3, .5]], np.float32)}] + [feeds_for(g, s) for s in (1, 2)]
    _, got = check(g, fuse, plan, feeds=feeds)
    np.testing.assert_allclose(got[0]["a"], [[1, 4], [9, .25]], rtol=1e-6)
    if both:
        np.testing.assert_allclose(got[0]["b"], [5, 9.25], rtol=1e-6)


@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_large_reduction_over_no_axes(fuse, plan):
    g = jg.Graph("a")
    x = g.input("x", (600, 1000))
    g.output(a=jg.sum(jg.sqr(x) - x, axis=()))
    check(g, fuse, plan, steps=2)


# ---- found by the random-graph tester (jitgraph/testing/) ---------------------------
VIEWS_OF_A_SCALAR = {
    "transpose": lambda x: x.T,                        # the interpreter returned shape (1,)
    "slice": lambda x: jg.slice(x),                    # did not compile (lib_shape.slice)
    "slice_then_math": lambda x: jg.exp(jg.slice(x)) * 2.0,
    "full_slice_2d": lambda x: jg.slice(jg.broadcast_to(x, (2, 3)), slice(0, 2), slice(0, 3)),
}


@pytest.mark.parametrize("view", sorted(VIEWS_OF_A_SCALAR))
@pytest.mark.parametrize("fuse,plan", CONFIGS)
def test_views_of_a_scalar(view, fuse, plan):
    g = jg.Graph("scalar_view")
    x = g.input("x", ())
    y = VIEWS_OF_A_SCALAR[view](x)
    g.output(y=y)
    _, outs = check(g, fuse, plan)
    assert all(o["y"].shape == y.shape for o in outs)

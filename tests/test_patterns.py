"""The patterns pass: softmax, log_softmax, rms_norm and layer_norm written from primitives
become their row ops (and one rows kernel), only with fusion on; the rewritten programs agree
with the unfused ones and the interpreter, forward and backward; near misses stay as written."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import ops
from jitgraph.cli.main import STAGES as CLI_STAGES
from jitgraph.registry import OPS
from jitgraph.passes.autodiff import grad
from jitgraph.passes.patterns import recognise_patterns
from jitgraph.passes.pipeline import STAGES

TOL = dict(rtol=2e-5, atol=2e-6)
GRAD_TOL = dict(rtol=2e-4, atol=2e-5)
ROW_OPS = {op for op, d in OPS.items() if d.kind == "rows"}


def _keep(f, x, axis=-1):
    return f(x, axis=axis, keepdims=True)


# ---- the primitive forms, one builder each: (x, w) -> value ------------------------------------
def softmax_shared(x, w):
    e = ops.exp(x - _keep(ops.max, x))
    return e / _keep(ops.sum, e)


def softmax_repeated(x, w):
    """exp(x - max(x)) written out twice: structurally equal nodes, not one shared node."""
    return ops.exp(x - _keep(ops.max, x)) / _keep(ops.sum, ops.exp(x - _keep(ops.max, x)))


def softmax_lse(x, w):
    return ops.exp(x - _keep(ops.logsumexp, x))


def log_softmax_max(x, w):
    d = x - _keep(ops.max, x)
    return d - ops.log(_keep(ops.sum, ops.exp(d)))


def log_softmax_lse(x, w):
    return x - _keep(ops.logsumexp, x)


def rms_div(x, w):
    return x / ops.sqrt(_keep(ops.mean, x * x) + 1e-6) * w


def rms_rsqrt(x, w):
    return x * (1.0 / ops.sqrt(_keep(ops.mean, ops.sqr(x)) + 1e-5))


def rms_pow(x, w):
    return ops.pow(1e-6 + _keep(ops.sum, ops.pow(x, 2)) / x.shape[-1], -0.5) * x


def rms_no_eps(x, w):
    return x / ops.sqrt(_keep(ops.mean, ops.sqr(x)))


def layer_norm_affine(x, w):
    xc = x - _keep(ops.mean, x)
    return xc / ops.sqrt(_keep(ops.mean, xc * xc) + 1e-5) * w + w


def layer_norm_repeated(x, w):
    xc = x - _keep(ops.mean, x)
    var = _keep(ops.mean, ops.sqr(x - _keep(ops.mean, x)))
    return xc * (1.0 / ops.sqrt(var + 1e-3))


FORMS = {f: op for op, fs in (
    ("softmax", (softmax_shared, softmax_repeated, softmax_lse)),
    ("log_softmax", (log_softmax_max, log_softmax_lse)),
    ("rms_norm", (rms_div, rms_rsqrt, rms_pow, rms_no_eps)),
    ("layer_norm", (layer_norm_affine, layer_norm_repeated))) for f in fs}


def graph(form, shape=(6, 16), dtype="f32", prologue=True):
    """out = form(x * 0.5 (a prologue), w), and a scalar loss over it for training."""
    g = jg.Graph(form.__name__)
    x = g.input("x", shape, dtype)
    a = g.param("a", shape[-1:], dtype, init=jg.init.normal())
    w = g.param("w", shape[-1:], dtype, init=jg.init.normal())
    h = (x * a) * 0.5 if prologue else x
    out = form(h, w)
    g.output(out=out, loss=ops.mean(ops.sqr(out) * w))
    return g


def row_ops(g):
    return [n for n in g.nodes if n.op in ROW_OPS]


def feeds(g, seed=0):
    rng = np.random.default_rng(seed)
    return {k: (3 * rng.standard_normal(g.nodes[i].type.shape)).astype(g.nodes[i].type.np_dtype)
            for k, i in g.inputs.items()}


# ---- recognition -------------------------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_form_becomes_its_row_op(form):
    g = graph(form)
    new, rep = recognise_patterns(g)
    (n,) = row_ops(new)
    assert n.op == FORMS[form] and rep.stats["rewritten"] == 1 and rep.stats[n.op] == 1
    assert new.nodes[n.inputs[0]].op == "scale"          # the prologue stays, on x
    assert n.attr.get("axis", 1) == 1
    if "eps" in n.attr:
        want = {rms_div: 1e-6, rms_rsqrt: 1e-5, rms_pow: 1e-6, rms_no_eps: 0.0,
                layer_norm_affine: 1e-5, layer_norm_repeated: 1e-3}[form]
        assert n.attr["eps"] == pytest.approx(want)
    # nothing of the primitive form is left before the row op (after it: the loss)
    assert {m.op for m in new.nodes if m.id < n.id} <= {"input", "param", "mul", "scale"}
    assert set(new.outputs) == {"out", "loss"}


def test_last_axis_of_3d_and_1d():
    for shape in ((2, 3, 8), (8,)):
        new, _ = recognise_patterns(graph(softmax_shared, shape, prologue=False))
        (n,) = row_ops(new)
        assert n.attr["axis"] == len(shape) - 1


def test_several_patterns_in_one_graph_and_the_report():
    g = jg.Graph("two")
    x = g.input("x", (4, 8))
    w = g.param("w", (8,))
    g.output(a=softmax_shared(layer_norm_affine(x, w), w), b=log_softmax_lse(x, w))
    new, rep = recognise_patterns(g)
    assert sorted(n.op for n in row_ops(new)) == ["layer_norm", "log_softmax", "softmax"]
    text = str(rep)
    assert "rewritten=3" in text and "= layer_norm(x) [eps=1e-05] from 7 nodes" in text
    assert not [n for n in new.nodes if n.op == "full"]      # eps constants went with them


# ---- near misses -------------------------------------------------------------------------------
def _near_misses():
    def wrong_axis(x, w):
        e = ops.exp(x - _keep(ops.max, x, 0))
        return e / _keep(ops.sum, e, 0)

    def no_keepdims(x, w):
        e = ops.exp(x - ops.reshape(ops.max(x, axis=-1), (x.shape[0], 1)))
        return e / _keep(ops.sum, e)

    def no_max(x, w):
        e = ops.exp(x)
        return e / _keep(ops.sum, e)

    def other_x_in_max(x, w):
        e = ops.exp(x - _keep(ops.max, x * 2.0))
        return e / _keep(ops.sum, e)

    def other_x_in_norm(x, w):
        return x / ops.sqrt(_keep(ops.mean, ops.sqr(x * 2.0)) + 1e-6)

    def mean_not_centred(x, w):                     # var of x, not of x - mean
        xc = x - _keep(ops.mean, x)
        return xc / ops.sqrt(_keep(ops.mean, x * x) + 1e-5)

    def negative_eps(x, w):
        return x / ops.sqrt(_keep(ops.mean, x * x) + (-1e-5))

    def eps_not_constant(x, w):
        return x / ops.sqrt(_keep(ops.mean, x * x) + _keep(ops.mean, w * w))

    def mul_of_two_values(x, w):
        return x / ops.sqrt(_keep(ops.mean, x * (x * 1.0)) + 1e-6)

    def sqrt_not_rsqrt(x, w):
        return x * ops.sqrt(_keep(ops.mean, x * x) + 1e-6)

    return [wrong_axis, no_keepdims, no_max, other_x_in_max, other_x_in_norm, mean_not_centred,
            negative_eps, eps_not_constant, mul_of_two_values, sqrt_not_rsqrt]


@pytest.mark.parametrize("form", _near_misses(), ids=lambda f: f.__name__)
def test_near_miss_is_left_alone(form):
    g = graph(form, prologue=False)
    new, rep = recognise_patterns(g)
    assert not row_ops(new), str(new)
    assert rep.stats["rewritten"] == 0 and new is g


def _softmax_exposing(which):
    g = jg.Graph("exposed")
    x = g.input("x", (4, 8))
    m = _keep(ops.max, x)
    d = x - m
    e = ops.exp(d)
    s = _keep(ops.sum, e)
    g.output(out=e / s, extra={"max": m, "shifted": d, "exp": e, "sum": s}[which])
    return g


@pytest.mark.parametrize("which", ["max", "shifted", "exp", "sum"])
def test_intermediate_read_elsewhere_blocks_the_rewrite(which):
    g = _softmax_exposing(which)
    assert not row_ops(recognise_patterns(g)[0])
    # the same intermediate read by another node instead of an output
    g2 = jg.Graph("read")
    x = g2.input("x", (4, 8))
    m = _keep(ops.max, x)
    e = ops.exp(x - m)
    s = _keep(ops.sum, e)
    other = {"max": m, "exp": e, "sum": s}.get(which, m)
    g2.output(out=e / s + other)
    assert not row_ops(recognise_patterns(g2)[0])


def test_centred_value_read_elsewhere_falls_back_to_rms_norm_of_it():
    """xc is an output too: layer_norm would drop it, rms_norm(xc) keeps it (same value)."""
    g = jg.Graph("xc")
    x = g.input("x", (4, 8))
    xc = x - _keep(ops.mean, x)
    g.output(y=xc / ops.sqrt(_keep(ops.mean, xc * xc) + 1e-5), xc=xc)
    new, _ = recognise_patterns(g)
    (n,) = row_ops(new)
    assert n.op == "rms_norm" and new.nodes[n.inputs[0]].op == "sub"
    _agree(g, feeds(g))


def test_root_as_output_and_read_twice():
    g = jg.Graph("root")
    x = g.input("x", (4, 8))
    y = softmax_shared(x, None)
    g.output(y=y, z=y * y)
    new, _ = recognise_patterns(g)
    assert [n.op for n in row_ops(new)] == ["softmax"]
    _agree(g, feeds(g))


# ---- compiled programs -------------------------------------------------------------------------
def _agree(g, f, params=None):
    ref = jg.interp.run(g, f, params or g.init_params(0))
    progs = [jg.compile(g, fuse=fuse) for fuse in (True, False)]
    for prog in progs:
        got = prog.run(**f)
        for k, v in ref.items():
            np.testing.assert_allclose(got[k], v, err_msg=k, **TOL)
    return progs


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_fused_equals_unfused_and_interpreter(form):
    g = graph(form)
    fused, unfused = _agree(g, feeds(g))
    assert "patterns" in fused._products.ir and "patterns" not in unfused._products.ir
    assert FORMS[form] in {n.op for n in fused.graph.nodes}
    assert not ROW_OPS & {n.op for n in unfused.graph.nodes}
    rows = [k for k in fused._products.kernels.kernels if k.kind == "rows"]
    assert len(rows) == 1 and len(rows[0].nodes) >= 2          # prologue (and epilogue) fused


@pytest.mark.parametrize("form", [softmax_shared, log_softmax_max, rms_div, layer_norm_affine],
                         ids=lambda f: f.__name__)
def test_gradients_through_the_rewritten_op(form):
    g = graph(form)
    f, params = feeds(g, 1), g.init_params(0)
    progs = [jg.compile(g, loss="loss", fuse=fuse) for fuse in (True, False)]
    assert {"softmax": "softmax_back", "log_softmax": "log_softmax", "rms_norm": "rms_norm_back",
            "layer_norm": "layer_norm_back"}[FORMS[form]] in {n.op for n in progs[0].graph.nodes}
    ref = jg.interp.run(grad(g, "loss")[0], f, params)
    fused, unfused = (p.run(**f) for p in progs)
    assert {k for k in ref if k.startswith("grad/")} == {"grad/a", "grad/w"}
    for k, v in ref.items():
        np.testing.assert_allclose(fused[k], unfused[k], err_msg=k, **GRAD_TOL)
        np.testing.assert_allclose(fused[k], v, err_msg=k, **GRAD_TOL)


@pytest.mark.parametrize("form", [softmax_shared, layer_norm_affine], ids=lambda f: f.__name__)
def test_training_steps_fused_match_unfused(form):
    g = graph(form)
    opt = jg.optim.AdamW(lr=1e-2)
    progs = [jg.compile(g, loss="loss", optimizer=opt, fuse=fuse) for fuse in (True, False)]
    for i in range(3):
        f = feeds(g, i)
        a, b = (p.step(**f)["loss"] for p in progs)
        np.testing.assert_allclose(a, b, **GRAD_TOL)
    for k in progs[1].params:
        np.testing.assert_allclose(progs[0].params[k], progs[1].params[k], err_msg=k, **GRAD_TOL)


def test_float64_and_extreme_rows():
    """f64 to 1e-12; rows with huge values (the max shift keeps softmax finite) and -inf."""
    g = graph(softmax_shared, dtype="f64", prologue=False)
    f = feeds(g)
    f["x"][0] *= 1e3
    f["x"][1, :3] = -np.inf
    ref = jg.interp.run(g, f, g.init_params(0))["out"]
    got = jg.compile(g).run(**f)["out"]
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14)


# ---- the pipeline ------------------------------------------------------------------------------
def test_pipeline_stage_and_dump_choices():
    names = [name for name, _, _ in STAGES]
    assert names.index("patterns") < names.index("autodiff") < names.index("fuse")
    assert "patterns" in CLI_STAGES


def test_ir_shows_the_rewrite():
    prog = jg.compile(graph(layer_norm_affine, prologue=False))
    text = prog.ir("patterns")
    assert "layer_norm(x) [eps=1e-05]" in text and "# pass patterns: rewritten=1" in text
    (k,) = [k for k in prog._products.kernels.kernels if k.kind == "rows"]
    assert [prog.graph.nodes[m].op for m in k.nodes][:3] == ["layer_norm", "mul", "add"]


@pytest.mark.parametrize("op", [jg.softmax, jg.log_softmax], ids=["softmax", "log_softmax"])
def test_row_max_keeps_nan_and_inf_rows(op):
    """The rows kernel's vectorised row max (llvm.maximum): NaN, +inf and all -inf rows give
    what the interpreter gives."""
    g = jg.Graph("special")
    g.output(y=op(g.input("x", (5, 33)) * 0.5))
    f = feeds(g)
    f["x"][0, 7] = np.nan
    f["x"][1, 3] = np.inf
    f["x"][2] = -np.inf
    f["x"][3, 32] = 1e30
    with np.errstate(invalid="ignore", divide="ignore"):
        ref = jg.interp.run(g, f, {})["y"]
    got = jg.compile(g).run(**f)["y"]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_allclose(got[~np.isnan(ref)], ref[~np.isnan(ref)], **TOL)

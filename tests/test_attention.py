"""The attention op (jitgraph/ops/attention.py) and its CPU kernels (runtime/cpu/lib_attention.py):
the reference against the same attention composed from primitive ops (matmul, scale,
causal_mask, softmax, permute), its gradient against finite differences in float64, the
compiled forward and backward against the interpreter (serial and prange paths, GQA), the
llama builder using it, and the shape errors."""
import math

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp, ops
from jitgraph.testing import check_grad
from jitgraph.types import ShapeError

NP = {"f32": np.float32, "f64": np.float64}


def composed(q, k, v):
    """Causal GQA attention from primitive ops, as llama_forward wrote it before the op."""
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    rep = H // Hkv
    qp = ops.reshape(ops.permute(q, (0, 2, 1, 3)), (B, Hkv, rep * S, D))
    kp, vp = ops.permute(k, (0, 2, 1, 3)), ops.permute(v, (0, 2, 1, 3))
    kq = ops.scale(ops.matmul(qp, kp, tb=True), 1.0 / math.sqrt(D))
    kq = ops.softmax(ops.causal_mask(ops.reshape(kq, (B, H, S, S))))
    att = ops.matmul(ops.reshape(kq, (B, Hkv, rep * S, S)), vp)
    return ops.permute(ops.reshape(att, (B, H, S, D)), (0, 2, 1, 3))


def feeds(B, S, H, Hkv, D, dt, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(NP[dt]) for n, s in
            (("q", (B, S, H, D)), ("k", (B, S, Hkv, D)), ("v", (B, S, Hkv, D)))}


def graph(f, dt, loss=False):
    g = jg.Graph("att")
    q, k, v = (g.input(n, x.shape, dt) for n, x in f.items())
    y = ops.attention(q, k, v)
    if loss:
        r = g.input("r", y.shape, dt)
        g.output(loss=ops.sum(y * r), y=y)
    else:
        g.output(y=y, z=composed(q, k, v))
    return g


SHAPES = [(2, 5, 4, 2, 3), (3, 17, 4, 4, 8), (1, 1, 2, 1, 4), (16, 64, 8, 4, 8)]


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_and_kernel_equal_the_composition(shape):
    """f64: the op's reference == the composed primitives; the compiled kernel (the last shape
    takes the prange path) == both; f32 within float rounding."""
    for dt, tol in (("f64", 1e-12), ("f32", 2e-6)):
        f = feeds(*shape, dt)
        g = graph(f, dt)
        ref = interp.run(g, f)
        np.testing.assert_allclose(ref["y"], ref["z"], atol=tol, rtol=0)
        out = jg.compile(g).run(**f)
        np.testing.assert_allclose(out["y"], ref["z"], atol=tol, rtol=0)
        np.testing.assert_allclose(out["z"], ref["z"], atol=tol, rtol=0)


@pytest.mark.parametrize("shape", [(2, 4, 4, 2, 3), (1, 6, 2, 2, 2)])
def test_gradient_against_finite_differences(shape):
    """The vjp (attention_back's reference, then slices) against central differences in f64,
    with respect to q, k and v (GQA in the first shape)."""
    B, S, H, Hkv, D = shape
    rng = np.random.default_rng(3)
    params = {"q": rng.standard_normal((B, S, H, D)), "k": rng.standard_normal((B, S, Hkv, D)),
              "v": rng.standard_normal((B, S, Hkv, D))}
    g = jg.Graph("t")
    q, k, v = (g.param(n, x.shape, "f64") for n, x in params.items())
    g.output(out=ops.attention(q, k, v))
    res = check_grad(g, {}, params, max_elements=48)
    for n in params:
        assert res.errors[n][2] > 0, res


@pytest.mark.parametrize("shape", [(2, 5, 4, 2, 3), (16, 64, 8, 4, 8), (4, 48, 4, 4, 32)])
@pytest.mark.parametrize("dt", ["f64", "f32"])
def test_compiled_backward_equals_the_interpreter(shape, dt):
    """Gradients of sum(attention(q, k, v) * r) w.r.t. q, k, v: the compiled attention_back
    kernel (serial and prange paths) against the interpreter running the references, and in
    f64 against the gradients of the composed primitives."""
    f = feeds(*shape, dt)
    f["r"] = np.random.default_rng(9).standard_normal(
        (shape[0], shape[1], shape[2], shape[4])).astype(NP[dt])
    g = graph({n: f[n] for n in "qkv"}, dt, loss=True)
    gg = jg.grad(g, "loss", wrt=[], inputs=["q", "k", "v"])
    want = interp.run(gg, f)
    got = jg.compile(gg).run(**f)
    tol = 1e-11 if dt == "f64" else 2e-5
    for n in "qkv":
        w = want[f"grad/{n}"]
        np.testing.assert_allclose(got[f"grad/{n}"], w, atol=tol * max(1.0, np.abs(w).max()))
    if dt == "f64":
        gc = jg.Graph("c")
        q, k, v = (gc.input(n, f[n].shape, dt) for n in "qkv")
        gc.output(loss=ops.sum(composed(q, k, v) * gc.input("r", f["r"].shape, dt)))
        ref = interp.run(jg.grad(gc, "loss", wrt=[], inputs=["q", "k", "v"]), f)
        for n in "qkv":
            np.testing.assert_allclose(got[f"grad/{n}"], ref[f"grad/{n}"], atol=1e-10)



def far_apart(dt, S=40):
    """q, k, v whose rows' score maxima differ by ~120 within one block of query rows: the
    even rows score about +60 against every key, the odd rows about -60 (k along one
    direction, q along it or against it), so a shift by the block's max underflows the odd
    rows' exps entirely (float32: e^-120 is 0; float64: their sums fall under REDO_BELOW)."""
    rng = np.random.default_rng(5)
    B, H, Hkv, D = 2, 4, 2, 4
    u = np.ones(D) / 2.0
    k = u + 0.2 * rng.standard_normal((B, S, Hkv, D))
    sign = np.where(np.arange(S) % 2 == 0, 1.0, -1.0)[None, :, None, None]
    q = sign * 120.0 * u + 0.5 * rng.standard_normal((B, S, H, D))
    v = rng.standard_normal((B, S, Hkv, D))
    return {"q": q.astype(NP[dt]), "k": k.astype(NP[dt]), "v": v.astype(NP[dt])}


@pytest.mark.parametrize("dt", ["f64", "f32"])
def test_rows_far_below_the_block_max_are_redone_with_their_own(dt):
    """The kernels shift a block's exps by the block's max; rows ~120 below it (underflowing
    there) must still get their own softmax: forward and gradients against the interpreter
    (whose reference takes each row's own max)."""
    f = far_apart(dt)
    f["r"] = np.random.default_rng(9).standard_normal(f["q"].shape).astype(NP[dt])
    g = graph({n: f[n] for n in "qkv"}, dt, loss=True)
    gg = jg.grad(g, "loss", wrt=[], inputs=["q", "k", "v"])
    want = interp.run(gg, f)
    got = jg.compile(gg).run(**f)
    tol = 1e-11 if dt == "f64" else 2e-5
    for n in ("y", "grad/q", "grad/k", "grad/v"):
        w = want[n]
        assert np.isfinite(got[n]).all(), n
        np.testing.assert_allclose(got[n], w, atol=tol * max(1.0, np.abs(w).max()), err_msg=n)


@pytest.mark.parametrize("dt", ["f64", "f32"])
def test_a_nan_key_poisons_only_the_rows_that_see_it(dt):
    """A NaN in key 20 makes the block's max NaN: every row is then taken with its own max, so
    the queries before 20 (which cannot see it) keep their finite outputs and the later ones
    are NaN, as in the reference."""
    f = feeds(1, 40, 2, 1, 4, dt)
    f["k"][0, 20, 0, 1] = np.nan
    g = graph(f, dt)
    want = interp.run(g, f)["y"]
    got = jg.compile(g).run(**f)["y"]
    assert np.isfinite(got[:, :20]).all() and np.isnan(got[:, 20:]).all()
    tol = 1e-12 if dt == "f64" else 2e-6
    np.testing.assert_allclose(got[:, :20], want[:, :20], atol=tol, rtol=0)

def test_llama_trains_through_the_op():
    """llama_forward uses attention (no causal_mask, no S x S scores) unless kv_f16 asks for
    llama.cpp's rounding; its training step's loss equals the interpreter's."""
    from jitgraph.models.llama import LlamaConfig, llama_forward
    cfg = LlamaConfig(vocab=40, dim=16, layers=1, heads=4, kv_heads=2, ff=24, ctx=8)
    g = llama_forward(cfg, 2, 8, labels=True)
    opnames = {n.op for n in g.nodes}
    assert "attention" in opnames and "causal_mask" not in opnames
    assert "attention" not in {n.op for n in llama_forward(cfg, 2, 8, kv_f16=True).nodes}
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1), seed=0)
    params = {k: np.array(v) for k, v in prog.params.items()}
    rng = np.random.default_rng(0)
    t = rng.integers(0, cfg.vocab, (2, 9)).astype(np.int32)
    f = dict(tokens=np.ascontiguousarray(t[:, :-1]), labels=np.ascontiguousarray(t[:, 1:]),
             pos=np.arange(8, dtype=np.int32))
    want = interp.run(g, f, params)["loss"]
    assert abs(float(prog.step(**f)["loss"]) - float(want)) < 1e-5
    # training keeps the probabilities (passes/attention.py): the stored pair, not the recompute
    assert {"attention_store", "attention_back_stored"} <= {n.op for n in prog.graph.nodes}
    assert "attention_back" not in {n.op for n in prog.graph.nodes}


def params_graph(f, dt):
    """sum(attention(q, k, v) * r) with q, k, v params: compiled with loss=, its backward goes
    through the autodiff stage (and passes/attention.py)."""
    g = jg.Graph("attp")
    q, k, v = (g.param(n, f[n].shape, dt) for n in "qkv")
    y = ops.attention(q, k, v)
    g.output(loss=ops.sum(y * g.input("r", y.shape, dt)), y=y)
    return g


def stored_against_interpreter(f, dt, tol):
    """The compiled training graph keeps attention's probabilities (attention_store and
    attention_back_stored in place of attention and attention_back); its output and gradients
    equal the interpreter's on the plain graph (the references recomputing everything)."""
    g = params_graph(f, dt)
    prog = jg.compile(g, loss="loss")
    ops_ = {n.op for n in prog.graph.nodes}
    assert {"attention_store", "attention_back_stored"} <= ops_ and "attention" not in ops_
    for k in "qkv":
        prog.params[k] = f[k]
    got = prog.run(r=f["r"])
    want = interp.run(jg.grad(g, "loss"), {"r": f["r"]}, {k: f[k] for k in "qkv"})
    for n in ("y", "grad/q", "grad/k", "grad/v"):
        w = want[n]
        np.testing.assert_allclose(got[n], w, atol=tol * max(1.0, np.nanmax(np.abs(w))),
                                   err_msg=n)
    return got


@pytest.mark.parametrize("shape", [(2, 5, 4, 2, 3), (16, 64, 8, 4, 8), (4, 48, 4, 4, 32),
                                   (2, 70, 2, 1, 8)])
@pytest.mark.parametrize("dt", ["f64", "f32"])
def test_stored_probabilities_equal_the_interpreter(shape, dt):
    """Serial and prange paths, GQA, a sequence not a multiple of the block (70: blocks of 32,
    32 and 6 rows)."""
    f = feeds(*shape, dt)
    f["r"] = np.random.default_rng(9).standard_normal(
        (shape[0], shape[1], shape[2], shape[4])).astype(NP[dt])
    stored_against_interpreter(f, dt, 1e-11 if dt == "f64" else 2e-5)


@pytest.mark.parametrize("dt", ["f64", "f32"])
def test_stored_probabilities_of_rows_far_below_the_block_max(dt):
    f = far_apart(dt)
    f["r"] = np.random.default_rng(9).standard_normal(f["q"].shape).astype(NP[dt])
    got = stored_against_interpreter(f, dt, 1e-11 if dt == "f64" else 2e-5)
    assert all(np.isfinite(got[n]).all() for n in ("y", "grad/q", "grad/k", "grad/v"))


def test_the_stored_layout_and_its_reference():
    """attention_store: out, then e blocked by PROBS_BLOCK query rows (each block only the keys
    its rows see, shifted by the block's largest score), then r: e r is the softmax (numpy's,
    each row by its own max), and the kernel's result equals the reference's."""
    from jitgraph.ops.attention import PROBS_BLOCK, probs_size
    from jitgraph.ops.common import apply
    B, S, H, Hkv, D = 2, 40, 4, 2, 8
    f = feeds(B, S, H, Hkv, D, "f64")
    g = jg.Graph("st")
    q, k, v = (g.input(n, f[n].shape, "f64") for n in "qkv")
    g.output(st=apply("attention_store", q, k, v, scale=0.5),
             y=ops.attention(q, k, v, scale=0.5))
    ref = interp.run(g, f)
    got = jg.compile(g).run(**f)
    assert probs_size(S) == PROBS_BLOCK * PROBS_BLOCK + 8 * 40
    nq, ne = B * S * H * D, B * H * probs_size(S)
    assert ref["st"].shape == got["st"].shape == (nq + ne + B * H * S,)
    np.testing.assert_allclose(ref["st"][:nq], ref["y"].ravel(), atol=1e-13)
    np.testing.assert_allclose(got["st"], ref["st"], rtol=1e-11, atol=1e-13)
    kk = np.repeat(f["k"], H // Hkv, axis=2)
    sc = np.einsum("bihd,bjhd->bhij", f["q"], kk) * 0.5
    sc = np.where(np.tril(np.ones((S, S), bool)), sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    e = ref["st"][nq:nq + ne].reshape(B, H, -1)
    r = ref["st"][nq + ne:].reshape(B, H, S)
    at = 0
    for i0 in range(0, S, PROBS_BLOCK):
        m = min(PROBS_BLOCK, S - i0)
        blk = e[:, :, at:at + m * (i0 + m)].reshape(B, H, m, i0 + m)
        assert blk.max() == 1.0                    # shifted by the block's largest score
        np.testing.assert_allclose(blk * r[:, :, i0:i0 + m, None], p[:, :, i0:i0 + m, :i0 + m],
                                   atol=1e-14)
        at += m * (i0 + m)


def test_the_pass_keeps_small_probabilities_only(monkeypatch):
    """Above STORE_MAX_BYTES, and for a backend that does not lower the pair (CUDA's kinds),
    the recompute stays; the autodiff report says what was stored."""
    from jitgraph.passes import attention as pa
    from jitgraph.runtime.cuda.backend import KINDS
    f = feeds(2, 40, 4, 2, 8, "f32")
    g = jg.grad(params_graph(f, "f32"), "loss")
    assert pa.store_attention_probs(g, KINDS) == (g, {})
    g2, stats = pa.store_attention_probs(g)
    assert stats["attention_probs_stored"] == 1
    assert "attention_back" not in {n.op for n in g2.nodes}
    monkeypatch.setattr(pa, "STORE_MAX_BYTES", 2 * 4 * pa.probs_size(40) * 4 - 1)  # B H p f32
    assert pa.store_attention_probs(g) == (g, {})
    rep = jg.compile(params_graph(f, "f32"), loss="loss")._products.reports
    auto = next(r for r in rep if r.name == "autodiff")
    assert "attention_probs_stored" not in auto.stats


def test_shape_errors_name_the_operands():
    g = jg.Graph("e")
    q = g.input("q", (2, 4, 3, 8))
    with pytest.raises(ShapeError, match="multiple of kv_heads"):
        ops.attention(q, g.input("k", (2, 4, 2, 8)), g.input("v", (2, 4, 2, 8)))
    with pytest.raises(ShapeError, match="head_dim must match"):
        ops.attention(q, g.input("k2", (2, 4, 3, 4)), g.input("v2", (2, 4, 3, 4)))
    with pytest.raises(ShapeError, match="batch, seq, heads, head_dim"):
        ops.attention(g.input("q3", (4, 3, 8)), g.input("k3", (4, 3, 8)),
                      g.input("v3", (4, 3, 8)))

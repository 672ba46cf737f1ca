"""The AVX512-BF16 GEMM (runtime/cpu/bf16gemm.py) against float64 numpy on the bf16 values:
every product of two bf16 values is exact in f32 and in f64, so the kernel (f32 sums) may
differ from the f64 sum only by f32 rounding of the partial sums, bounded per element by
about K * 2^-24 * sum |a_ik b_kj|. Sizes ragged against the kernel's blocks (MR rows, NR
columns, KC k-pairs, MC rows) and odd K (a padded pair), all four transposes, alpha and beta,
one band and several."""
import numpy as np
import pytest

from jitgraph.runtime.cpu import bf16gemm

pytestmark = pytest.mark.skipif(not bf16gemm.available(),
                                reason="this CPU has no AVX512-BF16 (vdpbf16ps)")


def bf16_bits(x):
    """bf16 bits (uint16) of float32 x, rounded to nearest even (jitgraph/half.py's rule)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(h):
    return (h.astype(np.uint32) << 16).view(np.float32)


def check(m, n, k, ta, tb, alpha, beta, parts, rng):
    a = bf16_bits(rng.standard_normal((k, m) if ta else (m, k)))
    b = bf16_bits(rng.standard_normal((n, k) if tb else (k, n)))
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    c = c0.copy() if beta != 0.0 else np.full((m, n), np.nan, np.float32)
    bf16gemm.gemm(ta, tb, alpha, a, b, beta, c, parts=parts)
    a64, b64 = bf16_values(a).astype(np.float64), bf16_values(b).astype(np.float64)
    a64, b64 = (a64.T if ta else a64), (b64.T if tb else b64)
    want = alpha * (a64 @ b64) + beta * c0.astype(np.float64)
    bound = (abs(alpha) * (np.abs(a64) @ np.abs(b64)) * (k + 2) + np.abs(beta * c0)) * 2.0 ** -23
    err = np.abs(c - want)
    assert np.all(err <= bound + 1e-30), (m, n, k, ta, tb, alpha, beta, parts,
                                          float((err - bound).max()))


MR, NR, KC, MC = bf16gemm.MR, bf16gemm.NR, bf16gemm.KC, bf16gemm.MC
SIZES = [(1, 1, 1), (MR, NR, 2), (MR + 1, NR - 1, 3), (MR - 1, NR + 1, 17), (2 * MR + 5, 3, 64),
         (5, 2 * NR + 7, 2 * KC + 1), (MC + MR + 1, NR + 3, 2 * KC + 6), (37, 70, 2 * KC - 1),
         (3, 5, 0)]


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_ragged_sizes_against_exact_products(ta, tb):
    rng = np.random.default_rng(7 + 2 * ta + tb)
    for m, n, k in SIZES:
        for alpha, beta, parts in ((1.0, 0.0, 1), (0.5, 1.0, 2), (-2.0, 0.25, 3)):
            check(m, n, k, ta, tb, alpha, beta, parts, rng)


@pytest.mark.slow
def test_training_shapes():
    """A llama-width product and its backward forms, in two bands."""
    rng = np.random.default_rng(3)
    for m, n, k, ta, tb in ((512, 352, 128, False, False), (512, 128, 352, False, True),
                            (128, 352, 512, True, False)):
        check(m, n, k, ta, tb, 1.0, 0.0, 2, rng)


def test_specials_propagate():
    """inf and NaN operands give what the f32 products give (inf, NaN), not zeros."""
    a = bf16_bits(np.ones((4, 6), np.float32))
    b = bf16_bits(np.ones((6, 3), np.float32))
    a[1, 2] = bf16_bits(np.float32(np.inf))
    a[2, 5] = bf16_bits(np.float32(np.nan))
    c = np.zeros((4, 3), np.float32)
    bf16gemm.gemm(False, False, 1.0, a, b, 0.0, c, parts=1)
    with np.errstate(invalid="ignore"):
        want = bf16_values(a).astype(np.float64) @ bf16_values(b).astype(np.float64)
    np.testing.assert_array_equal(c, want.astype(np.float32))


def _kernels_text(prog):
    return prog._products.ir["kernels"]


def test_mixed_program_runs_its_gemms_on_bf16_operands(monkeypatch):
    """A bf16 program's GEMMs on two bf16 operands run here (gemm_bf16_work, the f32 copies
    gone), and its loss and gradients (forward GEMM, dX = dY W^T, dW = X^T dY, sizes ragged
    against the kernel's blocks, odd K) match the interpreter on the same mixed graph within
    f32 summation order and a bf16 rounding now and then; JITGRAPH_BF16_GEMM=0 keeps the
    conversion path."""
    import jitgraph as jg
    from jitgraph import interp
    from jitgraph.passes.autodiff import grad
    from jitgraph.passes.precision import mixed
    g = jg.Graph("mm")
    x = g.input("x", (111, 19))
    w1, w2 = g.param("w1", (19, 45)), g.param("w2", (45, 23))
    h = jg.relu(x @ w1)
    g.output(loss=jg.sum((h @ w2) * (h @ w2)))
    bg, _ = grad(mixed(g, "bf16")[0], "loss")
    params = bg.init_params(4)
    feeds = {"x": np.random.default_rng(5).standard_normal((111, 19)).astype(np.float32)}
    ref = interp.run(bg, feeds, params)
    for on in ("1", "0"):
        monkeypatch.setenv("JITGRAPH_BF16_GEMM", on)
        prog = jg.compile(bg)
        text = _kernels_text(prog)
        assert ("gemm_bf16_work(" in text) == (on == "1")
        if on == "1":
            assert "gemm_bf16_work(True, False" in text      # a weight's gradient
        for k, v in params.items():
            prog.params[k] = v
        got = prog.step(**feeds)
        eps = 2.0 ** -8
        assert abs(float(got["loss"]) - float(ref["loss"])) <= 4 * eps * abs(float(ref["loss"]))
        for k in bg.params:
            a, b = got[f"grad/{k}"], ref[f"grad/{k}"]
            scale = float(np.max(np.abs(b)))
            np.testing.assert_allclose(a, b, atol=8 * eps * scale, rtol=0, err_msg=(on, k))

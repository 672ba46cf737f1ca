"""x converted before its dot with a stored weight as ggml's CPU backend does (the matmul
attribute xq, jitgraph.dots.ggml_dots, `generate --dot ggml`): x's rows quantized to Q8_0 / Q8_K
or rounded to f16, then dotted with the weight's quants in integers (runtime/cpu/lib_qdot8.py).

Oracles: ggml's reference quantizers ported line by line to Python loops here (for the numpy
reference jitgraph.quant.quantize_x, which the interpreter uses), gguf's Q8_0 quantizer, and
float64 products of the dequantized values (gguf's dequantization) for the kernels and the
compiled programs."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp
from jitgraph.dots import ggml_dots
from jitgraph.quant import VEC_DOT_TYPE, dequantize, quantize_x
from jitgraph.runtime.cpu import lib_qdot8 as L
from jitgraph.testing.storage import random_storage
from jitgraph.types import STORAGE, ShapeError, TensorType

KINDS = ("q8_0", "q4_k", "q6_k", "f16")


def _nearest_int(v: np.float32) -> int:
    """ggml's nearest_int: the float's bits after adding 1.5 * 2^23 (ties to even)."""
    f = np.float32(v) + np.float32(12582912.0)
    return int((np.array(f, np.float32).view(np.int32) & 0x007FFFFF) - 0x00400000)


def _q8_k_loops(x):
    """quantize_row_q8_K_ref (ggml-quants.c) as Python loops: (d, quants, bsums) per block."""
    out = []
    for b in range(len(x) // 256):
        blk = x[256 * b:256 * b + 256]
        amax, mx = np.float32(0), np.float32(0)
        for v in blk:
            if abs(v) > amax:
                amax, mx = abs(v), v
        if amax == 0:
            out.append((np.float32(0), [0] * 256, [0] * 16))
            continue
        iscale = np.float32(np.float32(-127.0) / mx)
        q = [min(127, _nearest_int(np.float32(iscale * v))) for v in blk]
        out.append((np.float32(np.float32(1.0) / iscale), q,
                    [sum(q[16 * j:16 * j + 16]) for j in range(16)]))
    return out


def _x(rng, k):
    """A row with a zero Q8_0 block, a Q8_0 block of small integers times one step, and (k >=
    512) a Q8_K block whose largest magnitude is negative and comes twice."""
    x = rng.standard_normal(k).astype(np.float32)
    x[:32] = 0.0
    x[32:64] = (np.arange(32) - 16).astype(np.float32) * np.float32(0.125)
    if k >= 512:
        x[256:512] = np.linspace(-2.0, 1.0, 256, dtype=np.float32)
        x[300] = -2.0
    return x


def test_q8_k_reference_is_ggmls_quantizer():
    x = _x(np.random.default_rng(0), 1024)
    x[768:1024] = 0.0
    want = np.concatenate([d * np.asarray(q, np.float32) for d, q, _ in _q8_k_loops(x)])
    assert np.array_equal(quantize_x(x, "q8_k"), want)
    # the kernels' quantizer: the same quants, scales and sums of 16
    work = np.zeros(L.q8_layout(STORAGE["q4_k"][0], len(x))[3], np.float32)
    q, d, bs = L.quantize_x(STORAGE["q4_k"][0], x, work)
    loops = _q8_k_loops(x)
    assert np.array_equal(q, np.concatenate([np.asarray(b[1], np.int8) for b in loops]))
    assert np.array_equal(d, np.array([b[0] for b in loops], np.float32))
    assert np.array_equal(bs, np.concatenate([np.asarray(b[2], np.int16) for b in loops]))


def test_q8_0_and_f16_references():
    import gguf
    x = _x(np.random.default_rng(1), 512)
    q8 = gguf.quants.quantize(x.reshape(1, -1), gguf.GGMLQuantizationType.Q8_0)
    want = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).reshape(-1)
    assert np.array_equal(quantize_x(x, "q8_0"), want)
    work = np.zeros(L.q8_layout(STORAGE["q8_0"][0], len(x))[3], np.float32)
    q, d, _ = L.quantize_x(STORAGE["q8_0"][0], x, work)
    assert np.array_equal(np.repeat(d, 32) * q.astype(np.float32), want)
    assert np.array_equal(quantize_x(x, "f16"), x.astype(np.float16).astype(np.float32))
    with pytest.raises(ShapeError, match="not whole q8_k blocks of 256"):
        quantize_x(x[:300], "q8_k")


@pytest.mark.parametrize("dtype", KINDS)
@pytest.mark.parametrize("k", [256, 1024])
def test_row_dots_match_the_dequantized_products(dtype, k):
    """dot_rows8 (alpha, beta, a range of rows) against float64 products of the dequantized
    weight and x as quantize_x converts it: within 1e-5 of |W| . |x| per row."""
    rng = np.random.default_rng(k + len(dtype))
    n = 40
    w = random_storage(dtype, (n, k), rng)
    x = _x(rng, k)
    kind = STORAGE[dtype][0]
    work = np.zeros(L.q8_layout(kind, k)[3], np.float32)
    out = rng.standard_normal(n).astype(np.float32)
    before = out.copy()
    L.dot_rows8(kind, 0.5, x, w.view(np.uint8).reshape(n, -1), 2.0, out, 3, 31, work)
    wf = dequantize(w, TensorType(dtype, (n, k))).astype(np.float64)
    xf = quantize_x(x, VEC_DOT_TYPE[dtype]).astype(np.float64)
    want = before.astype(np.float64)
    want[3:31] = 0.5 * (wf[3:31] @ xf) + 2.0 * before[3:31]
    tol = 1e-5 * (np.abs(wf) @ np.abs(xf)) + 1e-6
    assert np.all(np.abs(out - want) <= tol)
    assert np.array_equal(out[:3], before[:3]) and np.array_equal(out[31:], before[31:])


def test_plain_block_sums_are_the_integer_dots():
    """The loops used without AVX2 (and the AVX2 sums' definition): integer sums of the quants
    as ggml's vec_dot_q4_K_q8_K / q6_K_q8_K / q8_0_q8_0 form them, against numpy integers."""
    from numba import njit
    rng = np.random.default_rng(5)
    q = rng.integers(-127, 128, 256).astype(np.int8)
    bs = q.reshape(16, 16).astype(np.int64).sum(1).astype(np.int16)

    # Q4_K: 128 bytes of nibbles (low: sub-block 2g, high: 2g + 1), scales/mins as int64 bytes
    nib = rng.integers(0, 256, 128).astype(np.uint8)
    sc, mn = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
    vals = np.concatenate([np.concatenate([nib[32 * g:32 * g + 32] & 15,
                                           nib[32 * g:32 * g + 32] >> 4]) for g in range(4)])
    prods = (vals.astype(np.int64) * q).reshape(8, 32).sum(1)
    pack = lambda v: int(sum(int(b) << (8 * j) for j, b in enumerate(v)))  # noqa: E731
    isum = njit(lambda w, q, s: L._q4k_isum_plain(w, 0, q, 0, s))(nib, q, pack(sc))
    msum = njit(lambda m, b: L._q4k_msum_plain(m, b, 0))(pack(mn), bs)
    assert isum == int((sc * prods).sum())
    assert msum == int((mn * bs.reshape(8, 2).sum(1)).sum())

    # Q6_K: a block's 210 bytes (ql, qh, 16 int8 scales)
    blk = rng.integers(0, 256, 210).astype(np.uint8)
    six = np.empty(256, np.int64)
    for p in range(2):
        ql, qh = blk[64 * p:64 * p + 64].astype(np.int64), blk[128 + 32 * p:160 + 32 * p]
        for l in range(32):
            six[128 * p + l] = (ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)
            six[128 * p + 32 + l] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)
            six[128 * p + 64 + l] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)
            six[128 * p + 96 + l] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)
    scales = blk[192:208].view(np.int8).astype(np.int64)
    want = int((scales * ((six - 32) * q).reshape(16, 16).sum(1)).sum())
    assert njit(lambda w, q, b: L._q6k_isum_plain(w, 0, q, 0, b, 0))(blk, q, bs) == want

    w8 = rng.integers(0, 256, 34).astype(np.uint8)
    assert njit(lambda w, q: L._q8_0_isum_plain(w, 2, q, 0))(w8, q) == \
        int((w8[2:].view(np.int8).astype(np.int64) * q[:32]).sum())


def _graph(dtype, m, k=512, n=96):
    g = jg.Graph("xq")
    x = g.input("x", (m, k))
    w = g.param("w", (n, k), dtype, trainable=False)
    b = g.param("b", (n,))
    g.output(y=jg.relu(jg.ops.matmul(x, w, tb=True) + b))
    return g


@pytest.mark.parametrize("dtype", KINDS)
@pytest.mark.parametrize("m", [1, 3])
def test_compiled_program_matches_the_interpreter(dtype, m):
    rng = np.random.default_rng(m + 10 * len(dtype))
    g = ggml_dots(_graph(dtype, m))
    (mm,) = [n for n in g.nodes if n.op == "matmul"]
    assert mm.attr["xq"] == VEC_DOT_TYPE[dtype]
    assert f"xq={VEC_DOT_TYPE[dtype]}" in str(g)
    params = {"w": random_storage(dtype, (96, 512), rng),
              "b": rng.standard_normal(96).astype(np.float32)}
    feed = {"x": rng.standard_normal((m, 512)).astype(np.float32)}
    want = interp.run(g, feed, params)["y"]
    exact = interp.run(_graph(dtype, m), feed, params)["y"]
    assert not np.allclose(want, exact, rtol=0, atol=1e-6)   # x's conversion changes the result
    got = jg.compile(g, params=params).step(**feed)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * float(np.abs(want).max()))


def test_refusals_name_the_matmul_and_the_types():
    g = jg.Graph("bad")
    x = g.input("x", (2, 256))
    w = g.param("w", (8, 256), "q4_k", trainable=False)
    with pytest.raises(ShapeError, match=r"xq='q8_0': a q4_k weight is dotted with x in q8_k"):
        jg.apply("matmul", x, w, tb=True, xq="q8_0")
    with pytest.raises(ShapeError, match=r"xq='q8_k' reads an f32 x as x @ W\^T"):
        jg.apply("matmul", x, w, xq="q8_k")
    f = g.param("f", (8, 256))
    with pytest.raises(ShapeError, match=r"with W in q8_0, q4_k, q6_k, f16"):
        jg.apply("matmul", x, f, tb=True, xq="q8_k")
    # inference only: no gradient through x's conversion
    t = jg.Graph("train")
    x = t.input("x", (2, 256))
    h = t.param("h", (2, 256))
    w = t.param("w", (8, 256), "q8_0", trainable=False)
    t.output(loss=jg.ops.sum(jg.ops.matmul(x * h, w, tb=True)))
    with pytest.raises(ShapeError, match="has no gradient"):
        jg.compile(ggml_dots(t), loss="loss", optimizer=jg.optim.SGD(0.1))
    # the exact graph is left as it was: ggml_dots copies
    assert all(n.attr.get("xq") is None for n in t.nodes)


def test_generate_with_ggml_dots_follows_the_interpreter(tmp_path, testdata):
    """The decode program of a Q8_0 llama (its ffn_down rows are F16) with --dot ggml, step by
    step against the interpreter running the same graph; and the command's flag."""
    import json
    import subprocess
    import sys

    from jitgraph.models.generate import Generator, llama_decoder
    from jitgraph.models.llama import read_llama, write_llama
    path = tmp_path / "stories-q8_0.gguf"
    write_llama(path, *read_llama(testdata.stories), ftype="q8_0")
    cfg, params, tok = read_llama(path, keep_types=True)
    gen = Generator((cfg, params, tok), ctx=16, chunk=1, dot="ggml", warmup=False)
    g = ggml_dots(llama_decoder(cfg, 1, 16))
    assert {n.attr.get("xq") for n in g.nodes if n.op == "matmul"} >= {"q8_0", "f16"}
    ref = {k: np.asarray(v) for k, v in params.items()}
    for name, nid in g.params.items():
        if name not in ref:
            ref[name] = np.zeros(g.nodes[nid].type.shape, np.float32)
    for pos, t in enumerate(tok.encode("Once upon", bos=True)[:5]):
        feed = {"tokens": np.array([[t]], np.int32), "pos": np.array([pos], np.int32)}
        want = interp.run(g, feed, ref)["logits"]
        got = gen.decode.step(**feed)["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    r = subprocess.run([sys.executable, "-m", "jitgraph.cli", "generate", str(path), "--prompt",
                        "Once upon a time", "-n", "6", "--temp", "0", "--ignore-eos", "--json",
                        "--quiet", "--dot", "ggml", "--ctx", "32"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["dot"] == "ggml" and res["tokens"] == 6


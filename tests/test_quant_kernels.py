"""runtime/cpu/lib_quant.py against gguf-py's numpy port of ggml's formats (gguf.quants), numpy's
float16 and the bf16 bit layout: dequantization bit for bit (random bytes, special scales, valid
blocks), get_rows_q exact, qgemm equal to dequantize-then-f32 matmul within 1e-5 of the
products' magnitudes, quantize_rows bit for bit."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants

from jitgraph.runtime.cpu import lib_quant as L

KINDS = ("f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
# byte offsets of each block's f16 scales
SCALES = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
# f16 bits: zeros, smallest and largest subnormal, smallest normal, one, largest, inf, NaNs
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x83FF, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF,
                        0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF], np.uint16)


def reference(name, raw):
    """float32 values of stored rows raw (uint8[rows, row_bytes]), as ggml reads them."""
    if name == "f16":
        return raw.view(np.float16).astype(np.float32)
    if name == "bf16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return quants.dequantize(raw, getattr(GT, name.upper()))


def blocks(name, rows, nblocks, rng, scales=None):
    """Stored rows of random bytes; the f16 scales (every element for f16/bf16) drawn from
    `scales` (f16 bits) or, by default, sane positive values."""
    blk, nb = L.geometry(L.KINDS[name])
    raw = rng.integers(0, 256, (rows, nblocks, nb), dtype=np.uint8)
    if name in ("f16", "bf16"):
        if scales is None:
            x = rng.standard_normal((rows, nblocks), dtype=np.float32)
            return L.quantize_rows(L.KINDS[name], x)
        return rng.choice(scales, (rows, nblocks)).astype(np.uint16).view(np.uint8)
    for o in SCALES[name]:
        if scales is None:
            d = (rng.uniform(0.5, 1.5, (rows, nblocks)) / 64).astype(np.float16).view(np.uint16)
        else:
            d = rng.choice(scales, (rows, nblocks)).astype(np.uint16)
        raw[:, :, o:o + 2] = d.view(np.uint8).reshape(rows, nblocks, 2)
    return raw.reshape(rows, -1)


def dequantized(name, raw):
    out = np.full((raw.shape[0], raw.shape[1] // L.geometry(L.KINDS[name])[1]
                   * L.geometry(L.KINDS[name])[0]), np.nan, np.float32)
    L.dequantize_rows(L.KINDS[name], raw, 0, raw.shape[0], out)
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")      # the oracle's inf * 0
@pytest.mark.parametrize("name", KINDS)
def test_dequantize_bit_exact(name):
    rng = np.random.default_rng(1)
    cases = [rng.integers(0, 256, (64, 4 * L.geometry(L.KINDS[name])[1]), dtype=np.uint8),
             blocks(name, 16, 4, rng, SPECIAL_F16),            # subnormal, inf, NaN scales
             blocks(name, 16, 4, rng)]                          # valid blocks, sane scales
    if name == "f16":
        cases.append(np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(256, 512))
    for raw in cases:
        assert np.array_equal(dequantized(name, raw), reference(name, raw), equal_nan=True)
    one = np.empty(raw.shape[1] // L.geometry(L.KINDS[name])[1] * L.geometry(L.KINDS[name])[0],
                   np.float32)
    L.dequantize_row(L.KINDS[name], raw[3], one)
    assert np.array_equal(one, reference(name, raw[3:4])[0], equal_nan=True)


def test_dequantize_rows_range_and_errors():
    rng = np.random.default_rng(2)
    raw = blocks("q4_k", 10, 2, rng)
    out = np.zeros((5, 512), np.float32)
    L.dequantize_rows(L.KINDS["q4_k"], raw, 3, 7, out)
    assert np.array_equal(out[:4], reference("q4_k", raw[3:7])) and not out[4].any()
    with pytest.raises(ValueError, match="row_bytes"):
        L.dequantize_row(L.KINDS["q4_k"], raw[0], np.empty(256, np.float32))
    with pytest.raises(ValueError, match="unknown storage kind"):
        L.dequantize_row(3, raw[0], np.empty(512, np.float32))
    with pytest.raises(ValueError, match="outside src"):
        L.dequantize_rows(L.KINDS["q4_k"], raw, 8, 11, out)


@pytest.mark.parametrize("name", KINDS)
def test_get_rows_q(name):
    rng = np.random.default_rng(3)
    raw = blocks(name, 300, 256 // L.geometry(L.KINDS[name])[0] * 2, rng)
    ref = reference(name, raw)
    for n in (5, 600):                      # a serial and a parallel gather
        idx = rng.integers(0, 300, n).astype(np.int32)
        out = np.empty((n, ref.shape[1]), np.float32)
        L.get_rows_q(raw, L.KINDS[name], idx, out)
        assert np.array_equal(out, ref[idx])
    if name in ("f16", "bf16"):             # their 16-bit arrays, as the IR holds them (f16 as bits)
        L.get_rows_q(raw.view(np.uint16), L.KINDS[name], idx, out)
        assert np.array_equal(out, ref[idx])


def _check_qgemm(name, tb, m, n, k, alpha, beta, rng):
    kind = L.KINDS[name]
    blk = L.geometry(kind)[0]
    rows, cols = (n, k) if tb else (k, n)
    raw = blocks(name, rows, cols // blk, rng)
    w = reference(name, raw)
    op = w.T if tb else w
    x = rng.standard_normal((m, k), dtype=np.float32)
    out0 = rng.standard_normal((m, n), dtype=np.float32)
    want = alpha * (x.astype(np.float64) @ op) + beta * out0
    # the bound: 1e-5 relative to the scale of the products summed (|x| |W|)
    scale = abs(alpha) * (abs(x).astype(np.float64) @ abs(op)) + abs(beta * out0) + 1e-30
    outs = []
    for threads in (1, 2):                  # one slab or two: the same bits
        out = out0.copy()
        work = np.full(L.qgemm_workspace(kind, m, n, k, threads), np.nan, np.float32)
        L.qgemm(False, tb, alpha, x, raw, beta, out, kind, work)
        err = np.abs(out - want) / scale
        assert err.max() <= 1e-5, (name, tb, m, n, k, threads, err.max())
        assert np.abs(out - out0).max() > 0.1          # something was computed
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("name", KINDS)
def test_qgemm_forward(name):
    """out = alpha x @ W^T + beta out (W [N, K]): M = 1 and decode widths (W a row at a time),
    M over FUSED_MAX_M (tiles on sgemm, several tiles and a partial one), odd N."""
    rng = np.random.default_rng(4)
    blk = max(L.geometry(L.KINDS[name])[0], 32)
    for m, n, k, alpha, beta in ((1, 33, blk, 1.0, 0.0), (3, 7, 3 * blk, 0.5, 2.0),
                                 (1, 257, 8 * blk, -1.5, 1.0), (L.FUSED_MAX_M + 1, 65, 2 * blk,
                                                                1.0, 0.0)):
        _check_qgemm(name, True, m, n, k, alpha, beta, rng)
    # M = 1 at the 1B model's K (a decode GEMV: many blocks per row, every sub-block scale and
    # quarter of a K-quant block, the per-row accumulators summed once)
    _check_qgemm(name, True, 1, 19, 2048, 1.0, 0.0, rng)
    if name in ("q8_0", "q4_k"):                   # several tiles: tile rows = TILE_ELEMS / K
        k = 2048
        _check_qgemm(name, True, 24, L._tile_rows(k) * 2 + 40, k, 0.75, -1.0, rng)


@pytest.mark.parametrize("name", KINDS)
def test_qgemm_input_gradient(name):
    """out = alpha x @ W + beta out (W [K, N], blocks along N): fused and tiled, column chunks
    (CHUNK_COLS) whole and partial, several k tiles."""
    rng = np.random.default_rng(5)
    blk = max(L.geometry(L.KINDS[name])[0], 32)
    for m, n, k, alpha, beta in ((1, blk, 1, 1.0, 0.0), (2, 3 * blk, 37, 0.5, 2.0),
                                 (L.FUSED_MAX_M + 3, 2 * blk, 50, -1.0, 1.0)):
        _check_qgemm(name, False, m, n, k, alpha, beta, rng)
    if name in ("f16", "q4_k"):
        n = (L.CHUNK_COLS // 256 * 2 + 1) * 256
        _check_qgemm(name, False, 16, n, 1100, 1.0, 0.5, rng)
        _check_qgemm(name, False, 1, n, 300, 1.0, 0.5, rng)


def test_qgemm_beta_zero_and_refusals():
    rng = np.random.default_rng(6)
    kind = L.KINDS["q8_0"]
    raw = blocks("q8_0", 20, 2, rng)
    x = rng.standard_normal((12, 64), dtype=np.float32)
    work = np.empty(L.qgemm_workspace(kind, 12, 20, 64, 2), np.float32)
    for m in (1, 12):                              # beta 0 never reads out (NaN stays out)
        out = np.full((m, 20), np.nan, np.float32)
        L.qgemm(False, True, 1.0, x[:m], raw, 0.0, out, kind, work)
        assert np.isfinite(out).all()
    with pytest.raises(ValueError, match="transposed"):
        L.qgemm(True, True, 1.0, x, raw, 0.0, out, kind, work)
    with pytest.raises(ValueError, match="workspace"):
        L.qgemm(False, True, 1.0, x, raw, 0.0, out, kind, work[:10])
    with pytest.raises(ValueError, match="shapes differ"):
        L.qgemm(False, True, 1.0, x, raw[:5], 0.0, out, kind, work)
    with pytest.raises(ValueError, match="unknown storage kind"):
        L.qgemm_workspace(99, 1, 1, 1, 1)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_quantize_rows_bit_exact():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((40, 256), dtype=np.float32) * np.float32(3.0)
    x[0, :32] = 0.0                                            # d = 0
    x[1, :32] = np.arange(-16, 16) * np.float32(127 / 16 / 2)  # halves: roundf away from zero
    x[2, 32:64] = np.float32(1e-30)                           # subnormal f16 scale
    x[3, :] = np.float32(1e6)                                 # d over f16's range: inf
    q8 = L.quantize_rows(L.KINDS["q8_0"], x)
    assert q8.dtype == np.uint8 and q8.shape == (40, 8 * 34)
    assert np.array_equal(q8, quants.quantize(x, GT.Q8_0))
    assert np.array_equal(L.quantize_rows(L.KINDS["f16"], x).view(np.float16), x.astype(np.float16))
    assert np.array_equal(L.quantize_rows(L.KINDS["bf16"], x),
                          quants.quantize(x, GT.BF16).view(np.uint8).reshape(40, 512))
    ok = x[4:].reshape(36, 8, 32)
    back = dequantized("q8_0", q8[4:]).reshape(36, 8, 32)
    step = abs(ok).max(axis=2, keepdims=True) / 127                # the block's scale d
    # half a step, plus 127 steps times the scale's f16 rounding (2^-11 relative)
    assert (abs(back - ok) <= step * (0.5 + 127 * 2.0 ** -11)).all()

    special = np.array([[0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.4e38, -1e-45,
                         1.00390625, 1.01171875, -1.00390625, 65504.0, 1e-40, 2.5, 7.0, -0.1]],
                       np.float32)
    special.view(np.uint32)[0, 5] = 0x7F800001                 # a signalling NaN: kept, quiet
    bf = L.quantize_rows(L.KINDS["bf16"], special)
    assert np.array_equal(bf, quants.quantize(special, GT.BF16).view(np.uint8).reshape(1, -1))
    assert bf.view(np.uint16)[0, 5] == 0x7FC0
    assert np.array_equal(dequantized("bf16", bf), reference("bf16", bf), equal_nan=True)
    with pytest.raises(ValueError, match="q4_k"):
        L.quantize_rows(L.KINDS["q4_k"], x)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        L.quantize_rows(L.KINDS["q8_0"], x[:, :40])
    x[7, 100] = np.inf
    with pytest.raises(ValueError, match="non-finite values \\(row 7 of 40\\)"):
        L.quantize_rows(L.KINDS["q8_0"], x)

"""Half-precision values (f16, bf16): the conversions against numpy's float16 and a bit-exact
bf16 reference written here, the interpreter's meaning (f32 compute, one rounding per op),
every op that takes half types compiled on the CPU against the interpreter, autodiff through
casts against finite differences in float64, and the build-time refusals."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp
from jitgraph.half import as_value, round_to, to_f32
from jitgraph.passes.autodiff import grad
from jitgraph.passes.precision import cast_graph

EPS = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11}     # the formats' relative rounding bound


def bf16_reference(x):
    """bf16 bits of float32 x by Python integers: round to nearest, ties to even; a NaN keeps
    its sign and top payload bits with the quiet bit set (ggml's GGML_FP32_TO_BF16)."""
    out = []
    for b in np.asarray(x, np.float32).reshape(-1).view(np.uint32).tolist():
        if b & 0x7FFFFFFF > 0x7F800000:
            out.append((b >> 16) | 0x40)
            continue
        hi, lo = b >> 16, b & 0xFFFF
        if lo > 0x8000 or (lo == 0x8000 and hi & 1):
            hi += 1
        out.append(hi)
    return np.array(out, np.uint16).reshape(np.shape(x))


EDGES = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan,
                  # bf16 ties: 1 + 2^-8 (down to even 1.0), 1 + 3 * 2^-8 (up to 1 + 2^-6)
                  1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -20,
                  # f16 ties: 1 + 2^-11 (down), 1 + 3 * 2^-11 (up); max, overflow boundary
                  1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65504.0, 65519.0, 65520.0, 1e6, -1e6,
                  # f16 subnormals: 2^-24 the least, half of it a tie to 0, 1.5 of it to 2^-23
                  2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -24, 2.0 ** -14, 6e-8,
                  3.0e38, 3.4028235e38, -3.4028235e38, 1e-40, 1.17549435e-38], np.float32)


def _cast_graph(src, dst, shape):
    g = jg.Graph(f"cast_{src}_{dst}")
    g.output(y=jg.cast(g.input("x", shape, src), dst))
    return g


@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_rounding_matches_numpy_and_the_bit_reference(dt):
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([EDGES, rand])
    with np.errstate(over="ignore", invalid="ignore"):
        want = bf16_reference(x) if dt == "bf16" else x.astype(np.float16)
    got = round_to(x, dt)
    assert got.dtype == want.dtype
    nan = np.isnan(x)
    assert np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))
    assert np.isnan(to_f32(got[nan], dt)).all()
    # the interpreter's cast and the compiled one give the same bits
    g = _cast_graph("f32", dt, x.shape)
    ref = interp.run(g, {"x": x})["y"]
    out = jg.compile(g).step(x=x)["y"]
    assert np.array_equal(ref[~nan].view(np.uint16), want[~nan].view(np.uint16))
    assert np.array_equal(out[~nan].view(np.uint16), want[~nan].view(np.uint16))
    assert np.isnan(to_f32(out[nan], dt)).all()


def test_f16_overflow_is_inf_and_bf16_keeps_f32_range():
    big = np.float32([65519.0, 65520.0, -70000.0, 3.0e38])
    assert np.array_equal(to_f32(round_to(big, "f16"), "f16"),
                          np.float32([65504.0, np.inf, -np.inf, np.inf]))
    b = to_f32(round_to(big, "bf16"), "bf16")
    assert np.isfinite(b).all() and np.allclose(b, big, rtol=2.0 ** -8)
    assert to_f32(round_to(np.float32([3.4028235e38]), "bf16"), "bf16")[0] == np.inf


@pytest.mark.parametrize("src,dst", [(a, b) for a in ("f64", "f32", "f16", "bf16", "i32")
                                     for b in ("f64", "f32", "f16", "bf16") if a != b])
def test_cast_between_all_float_types_compiled_as_interpreted(src, dst):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(257) * 300).astype(np.float64)
    if src == "i32":
        x = np.rint(x).astype(np.int32)
    elif src in ("f16", "bf16"):
        x = round_to(x, src)
    g = _cast_graph(src, dst, x.shape)
    ref = interp.run(g, {"x": x})["y"]
    out = jg.compile(g).step(x=x)["y"]
    assert out.dtype == ref.dtype
    assert np.array_equal(out.view(np.uint8), ref.view(np.uint8))


def test_half_round_trip_is_exact_and_f64_rounds_through_f32():
    rng = np.random.default_rng(2)
    for dt in ("f16", "bf16"):
        h = round_to(rng.standard_normal(100), dt)
        g = jg.Graph("rt")
        x = g.input("x", (100,), dt)
        g.output(y=jg.cast(jg.cast(jg.cast(x, "f32"), "f64"), dt))
        assert np.array_equal(jg.compile(g).step(x=h)["y"].view(np.uint16), h.view(np.uint16))
    # f64 -> half: rounded to f32 first (the documented meaning), in both implementations
    v = np.array([1 + 2.0 ** -8 + 2.0 ** -40], np.float64)   # f32 rounds it to the tie
    g = _cast_graph("f64", "bf16", (1,))
    assert interp.run(g, {"x": v})["y"][0] == jg.compile(g).step(x=v)["y"][0] == 0x3F80


def test_user_arrays_for_half_values():
    """A half input takes its own array or floats (rounded); a bf16 output is uint16 bits."""
    g = jg.Graph("io")
    x = g.input("x", (3,), "bf16")
    g.output(y=x * 2.0)
    prog = jg.compile(g)
    f = np.float32([1.0, 1 + 2.0 ** -8, -3.0])
    a = prog.step(x=f)["y"]
    b = prog.step(x=round_to(f, "bf16"))["y"]
    assert a.dtype == np.uint16 and np.array_equal(a, b)
    assert np.array_equal(to_f32(a, "bf16"), np.float32([2.0, 2.0, -6.0]))
    with pytest.raises(jg.ShapeError, match=r"input x: a bf16 value is given as uint16\[3\] "
                                            r"\(its own array\), its bytes or a float array, "
                                            r"got int32\[3\]"):
        as_value(np.int32([1, 2, 3]), g.nodes[0].type, "input x")
    # its bytes (a file's uint8 view) are taken as they are
    h = round_to(f, "bf16")
    assert np.array_equal(as_value(h.view(np.uint8), g.nodes[0].type, "input x"), h)


def test_each_op_computes_in_f32_and_rounds_once():
    rng = np.random.default_rng(3)
    xs = round_to(rng.standard_normal((8, 16)), "bf16")
    ws = round_to(rng.standard_normal((16, 4)), "bf16")
    g = jg.Graph("sem")
    x, w = g.input("x", (8, 16), "bf16"), g.param("w", (16, 4), "bf16")
    g.output(p=x @ w, e=jg.exp(x), s=jg.sum(x, axis=1))
    r = interp.run(g, {"x": xs}, {"w": ws})
    xf, wf = to_f32(xs, "bf16"), to_f32(ws, "bf16")
    assert np.array_equal(r["p"], bf16_reference(xf @ wf))
    assert np.array_equal(r["e"], bf16_reference(np.exp(xf)))
    assert np.array_equal(r["s"], bf16_reference(xf.sum(axis=1, dtype=np.float32)))


# ---- every op that takes half types, compiled, against the interpreter --------------------
def _unary(f):
    return lambda x, y, w: f(x)


OPS = {
    "add": lambda x, y, w: x + y, "sub": lambda x, y, w: x - y, "mul": lambda x, y, w: x * y,
    "div": lambda x, y, w: x / (jg.abs(y) + 1.0), "maximum": lambda x, y, w: jg.maximum(x, y),
    "exp": _unary(jg.exp), "log": lambda x, y, w: jg.log(jg.abs(x) + 0.5),
    "tanh": _unary(jg.tanh), "sigmoid": _unary(jg.sigmoid), "silu": _unary(jg.silu),
    "gelu": _unary(jg.gelu), "relu": _unary(jg.relu), "neg": lambda x, y, w: -x,
    "sqrt": lambda x, y, w: jg.sqrt(jg.abs(x)), "where": lambda x, y, w: jg.where(jg.step(x - y), x, y),
    "softmax": _unary(jg.softmax), "log_softmax": _unary(jg.log_softmax),
    "rms_norm": lambda x, y, w: jg.rms_norm(x), "sum_rows": lambda x, y, w: jg.sum(x, axis=1),
    "sum_cols": lambda x, y, w: jg.sum(x, axis=0), "mean": lambda x, y, w: jg.mean(x),
    "max": lambda x, y, w: jg.max(x, axis=1), "matmul": lambda x, y, w: x @ w,
    "matmul_tb": lambda x, y, w: jg.ops.matmul(x, y, tb=True),
    "matmul_ta": lambda x, y, w: jg.ops.matmul(x, y, ta=True),
    "permute": lambda x, y, w: jg.permute(x, (1, 0)),
    "concat": lambda x, y, w: jg.concat([x, y], axis=1),
    "slice": lambda x, y, w: jg.slice(x, (2, 9, 1), (1, 30, 3)),
    "fused_chain": lambda x, y, w: jg.softmax(jg.relu(x @ w) * 0.5 + 1.0) * 2.0,
}


def _close(got, ref, dt, what):
    a, b = to_f32(got, dt), to_f32(ref, dt)
    assert a.shape == b.shape, what
    finite = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), finite), what
    eps = EPS[dt]
    scale = float(np.max(np.abs(b[finite]), initial=0.0))
    np.testing.assert_allclose(a[finite], b[finite], rtol=2 * eps, atol=eps * scale, err_msg=what)


@pytest.mark.parametrize("dt", ["bf16", "f16"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_op_compiled_matches_interpreter(op, dt):
    rng = np.random.default_rng(4)
    g = jg.Graph(f"{op}_{dt}")
    x, y = g.input("x", (24, 40), dt), g.input("y", (24, 40), dt)
    w = g.param("w", (40, 40), dt)
    out = OPS[op](x, y, w)
    assert out.dtype in (dt, "i32")
    g.output(out=out)
    feeds = {"x": round_to(rng.standard_normal((24, 40)), dt),
             "y": round_to(rng.standard_normal((24, 40)), dt)}
    ws = round_to(rng.standard_normal((40, 40)) * 0.2, dt)
    ref = interp.run(g, feeds, {"w": ws})["out"]
    for fuse in (True, False):
        prog = jg.compile(g, fuse=fuse)
        prog.params["w"] = ws
        got = prog.step(**feeds)["out"]
        assert got.dtype == ref.dtype
        _close(got, ref, dt, f"{op} {dt} fuse={fuse}")


def test_half_weight_of_an_f32_matmul_is_read_as_storage():
    """x f32 @ w bf16 (a half weight): the storage read, f32 product; and its gradient reaches
    a trainable half weight rounded to its type."""
    rng = np.random.default_rng(5)
    g = jg.Graph("mixed")
    x, w = g.input("x", (6, 16)), g.param("w", (16, 5), "bf16")
    y = x @ w
    assert y.dtype == "f32"
    g.output(loss=jg.sum(y * y))
    gg, _ = grad(g, "loss", wrt=["w"])
    assert gg.nodes[gg.outputs["grad/w"]].type.dtype == "bf16"
    xs, ws = rng.standard_normal((6, 16)).astype(np.float32), round_to(rng.standard_normal((16, 5)), "bf16")
    r = interp.run(gg, {"x": xs}, {"w": ws})
    want = 2 * xs.T @ (xs @ to_f32(ws, "bf16"))
    np.testing.assert_allclose(to_f32(r["grad/w"], "bf16"), want, rtol=2 ** -7, atol=1e-5)
    prog = jg.compile(gg)
    prog.params["w"] = ws
    _close(prog.step(x=xs)["grad/w"], r["grad/w"], "bf16", "mixed grad")


# ---- autodiff through casts ---------------------------------------------------------------
def _through(dt):
    """loss(w, x) = sum(r * cast(tanh(cast(x @ w, dt)) * cast(w2, dt), f32)): f32 params, the
    middle in `dt` (dt f32: the same graph without rounding)."""
    g = jg.Graph(f"through_{dt}")
    x, r = g.input("x", (5, 7)), g.input("r", (5, 3))
    w, w2 = g.param("w", (7, 3)), g.param("w2", (3,))
    h = jg.tanh(jg.cast(x @ w, dt)) * jg.cast(w2, dt)
    g.output(loss=jg.sum(jg.cast(jg.softmax(h), "f32") * r))
    return g


@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_autodiff_through_casts_matches_finite_differences(dt):
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((5, 7)), "r": rng.standard_normal((5, 3))}
    params = {"w": rng.standard_normal((7, 3)) * 0.5, "w2": rng.standard_normal(3)}
    gh, _ = grad(_through(dt), "loss", wrt=["w", "w2"])
    casts = [n for n in gh.nodes if n.op == "cast" and n.type.dtype in ("f32", dt)]
    assert len(casts) >= 4          # the backward casts the gradient back at each cast
    got = interp.run(gh, feeds, params)
    compiled = jg.compile(gh)
    for k, v in params.items():
        compiled.params[k] = v
    out = compiled.step(**feeds)
    # central differences in float64 of the f32 twin
    g64 = cast_graph(_through("f32"), "f64")
    for name, p in params.items():
        num = np.zeros(p.shape)
        for i in range(p.size):
            d = np.zeros(p.size)
            d[i] = 1e-6
            lo = {**params, name: p - d.reshape(p.shape)}
            hi = {**params, name: p + d.reshape(p.shape)}
            num.reshape(-1)[i] = (interp.run(g64, feeds, hi)["loss"] -
                                  interp.run(g64, feeds, lo)["loss"]) / 2e-6
        scale = np.max(np.abs(num))
        tol = 16 * EPS[dt] * scale        # a few roundings per value on the way
        assert got[f"grad/{name}"].dtype == np.float32
        np.testing.assert_allclose(got[f"grad/{name}"], num, atol=tol, rtol=0)
        np.testing.assert_allclose(out[f"grad/{name}"], got[f"grad/{name}"],
                                   atol=4 * EPS[dt] * scale, rtol=0)


# ---- refusals ---------------------------------------------------------------------------------
def test_ops_without_half_support_are_refused_at_build_time():
    g = jg.Graph("refuse")
    logits = g.input("logits", (4, 10), "bf16")
    labels = g.input("labels", (4,), "i32")
    with pytest.raises(jg.ShapeError, match=r"cross_entropy: operand 1 \(logits bf16\[4,10\]\) "
                                            r"is bf16, and cross_entropy takes no half-precision "
                                            r"operands; cast it to f32 first"):
        jg.cross_entropy(logits, labels)
    x = g.input("x", (4, 10))
    with pytest.raises(jg.ShapeError, match="dtypes differ"):
        x + logits
    with pytest.raises(jg.ShapeError, match="input q: q8_0 is a storage type"):
        g.input("q", (2, 32), "q8_0")


# ---- mixed precision: jg.compile(..., precision=) ---------------------------------------------
def _mlp():
    g = jg.Graph("mlp")
    x, y = g.input("x", (64, 20)), g.input("y", (64,), "i32")
    w1 = g.param("w1", (20, 48), init=jg.init.normal(0.0, 0.3))
    w2 = g.param("w2", (48, 5), init=jg.init.normal(0.0, 0.3))
    g.output(loss=jg.cross_entropy(jg.rms_norm(jg.relu(x @ w1)) @ w2, y))
    return g


@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_mixed_precision_trains_as_f32_does(dt):
    """precision=dt: the GEMMs forward and backward in dt (the backward's read the half
    operands the forward cast), the params f32; a few Adam steps follow the f32 run's losses
    within the format's rounding and end as low."""
    from jitgraph.passes.precision import mixed
    g = _mlp()
    mg, rep = mixed(g, dt)
    assert rep.stats["gemms"] == 2
    assert all(mg.nodes[mg.params[k]].type.dtype == "f32" for k in mg.params)
    back, _ = grad(mg, "loss")
    mm = [n for n in back.nodes if n.op == "matmul"]
    assert len(mm) == 5 and all(n.type.dtype == dt for n in mm)     # 2 forward, 3 backward
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 20)).astype(np.float32)
    y = (x[:, :5] @ rng.standard_normal((5, 5))).argmax(1).astype(np.int32)
    losses = {}
    for p in ("f32", dt):
        prog = jg.compile(g, loss="loss", optimizer=jg.optim.Adam(lr=0.01), precision=p)
        losses[p] = [float(prog.step(x=x, y=y)["loss"]) for _ in range(30)]
    a, b = np.array(losses["f32"]), np.array(losses[dt])
    assert b[-1] < 0.6 * b[0]
    assert not np.array_equal(a, b)          # the half GEMMs did round
    np.testing.assert_allclose(b, a, rtol=8 * EPS[dt], atol=0)


def test_precision_option_is_checked():
    with pytest.raises(ValueError, match="precision='fp8'; expected one of f32, bf16, f16"):
        jg.compile(_mlp(), loss="loss", optimizer=jg.optim.SGD(lr=0.1), precision="fp8")


def test_mixed_precision_llama_trains_as_f32_does():
    """A small llama (attention, rope, rms_norm, tied shapes) in precision="bf16": its
    projections' GEMMs in bf16, the rest f32; a few Adam steps on one batch follow f32's
    losses within a few bf16 roundings."""
    from jitgraph.models.llama import LlamaConfig, llama_forward
    cfg = LlamaConfig(vocab=40, dim=32, layers=2, heads=2, ctx=16)
    rng = np.random.default_rng(8)
    toks = rng.integers(0, 40, (4, 17)).astype(np.int32)
    feeds = dict(tokens=toks[:, :-1], pos=np.arange(16, dtype=np.int32), labels=toks[:, 1:])
    losses = {}
    for p in ("f32", "bf16"):
        prog = jg.compile(llama_forward(cfg, 4, 16, labels=True), loss="loss",
                          optimizer=jg.optim.Adam(lr=0.01), seed=3, precision=p)
        losses[p] = np.array([float(prog.step(**feeds)["loss"]) for _ in range(12)])
        if p == "bf16":
            assert "bf16" in prog.ir("precision")
    a, b = losses["f32"], losses["bf16"]
    assert b[-1] < 0.8 * b[0] and not np.array_equal(a, b)
    np.testing.assert_allclose(b, a, rtol=16 * EPS["bf16"], atol=0)


def test_half_params_start_rounded_from_their_init():
    g = jg.Graph("init")
    g.param("a", (), "bf16", init=jg.init.normal(0.0, 1.0))
    g.param("b", (2, 3), "f16", init=jg.init.normal(0.0, 1.0))
    ps = g.init_params(0)
    assert ps["a"].shape == () and ps["a"].dtype == np.uint16
    assert ps["b"].shape == (2, 3) and ps["b"].dtype == np.float16
    # the same draws as an f32 param's (a stream depends on the seed and the name), rounded
    g32 = jg.Graph("init")
    g32.param("b", (2, 3), init=jg.init.normal(0.0, 1.0))
    assert np.array_equal(ps["b"], g32.init_params(0)["b"].astype(np.float16))

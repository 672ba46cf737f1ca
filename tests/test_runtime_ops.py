"""Every op lowered by the CPU backend agrees with the numpy reference interpreter.

Few multi-op graphs (compiling is the slow part): each graph makes every interesting value an
output, with odd sizes (1, primes), broadcasts, scalars, transposes, negative-step slices and
sizes above the parallel threshold; float32 and float64.
"""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph.ops import OPS, apply
from jitgraph.runtime.cpu.lower import PARALLEL_MIN_WORK

TOL = {"f32": dict(rtol=2e-5, atol=2e-6), "f64": dict(rtol=1e-11, atol=1e-12)}
BIG = (300, 901)           # above the parallel threshold for kernels with a math call
HUGE = (600, 901)          # above it for every kernel
assert 2 * BIG[0] * BIG[1] >= PARALLEL_MIN_WORK and HUGE[0] * HUGE[1] >= PARALLEL_MIN_WORK


def _feeds(g, rng):
    out = {}
    for name, nid in g.inputs.items():
        t = g.nodes[nid].type
        if t.dtype == "i32":
            out[name] = rng.integers(-3, 4, t.shape).astype(np.int32)
        elif name.startswith("pos"):
            out[name] = rng.uniform(0.2, 2.0, t.shape).astype(t.np_dtype)
        else:
            out[name] = rng.standard_normal(t.shape).astype(t.np_dtype)
    return out


def check(g, feeds=None, params=None, seed=0, atol32=None):
    """Compile g, run once, compare every output with the interpreter (atol32: absolute
    tolerance in float32, for sums that cancel)."""
    rng = np.random.default_rng(seed)
    feeds = feeds if feeds is not None else _feeds(g, rng)
    prog = jg.compile(g)
    params = params if params is not None else {k: prog.params[k] for k in g.params}
    for k, v in params.items():
        prog.params[k] = v
    got = prog.run(**feeds)
    ref = jg.interp.run(g, feeds, dict(params))
    assert set(got) == set(ref)
    for k in ref:
        tol = dict(TOL["f64" if ref[k].dtype == np.float64 else "f32"])
        if atol32 and ref[k].dtype == np.float32:
            tol["atol"] = atol32
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape, k
        np.testing.assert_allclose(got[k], ref[k], err_msg=k, **tol)
    return prog


# ---- graphs ----------------------------------------------------------------------------------
def elementwise_graph(dt):
    g = jg.Graph(f"elementwise_{dt}")
    a = g.input("a", (7, 1, 5), dt)          # broadcasts against b over the middle axis
    b = g.input("b", (3, 5), dt)
    c = g.input("c", (1, 5), dt)
    s = g.input("s", (), dt)
    p = g.input("pos_p", (7, 3, 5), dt)
    q = g.input("q", (7, 3, 5), dt)
    lr, c1, c2 = (g.input(n, (), dt) for n in ("pos_lr", "pos_c1", "pos_c2"))
    big, bias = g.input("big", BIG, dt), g.input("bias", BIG[1:], dt)
    other = "f64" if dt == "f32" else "f32"
    o = dict(
        add=a + b, sub=a - b, mul=a * b, div=a / p, rdiv=2.0 / p, maximum=jg.maximum(a, b),
        minimum=jg.minimum(a, c), neg=-a, scale=a * 2.5, pow=jg.pow(p, 1.7), sqr=jg.sqr(a),
        sqrt=jg.sqrt(p), exp=jg.exp(a), log=jg.log(p), abs=jg.abs(a), sgn=jg.sgn(a),
        step=jg.step(a), relu=jg.relu(a), leaky_relu=jg.leaky_relu(a, 0.1),
        sigmoid=jg.sigmoid(a), tanh=jg.tanh(a), softplus=jg.softplus(a), gelu=jg.gelu(a),
        silu=jg.silu(a), clamp=jg.clamp(a, -0.5, 0.3), clamp_inf=jg.clamp(a, lo=0.0),
        cast=jg.cast(a, other), cast_i32=jg.cast(a * 10.0, "i32"),
        where=jg.where(jg.step(a), a, b), broadcast_to=jg.broadcast_to(c, (7, 3, 5)),
        full=jg.full_like(b, 3.0), scalar=s * s + s, scalar_bcast=a + s,
        gelu_back=apply("gelu_back", q, p), silu_back=apply("silu_back", q, p),
        clamp_back=apply("clamp_back", q, p, lo=-0.5, hi=0.5),
        ema=apply("ema", q, p, beta=0.9), ema_sq=apply("ema_sq", q, p, beta=0.99),
        adam_step=apply("adam_step", q, a * 0.1 + q, p, lr, c1, c2, eps=1e-8, wd=0.01),
        big=jg.exp(jg.relu(big + bias)), reshape=jg.reshape(a, (5, 7)) * 2.0,
        checkpoint=apply("checkpoint", a) + 1.0, round_f16=jg.round_f16(a * 1e3),
        window=apply("window", a * 3.0, offset=4, shape=(2, 3)),        # an output at an offset
        window_read=apply("window", jg.exp(p), offset=17, shape=(3, 5)) * 2.0,
    )
    g.output(**o)
    return g


def int_graph():
    g = jg.Graph("ints")
    i, j = g.input("i", (6, 5), "i32"), g.input("j", (5,), "i32")
    x = g.input("x", (6, 5), "f32")
    g.output(add=i + j, sub=i - j, mul=i * j, maximum=jg.maximum(i, j), minimum=jg.minimum(i, j),
             neg=-i, abs=jg.abs(i), sgn=jg.sgn(i), step=jg.step(i), where=jg.where(i, i, j),
             to_f32=jg.cast(i, "f32"), sum=jg.sum(i, axis=0), max=jg.max(i, axis=1),
             count_equal=jg.count_equal(i, jg.broadcast_to(j, (6, 5))),
             argmax=jg.argmax(x, axis=0), argmax_last=jg.argmax(x, axis=1, keepdims=True),
             # bf16 master weights' stochastic rounding: bit for bit (tests/test_master_bf16.py)
             sround=jg.ops.apply("sround_bf16", x, jg.sum(x) * 100.0, seed=3, salt=7))
    return g


def reduce_graph(dt):
    g = jg.Graph(f"reduce_{dt}")
    x = g.input("x", (6, 1, 7, 5), dt)
    big = g.input("big", HUGE, dt)
    o = {}
    for op in ("sum", "mean", "max", "logsumexp"):
        f = getattr(jg, op)
        for axes in ((0,), (1,), (3,), (0, 2), (2, 3), (1, 3), None):
            for keep in (False, True):
                name = f"{op}_{'all' if axes is None else ''.join(map(str, axes))}_{int(keep)}"
                o[name] = f(x, axis=axes, keepdims=keep)
        o[f"{op}_big0"] = f(big, axis=0)
        o[f"{op}_big1"] = f(big, axis=1)
    for ax in range(4):
        o[f"argmax_{ax}"] = jg.argmax(x, axis=ax)
    o["count_equal"] = jg.count_equal(x, jg.maximum(x, jg.full_like(x, 0.0)))
    g.output(**o)
    return g


def matmul_graph(dt):
    g = jg.Graph(f"matmul_{dt}")
    x, w = g.input("x", (7, 13), dt), g.input("w", (13, 5), dt)
    xt, wt = g.input("xt", (13, 7), dt), g.input("wt", (5, 13), dt)
    bx, bw = g.input("bx", (3, 7, 13), dt), g.input("bw", (3, 13, 5), dt)
    b4, w3 = g.input("b4", (2, 1, 7, 13), dt), g.input("w3", (3, 13, 1), dt)
    bxt = g.input("bxt", (3, 13, 7), dt)
    one = g.input("one", (1, 13), dt)
    mm = jg.matmul
    g.output(nn=mm(x, w), tn=mm(xt, w, ta=True), nt=mm(x, wt, tb=True),
             tt=mm(xt, wt, ta=True, tb=True), batched=mm(bx, bw), folded=mm(bx, w),
             folded_nt=mm(bx, wt, tb=True), bcast=mm(b4, w3), batched_ta=mm(bxt, w, ta=True),
             batched_tt=mm(bxt, bw, ta=True, tb=False), row=mm(one, w),
             outer=mm(jg.reshape(one, (13, 1)), one))
    return g


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_elementwise_ops_match_interpreter(dt):
    check(elementwise_graph(dt))


def test_integer_ops_match_interpreter():
    check(int_graph())


@pytest.mark.slow
@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_reductions_match_interpreter(dt):
    check(reduce_graph(dt), atol32=2e-5)   # sums of 901 normals: numpy's f32 pairwise sum is
                                           # ~1e-5 off; the kernels accumulate in f64


@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_matmul_flags_batches_and_broadcasts_match_interpreter(dt):
    check(matmul_graph(dt))


def library_graph(dt):
    g = jg.Graph(f"library_{dt}")
    x = g.input("x", (3, 7, 5), dt)
    idx = g.input("idx", (4, 2), "i32")
    table = g.input("table", (6, 5), dt)
    img = g.input("img", (2, 3, 9, 8), dt)
    k = g.input("k", (4, 3, 3, 3), dt)
    seq = g.input("seq", (1, 5, 2, 6), dt)
    pos = g.input("posi", (5,), "i32")
    labels = g.input("labels", (7,), "i32")
    o = dict(
        permute=jg.permute(x, (2, 0, 1)), transpose=jg.transpose(x, (0, 2, 1)),
        slice=jg.slice(x, (0, 3, 2), (6, None, -2)),
        pad=jg.pad(x, [(1, 0), (0, 2), (2, 1)], value=-1.5), concat=jg.concat([x, x * 2.0], 1),
        softmax=jg.softmax(x), softmax0=jg.softmax(x, axis=0), log_softmax=jg.log_softmax(x),
        rms_norm=jg.rms_norm(x), layer_norm=jg.layer_norm(x),
        rope=jg.rope(seq, pos), rope_neox=jg.rope(seq, pos, mode="neox"),
        causal_mask=jg.causal_mask(x, 1),
        conv=jg.conv2d(img, k, padding=1), conv_s2=jg.conv2d(img, k, stride=2, dilation=(1, 2)),
        max_pool=jg.max_pool2d(img, 2), avg_pool=jg.avg_pool2d(img, 3, stride=2, padding=1),
        cross_entropy=jg.cross_entropy(jg.reshape(jg.slice(x, (1, 2, 1)), (7, 5)), labels),
        lse_last=jg.logsumexp(x, axis=2), max_last=jg.max(x, axis=2),
    )
    o["get_rows"] = jg.get_rows(table, jg.abs(idx))
    g.output(**o)
    return g


@pytest.mark.slow
@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_library_ops_match_interpreter(dt):
    g = library_graph(dt)
    rng = np.random.default_rng(1)
    feeds = _feeds(g, rng)
    feeds["labels"] = rng.integers(0, 5, 7).astype(np.int32)
    feeds["posi"] = np.array([0, 3, 1, 7, 2], np.int32)
    check(g, feeds)


def library_training_graph():
    """library_graph's float outputs reduced to a scalar loss, with every input differentiated:
    autodiff adds the backward ops (slice_back, pad/concat slices, conv/pool/norm/rope backs)."""
    g = library_graph("f64")
    loss = None
    for k, i in g.outputs.items():
        if g.nodes[i].type.is_float:
            t = jg.sum(jg.tanh(g.tensor(i))) if g.nodes[i].type.shape else g.tensor(i)
            loss = t if loss is None else loss + t
    g.outputs = {"loss": loss.id}
    floats = [k for k, i in g.inputs.items() if g.nodes[i].type.is_float]
    return jg.grad(g, "loss", inputs=floats)


@pytest.mark.slow
def test_library_backward_ops_match_interpreter():
    g = library_training_graph()
    rng = np.random.default_rng(2)
    feeds = _feeds(g, rng)
    feeds["labels"] = rng.integers(0, 5, 7).astype(np.int32)
    feeds["posi"] = np.array([0, 3, 1, 7, 2], np.int32)
    check(g, feeds)


def kv_graph(dt):
    """The KV-cache ops (inference only, no vjp): set_rows as a param's in-place update (f16
    rounding) and on an input (axis 2, copied), kv_attention with GQA (6 heads over 2)."""
    g = jg.Graph(f"kv_{dt}")
    pos = g.input("pos", (3,), "i32")
    cache = g.param("cache", (2, 4, 9), dt, init=jg.init.normal(), trainable=False)
    k = jg.set_rows(cache, pos, jg.permute(g.input("k", (3, 2, 4), dt), (1, 2, 0)), axis=2,
                    f16=True)
    g.update(cache=k)
    vt = jg.set_rows(g.input("vt", (9, 2, 4), dt), pos, g.input("v", (3, 2, 4), dt))
    vt = jg.permute(vt, (1, 2, 0))
    g.output(att=jg.kv_attention(g.input("q", (3, 6, 4), dt), k, vt, pos), vt=vt)
    return g


@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_kv_cache_ops_match_interpreter(dt):
    g = kv_graph(dt)
    feeds = _feeds(g, np.random.default_rng(3))
    feeds["pos"] = np.array([1, 8, 4], np.int32)
    prog = check(g, feeds)
    params = {"cache": prog.params["cache"]}
    got = prog.run(**feeds)
    want = jg.interp.run(g, feeds, params)
    np.testing.assert_allclose(got["att"], want["att"], **TOL[dt])
    np.testing.assert_array_equal(prog.params["cache"], params["cache"])


def attention_graph(dt):
    """attention (GQA, 4 query heads over 2) and attention_back on a given output gradient;
    the stored pair (attention_store: its output part; attention_back_stored: the gradients;
    its probabilities are the kernel's own unnormalised form, checked in test_attention.py)."""
    g = jg.Graph(f"attention_{dt}")
    q, k, v = (g.input(n, (2, 7, h, 5), dt) for n, h in (("q", 4), ("k", 2), ("v", 2)))
    o = jg.attention(q, k, v)
    go = g.input("go", o.shape, dt)
    st = jg.ops.apply("attention_store", q, k, v, scale=0.6)
    g.output(o=o, back=jg.ops.apply("attention_back", q, k, v, o, go, scale=0.6),
             o_stored=jg.slice(st, (0, o.type.size)),
             back_stored=jg.ops.apply("attention_back_stored", q, k, v, st, go, scale=0.6))
    return g


@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_attention_matches_interpreter(dt):
    check(attention_graph(dt))


def test_every_registered_op_is_covered_by_these_tests():
    graphs = [elementwise_graph("f32"), int_graph(), reduce_graph("f32"), matmul_graph("f32"),
              library_training_graph(), kv_graph("f32"), attention_graph("f32")]
    covered = {n.op for g in graphs for n in g.nodes}
    missing = set(OPS) - covered - {"test_only_op"}
    assert not missing, f"ops without a compiled-vs-interpreter test: {sorted(missing)}"


# ---- float32 exp/tanh approximations (runtime/cpu/approx.py) ---------------------------------
def _ulps(got, exact):
    """|got - exact| in units of the float32 spacing at the exact value."""
    return np.abs(got.astype(np.float64) - exact) / np.spacing(np.abs(exact).astype(np.float32))


def test_f32_exp_and_tanh_approximations_are_within_4_ulp():
    from numba import njit

    from jitgraph.runtime.cpu.approx import fexp, ftanh

    @njit(error_model="numpy")
    def apply_both(x, e, t):
        for i in range(x.shape[0]):
            e[i] = fexp(x[i])
            t[i] = ftanh(x[i])
    x = np.concatenate([np.linspace(-87.3, 88.7, 200_001), np.linspace(-3, 3, 100_001),
                        np.logspace(-30, 1.5, 10_001), -np.logspace(-30, 1.5, 10_001)])
    x = x.astype(np.float32)
    e, t = np.empty_like(x), np.empty_like(x)
    apply_both(x, e, t)
    x64 = x.astype(np.float64)
    assert _ulps(e, np.exp(x64)).max() <= 2
    assert _ulps(t, np.tanh(x64)).max() <= 4       # the bound issue 16 sets for f32
    special = np.array([np.nan, np.inf, -np.inf, 89.0, -88.0, -1e4, 1e4, 0.0], np.float32)
    e, t = np.empty_like(special), np.empty_like(special)
    apply_both(special, e, t)
    # results below FLT_MIN are subnormals (exp(-88) = 6.05e-39), not flushed to 0
    with np.errstate(over="ignore"):
        want = np.exp(special.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(e, want)
    np.testing.assert_array_equal(t, [np.nan, 1, -1, 1, -1, -1, 1, 0])


# ---- fused kernels write every element of every output -------------------------------------
def _kernel_outputs_on_nan_arena(prog, feeds):
    """Run prog's kernels one by one on an arena of NaNs; after each, yield (kernel, node id,
    value in its buffer). The buffers of later kernels may reuse it, so check it right away."""
    import sys

    prog._arena[:] = 0xFF
    prog._feed(feeds)
    for k, v in prog._runtime_views.items():
        v[...] = prog.options.optimizer.runtime_inputs(0)[k]
    kernel_of = {k.root: k for k in prog._products.kernels.kernels}
    for nid, name, addrs, dims in prog._products.module.calls:
        getattr(sys.modules[f"jitgraph_cache.{name}"], name).ctypes(
            *[prog._address(r, off) for r, off in addrs], *dims)
        k = kernel_of[nid]
        for o in k.outputs:
            yield k, o, prog._view(o)


@pytest.mark.parametrize("fuse", [True, False])
def test_every_kernel_output_matches_interpreter_on_nan_arena(fuse):
    """Regression (issue 4/5): a GEMM kernel with several outputs (transformer block: matmul,
    silu, mul) must write all of each output; a planned arena starting as NaN exposes any
    element it skips. Each kernel's outputs are compared with the interpreter right after it."""
    from jitgraph.cli.workloads import WORKLOADS
    w = WORKLOADS["transformer_block"](scale=0.1)
    prog = jg.compile(w.graph, loss=w.loss, optimizer=w.optimizer, fuse=fuse, plan_memory=True)
    g = prog._products.graph
    params = {k: prog._param_views[k].copy() for k in g.params}
    rt = {k: v for k, v in w.optimizer.runtime_inputs(0).items() if k in g.inputs}
    _, vals = jg.interp.run(g, {**w.feeds, **rt}, params, values=True)
    kinds = set()
    for k, o, got in _kernel_outputs_on_nan_arena(prog, w.feeds):
        kinds.add(k.kind)
        np.testing.assert_allclose(got, vals[o], rtol=1e-4, atol=1e-5,
                                   err_msg=f"k{k.id} [{k.kind}] output %{o} {g.nodes[o].op}")
    assert "gemm" in kinds or not fuse

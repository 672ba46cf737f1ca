"""Mixed precision's autocast policy (passes/precision.py `mixed`): which values of a llama-like
graph are half and which stay f32, the mixed program's gradients against the numpy interpreter
running the same mixed graph, a few training steps in bf16 and in f16 with loss scaling, and
the planned arena of a bf16 program against f32's."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp
from jitgraph.half import to_f32
from jitgraph.models.llama import LlamaConfig, llama_forward
from jitgraph.ir import op_kind
from jitgraph.passes.autodiff import grad
from jitgraph.passes.precision import mixed, mixed_role

EPS = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11}
CFG = LlamaConfig(vocab=40, dim=32, layers=2, heads=2, ctx=16)


def _feeds(batch=4, seq=16, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, CFG.vocab, (batch, seq + 1)).astype(np.int32)
    return dict(tokens=toks[:, :-1], pos=np.arange(seq, dtype=np.int32), labels=toks[:, 1:])


def _types(g, op):
    return {g.nodes[n.id].type.dtype for n in g.nodes if n.op == op}


@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_policy_types_on_a_llama(dt):
    g = llama_forward(CFG, 2, 16, labels=True)
    mg, rep = mixed(g, dt)
    gemms = sum(n.op == "matmul" for n in g.nodes)
    assert rep.stats["gemms"] == gemms
    # GEMM products and the ops that follow them: half
    for op in ("matmul", "rope", "attention", "silu"):
        assert _types(mg, op) == {dt}, op
    # silu(gate) * up is half; the norm weight's product and the residual adds stay f32
    assert _types(mg, "mul") == {dt, "f32"} and _types(mg, "add") == {"f32"}
    # numerically sensitive ops, the embedding, the params, the outputs: f32
    for op in ("rms_norm", "cross_entropy", "get_rows", "param"):
        assert _types(mg, op) == {"f32"}, op
    assert all(mg.nodes[i].type.dtype == "f32" for i in mg.outputs.values())
    # every half value is computed from a GEMM's product (no f32 value is rounded for an op
    # that is not a GEMM): each cast to half reads a param or an f32 value a GEMM reads
    for n in mg.nodes:
        if n.op == "cast" and n.type.dtype == dt:
            readers = {m.op for m in mg.nodes if n.id in m.inputs}
            assert readers == {"matmul"}, readers
    # the backward: half where the forward is, the params' gradients f32
    bg, _ = grad(mg, "loss")
    assert _types(bg, "matmul") == {dt} and _types(bg, "rope_back") == {dt}
    assert _types(bg, "rms_norm_back") == {"f32"}
    assert all(bg.nodes[bg.outputs[f"grad/{k}"]].type.dtype == "f32" for k in bg.params)


def test_roles_come_from_the_registry():
    assert mixed_role("matmul") == "gemm"
    for op in ("add", "mul", "silu", "rope", "attention", "attention_back", "reshape",
               "permute", "concat", "slice"):
        assert mixed_role(op) == "follow", op
    for op in ("rms_norm", "layer_norm", "softmax", "log_softmax", "sum", "mean",
               "cross_entropy", "exp", "log", "conv2d", "get_rows"):
        assert mixed_role(op) == "f32", op


def test_bias_after_a_gemm_is_half_and_a_mixed_sum_is_f32():
    """x @ w + b (b a param: a GEMM's bias, read in the half type) is half; the sum of that
    and an f32 value computed in the graph runs in f32."""
    g = jg.Graph("bias")
    x = g.input("x", (8, 16))
    w, b = g.param("w", (16, 16)), g.param("b", (16,))
    h = jg.relu(x @ w + b)
    g.output(y=jg.sum(h + jg.tanh(x)))
    mg, _ = mixed(g, "bf16")
    assert _types(mg, "add") == {"bf16", "f32"} and _types(mg, "relu") == {"bf16"}
    adds = [n for n in mg.nodes if n.op == "add"]
    assert [n.type.dtype for n in adds] == ["bf16", "f32"]
    assert _types(mg, "tanh") == {"f32"} and _types(mg, "sum") == {"f32"}


@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_mixed_gradients_match_the_interpreter(dt):
    """The compiled mixed program (forward and backward) against the interpreter running the
    same mixed graph: each op computed in f32 and rounded, so they differ by the order of
    f32 accumulation alone (a rounding of a half value now and then)."""
    mg, _ = mixed(llama_forward(CFG, 4, 16, labels=True), dt)
    bg, _ = grad(mg, "loss")
    params = bg.init_params(1)
    feeds = _feeds()
    ref = interp.run(bg, feeds, params)
    prog = jg.compile(bg)
    for k, v in params.items():
        prog.params[k] = v
    got = prog.step(**feeds)
    assert abs(float(got["loss"]) - float(ref["loss"])) <= 4 * EPS[dt] * abs(float(ref["loss"]))
    for k in bg.params:
        a, b = got[f"grad/{k}"], ref[f"grad/{k}"]
        assert a.dtype == b.dtype == np.float32, k
        scale = float(np.max(np.abs(b)))
        np.testing.assert_allclose(a, b, atol=8 * EPS[dt] * scale, rtol=0, err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_mixed_llama_trains_beside_f32(dt):
    """A few Adam steps of a small llama on one batch: precision=dt (f16 with its loss scale)
    follows the f32 run's losses within a few roundings of the format and lowers the loss."""
    feeds = _feeds(seed=2)
    losses = {}
    for p in ("f32", dt):
        prog = jg.compile(llama_forward(CFG, 4, 16, labels=True), loss="loss",
                          optimizer=jg.optim.Adam(lr=0.01), seed=3, precision=p)
        losses[p] = np.array([float(prog.step(**feeds)["loss"]) for _ in range(12)])
        if p == "f16":
            assert prog.scaler is not None and prog.skipped == 0
    a, b = losses["f32"], losses[dt]
    assert b[-1] < 0.8 * b[0] and not np.array_equal(a, b)
    np.testing.assert_allclose(b, a, rtol=32 * EPS["bf16"], atol=0)


def test_bf16_arena_is_clearly_smaller_than_f32s():
    """The memory plan of a bf16 training program: the saved activations and the backward's
    values half, so the arena is well under f32's (from the plans, not from timings)."""
    from jitgraph.passes.pipeline import run_pipeline
    from jitgraph.passes.planning import Options
    cfg = LlamaConfig(vocab=64, dim=64, layers=2, heads=2, ctx=64)
    arena = {}
    for p in ("f32", "bf16", "f16"):
        st = run_pipeline(llama_forward(cfg, 4, 64, labels=True),
                          Options(loss="loss", optimizer=jg.optim.AdamW(lr=1e-3), precision=p))
        arena[p] = st.memory.arena_bytes
    # the residual stream and the norms' outputs stay f32, so not half: about 0.7 here
    assert arena["bf16"] < 0.75 * arena["f32"], arena
    assert arena["f16"] < 0.75 * arena["f32"], arena


def test_half_attention_keeps_its_probabilities():
    """A bf16 attention keeps its probabilities for the backward in bf16; an f16 one keeps them
    in f32 (1 / a row's sum can pass f16's range): the pair reads q, k, v cast to f32 and its
    results are rounded to f16. The forward equals the recomputing graph's bit for bit (both
    compute in f32 and round), the gradients within a few f16 roundings."""
    from jitgraph.passes.attention import store_attention_probs
    feeds = _feeds(2, 16)
    for dt, kept in (("bf16", "bf16"), ("f16", "f32")):
        mg, _ = mixed(llama_forward(CFG, 2, 16, labels=True), dt)
        bg, _ = grad(mg, "loss")
        sg, stats = store_attention_probs(bg)
        assert stats.get("attention_probs_stored", 0) == CFG.layers
        assert not any(n.op == "attention_back" for n in sg.nodes)
        assert _types(sg, "attention_store") == {kept}
        assert _types(sg, "attention_back_stored") == {kept}
        params = bg.init_params(1)
        ref, got = interp.run(bg, feeds, params), interp.run(sg, feeds, params)
        assert float(got["loss"]) == float(ref["loss"]), dt
        for k in bg.params:
            a, b = got[f"grad/{k}"], ref[f"grad/{k}"]
            scale = float(np.max(np.abs(b)))
            np.testing.assert_allclose(a, b, atol=8 * EPS[dt] * scale, rtol=0, err_msg=k)


@pytest.mark.parametrize("native", [False, True], ids=["converted", "native"])
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_a_weights_rounding_runs_in_its_gemms_prologue(dt, native):
    """An f32 master weight read by a GEMM in half precision is rounded to the half type and
    converted back in the GEMM's prologue, one pass over the f32 weight into its scratch: no
    kernel of its own writes the half copy (passes/fuse.py); the values are
    test_mixed_gradients_match_the_interpreter's. A backend whose kinds name gemm_<dt> (the
    CPU with AVX512-BF16: "gemm_bf16") runs GEMMs on half buffers: there the rounding keeps a
    kernel of its own, whose output the GEMM reads."""
    from jitgraph.passes.pipeline import run_pipeline
    from jitgraph.passes.planning import Options
    from jitgraph.runtime.cpu.backend import CPU
    kinds = CPU.kinds | {f"gemm_{dt}"} if native else CPU.kinds
    st = run_pipeline(llama_forward(CFG, 4, 16, labels=True),
                      Options(loss="loss", optimizer=jg.optim.AdamW(lr=1e-3), precision=dt,
                              kinds=kinds))
    kg = st.kernels
    g = kg.graph
    weights = {g.params[k] for k in g.params if len(g.nodes[g.params[k]].type.shape) == 2}
    rounded = [n.id for n in g.nodes if n.op == "cast" and n.inputs[0] in weights and
               n.type.dtype == dt]
    assert rounded
    kernel_of = {m: k for k in kg.kernels for m in k.nodes}
    users = g.users()
    for r in rounded:
        k = kernel_of[r]
        gemms = {kernel_of[u].id for u in users[r]}
        if native:
            assert r in k.outputs and k.kind != "gemm" and k.id not in gemms
        else:
            assert k.kind == "gemm" and r not in k.outputs and gemms == {k.id}, \
                [g.nodes[m].op for m in k.nodes]


@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_casts_of_reshaped_products_join_the_gemm(dt):
    """q, k and v are GEMM products viewed as heads (a reshape) and read in f32 by rope and
    attention: the half stage casts the product and reshapes the cast (passes/half.py
    `casts_before_reshapes`), so the GEMM's epilogue writes the f32 copy and no kernel of its
    own casts the view; a GEMM reading a reshaped half value keeps the cast for its prologue.
    The program's loss and gradients stay the interpreter's (the move is exact)."""
    from jitgraph.passes.fuse import forward_nodes
    from jitgraph.passes.half import casts_before_reshapes
    from jitgraph.passes.pipeline import run_pipeline
    from jitgraph.passes.planning import Options
    st = run_pipeline(llama_forward(CFG, 4, 16, labels=True),
                      Options(loss="loss", precision=dt))
    kg = st.kernels
    g = kg.graph
    users = g.users()
    kernel_of = {m: k for k in kg.kernels for m in k.nodes}
    forward = forward_nodes(g)      # (a backward cast of a forward value keeps its kernel)
    viewed = [n for n in g.nodes if n.op == "reshape" and g.nodes[n.inputs[0]].op == "cast" and
              g.nodes[n.inputs[0]].type.dtype == "f32" and n.id in forward and
              g.nodes[g.nodes[n.inputs[0]].inputs[0]].type.dtype == dt]
    assert len(viewed) >= 3 * CFG.layers          # q, k, v of every layer, at least
    for n in viewed:
        c = g.nodes[n.inputs[0]]
        k = kernel_of[c.id]
        assert k.kind == "gemm" or len(k.nodes) > 1, [g.nodes[m].op for m in k.nodes]
    for n in g.nodes:
        if n.op == "cast" and g.nodes[n.inputs[0]].op == "reshape":
            assert all(g.nodes[u].op == "matmul" for u in users[n.id]) or \
                op_kind(g.nodes[g.nodes[n.inputs[0]].inputs[0]].op) in ("leaf", "view")
    assert casts_before_reshapes(g) == (g, 0)
    mg, _ = mixed(llama_forward(CFG, 4, 16, labels=True), dt)
    bg, _ = grad(mg, "loss")
    params = bg.init_params(1)
    ref = interp.run(bg, _feeds(), params)
    prog = jg.compile(bg)
    for k, v in params.items():
        prog.params[k] = v
    got = prog.step(**_feeds())
    assert abs(float(got["loss"]) - float(ref["loss"])) <= 4 * EPS[dt] * abs(float(ref["loss"]))


@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_summed_gemm_products_accumulate_in_f32(dt):
    """A weight x read by two GEMMs: its gradient sums their backward products. Under mixed
    precision the sum computes in f32 and is rounded once (passes/precision.py
    `sums_in_f32`): the compiled gradient is the rounding of the exact sum of the half
    operands' products (the f64 sum here) but where f32's own rounding lands within a hair of
    a tie, where rounding each product and the sum to the half type would miss it by an ulp in
    a good part of the elements. The CPU runs the second GEMM into the first's output
    (beta = 1) in one kernel, both GEMMs' operands converted in its prologue, unless it runs
    GEMMs on that type's buffers (the kind gemm_bf16 of AVX512-BF16)."""
    from jitgraph.half import round_to
    from jitgraph.passes.pipeline import run_pipeline
    from jitgraph.passes.planning import Options
    rng = np.random.default_rng(5)
    g = jg.Graph("two")
    x, w1, w2 = g.param("x", (64, 48)), g.param("w1", (48, 40)), g.param("w2", (48, 40))
    r1, r2 = g.input("r1", (64, 40)), g.input("r2", (64, 40))
    g.output(loss=jg.sum((x @ w1) * r1) + jg.sum((x @ w2) * r2))
    from jitgraph.runtime.cpu.backend import CPU
    st = run_pipeline(g, Options(loss="loss", precision=dt, kinds=CPU.kinds))
    acc = [k for k in st.kernels.kernels if k.accumulate]
    assert len(acc) == 1 and sum(st.kernels.graph.nodes[m].op == "cast" for m in acc[0].nodes) >= 4
    # a backend running GEMMs on that half type's buffers (gemm_<dt>) keeps them apart
    native = run_pipeline(g, Options(loss="loss", precision=dt, kinds=CPU.kinds | {f"gemm_{dt}"}))
    assert not any(k.accumulate for k in native.kernels.kernels)
    feeds = {k: rng.standard_normal((64, 40)).astype(np.float32) for k in ("r1", "r2")}
    params = {"x": rng.standard_normal((64, 48)).astype(np.float32),
              "w1": rng.standard_normal((48, 40)).astype(np.float32),
              "w2": rng.standard_normal((48, 40)).astype(np.float32)}
    prog = jg.compile(g, loss="loss", precision=dt, loss_scale=None)
    for k, v in params.items():
        prog.params[k] = v
    got = prog.step(**feeds)["grad/x"]
    h = {k: to_f32(round_to(v, dt), dt).astype(np.float64) for k, v in {**feeds, **params}.items()}
    exact = h["r1"] @ h["w1"].T + h["r2"] @ h["w2"].T
    want = to_f32(round_to(exact, dt), dt)
    assert np.mean(got == want) > 0.99, np.mean(got == want)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(want))) - (7 if dt == "bf16" else 10))
    assert np.all(np.abs(got - want) <= ulp)
    each = to_f32(round_to(to_f32(round_to(h["r1"] @ h["w1"].T, dt), dt) +
                           to_f32(round_to(h["r2"] @ h["w2"].T, dt), dt), dt), dt)
    assert np.mean(each == want) < 0.95          # the rounding of each product would show

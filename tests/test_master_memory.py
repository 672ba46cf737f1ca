"""bf16 master weights and moments in the memory plan: the f32 value of a stored param is cast
by each of its readers (passes/half.py leaf_casts_per_reader), so no f32 copy of a whole weight
stays live from the forward pass to the backward."""
import pytest

from jitgraph import optim
from jitgraph.models.llama import LlamaConfig, llama_forward
from jitgraph.passes.pipeline import Options, run_pipeline
from jitgraph.runtime.backend import get_backend

CFG = LlamaConfig(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ff=192, ctx=32, tied=True)


def _plan(master, moments):
    opt = optim.AdamW(lr=1e-3, master=master, moments=moments)
    return run_pipeline(llama_forward(CFG, 2, 32, labels=True),
                        Options(loss="loss", optimizer=opt, kinds=get_backend("cpu").kinds))


def test_each_reader_casts_a_stored_weight_and_the_cast_dies_at_once():
    st = _plan("bf16", "bf16")
    g, mem = st.graph, st.memory
    readers = {}
    for n in g.nodes:
        for i in set(n.inputs):
            readers.setdefault(i, []).append(n.id)
    casts = [n for n in g.nodes if n.op == "cast" and n.id in st.kernels.live and
             g.nodes[n.inputs[0]].op == "param" and g.nodes[n.inputs[0]].type.dtype == "bf16"]
    stored = {g.nodes[n.inputs[0]].attr["name"] for n in casts}
    assert {k for k in g.params if g.nodes[g.params[k]].type.dtype == "bf16"} <= stored
    for n in casts:
        assert len(readers[n.id]) == 1, (n, readers[n.id])
        first, last = mem.intervals.get(n.id, (0, 0))
        assert last - first <= 1, (n, first, last)      # written by one kernel, read by the next


def test_the_arena_of_bf16_masters_holds_no_weight_copies():
    """Against f32 masters (whose updates write in place): the extra arena is at most the
    f32 update values of one param at a time (new m, v and w: three of the largest param's
    f32 bytes) plus the tied weight's gradient, not the f32 copies of every weight."""
    f32, bf16 = _plan("f32", "f32").memory.arena_bytes, _plan("bf16", "bf16").memory.arena_bytes
    tied = 4 * CFG.vocab * CFG.dim          # the largest param's f32 bytes
    assert bf16 <= f32 + 4 * tied, (f32, bf16, tied)


def test_bf16_moments_update_in_place_in_the_gemm_epilogues():
    """The casts of the new moments to bf16 join the weight gradient's GEMM epilogue (an
    epilogue may store a half output) and write into the moments' own buffers: no moment is
    copied at the end of the step, as with f32 moments."""
    for moments in ("f32", "bf16"):
        st = _plan("f32", moments)
        g, kg = st.graph, st.kernels
        moment = [k for k in g.params if k.startswith(("opt/m/", "opt/v/"))]
        assert moment and set(moment) <= set(st.memory.inplace), \
            (moments, sorted(set(moment) - set(st.memory.inplace)))
        where = {m: k for k in kg.kernels for m in k.nodes}
        in_gemm = [k for k in moment if where[st.memory.inplace[k]].kind == "gemm"]
        assert in_gemm, (moments, [where[st.memory.inplace[k]].kind for k in moment])


def _tied_lm():
    """An embedding table also used as the output projection (a tied embedding): its gradient
    is get_rows' scatter plus the output GEMM's product, summed in place."""
    import jitgraph as jg
    g = jg.Graph("tied")
    tok, lab = g.input("tok", (24,), "i32"), g.input("lab", (24,), "i32")
    emb = g.param("emb", (40, 64), init=jg.init.normal(0.0, 0.5))
    w = g.param("w", (64, 64), init=jg.init.normal(0.0, 0.2))
    h = jg.ops.get_rows(emb, tok)
    h = jg.relu(h @ w) + h
    g.output(loss=jg.cross_entropy(jg.ops.matmul(h, emb, tb=True), lab))
    return g


def test_the_update_of_a_tied_bf16_master_weight_overwrites_its_summed_gradient():
    """The f32 update of the tied weight (read by the stochastic rounding that stores it as
    bf16) takes the buffer of its gradient, the GEMM's product accumulated into get_rows'
    scatter, which the same epilogue reads: the program computes what the naive plan (no
    shared buffers) and the interpreter compute."""
    import numpy as np
    import jitgraph as jg
    from jitgraph import interp
    from jitgraph.half import to_f32
    g = _tied_lm()
    opt = jg.optim.AdamW(lr=1e-2, master="bf16", moments="bf16", seed=3)
    prog = jg.compile(g, loss="loss", optimizer=opt)
    naive = jg.compile(g, loss="loss", optimizer=opt, plan_memory=False)
    mem, gg = prog._products.memory, prog._products.kernels.graph
    ops = {gg.nodes[u].op: gg.nodes[b].op for u, b in mem.reuses.items()}
    assert mem.sums and ops.get("adam_step") == "get_rows_back", ops
    tg = jg.training_graph(g, loss="loss", optimizer=opt)
    state = tg.init_params(0)
    rng = np.random.default_rng(0)
    for i in range(4):
        feeds = dict(tok=rng.integers(0, 40, 24).astype(np.int32),
                     lab=rng.integers(0, 40, 24).astype(np.int32))
        ref = interp.run(tg, {**feeds, **opt.runtime_inputs(i)}, state)
        a, b = prog.step(**feeds)["loss"], naive.step(**feeds)["loss"]
        assert a == b, (i, a, b)
        np.testing.assert_allclose(a, ref["loss"], rtol=1e-3)
    for k in ("emb", "w"):
        np.testing.assert_array_equal(prog.params[k], naive.params[k])
        # stochastic rounding of f32 values computed in another order: one bf16 step at most
        np.testing.assert_allclose(to_f32(prog.params[k], "bf16"), to_f32(state[k], "bf16"),
                                   rtol=2 ** -6, atol=1e-6)


@pytest.mark.parametrize("tb", [False, True])
def test_a_long_contraction_reads_the_bf16_master_weight_as_stored(tb):
    """x @ w with w a bf16 master weight, a contraction of STORED_MIN_K and STORED_MIN_N output
    columns: the GEMM reads the bf16 weight tile by tile (no f32 copy of it in scratch space);
    shorter contractions or fewer columns keep the cast. All train as the interpreter does."""
    import numpy as np
    import jitgraph as jg
    from jitgraph import interp
    from jitgraph.half import to_f32
    from jitgraph.passes.half import KIND, STORED_MIN_K, STORED_MIN_N
    for k, n in ((STORED_MIN_K, STORED_MIN_N), (64, STORED_MIN_N), (STORED_MIN_K, 24)):
        g = jg.Graph("long")
        x, y = g.input("x", (8, k)), g.input("y", (8,), "i32")
        w = g.param("w", (n, k) if tb else (k, n), init=jg.init.normal(0.0, 0.05))
        g.output(loss=jg.cross_entropy(jg.ops.matmul(x, w, tb=tb), y))
        opt = jg.optim.AdamW(lr=1e-2, master="bf16", seed=1)
        prog = jg.compile(g, loss="loss", optimizer=opt)
        gg = prog._products.kernels.graph
        mm = [m for m in gg.nodes if m.op == "matmul" and m.id in prog._products.kernels.live
              and not m.attr["ta"]]
        reads = {gg.nodes[m.inputs[1]].op for m in mm}
        stored = k >= STORED_MIN_K and n >= STORED_MIN_N
        assert reads == ({"param"} if stored else {"cast"}), (k, n, reads)
        # a target whose GEMMs do not read half weights (no KIND among its kinds) keeps casts
        other = get_backend("cpu").kinds - {KIND}
        st = run_pipeline(g, Options(loss="loss", optimizer=opt, kinds=other))
        assert {st.graph.nodes[m.inputs[1]].op for m in st.graph.nodes if m.op == "matmul"
                and m.id in st.kernels.live and not m.attr["ta"]} == {"cast"}
        tg = jg.training_graph(g, loss="loss", optimizer=opt)
        state = tg.init_params(0)
        rng = np.random.default_rng(2)
        for i in range(3):
            feeds = dict(x=rng.standard_normal((8, k)).astype(np.float32),
                         y=rng.integers(0, n, 8).astype(np.int32))
            ref = interp.run(tg, {**feeds, **opt.runtime_inputs(i)}, state)
            np.testing.assert_allclose(prog.step(**feeds)["loss"], ref["loss"], rtol=1e-4)
        # stochastic rounding of f32 values computed in another order: a bf16 step or two,
        # or (a gradient near 0 whose sign differs) a small part of Adam's step lr
        np.testing.assert_allclose(to_f32(prog.params["w"], "bf16"), to_f32(state["w"], "bf16"),
                                   rtol=2 ** -6, atol=1e-3)


def test_bf16_master_updates_run_as_their_gradients_complete():
    """A dW GEMM whose epilogue computes a bf16 master weight's f32 update (read at once by the
    stochastic rounding that stores it) runs as soon as its gradient is complete, as with f32
    masters, not after the whole backward pass (which kept every layer's activation gradient
    alive): the bf16-master arena exceeds the f32-master one by less than half the tied
    weight's f32 bytes (its update shares its gradient's buffer)."""
    cfg = LlamaConfig(vocab=2048, dim=512, layers=4, heads=8, kv_heads=4, ff=1024, ctx=64,
                      tied=True)

    def arena(master):
        opt = optim.AdamW(lr=1e-3, master=master, moments=master)
        return run_pipeline(llama_forward(cfg, 1, 64, labels=True, logits=False),
                            Options(loss="loss", optimizer=opt,
                                    kinds=get_backend("cpu").kinds)).memory.arena_bytes
    f32, bf16 = arena("f32"), arena("bf16")
    assert bf16 - f32 < 2 * cfg.vocab * cfg.dim, (f32, bf16)

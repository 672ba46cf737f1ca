"""bf16 master weights and moments in the memory plan: the f32 value of a stored param is cast
by each of its readers (passes/half.py leaf_casts_per_reader), so no f32 copy of a whole weight
stays live from the forward pass to the backward."""
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

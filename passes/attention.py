"""Attention's probabilities kept for the backward (part of the autodiff stage).

attention (jitgraph/ops/attention.py) stores nothing: its backward, attention_back, recomputes
the scores q k^T and their exps from q and k (flash attention's trade, memory for a second
pass). With small heads that second pass is most of the backward (stories260K, head_dim 8).
So after autodiff, an attention whose
output feeds an attention_back of the same operands becomes
    stored = attention_store(q, k, v)           out and the probabilities, one flat buffer
    out    = reshape(slice(stored, 0..B S H D))
    grads  = attention_back_stored(q, k, v, stored, dout)
when its heads are small (head_dim <= STORE_MAX_HEAD_DIM: the recompute costs 2 head_dim
FLOPs and an exp per score, storing 8 bytes of traffic per score; at head_dim 64 the recompute
is an efficient GEMM and storing only costs memory) and its probabilities take at most
STORE_MAX_BYTES (B H probs_size(S) elements: they grow with the square of the sequence, where
recomputing is the only choice). An f16 attention keeps them in f32: its q, k, v (and the
backward's dout) are read through casts to f32, the pair computes in f32 and its results are
rounded to f16 (f16 attention's meaning: computed in f32, rounded on store), because r, 1 / a
row's sum of e, can pass f16's 65504 where a row's scores lie far below its block's largest
(bf16 has f32's range and keeps bf16 probabilities). Storing was faster at head_dim 8 and 32 and within noise at
64 (bench/attention_store.py; bench/README.md: "Figures behind the code", attention's kept
probabilities). The checkpoint pass may still
drop `stored` and recompute it in the backward. A backend lowers the pair only when its
`kinds` name "attention_store" (runtime/backend.py); otherwise, and in forward-only graphs,
nothing changes. The forward's output is attention's, bit for bit; the gradients change by
float rounding only (P = e r formed in another order).
"""
from __future__ import annotations

from jitgraph.ir import copy_node, rebuild
from jitgraph.ops.attention import probs_size

STORE_MAX_BYTES, STORE_MAX_HEAD_DIM = 1 << 24, 32
KIND = "attention_store"


def store_attention_probs(graph, kinds=None):
    """(graph, stats): the attention / attention_back pairs rewritten as above."""
    if kinds is not None and KIND not in kinds:
        return graph, {}
    chosen = {}
    for n in graph.nodes:
        if n.op != "attention_back":
            continue
        q, k, v, out, _ = n.inputs
        a = graph.nodes[out]
        if a.op == "attention" and a.inputs == (q, k, v) and a.attrs == n.attrs:
            B, S, H, D = a.type.shape
            kept = 4 if a.type.dtype == "f16" else a.type.np_dtype.itemsize
            if D <= STORE_MAX_HEAD_DIM and B * H * probs_size(S) * kept <= STORE_MAX_BYTES:
                chosen.setdefault(a.id, []).append(n.id)
    if not chosen:
        return graph, {}
    stored, backs = {}, {b for bs in chosen.values() for b in bs}

    def wide(g, i):
        """Value i as the pair reads it: an f16 value cast to f32."""
        return g.emit("cast", (i,), {"dtype": "f32"}) if g.nodes[i].type.dtype == "f16" else i

    def narrow(g, i, like):
        """The pair's result i in the type of the node it replaces (`like`)."""
        t = like.type.dtype
        return i if g.nodes[i].type.dtype == t else g.emit("cast", (i,), {"dtype": t})

    def rule(g, n, new):
        if n.id in chosen:
            ids, attrs = [wide(g, new[i]) for i in n.inputs], dict(n.attrs)
            s = g.emit("attention_store", ids, attrs)
            stored[n.id] = s
            sl = g.emit("slice", [s], {"slices": ((0, n.type.size, 1),)})
            return narrow(g, g.emit("reshape", [sl], {"shape": n.type.shape}), n)
        if n.id in backs:
            q, k, v, out, dout = n.inputs
            back = g.emit("attention_back_stored",
                          [wide(g, new[q]), wide(g, new[k]), wide(g, new[v]), stored[out],
                           wide(g, new[dout])], dict(n.attrs))
            return narrow(g, back, n)
        return copy_node(g, n, new)
    g, _ = rebuild(graph, rule)
    extra = sum(g.nodes[s].type.nbytes - graph.nodes[a].type.nbytes for a, s in stored.items())
    return g.validate(), {"attention_probs_stored": len(chosen), "attention_probs_bytes": extra}

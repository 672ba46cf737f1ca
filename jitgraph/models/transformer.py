"""A llama-style decoder (the baby-llama of ggml's train-text-from-scratch) as a jitgraph Graph.

Per layer: rms_norm -> q, k, v projections -> heads -> rope -> softmax(causal(q k^T / sqrt(hd)))
-> @ v -> output projection -> residual; rms_norm -> MLP (SwiGLU, or GELU) -> residual. Then a
final norm, the output projection to the vocabulary and cross-entropy against next-token labels.
Params carry llama's names (`tok_embeddings.weight`, `layers.0.attention.wq.weight`, ...).

Activations are kept as [batch * seq, d_model] rows, so every projection is one flat GEMM; only
attention reshapes to [batch, heads, seq, head_dim]. Dense weights are [in, out] (x @ w).

Inputs: with a vocabulary, `tokens` i32[B*S] and `labels` i32[B*S] (the next token of each
position); without one (vocab=None), `x` f32[B, S, D] and a regression target `y` f32[B, S, D]
(loss: mse of the final normed output), which is how a single block is benchmarked. Both take
`pos` i32[S], the rope positions (normally 0..S-1). Outputs: `loss`, and `logits` [B*S, vocab]
when there is a vocabulary.
"""
from __future__ import annotations

import math

import numpy as np

from .. import init, ops
from ..ir import Graph
from ..types import ShapeError

NORMS = ("rms", "layer")
ACTS = ("silu", "gelu")


def _weight(g, name, shape, dtype):
    return g.param(name, shape, dtype, init=init.normal(0.0, 0.02))   # as baby-llama


def _norm(g, name, x, kind, dtype):
    w = g.param(name, (x.shape[-1],), dtype, init=init.ones())
    return ops.rms_norm(x, w) if kind == "rms" else ops.layer_norm(x, w)


def _attention(g, p, h, pos, batch, seq, n_heads, dtype):
    d = h.shape[-1]
    hd = d // n_heads

    def heads(name, rotate):
        t = ops.reshape(h @ _weight(g, f"{p}.attention.{name}.weight", (d, d), dtype),
                        (batch, seq, n_heads, hd))
        t = ops.rope(t, pos) if rotate else t
        return ops.permute(t, (0, 2, 1, 3))                          # [B, H, S, hd]

    q, k, v = heads("wq", True), heads("wk", True), heads("wv", False)
    scores = ops.scale(ops.matmul(q, k, tb=True), 1.0 / math.sqrt(hd))   # [B, H, S, S]
    att = ops.softmax(ops.causal_mask(scores)) @ v                        # [B, H, S, hd]
    att = ops.reshape(ops.permute(att, (0, 2, 1, 3)), (batch * seq, d))
    return att @ _weight(g, f"{p}.attention.wo.weight", (d, d), dtype)


def _feed_forward(g, p, h, ffn, act, dtype):
    d = h.shape[-1]
    up = h @ _weight(g, f"{p}.feed_forward.w1.weight", (d, ffn), dtype)
    if act == "silu":       # SwiGLU: w2(silu(w1 h) * w3 h)
        up = ops.silu(up) * (h @ _weight(g, f"{p}.feed_forward.w3.weight", (d, ffn), dtype))
    else:
        up = ops.gelu(up)
    return up @ _weight(g, f"{p}.feed_forward.w2.weight", (ffn, d), dtype)


def transformer_block(g: Graph, x, pos, layer: int, *, batch: int, seq: int, n_heads: int,
                      ffn: int, norm: str = "rms", act: str = "silu"):
    """One decoder layer over rows x [batch * seq, d_model]; returns the new rows."""
    p, dt = f"layers.{layer}", x.dtype
    x = x + _attention(g, p, _norm(g, f"{p}.attention_norm.weight", x, norm, dt), pos,
                       batch, seq, n_heads, dt)
    return x + _feed_forward(g, p, _norm(g, f"{p}.ffn_norm.weight", x, norm, dt), ffn, act, dt)


def _check(d_model, n_heads, norm, act):
    if n_heads < 1 or d_model % n_heads or (d_model // n_heads) % 2:
        raise ShapeError(f"transformer: d_model {d_model} must split into {n_heads} heads of an "
                         f"even head_dim (rope rotates pairs)")
    if norm not in NORMS or act not in ACTS:
        raise ShapeError(f"transformer: norm must be one of {NORMS} and act one of {ACTS}, got "
                         f"norm={norm!r}, act={act!r}")


def transformer(n_layers: int, d_model: int = 256, n_heads: int = 4, seq: int = 128,
                batch: int = 8, vocab: int | None = None, ffn: int | None = None,
                norm: str = "rms", act: str = "silu", dtype: str = "f32",
                name: str = "transformer") -> Graph:
    """The whole model as a forward graph with output `loss` (see the module docstring);
    ffn defaults to 4 * d_model."""
    _check(d_model, n_heads, norm, act)
    ffn = ffn or 4 * d_model
    g = Graph(name)
    rows = batch * seq
    pos = g.input("pos", (seq,), "i32")
    if vocab is None:
        h = ops.reshape(g.input("x", (batch, seq, d_model), dtype), (rows, d_model))
    else:
        h = ops.get_rows(_weight(g, "tok_embeddings.weight", (vocab, d_model), dtype),
                         g.input("tokens", (rows,), "i32"))
    for i in range(n_layers):
        h = transformer_block(g, h, pos, i, batch=batch, seq=seq, n_heads=n_heads, ffn=ffn,
                              norm=norm, act=act)
    h = _norm(g, "norm.weight", h, norm, dtype)
    if vocab is None:
        g.output(loss=ops.mse(h, ops.reshape(g.input("y", (batch, seq, d_model), dtype),
                                             (rows, d_model))))
        return g
    logits = h @ _weight(g, "output.weight", (d_model, vocab), dtype)
    g.output(loss=ops.cross_entropy(logits, g.input("labels", (rows,), "i32")), logits=logits)
    return g


def sample_inputs(g: Graph, rng: np.random.Generator) -> dict:
    """Random inputs for a `transformer` graph: token sequences whose labels are the next tokens
    (or normal x and y without a vocabulary) and positions 0..S-1."""
    seq = g.nodes[g.inputs["pos"]].type.shape[0]
    out = {"pos": np.arange(seq, dtype=np.int32)}
    if "tokens" in g.inputs:
        vocab = g.nodes[g.params["tok_embeddings.weight"]].type.shape[0]
        rows = g.nodes[g.inputs["tokens"]].type.shape[0]
        text = rng.integers(0, vocab, (rows // seq, seq + 1), dtype=np.int32)
        out["tokens"] = text[:, :-1].reshape(-1).copy()
        out["labels"] = text[:, 1:].reshape(-1).copy()
        return out
    for k in ("x", "y"):
        t = g.nodes[g.inputs[k]].type
        out[k] = rng.standard_normal(t.shape).astype(t.np_dtype)
    return out

"""Causal self-attention as one op, and its backward as one op (ggml_flash_attn_ext and its back;
torch's scaled_dot_product_attention(is_causal=True)).

Written from primitives, attention materialises the scores [B, H, S, S] and passes over them
four times in the forward (matmul, scale, causal_mask, softmax) and four in the backward; with
small heads (stories260K: head_dim 8) those passes cost more than every projection GEMM. As one
op, a kernel keeps one query row's scores in cache, and the backward recomputes them from q and
k (flash attention's trade: a second q.k product instead of an S x S tensor in memory).

Layout: token-major, the projections' own, so no permute is needed on either side:
  attention(q [B, S, H, D], k [B, S, Hkv, D], v [B, S, Hkv, D], scale) -> out [B, S, H, D]
  out[b, i, h] = sum_{j <= i} p_j v[b, j, g],  p = softmax_j(scale * q[b, i, h] . k[b, j, g]),
  g = h // (H / Hkv) (grouped-query attention: the query heads of one kv head are adjacent, as
  in ggml and llama.cpp).
  attention_back(q, k, v, out, dout, scale) -> a flat [B S (H + 2 Hkv) D]: dq, then dk, then
  dv, each C-ordered in its operand's shape (one op, one pass: dk and dv sum over the query
  heads sharing them); the vjp takes the three apart with contiguous slices and reshapes.

Stored probabilities (passes/attention.py puts this pair in place of the one above in a training
graph when the probabilities are small enough): the forward keeps what the backward would
recompute, flash attention's trade undone where memory allows it:
  attention_store(q, k, v, scale) -> a flat [B S H D + B H probs_size(S) + B H S]: out, then
  the causal softmax probabilities p[b, h, i, j] = e[b, h, i, j] r[b, h, i] as e, blocked (for
  each (b, h) the query rows in blocks of PROBS_BLOCK, i0 .. i0 + m, each block m x (i0 + m):
  the keys its rows can see, 0 past each row's own; C-ordered, one block after the other),
  then r [B, H, S]: e = e^(s - c), c the largest score any row of the block sees, r = 1 /
  the row's sum of e (the kernels' one flat pass over a block); a row whose sum falls below
  REDO_BELOW (2^-50) takes its own largest score as c, as does every row of a block holding
  a NaN or an infinity (c 0 when the row's own is not finite either).
  attention_back_stored(q, k, v, stored, dout, scale) -> attention_back's flat gradients,
  reading out, e and r from `stored` instead of recomputing the scores and their exps.
"""
from __future__ import annotations

import math

import numpy as np

from ..registry import register
from ..types import ShapeError, TensorType
from .common import apply, need_float, same_dtype
from .shape import reshape as _reshape
from .shape import slice as _slice

__all__ = ["attention"]


def _check(q, k, v, what):
    for x in (q, k, v):
        need_float(x)
    same_dtype([q, k, v], what)
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ShapeError(f"expected q [batch, seq, heads, head_dim], k and v [batch, seq, "
                         f"kv_heads, head_dim] (the same shape): got {q}, {k}, {v}")
    B, S, H, D = q.shape
    if k.shape[0] != B or k.shape[1] != S or k.shape[3] != D:
        raise ShapeError(f"q {q} and k {k}: batch, seq and head_dim must match")
    if k.shape[2] < 1 or H % k.shape[2]:
        raise ShapeError(f"q {q} and k {k}: heads ({H}) must be a multiple of kv_heads "
                         f"({k.shape[2]})")


def _attention_infer(args, a):
    _check(*args, "attention")
    return args[0].type


def _back_infer(args, a):
    q, k, v, out, dout = args
    _check(q, k, v, "attention_back")
    if out.shape != q.shape or dout.shape != q.shape or out.dtype != q.dtype \
            or dout.dtype != q.dtype:
        raise ShapeError(f"out {out} and dout {dout} must have q's type {q.type}")
    return TensorType(q.dtype, (q.type.size + 2 * k.type.size,))


def _scores(q, k, scale):
    """scale q k^T [B, H, S, S] (unmasked) and the repeated k [B, S, H, D]."""
    kk = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    return np.einsum("bihd,bjhd->bhij", q, kk) * np.asarray(scale, q.dtype), kk


def _probs(q, k, scale, scores=None):
    """p [B, H, S, S] (causal softmax of the scores) and the repeated k [B, S, H, D]."""
    s, kk = _scores(q, k, scale) if scores is None else scores
    S = q.shape[1]
    s = np.where(np.triu(np.ones((S, S), bool), 1), -np.inf, s)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(q.dtype), kk


def _attention_ref(a, q, k, v):
    p, _ = _probs(q, k, a["scale"])
    vv = np.repeat(v, q.shape[2] // k.shape[2], axis=2)
    return np.einsum("bhij,bjhd->bihd", p, vv).astype(q.dtype)


def _back_ref(a, q, k, v, out, dout):
    p, kk = _probs(q, k, a["scale"])
    return _back_from_probs(a, q, k, v, p, kk, out, dout)


def _back_from_probs(a, q, k, v, p, kk, out, dout):
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    rep = H // Hkv
    vv = np.repeat(v, rep, axis=2)
    dp = np.einsum("bihd,bjhd->bhij", dout, vv)
    rows = np.einsum("bihd,bihd->bhi", dout, out)[..., None]    # = sum_j p_ij dp_ij
    ds = p * (dp - rows) * np.asarray(a["scale"], q.dtype)
    dq = np.einsum("bhij,bjhd->bihd", ds, kk)
    dk = np.einsum("bhij,bihd->bjhd", ds, q).reshape(B, S, Hkv, rep, D).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", p, dout).reshape(B, S, Hkv, rep, D).sum(3)
    return np.concatenate([dq.ravel(), dk.ravel(), dv.ravel()]).astype(q.dtype)


PROBS_BLOCK = 32      # query rows per block of attention_store's probabilities


def _blocks(S):
    """(first row i0, rows m) of each block of PROBS_BLOCK query rows."""
    return [(i0, min(PROBS_BLOCK, S - i0)) for i0 in range(0, S, PROBS_BLOCK)]


def probs_size(S: int) -> int:
    """Elements of one (batch, head)'s blocked probabilities: each block m x (i0 + m)."""
    return sum(m * (i0 + m) for i0, m in _blocks(S))


def _store_infer(args, a):
    q, k, v = args
    _check(q, k, v, "attention_store")
    B, S, H, _ = q.shape
    return TensorType(q.dtype, (q.type.size + B * H * (probs_size(S) + S),))


REDO_BELOW = 2.0 ** -50


def _exps(s, valid):
    """(e, r) of one block of scores s [m, n] (valid: the keys each row sees), as above."""
    with np.errstate(all="ignore"):
        c = np.max(np.where(valid, s, -np.inf))
        if np.isfinite(c):
            e = np.where(valid, np.exp(s - c), 0).astype(s.dtype)
            own = e.sum(1) < REDO_BELOW
        else:
            own = np.ones(len(s), bool)
            e = np.zeros_like(s)
        if own.any():
            cr = np.max(np.where(valid, s, -np.inf), axis=1, keepdims=True)
            cr = np.where(np.isfinite(cr), cr, 0).astype(s.dtype)
            e[own] = np.where(valid, np.exp(s - cr), 0)[own]
        return e, (1 / e.sum(1)).astype(s.dtype)


def _store_ref(a, q, k, v):
    scores = _scores(q, k, a["scale"])
    p, _ = _probs(q, k, a["scale"], scores)
    vv = np.repeat(v, q.shape[2] // k.shape[2], axis=2)
    out = np.einsum("bhij,bjhd->bihd", p, vv)
    B, S, H, _ = q.shape
    sc = scores[0]
    e = np.zeros((B, H, probs_size(S)), q.dtype)
    r = np.zeros((B, H, S), q.dtype)
    for b in range(B):
        for h in range(H):
            at = 0
            for i0, m in _blocks(S):
                n = i0 + m
                valid = np.arange(n)[None, :] <= np.arange(i0, n)[:, None]
                eb, r[b, h, i0:n] = _exps(sc[b, h, i0:n, :n], valid)
                e[b, h, at:at + m * n] = eb.ravel()
                at += m * n
    return np.concatenate([out.ravel(), e.ravel(), r.ravel()]).astype(q.dtype)


def _unpack(q, stored):
    """(out [B, S, H, D], p [B, H, S, S] = e r) from attention_store's flat result."""
    B, S, H, _ = q.shape
    n = B * H * probs_size(S)
    out = stored[:q.size].reshape(q.shape)
    flat = stored[q.size:q.size + n].reshape(B, H, -1)
    r = stored[q.size + n:].reshape(B, H, S, 1)
    p = np.zeros((B, H, S, S), stored.dtype)
    at = 0
    for i0, m in _blocks(S):
        p[:, :, i0:i0 + m, :i0 + m] = flat[:, :, at:at + m * (i0 + m)].reshape(B, H, m, i0 + m)
        at += m * (i0 + m)
    return out, p * r


def _back_stored_infer(args, a):
    q, k, v, stored, dout = args
    _check(q, k, v, "attention_back_stored")
    want = _store_infer((q, k, v), a)
    if stored.type != want:
        raise ShapeError(f"stored {stored} must be attention_store's result {want}")
    if dout.shape != q.shape or dout.dtype != q.dtype:
        raise ShapeError(f"dout {dout} must have q's type {q.type}")
    return TensorType(q.dtype, (q.type.size + 2 * k.type.size,))


def _back_stored_ref(a, q, k, v, stored, dout):
    out, p = _unpack(q, stored)
    kk = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    return _back_from_probs(a, q, k, v, p, kk, out, dout)


def _pairs(q):
    """Causal (query, key) pairs: B * H * S (S + 1) / 2."""
    B, S, H, _ = q.shape
    return B * H * S * (S + 1) // 2


def _attention_vjp(g, out, xs, a):
    q, k, v = xs
    nq, nk = q.type.size, k.type.size
    packed = apply("attention_back", *xs, out, g, scale=a["scale"])
    return [_reshape(_slice(packed, (lo, hi)), x.shape)
            for x, lo, hi in ((q, 0, nq), (k, nq, nq + nk), (v, nq + nk, nq + 2 * nk))]


register("attention", kind="opaque", half="compute", arity=3, attrs={"scale": ("float", 1.0)},
         infer=_attention_infer, ref=_attention_ref, vjp=_attention_vjp,
         flops=lambda ins, out, a: _pairs(ins[0]) * (4 * ins[0].shape[3] + 5),
         bytes=lambda ins, out, a: sum(t.nbytes for t in ins) + out.nbytes,
         doc="attention(q [B, S, H, D], k, v [B, S, Hkv, D], scale): causal softmax attention, "
             "out[b, i, h] = sum_{j<=i} softmax_j(scale q[b,i,h].k[b,j,g]) v[b,j,g], "
             "g = h // (H / Hkv) (GQA); the scores are never stored (the backward recomputes "
             "them)")
register("attention_back", kind="opaque", half="compute", arity=5, attrs={"scale": ("float", 1.0)},
         infer=_back_infer, ref=_back_ref,
         flops=lambda ins, out, a: _pairs(ins[0]) * (10 * ins[0].shape[3] + 8),
         bytes=lambda ins, out, a: sum(t.nbytes for t in ins) + out.nbytes,
         doc="attention_back(q, k, v, out, dout, scale) -> flat [B S (H + 2 Hkv) D]: the "
             "gradients of attention with respect to q, k and v, one after the other")


register("attention_store", kind="opaque", half="compute", arity=3, attrs={"scale": ("float", 1.0)},
         infer=_store_infer, ref=_store_ref,
         flops=lambda ins, out, a: _pairs(ins[0]) * (4 * ins[0].shape[3] + 6),
         bytes=lambda ins, out, a: sum(t.nbytes for t in ins) + out.nbytes,
         doc="attention_store(q, k, v, scale) -> flat [B S H D + B H (probs_size(S) + S)]: "
             "attention's output, then its probabilities p = e r (e in blocks of query rows, "
             "then r per row), kept for attention_back_stored (passes/attention.py)")
register("attention_back_stored", kind="opaque", half="compute", arity=5,
         attrs={"scale": ("float", 1.0)},
         infer=_back_stored_infer, ref=_back_stored_ref,
         flops=lambda ins, out, a: _pairs(ins[0]) * (6 * ins[0].shape[3] + 4),
         bytes=lambda ins, out, a: sum(t.nbytes for t in ins) + out.nbytes,
         doc="attention_back_stored(q, k, v, stored, dout, scale) -> attention_back's flat "
             "gradients, reading the output and probabilities attention_store kept")


def attention(q, k, v, scale=None):
    """Causal self-attention of q [batch, seq, heads, head_dim] over k and v [batch, seq,
    kv_heads, head_dim] (heads a multiple of kv_heads: grouped-query attention), as one op
    whose scores are never stored; scale: default 1/sqrt(head_dim). Returns [batch, seq, heads,
    head_dim]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return apply("attention", q, k, v, scale=scale)

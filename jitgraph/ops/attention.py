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


def _probs(q, k, scale):
    """p [B, H, S, S] (causal softmax of the scores) and the repeated k [B, S, H, D]."""
    rep = q.shape[2] // k.shape[2]
    kk = np.repeat(k, rep, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kk) * np.asarray(scale, q.dtype)
    S = q.shape[1]
    s = np.where(np.triu(np.ones((S, S), bool), 1), -np.inf, s)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(q.dtype), kk


def _attention_ref(a, q, k, v):
    p, _ = _probs(q, k, a["scale"])
    vv = np.repeat(v, q.shape[2] // k.shape[2], axis=2)
    return np.einsum("bhij,bjhd->bihd", p, vv).astype(q.dtype)


def _back_ref(a, q, k, v, out, dout):
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    rep = H // Hkv
    p, kk = _probs(q, k, a["scale"])
    vv = np.repeat(v, rep, axis=2)
    dp = np.einsum("bihd,bjhd->bhij", dout, vv)
    rows = np.einsum("bihd,bihd->bhi", dout, out)[..., None]    # = sum_j p_ij dp_ij
    ds = p * (dp - rows) * np.asarray(a["scale"], q.dtype)
    dq = np.einsum("bhij,bjhd->bihd", ds, kk)
    dk = np.einsum("bhij,bihd->bjhd", ds, q).reshape(B, S, Hkv, rep, D).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", p, dout).reshape(B, S, Hkv, rep, D).sum(3)
    return np.concatenate([dq.ravel(), dk.ravel(), dv.ravel()]).astype(q.dtype)


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


register("attention", kind="opaque", arity=3, attrs={"scale": ("float", 1.0)},
         infer=_attention_infer, ref=_attention_ref, vjp=_attention_vjp,
         flops=lambda ins, out, a: _pairs(ins[0]) * (4 * ins[0].shape[3] + 5),
         bytes=lambda ins, out, a: sum(t.nbytes for t in ins) + out.nbytes,
         doc="attention(q [B, S, H, D], k, v [B, S, Hkv, D], scale): causal softmax attention, "
             "out[b, i, h] = sum_{j<=i} softmax_j(scale q[b,i,h].k[b,j,g]) v[b,j,g], "
             "g = h // (H / Hkv) (GQA); the scores are never stored (the backward recomputes "
             "them)")
register("attention_back", kind="opaque", arity=5, attrs={"scale": ("float", 1.0)},
         infer=_back_infer, ref=_back_ref,
         flops=lambda ins, out, a: _pairs(ins[0]) * (10 * ins[0].shape[3] + 8),
         bytes=lambda ins, out, a: sum(t.nbytes for t in ins) + out.nbytes,
         doc="attention_back(q, k, v, out, dout, scale) -> flat [B S (H + 2 Hkv) D]: the "
             "gradients of attention with respect to q, k and v, one after the other")


def attention(q, k, v, scale=None):
    """Causal self-attention of q [batch, seq, heads, head_dim] over k and v [batch, seq,
    kv_heads, head_dim] (heads a multiple of kv_heads: grouped-query attention), as one op
    whose scores are never stored; scale: default 1/sqrt(head_dim). Returns [batch, seq, heads,
    head_dim]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return apply("attention", q, k, v, scale=scale)

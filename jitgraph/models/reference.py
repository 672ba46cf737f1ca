"""Float64 numpy implementations of the model families, written from llama.cpp's graph
(build_llama) and independent of jitgraph's ops and compiler: the oracles the tests compare
compiled programs with."""
from __future__ import annotations

import math

import numpy as np


def llama_logits(cfg, params, ids):
    """llama.cpp's build_llama in float64 numpy, one sequence: NORM rope on the first rope_dims,
    query head h reading kv head h // (heads / kv_heads)."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    s, hd, rd, rep = len(ids), cfg.head_dim, cfg.rope_dims, cfg.heads // cfg.kv_heads

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * w

    def rope(t):                                        # t [S, H, hd]
        ang = np.arange(s)[:, None] * cfg.rope_base ** (-np.arange(0, rd, 2) / rd)
        c, sn = np.cos(ang)[:, None], np.sin(ang)[:, None]
        o = t.copy()
        a, b = t[..., 0:rd:2], t[..., 1:rd:2]
        o[..., 0:rd:2], o[..., 1:rd:2] = a * c - b * sn, a * sn + b * c
        return o

    h = p["token_embd.weight"][ids]
    for i in range(cfg.layers):
        b = f"blk.{i}."
        x = rms(h, p[b + "attn_norm.weight"])
        q = rope((x @ p[b + "attn_q.weight"].T).reshape(s, cfg.heads, hd))
        k = rope((x @ p[b + "attn_k.weight"].T).reshape(s, cfg.kv_heads, hd))
        v = (x @ p[b + "attn_v.weight"].T).reshape(s, cfg.kv_heads, hd)
        att = np.empty((s, cfg.heads, hd))
        for hh in range(cfg.heads):
            sc = q[:, hh] @ k[:, hh // rep].T / math.sqrt(hd)
            sc = np.where(np.tril(np.ones((s, s))) > 0, sc, -np.inf)
            e = np.exp(sc - sc.max(-1, keepdims=True))
            att[:, hh] = (e / e.sum(-1, keepdims=True)) @ v[:, hh // rep]
        h = h + att.reshape(s, -1) @ p[b + "attn_output.weight"].T
        x = rms(h, p[b + "ffn_norm.weight"])
        gate = x @ p[b + "ffn_gate.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * (x @ p[b + "ffn_up.weight"].T)) @ \
            p[b + "ffn_down.weight"].T
    out = p["token_embd.weight"] if cfg.tied else p["output.weight"]
    return rms(h, p["output_norm.weight"]) @ out.T

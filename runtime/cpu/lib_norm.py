"""Last-axis normalisation kernels (rms_norm, layer_norm and their *_back), rope / rope_back and
causal_mask. Row statistics accumulate in float64; rows run in a prange when there is enough
work."""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from .lib_common import PAR_MIN_WORK, kernel, pkernel


@kernel
def _mean(xf, base, n):
    s = 0.0
    for k in range(n):
        s += xf[base + k]
    return s / n


@kernel
def _rstd(xf, base, n, mu, eps):
    """1 / sqrt(mean((x - mu)^2) + eps) of a row."""
    s = 0.0
    for k in range(n):
        d = xf[base + k] - mu
        s += d * d
    return 1.0 / math.sqrt(s / n + eps)


@kernel
def _norm_row(xf, gf, of, base, n, eps, op):
    """One row of op 0 rms_norm, 1 layer_norm, 2 rms_norm_back, 3 layer_norm_back."""
    mu = _mean(xf, base, n) if op % 2 else 0.0
    r = _rstd(xf, base, n, mu, eps)
    if op < 2:
        for k in range(n):
            of[base + k] = (xf[base + k] - mu) * r
        return
    gm, gy = 0.0, 0.0                       # mean(g), mean(g * y) with y = (x - mu) * r
    for k in range(n):
        gm += gf[base + k]
        gy += gf[base + k] * (xf[base + k] - mu) * r
    gm, gy = gm / n, gy / n
    if op == 2:                             # r * (g - x * r^2 * mean(g * x))
        for k in range(n):
            of[base + k] = r * (gf[base + k] - xf[base + k] * r * gy)
    else:                                   # r * (g - mean(g) - y * mean(g * y))
        for k in range(n):
            of[base + k] = r * (gf[base + k] - gm - (xf[base + k] - mu) * r * gy)


@pkernel
def _norm(x, g, out, eps, op):
    n = x.shape[x.ndim - 1]
    if x.size == 0:
        return
    xf, gf, of = x.reshape(x.size), g.reshape(g.size), out.reshape(out.size)
    if x.size * 4 < PAR_MIN_WORK:
        for r in range(x.size // n):
            _norm_row(xf, gf, of, r * n, n, eps, op)
    else:
        for r in prange(x.size // n):
            _norm_row(xf, gf, of, r * n, n, eps, op)


@kernel
def rms_norm(x, out, eps):
    """rms_norm: out = x / sqrt(mean(x^2) + eps) over the last axis."""
    _norm(x, x, out, eps, 0)


@kernel
def layer_norm(x, out, eps):
    """layer_norm: out = (x - mean) / sqrt(var + eps) over the last axis."""
    _norm(x, x, out, eps, 1)


@kernel
def rms_norm_back(x, g, out, eps):
    """rms_norm_back(x, g): out = r * (g - x * r^2 * mean(g * x)), r = 1/sqrt(mean(x^2)+eps)."""
    _norm(x, g, out, eps, 2)


@kernel
def layer_norm_back(x, g, out, eps):
    """layer_norm_back(x, g): out = r * (g - mean(g) - y * mean(g * y)), y = layer_norm(x)."""
    _norm(x, g, out, eps, 3)


@kernel
def workspace_size_rope(x_shape, pos_shape):
    """Scratch elements of rope / rope_back: the cos and sin of each (position, pair) angle,
    repeated for each head (a row's pairs then read the table contiguously)."""
    n = len(x_shape)
    return 2 * x_shape[n - 3] * x_shape[n - 2] * (x_shape[n - 1] // 2)


@kernel
def _rope_table(pos, D, theta, sign, cs, sn, factors):
    """cs[s, h * D/2 + i], sn[...] = cos, sign * sin of pos[s] * theta^(-2i/D) / factors[i]
    (factors empty: 1) for every head h, computed in float64 and rounded to the table's dtype:
    once per angle, not once per batch row."""
    log_theta = math.log(theta)
    T = cs.dtype.type
    half = D // 2
    for i in range(half):
        f = math.exp(-2.0 * i / D * log_theta)
        if factors.size:
            f = f / np.float64(factors[i])
        for s in range(cs.shape[0]):
            ang = pos[s] * f
            cs[s, i] = T(math.cos(ang))
            sn[s, i] = T(sign * math.sin(ang))
    for s in range(cs.shape[0]):
        for k in range(half, cs.shape[1]):
            cs[s, k] = cs[s, k % half]
            sn[s, k] = sn[s, k % half]


@kernel
def _rope_slab(xf, of, b, S, H, D, cs, sn, neox):
    """Rotate slab b (one batch index: S positions x H heads x D, contiguous) of the flat x
    with the table (D is even: the op's shape rule). Mode normal: the slab's S * H * D/2
    adjacent pairs against the table read flat (row s of the table is position s's H * D/2
    pairs) in one loop, which vectorises: it indexes views from 0, as an index computed as
    base + i may be negative as far as numba knows, and its wraparound select kept LLVM from
    vectorising. One loop per slab, not per (batch, position) row: a row is 32 to 64 elements
    at stories260K's width, and the per-row calls cost more than the rotation (bench/README.md:
    "Figures behind the code", rope). The per-head loops of mode neox are a few pairs long;
    views cost them more than they gain."""
    half = D // 2
    n = S * H * D
    base = b * n
    if not neox:
        m = S * H * half
        xr, orow = xf[base:base + n], of[base:base + n]
        c, sg = cs.reshape(m), sn.reshape(m)
        for p in range(m):
            a, z = xr[2 * p], xr[2 * p + 1]
            orow[2 * p] = a * c[p] - z * sg[p]
            orow[2 * p + 1] = a * sg[p] + z * c[p]
        return
    for s in range(S):
        for h in range(H):
            hb = base + (s * H + h) * D
            for i in range(half):
                a, z, c, sg = xf[hb + i], xf[hb + i + half], cs[s, i], sn[s, i]
                of[hb + i] = a * c - z * sg
                of[hb + i + half] = a * sg + z * c


@pkernel
def _rope(x, pos, factors, out, work, theta, neox, sign):
    """The angles' cos/sin into `work` (workspace_size_rope elements) first, then each batch
    slab [S, H, D] in memory order (a prange over the slabs when there is work enough). The
    former loop, angle outermost and batch rows (64 KB apart) innermost, ran at under a fifth
    of memory speed."""
    S, H, D = x.shape[x.ndim - 3], x.shape[x.ndim - 2], x.shape[x.ndim - 1]
    if x.size == 0:
        return
    n = S * H * (D // 2)
    cs = work[:n].reshape((S, H * (D // 2)))
    sn = work[n:2 * n].reshape((S, H * (D // 2)))
    _rope_table(pos, D, theta, sign, cs, sn, factors)
    xf, of = x.reshape(x.size), out.reshape(out.size)
    slabs = x.size // (S * H * D)
    # the slab loop vectorises (cheap per element), so a prange region pays only from some
    # 4 * PAR_MIN_WORK elements (bench/README.md: "Figures behind the code", rope)
    if x.size < 4 * PAR_MIN_WORK or slabs == 1:
        for b in range(slabs):
            _rope_slab(xf, of, b, S, H, D, cs, sn, neox)
    else:
        for b in prange(slabs):
            _rope_slab(xf, of, b, S, H, D, cs, sn, neox)


@kernel
def rope_work(x, pos, out, work, theta, neox):
    """rope(x [..., seq, heads, head_dim], pos i32[seq]): rotate pairs by pos * theta^(-2i/D);
    neox=False rotates (x[2i], x[2i+1]) (mode "normal"), True rotates (x[i], x[i + D/2]).
    work: workspace_size_rope(x.shape, pos.shape) elements of x's dtype (compiled programs call
    this one, with arena scratch)."""
    _rope(x, pos, x.reshape(x.size)[:0], out, work, theta, neox, 1.0)


@kernel
def rope_back_work(g, pos, out, work, theta, neox):
    """rope_back(g, pos): the inverse rotation of rope (same layout, parameters, work)."""
    _rope(g, pos, g.reshape(g.size)[:0], out, work, theta, neox, -1.0)


@kernel
def rope_freqs_work(x, pos, factors, out, work, theta, neox):
    """rope_work with each pair's frequency divided by factors[i] (LLaMA 3.x rope_freqs)."""
    _rope(x, pos, factors, out, work, theta, neox, 1.0)


@kernel
def rope_back_freqs_work(g, pos, factors, out, work, theta, neox):
    """rope_back_work with frequency factors."""
    _rope(g, pos, factors, out, work, theta, neox, -1.0)


@kernel
def rope(x, pos, out, theta, neox):
    """rope_work allocating its own cos/sin table (for direct callers; programs use rope_work)."""
    work = np.empty(workspace_size_rope(x.shape, pos.shape), x.dtype)
    _rope(x, pos, np.empty(0, x.dtype), out, work, theta, neox, 1.0)


@kernel
def rope_back(g, pos, out, theta, neox):
    """rope_back_work allocating its own cos/sin table (for direct callers)."""
    work = np.empty(workspace_size_rope(g.shape, pos.shape), g.dtype)
    _rope(g, pos, np.empty(0, g.dtype), out, work, theta, neox, -1.0)


@kernel
def causal_mask(x, out, n_past, value):
    """causal_mask: x [..., rows, cols]; out[.., i, j] = value where j > i + n_past, else x."""
    R, C = x.shape[x.ndim - 2], x.shape[x.ndim - 1]
    if x.size == 0:
        return
    x3, o3 = x.reshape((x.size // (R * C), R, C)), out.reshape((x.size // (R * C), R, C))
    for b in range(x3.shape[0]):
        for i in range(R):
            keep = min(max(i + n_past + 1, 0), C)
            for j in range(keep):
                o3[b, i, j] = x3[b, i, j]
            for j in range(keep, C):
                o3[b, i, j] = value

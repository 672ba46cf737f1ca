"""Last-axis normalisation kernels (rms_norm, layer_norm and their *_back), rope / rope_back and
causal_mask. Row statistics accumulate in float64; rows run in a prange when there is enough
work."""
from __future__ import annotations

import math

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
def _rope_position(x4, pos, o4, s, theta, neox, sign):
    """Rotate x4[:, s, :, :] (every batch row and head at position s); each angle's cos/sin
    is computed once, in float64, and rounded to x's dtype. Looping over the batch inside the
    angle, not outside, takes B times fewer pow/cos/sin calls: the transformer block's four
    rope kernels went from 2.5 to about 1 ms."""
    B, H, D = x4.shape[0], x4.shape[2], x4.shape[3]
    half = D // 2
    log_theta = math.log(theta)
    for i in range(half):
        ang = pos[s] * math.exp(-2.0 * i / D * log_theta)     # pos * theta^(-2i/D)
        c, sn = x4.dtype.type(math.cos(ang)), x4.dtype.type(sign * math.sin(ang))
        lo, hi = (i, i + half) if neox else (2 * i, 2 * i + 1)
        for b in range(B):
            for h in range(H):
                a, z = x4[b, s, h, lo], x4[b, s, h, hi]
                o4[b, s, h, lo] = a * c - z * sn
                o4[b, s, h, hi] = a * sn + z * c


@pkernel
def _rope(x, pos, out, theta, neox, sign):
    S, H, D = x.shape[x.ndim - 3], x.shape[x.ndim - 2], x.shape[x.ndim - 1]
    if x.size == 0:
        return
    shape4 = (x.size // (S * H * D), S, H, D)
    x4, o4 = x.reshape(shape4), out.reshape(shape4)
    if x.size * 2 < PAR_MIN_WORK:
        for s in range(S):
            _rope_position(x4, pos, o4, s, theta, neox, sign)
    else:
        for s in prange(S):
            _rope_position(x4, pos, o4, s, theta, neox, sign)


@kernel
def rope(x, pos, out, theta, neox):
    """rope(x [..., seq, heads, head_dim], pos i32[seq]): rotate pairs by pos * theta^(-2i/D);
    neox=False rotates (x[2i], x[2i+1]) (mode "normal"), True rotates (x[i], x[i + D/2])."""
    _rope(x, pos, out, theta, neox, 1.0)


@kernel
def rope_back(g, pos, out, theta, neox):
    """rope_back(g, pos): the inverse rotation of rope (same layout and parameters)."""
    _rope(g, pos, out, theta, neox, -1.0)


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

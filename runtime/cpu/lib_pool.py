"""2-D pooling kernels on NCHW images: max_pool2d, max_pool2d_back, avg_pool2d, avg_pool2d_back.
Window sizes, strides and paddings are int scalars (kh, kw, sh, sw, ph, pw); spatial sizes come
from the arrays. Max pooling pads with -inf, average pooling with zeros that count in the divisor
(kh * kw for every window), as the references in jitgraph/ops/nn.py."""
from __future__ import annotations

import math

from .lib_common import kernel


@kernel
def _first_max(x, n, c, p, q, kh, kw, sh, sw, ph, pw):
    """(value, y, z) of the first maximum of window (p, q) in row-major tap order; a padded tap
    counts as -inf and reports y = -1 (its gradient is dropped, as the reference's crop does)."""
    H, W = x.shape[2], x.shape[3]
    best, by, bz = -math.inf, -1, -1
    first = True
    for i in range(kh):
        y = p * sh + i - ph
        for j in range(kw):
            z = q * sw + j - pw
            inside = 0 <= y < H and 0 <= z < W
            v = x[n, c, y, z] if inside else -math.inf
            if first or v > best:
                best, by, bz, first = v, (y if inside else -1), z, False
    return best, by, bz


@kernel
def max_pool2d(x, out, kh, kw, sh, sw, ph, pw):
    """max_pool2d: x [N,C,H,W] -> out [N,C,oh,ow], the max of each window."""
    N, C, oh, ow = out.shape
    for n in range(N):
        for c in range(C):
            for p in range(oh):
                for q in range(ow):
                    out[n, c, p, q] = _first_max(x, n, c, p, q, kh, kw, sh, sw, ph, pw)[0]


@kernel
def max_pool2d_back(x, g, out, kh, kw, sh, sw, ph, pw):
    """max_pool2d_back(x, g [N,C,oh,ow]) -> out [N,C,H,W]: each window's gradient goes to its
    first maximum (row-major in the window); overlapping windows accumulate."""
    N, C, oh, ow = g.shape
    out[...] = 0
    for n in range(N):
        for c in range(C):
            for p in range(oh):
                for q in range(ow):
                    _, y, z = _first_max(x, n, c, p, q, kh, kw, sh, sw, ph, pw)
                    if y >= 0:
                        out[n, c, y, z] += g[n, c, p, q]


@kernel
def avg_pool2d(x, out, kh, kw, sh, sw, ph, pw):
    """avg_pool2d: x [N,C,H,W] -> out [N,C,oh,ow], window sums / (kh * kw) (zero padding)."""
    N, C, oh, ow = out.shape
    H, W = x.shape[2], x.shape[3]
    for n in range(N):
        for c in range(C):
            for p in range(oh):
                for q in range(ow):
                    s = 0.0
                    for i in range(kh):
                        y = p * sh + i - ph
                        if 0 <= y < H:
                            for j in range(kw):
                                z = q * sw + j - pw
                                if 0 <= z < W:
                                    s += x[n, c, y, z]
                    out[n, c, p, q] = s / (kh * kw)


@kernel
def avg_pool2d_back(g, out, kh, kw, sh, sw, ph, pw):
    """avg_pool2d_back(g [N,C,oh,ow]) -> out [N,C,H,W]: g / (kh * kw) added to every in-bounds
    tap of its window."""
    N, C, oh, ow = g.shape
    H, W = out.shape[2], out.shape[3]
    out[...] = 0
    for n in range(N):
        for c in range(C):
            for p in range(oh):
                for q in range(ow):
                    v = g[n, c, p, q] / (kh * kw)
                    for i in range(kh):
                        y = p * sh + i - ph
                        if 0 <= y < H:
                            for j in range(kw):
                                z = q * sw + j - pw
                                if 0 <= z < W:
                                    out[n, c, y, z] += v

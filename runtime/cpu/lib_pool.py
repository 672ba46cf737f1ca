"""2-D pooling kernels on NCHW images: max_pool2d, max_pool2d_back, avg_pool2d, avg_pool2d_back.
Window sizes, strides and paddings are int scalars (kh, kw, sh, sw, ph, pw); spatial sizes come
from the arrays. Max pooling pads with -inf, average pooling with zeros that count in the divisor
(kh * kw for every window), as the references in jitgraph/ops/conv.py.

Each kernel walks the [H, W] planes through 2-D views; max pooling splits the planes over threads
when the work pays for a parallel region (lib_common.PAR_MIN_WORK), and the common 2x2 stride-2
unpadded window has loops of its own (no window tests; disjoint windows, so the backward stores).
A window that lies inside the plane (all of them without padding) is read without per-tap bounds
tests and keeps its running maximum with selects; only border windows take the checked path
(bench/README.md: "Figures behind the code", pooling).
"""
from __future__ import annotations

import math

from numba import prange

from .lib_common import PAR_MIN_WORK, kernel, pkernel


@kernel
def _first_max(xc, y0, z0, kh, kw):
    """(value, y, z) of the first maximum, in row-major tap order, of the window whose top-left
    tap is (y0, z0) in the plane xc [H, W]; a tap outside the plane counts as -inf and reports
    y = -1 (its gradient is dropped, as the reference's crop does). The running maximum is
    kept with selects, not branches: faster on unpredictable data."""
    H, W = xc.shape
    if y0 >= 0 and z0 >= 0 and y0 + kh <= H and z0 + kw <= W:
        best, k = xc[y0, z0], 0
        for i in range(kh):
            r = xc[y0 + i]
            for j in range(kw):
                v = r[z0 + j]
                gt = v > best
                k = i * kw + j if gt else k
                best = v if gt else best
        return best, y0 + k // kw, z0 + k % kw
    best, by, bz = -math.inf, -1, -1
    first = True
    for i in range(kh):
        y = y0 + i
        for j in range(kw):
            z = z0 + j
            inside = 0 <= y < H and 0 <= z < W
            v = xc[y, z] if inside else -math.inf
            if first or v > best:
                best, by, bz, first = v, (y if inside else -1), z, False
    return best, by, bz


@kernel
def _window_max(xc, y0, z0, kh, kw):
    """_first_max, with the common 2x2 window passed as constants (unrolled)."""
    if kh == 2 and kw == 2:
        return _first_max(xc, y0, z0, 2, 2)
    return _first_max(xc, y0, z0, kh, kw)


@kernel
def _max_plane_2x2(xc, oc):
    """2x2 windows, stride 2, no padding (windows never overlap): the four taps in row-major
    order with selects, the same first-maximum rule as _first_max; LLVM vectorises it."""
    oh, ow = oc.shape
    for p in range(oh):
        r0, r1, o = xc[2 * p], xc[2 * p + 1], oc[p]
        for q in range(ow):
            best = r0[2 * q]
            v = r0[2 * q + 1]
            best = v if v > best else best
            v = r1[2 * q]
            best = v if v > best else best
            v = r1[2 * q + 1]
            best = v if v > best else best
            o[q] = best


@kernel
def _max_back_plane_2x2(xc, gc, oc):
    """Backward of _max_plane_2x2: the plane zeroed, then each window's gradient stored at its
    first maximum (the windows are disjoint: plain stores). Faster over many planes than
    branch-free stores of all four taps."""
    oh, ow = gc.shape
    oc[:] = 0
    for p in range(oh):
        r0, r1, gr = xc[2 * p], xc[2 * p + 1], gc[p]
        for q in range(ow):
            best, k = r0[2 * q], 0
            v = r0[2 * q + 1]
            gt = v > best
            k = 1 if gt else k
            best = v if gt else best
            v = r1[2 * q]
            gt = v > best
            k = 2 if gt else k
            best = v if gt else best
            v = r1[2 * q + 1]
            k = 3 if v > best else k
            oc[2 * p + (k >> 1), 2 * q + (k & 1)] = gr[q]


@kernel
def _is_2x2(kh, kw, sh, sw, ph, pw):
    return kh == 2 and kw == 2 and sh == 2 and sw == 2 and ph == 0 and pw == 0


@kernel
def _max_plane(xc, oc, kh, kw, sh, sw, ph, pw):
    if _is_2x2(kh, kw, sh, sw, ph, pw):
        _max_plane_2x2(xc, oc)
        return
    oh, ow = oc.shape
    for p in range(oh):
        for q in range(ow):
            oc[p, q] = _window_max(xc, p * sh - ph, q * sw - pw, kh, kw)[0]


@kernel
def _max_back_plane(xc, gc, oc, kh, kw, sh, sw, ph, pw):
    if _is_2x2(kh, kw, sh, sw, ph, pw):
        _max_back_plane_2x2(xc, gc, oc)
        return
    oh, ow = gc.shape
    oc[:] = 0
    for p in range(oh):
        for q in range(ow):
            _, y, z = _first_max(xc, p * sh - ph, q * sw - pw, kh, kw)
            if y >= 0:
                oc[y, z] += gc[p, q]


@kernel
def _avg_plane(xc, oc, kh, kw, sh, sw, ph, pw):
    oh, ow = oc.shape
    H, W = xc.shape
    for p in range(oh):
        y0 = p * sh - ph
        for q in range(ow):
            z0 = q * sw - pw
            s = 0.0
            for y in range(max(y0, 0), min(y0 + kh, H)):
                r = xc[y]
                for z in range(max(z0, 0), min(z0 + kw, W)):
                    s += r[z]
            oc[p, q] = s / (kh * kw)


@kernel
def _avg_back_plane(gc, oc, kh, kw, sh, sw, ph, pw):
    oh, ow = gc.shape
    H, W = oc.shape
    oc[:] = 0
    for p in range(oh):
        y0 = p * sh - ph
        for q in range(ow):
            z0 = q * sw - pw
            v = gc[p, q] / (kh * kw)
            for y in range(max(y0, 0), min(y0 + kh, H)):
                r = oc[y]
                for z in range(max(z0, 0), min(z0 + kw, W)):
                    r[z] += v


@pkernel
def max_pool2d(x, out, kh, kw, sh, sw, ph, pw):
    """max_pool2d: x [N,C,H,W] -> out [N,C,oh,ow], the max of each window; planes split over
    threads when the work pays for a parallel region."""
    C = out.shape[1]
    if out.size * kh * kw < PAR_MIN_WORK:
        for k in range(out.shape[0] * C):
            _max_plane(x[k // C, k % C], out[k // C, k % C], kh, kw, sh, sw, ph, pw)
        return
    for k in prange(out.shape[0] * C):
        _max_plane(x[k // C, k % C], out[k // C, k % C], kh, kw, sh, sw, ph, pw)


@pkernel
def max_pool2d_back(x, g, out, kh, kw, sh, sw, ph, pw):
    """max_pool2d_back(x, g [N,C,oh,ow]) -> out [N,C,H,W]: each window's gradient goes to its
    first maximum (row-major in the window); overlapping windows accumulate."""
    C = g.shape[1]
    if x.size * 2 < PAR_MIN_WORK:
        for k in range(g.shape[0] * C):
            _max_back_plane(x[k // C, k % C], g[k // C, k % C], out[k // C, k % C],
                            kh, kw, sh, sw, ph, pw)
        return
    for k in prange(g.shape[0] * C):
        _max_back_plane(x[k // C, k % C], g[k // C, k % C], out[k // C, k % C],
                        kh, kw, sh, sw, ph, pw)


@kernel
def avg_pool2d(x, out, kh, kw, sh, sw, ph, pw):
    """avg_pool2d: x [N,C,H,W] -> out [N,C,oh,ow], window sums / (kh * kw) (zero padding)."""
    C = out.shape[1]
    for k in range(out.shape[0] * C):
        _avg_plane(x[k // C, k % C], out[k // C, k % C], kh, kw, sh, sw, ph, pw)


@kernel
def avg_pool2d_back(g, out, kh, kw, sh, sw, ph, pw):
    """avg_pool2d_back(g [N,C,oh,ow]) -> out [N,C,H,W]: g / (kh * kw) added to every in-bounds
    tap of its window."""
    C = g.shape[1]
    for k in range(g.shape[0] * C):
        _avg_back_plane(g[k // C, k % C], out[k // C, k % C], kh, kw, sh, sw, ph, pw)

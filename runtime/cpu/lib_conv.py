"""conv2d and its backward ops as im2col + BLAS GEMM (NCHW images, weights [O, C, kh, kw]).

Per image n, the im2col matrix col[C*kh*kw, oh*ow] holds in row (c, i, j) the input pixel that
kernel tap (i, j) of channel c reads for every output position (0 in the padding), so
    conv2d:             out[n] [O, oh*ow]   = w [O, C*kh*kw] @ col
    conv2d_back_weight: gw [O, C*kh*kw]    += g[n] [O, oh*ow] @ col^T      (beta = 1 after n = 0)
    conv2d_back_input:  col = w^T @ g[n];   gx[n] = col2im(col)            (scatter-add)
The caller passes the workspace `work` (workspace_size_conv2d elements of the array dtype): one
image's col matrix, reused for every image while it is still in cache.

Measured (f32, batch 100, 3x3, padding 1, 2 cores): 1->8 channels at 28x28 took 0.29 ms here vs
4.5 ms for a direct loop nest (vectorised inner loop over the output width); 8->16 at 14x14 took
1.2 ms vs 21 ms. Splitting the images over two prange threads (one col matrix each) gained at
most ~15 % and lost at batch 1000, so the loop over images is serial. Both backward kernels
cost about the forward (0.3 / 1.2 ms).
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from .blas import gemm_f32, gemm_f64
from .lib_common import kernel


def gemm(ta, tb, alpha, a, b, beta, c):
    """c = alpha * op(a) @ op(b) + beta * c, dispatched on dtype (f32: sgemm, f64: dgemm)."""
    raise NotImplementedError("gemm is callable from @njit code only")


@overload(gemm)
def _gemm_typed(ta, tb, alpha, a, b, beta, c):
    impl = gemm_f32 if c.dtype == types.float32 else gemm_f64
    return lambda ta, tb, alpha, a, b, beta, c: impl(ta, tb, alpha, a, b, beta, c)


def workspace_size_conv2d(x_shape, w_shape, out_shape):
    """Elements of the `work` buffer of conv2d / conv2d_back_input / conv2d_back_weight (all
    three take the same shapes: x [N,C,H,W], w [O,C,kh,kw], out [N,O,oh,ow])."""
    return int(np.prod(w_shape[1:])) * int(out_shape[2]) * int(out_shape[3])


@kernel
def _im2col(x, n, col, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw):
    """col[(c*kh + i)*kw + j, p*ow + q] = x[n, c, p*sh + i*dh - ph, q*sw + j*dw - pw] (or 0).
    (A branch per element measured 3x faster than splitting each row into valid ranges.)"""
    C, H, W = x.shape[1], x.shape[2], x.shape[3]
    for c in range(C):
        for i in range(kh):
            for j in range(kw):
                row = (c * kh + i) * kw + j
                for p in range(oh):
                    y = p * sh + i * dh - ph
                    for q in range(ow):
                        z = q * sw + j * dw - pw
                        ok = 0 <= y < H and 0 <= z < W
                        col[row, p * ow + q] = x[n, c, y, z] if ok else 0


@kernel
def _col2im(col, gx, n, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw):
    """gx[n] = 0, then the scatter-add inverse of _im2col."""
    C, H, W = gx.shape[1], gx.shape[2], gx.shape[3]
    gx[n] = 0
    for c in range(C):
        for i in range(kh):
            for j in range(kw):
                row = (c * kh + i) * kw + j
                for p in range(oh):
                    y = p * sh + i * dh - ph
                    if 0 <= y < H:
                        for q in range(ow):
                            z = q * sw + j * dw - pw
                            if 0 <= z < W:
                                gx[n, c, y, z] += col[row, p * ow + q]


@kernel
def conv2d(x, w, out, work, sh, sw, ph, pw, dh, dw):
    """conv2d: x [N,C,H,W], w [O,C,kh,kw] -> out [N,O,oh,ow] (cross-correlation, zero padding);
    work: workspace_size_conv2d elements."""
    N, O, oh, ow = out.shape
    kh, kw = w.shape[2], w.shape[3]
    K = w.size // O if O else 0
    col = work[:K * oh * ow].reshape((K, oh * ow))
    w2 = w.reshape((O, K))
    for n in range(N):
        _im2col(x, n, col, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)
        gemm(False, False, 1.0, w2, col, 0.0, out[n].reshape((O, oh * ow)))


@kernel
def conv2d_back_weight(x, g, out, work, sh, sw, ph, pw, dh, dw):
    """conv2d_back_weight(x [N,C,H,W], g [N,O,oh,ow]) -> out [O,C,kh,kw] = sum over n of
    g[n] @ im2col(x[n])^T; work: workspace_size_conv2d elements."""
    N, O, oh, ow = g.shape
    kh, kw = out.shape[2], out.shape[3]
    K = out.size // O if O else 0
    col = work[:K * oh * ow].reshape((K, oh * ow))
    gw = out.reshape((O, K))
    if N == 0:
        out[...] = 0
    for n in range(N):
        _im2col(x, n, col, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)
        gemm(False, True, 1.0, g[n].reshape((O, oh * ow)), col, 1.0 if n else 0.0, gw)


@kernel
def conv2d_back_input(w, g, out, work, sh, sw, ph, pw, dh, dw):
    """conv2d_back_input(w [O,C,kh,kw], g [N,O,oh,ow]) -> out [N,C,H,W]: col2im(w^T @ g[n]);
    work: workspace_size_conv2d elements."""
    N, O, oh, ow = g.shape
    kh, kw = w.shape[2], w.shape[3]
    K = w.size // O if O else 0
    col = work[:K * oh * ow].reshape((K, oh * ow))
    w2 = w.reshape((O, K))
    for n in range(N):
        gemm(True, False, 1.0, w2, g[n].reshape((O, oh * ow)), 0.0, col)
        _col2im(col, out, n, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw)

"""conv2d and its backward ops as im2col + BLAS GEMM per image (NCHW images, weights
[O, C, kh, kw]).

Each image is copied into a zero-padded buffer xp [C, Hp, Wp] (Hp = H + 2 ph, Wp = W + 2 pw), and
the im2col matrix is built on the "wide" grid of xp's row pitch: column p*Wp + q of row (c, i, j)
holds xp[c, p*sh + i*dh, q + j*dw]. For sh == 1 a row is then one contiguous slice of xp, copied
without bounds tests or zero fill (faster than a per-element im2col). A row has
L = (oh-1)*Wp + Wp - dw*(kw-1) columns; the columns that are no output position (q >= the
stride-1 output width, or q not a multiple of sw) are computed and dropped, so a horizontal
stride sw costs sw times the GEMM work, and stride 1 about Wp / ow.
    conv2d:             wide [O, L] = w [O, C*kh*kw] @ col;       out[n] = wide's output columns
    conv2d_back_weight: gw [O, C*kh*kw] += gwide [O, L] @ col^T   (gwide: g[n] on the wide grid,
                                                                   zeros elsewhere)
    conv2d_back_input:  col = w^T @ gwide; gxp = col2im(col) (slice adds); gx[n] = gxp cropped
Images are split over threads (prange) when the work pays for a parallel region; each thread has
its own workspace slot (and partial gw). At MNIST sizes each per-image GEMM is below OpenBLAS's
threading threshold and runs in its caller's thread; one GEMM over the whole batch measured
slower (skinny and out of cache; bench/README.md: "Figures behind the code", convolution).
"""
from __future__ import annotations

import numba
from numba import prange

from .blas import gemm_one as gemm   # on the calling thread: it runs inside prange
from .lib_common import PAR_MIN_WORK, kernel, pkernel


@kernel
def _geometry(C, H, W, O, kh, kw, oh, ph, pw, dw):
    """(Hp, Wp, K, L, S): padded image size, GEMM inner size, wide row length, elements of one
    thread's workspace slot [xp C*Hp*Wp | col K*L | wide O*L | gw O*K]."""
    Hp, Wp, K = H + 2 * ph, W + 2 * pw, C * kh * kw
    L = (oh - 1) * Wp + Wp - dw * (kw - 1)
    return Hp, Wp, K, L, C * Hp * Wp + (K + O) * L + O * K


def workspace_size_conv2d(x_shape, w_shape, out_shape, sh, sw, ph, pw, dh, dw):
    """Elements of the `work` buffer of conv2d / conv2d_back_input / conv2d_back_weight, which all
    take the shapes x [N,C,H,W], w [O,C,kh,kw], out [N,O,oh,ow] and the same parameters: one
    slot per thread that may run (numba's thread count, at most N)."""
    (N, C, H, W), (O, _, kh, kw), oh = x_shape, w_shape, out_shape[2]
    slot = _geometry(C, H, W, O, kh, kw, oh, ph, pw, dw)[4]
    return int(slot) * max(1, min(numba.config.NUMBA_NUM_THREADS, N))


@kernel
def _threads(N, macs_per_image, slots):
    """Image chunks (one per workspace slot, i.e. per thread) to split N images into: 1 below
    PAR_MIN_WORK, counting a multiply-add in these GEMMs (im2col included) as 1/32 of a simple
    loop iteration."""
    if N * macs_per_image < 32 * PAR_MIN_WORK:
        return 1
    return max(1, min(N, slots))


@kernel
def _copy(dst, src):
    for k in range(dst.size):
        dst[k] = src[k]


@kernel
def _add(dst, src):
    for k in range(dst.size):
        dst[k] += src[k]


@kernel
def _scatter(img, f, base, cpitch, pitch, step):
    """f[base + c*cpitch + r*pitch + q*step] = img[c, r, q] (f flat; others left as they are)."""
    C, R, Q = img.shape
    for c in range(C):
        for r in range(R):
            s, o = img[c, r], base + c * cpitch + r * pitch
            if step == 1:
                _copy(f[o:o + Q], s)
            else:
                for q in range(Q):
                    f[o + q * step] = s[q]


@kernel
def _gather(f, img, base, cpitch, pitch, step):
    """img[c, r, q] = f[base + c*cpitch + r*pitch + q*step] (the inverse of _scatter)."""
    C, R, Q = img.shape
    for c in range(C):
        for r in range(R):
            d, o = img[c, r], base + c * cpitch + r * pitch
            if step == 1:
                _copy(d, f[o:o + Q])
            else:
                for q in range(Q):
                    d[q] = f[o + q * step]


@kernel
def _im2col(xf, col, back, C, Hp, Wp, kh, kw, sh, dh, dw):
    """back False: col[(c*kh + i)*kw + j, p*Wp + q] = xp[c, p*sh + i*dh, q + j*dw] (xf = xp flat);
    back True: the transpose, xp[...] += col[...] (col2im). One slice per row if sh == 1, else
    one per output row p."""
    L = col.shape[1]
    seg = L if sh == 1 else Wp
    for c in range(C):
        for i in range(kh):
            for j in range(kw):
                row = col[(c * kh + i) * kw + j]
                s = (c * Hp + i * dh) * Wp + j * dw
                for a in range(0, L, seg):
                    b, t = min(a + seg, L), s + a * sh
                    if back:
                        _add(xf[t:t + b - a], row[a:b])
                    else:
                        _copy(row[a:b], xf[t:t + b - a])


@kernel
def _slot(work, t, S, C, Hp, Wp, K, L, O):
    """Thread t's workspace: xp flat, col [K, L], wide [O, L], gw [O, K]."""
    w = work[t * S:(t + 1) * S]
    a, b = C * Hp * Wp, C * Hp * Wp + K * L
    return (w[:a], w[a:b].reshape((K, L)), w[b:b + O * L].reshape((O, L)),
            w[b + O * L:b + O * L + O * K].reshape((O, K)))


@kernel
def _forward_images(n0, n1, x, w2, out, xf, col, wide, Hp, Wp, kh, kw, sh, sw, ph, pw, dh, dw):
    C = x.shape[1]
    xf[:] = 0
    for n in range(n0, n1):
        _scatter(x[n], xf, ph * Wp + pw, Hp * Wp, Wp, 1)
        _im2col(xf, col, False, C, Hp, Wp, kh, kw, sh, dh, dw)
        gemm(False, False, 1.0, w2, col, 0.0, wide)
        _gather(wide.reshape(wide.size), out[n], 0, wide.shape[1], Wp, sw)


@kernel
def _back_weight_images(n0, n1, x, g, gw, xf, col, wide, Hp, Wp, kh, kw, sh, sw, ph, pw, dh,
                        dw):
    C = x.shape[1]
    xf[:] = 0
    wide[:] = 0
    gw[:] = 0
    for n in range(n0, n1):
        _scatter(x[n], xf, ph * Wp + pw, Hp * Wp, Wp, 1)
        _im2col(xf, col, False, C, Hp, Wp, kh, kw, sh, dh, dw)
        _scatter(g[n], wide.reshape(wide.size), 0, wide.shape[1], Wp, sw)
        gemm(False, True, 1.0, wide, col, 1.0, gw)


@kernel
def _back_input_images(n0, n1, w2, g, out, xf, col, wide, Hp, Wp, kh, kw, sh, sw, ph, pw, dh,
                       dw):
    C = out.shape[1]
    wide[:] = 0
    for n in range(n0, n1):
        _scatter(g[n], wide.reshape(wide.size), 0, wide.shape[1], Wp, sw)
        gemm(True, False, 1.0, w2, wide, 0.0, col)
        xf[:] = 0
        _im2col(xf, col, True, C, Hp, Wp, kh, kw, sh, dh, dw)
        _gather(xf, out[n], ph * Wp + pw, Hp * Wp, Wp, 1)


@pkernel
def conv2d(x, w, out, work, sh, sw, ph, pw, dh, dw):
    """conv2d: x [N,C,H,W], w [O,C,kh,kw] -> out [N,O,oh,ow] (cross-correlation, zero padding);
    work: workspace_size_conv2d elements."""
    N, C, H, W = x.shape
    O, oh, kh, kw = out.shape[1], out.shape[2], w.shape[2], w.shape[3]
    Hp, Wp, K, L, S = _geometry(C, H, W, O, kh, kw, oh, ph, pw, dw)
    w2 = w.reshape((O, K))
    T = _threads(N, O * K * L, work.size // S)
    if T == 1:
        xf, col, wide, _ = _slot(work, 0, S, C, Hp, Wp, K, L, O)
        _forward_images(0, N, x, w2, out, xf, col, wide, Hp, Wp, kh, kw, sh, sw, ph, pw, dh, dw)
        return
    for t in prange(T):
        xf, col, wide, _ = _slot(work, t, S, C, Hp, Wp, K, L, O)
        _forward_images(t * N // T, (t + 1) * N // T, x, w2, out, xf, col, wide, Hp, Wp, kh, kw,
                        sh, sw, ph, pw, dh, dw)


@pkernel
def conv2d_back_weight(x, g, out, work, sh, sw, ph, pw, dh, dw):
    """conv2d_back_weight(x [N,C,H,W], g [N,O,oh,ow]) -> out [O,C,kh,kw] = sum over n of
    g[n] @ im2col(x[n])^T; work: workspace_size_conv2d elements."""
    N, C, H, W = x.shape
    O, oh, kh, kw = g.shape[1], g.shape[2], out.shape[2], out.shape[3]
    Hp, Wp, K, L, S = _geometry(C, H, W, O, kh, kw, oh, ph, pw, dw)
    gw = out.reshape((O, K))
    T = _threads(N, O * K * L, work.size // S)
    if T == 1:
        xf, col, wide, _ = _slot(work, 0, S, C, Hp, Wp, K, L, O)
        _back_weight_images(0, N, x, g, gw, xf, col, wide, Hp, Wp, kh, kw, sh, sw, ph, pw, dh,
                            dw)
        return
    for t in prange(T):
        xf, col, wide, part = _slot(work, t, S, C, Hp, Wp, K, L, O)
        _back_weight_images(t * N // T, (t + 1) * N // T, x, g, part, xf, col, wide, Hp, Wp,
                            kh, kw, sh, sw, ph, pw, dh, dw)
    gw[:] = 0
    for t in range(T):
        _add(out.reshape(out.size), _slot(work, t, S, C, Hp, Wp, K, L, O)[3].reshape(O * K))


@pkernel
def conv2d_back_input(w, g, out, work, sh, sw, ph, pw, dh, dw):
    """conv2d_back_input(w [O,C,kh,kw], g [N,O,oh,ow]) -> out [N,C,H,W]: col2im(w^T @ g[n]);
    work: workspace_size_conv2d elements."""
    N, C, H, W = out.shape
    O, oh, kh, kw = g.shape[1], g.shape[2], w.shape[2], w.shape[3]
    Hp, Wp, K, L, S = _geometry(C, H, W, O, kh, kw, oh, ph, pw, dw)
    w2 = w.reshape((O, K))
    T = _threads(N, O * K * L, work.size // S)
    if T == 1:
        xf, col, wide, _ = _slot(work, 0, S, C, Hp, Wp, K, L, O)
        _back_input_images(0, N, w2, g, out, xf, col, wide, Hp, Wp, kh, kw, sh, sw, ph, pw, dh,
                           dw)
        return
    for t in prange(T):
        xf, col, wide, _ = _slot(work, t, S, C, Hp, Wp, K, L, O)
        _back_input_images(t * N // T, (t + 1) * N // T, w2, g, out, xf, col, wide, Hp, Wp, kh,
                           kw, sh, sw, ph, pw, dh, dw)

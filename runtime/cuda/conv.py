"""The CUDA backend's convolution and pooling writers (direct: one thread per output element,
or per weight with a block tree for conv2d_back_weight), one per op."""
from __future__ import annotations

from ..kernelgen import NP_DTYPE
from .kernel import Source, block_reduce, per_element, unravel


def _window_taps(hvar, wvar, a, kernel, dilation=(1, 1)):
    """Lines, per tap (i, j) of the window at output (oy, ox): ih, iw the input position and
    `ok` whether it lies inside the unpadded input (H, W)."""
    (sh, sw), (ph, pw), (dh, dw) = a["stride"], a["padding"], dilation
    return [f"for i in range({kernel[0]}):", f"    ih = oy * {sh} - {ph} + i * {dh}",
            f"    for j in range({kernel[1]}):", f"        iw = ox * {sw} - {pw} + j * {dw}",
            f"        ok = ih >= 0 and ih < {hvar} and iw >= 0 and iw < {wvar}"]


def _inverse_taps(a, kernel, OH, OW, dilation=(1, 1)):
    """Lines, per tap (i, j), finding the output (oy, ox) whose window reads input (h, w) at
    that tap, `ok` when there is one."""
    (sh, sw), (ph, pw), (dh, dw) = a["stride"], a["padding"], dilation
    return [f"for i in range({kernel[0]}):", f"    ty = h + {ph} - i * {dh}",
            f"    oy = ty // {sh}", f"    for j in range({kernel[1]}):",
            f"        tx = w + {pw} - j * {dw}", f"        ox = tx // {sw}",
            f"        ok = ty >= 0 and tx >= 0 and ty % {sh} == 0 and tx % {sw} == 0 and "
            f"oy < {OH} and ox < {OW}"]


def conv2d(ctx, n, note="") -> list:
    """One thread per output element, summing over channels and the window's taps."""
    g, a, T, src = ctx.g, n.attr, NP_DTYPE[n.type.dtype], Source(ctx)
    x, w = (g.nodes[i] for i in n.inputs)
    N, C, H, W = x.type.shape
    O, _, KH, KW = w.type.shape
    OH, OW = n.type.shape[2:]
    xa, wa = src.arg(ctx.ref(x.id, x.type.shape)), src.arg(ctx.ref(w.id, w.type.shape))
    o = src.arg(ctx.ref(n.id, n.type.shape), "o")
    body = [f"acc = {T}(0.0)", f"for c in range({C}):"] + \
        ["    " + ln for ln in _window_taps(H, W, a, (KH, KW), a["dilation"])] + \
        ["            if ok:",
         f"                acc += {xa}[nn, c, ih, iw] * {wa}[oo, c, i, j]",
         f"{o}[nn, oo, oy, ox] = acc"]
    return [per_element(ctx, src, (N, O, OH, OW), ("nn", "oo", "oy", "ox"), body, note)]


def conv2d_back_input(ctx, n, note="") -> list:
    """One thread per input element, summing over output channels and the taps whose window
    reads it."""
    g, a, T, src = ctx.g, n.attr, NP_DTYPE[n.type.dtype], Source(ctx)
    w, gg = (g.nodes[i] for i in n.inputs)
    N, C, H, W = n.type.shape
    O, _, KH, KW = w.type.shape
    OH, OW = gg.type.shape[2:]
    wa, ga = src.arg(ctx.ref(w.id, w.type.shape)), src.arg(ctx.ref(gg.id, gg.type.shape))
    o = src.arg(ctx.ref(n.id, n.type.shape), "o")
    body = [f"acc = {T}(0.0)", f"for oo in range({O}):"] + \
        ["    " + ln for ln in _inverse_taps(a, (KH, KW), OH, OW, a["dilation"])] + \
        ["            if ok:",
         f"                acc += {ga}[nn, oo, oy, ox] * {wa}[oo, c, i, j]",
         f"{o}[nn, c, h, w] = acc"]
    return [per_element(ctx, src, (N, C, H, W), ("nn", "c", "h", "w"), body, note)]


def conv2d_back_weight(ctx, n, note="") -> list:
    """One block per weight, threads over (n, oy, ox), a float64 tree sum."""
    g, a, T, src = ctx.g, n.attr, NP_DTYPE[n.type.dtype], Source(ctx)
    x, gg = (g.nodes[i] for i in n.inputs)
    N, C, H, W = x.type.shape
    O, _, KH, KW = n.type.shape
    OH, OW = gg.type.shape[2:]
    (sh, sw), (ph, pw), (dh, dw) = a["stride"], a["padding"], a["dilation"]
    xa, ga = src.arg(ctx.ref(x.id, x.type.shape)), src.arg(ctx.ref(gg.id, gg.type.shape))
    o = src.arg(ctx.ref(n.id, n.type.shape), "o")
    total = O * C * KH * KW
    src.lines += ["sd = cuda.shared.array(TPB, np.float64)", "t = cuda.threadIdx.x",
                  "e = cuda.blockIdx.x", f"while e < {total}:"]
    src.lines += unravel("e", [0, 1, 2, 3], (O, C, KH, KW), "    ")
    src.lines += ["    acc = 0.0", "    q = t", f"    while q < {N * OH * OW}:"]
    src.lines += unravel("q", [4, 5, 6], {4: N, 5: OH, 6: OW}, "        ")
    src.lines += [f"        ih = i5 * {sh} - {ph} + i2 * {dh}",
                  f"        iw = i6 * {sw} - {pw} + i3 * {dw}",
                  f"        if ih >= 0 and ih < {H} and iw >= 0 and iw < {W}:",
                  f"            acc += np.float64({ga}[i4, i0, i5, i6] * {xa}[i4, i1, ih, iw])",
                  "        q += TPB"]
    src.lines += block_reduce("acc", "sum", "np.float64", "sd", "    ")
    src.lines += ["    if t == 0:", f"        {o}[i0, i1, i2, i3] = {T}(acc)",
                  "    e += cuda.gridDim.x"]
    return [src.finish((ctx.blocks(total, 1),), (ctx.tpb,), note)]


def pool2d(ctx, n, note="", mx=False) -> list:
    """max_pool2d (`mx`) / avg_pool2d: one thread per output element over its window."""
    g, a, T = ctx.g, n.attr, NP_DTYPE[n.type.dtype]
    KH, KW = a["kernel"]
    src = Source(ctx)
    o = src.arg(ctx.ref(n.id, n.type.shape), "o")
    x = g.nodes[n.inputs[0]]
    N, C, H, W = x.type.shape
    OH, OW = n.type.shape[2:]
    xa = src.arg(ctx.ref(x.id, x.type.shape))
    body = [f"acc = {T}(-math.inf)" if mx else f"acc = {T}(0.0)"] + \
        _window_taps(H, W, a, (KH, KW)) + \
        ["        if ok:", f"            acc = max(acc, {xa}[nn, c, ih, iw])" if mx else
         f"            acc += {xa}[nn, c, ih, iw]",
         f"{o}[nn, c, oy, ox] = acc" if mx else f"{o}[nn, c, oy, ox] = acc / {T}({KH * KW})"]
    return [per_element(ctx, src, (N, C, OH, OW), ("nn", "c", "oy", "ox"), body, note)]


def avg_pool2d_back(ctx, n, note="") -> list:
    """One thread per input element: the mean of the gradients of the windows holding it."""
    g, a, T = ctx.g, n.attr, NP_DTYPE[n.type.dtype]
    KH, KW = a["kernel"]
    src = Source(ctx)
    o = src.arg(ctx.ref(n.id, n.type.shape), "o")
    N, C, H, W = n.type.shape
    gg = g.nodes[n.inputs[0]]
    OH, OW = gg.type.shape[2:]
    ga = src.arg(ctx.ref(gg.id, gg.type.shape))
    body = [f"acc = {T}(0.0)"] + _inverse_taps(a, (KH, KW), OH, OW) + \
        ["        if ok:", f"            acc += {ga}[nn, c, oy, ox]",
         f"{o}[nn, c, h, w] = acc / {T}({KH * KW})"]
    return [per_element(ctx, src, (N, C, H, W), ("nn", "c", "h", "w"), body, note)]


def max_pool2d_back(ctx, n, note="") -> list:
    """One thread per input element: each window's gradient to its first maximum."""
    g, a, T = ctx.g, n.attr, NP_DTYPE[n.type.dtype]
    KH, KW = a["kernel"]
    src = Source(ctx)
    o = src.arg(ctx.ref(n.id, n.type.shape), "o")
    N, C, H, W = n.type.shape
    x, gg = (g.nodes[i] for i in n.inputs)
    OH, OW = gg.type.shape[2:]
    xa, ga = src.arg(ctx.ref(x.id, x.type.shape)), src.arg(ctx.ref(gg.id, gg.type.shape))
    (sh, sw), (ph, pw) = a["stride"], a["padding"]
    body = [f"acc = {T}(0.0)"] + _inverse_taps(a, (KH, KW), OH, OW) + [
        "        if ok:", f"            best = {T}(-math.inf)", "            bh = -1",
        "            bw = -1", f"            for u in range({KH}):",
        f"                uh = oy * {sh} - {ph} + u", f"                for v in range({KW}):",
        f"                    uw = ox * {sw} - {pw} + v",
        f"                    xv = {T}(-math.inf)",
        f"                    if uh >= 0 and uh < {H} and uw >= 0 and uw < {W}:",
        f"                        xv = {xa}[nn, c, uh, uw]",
        "                    if bh < 0 or xv > best:", "                        best = xv",
        "                        bh = uh", "                        bw = uw",
        "            if bh == h and bw == w:", f"                acc += {ga}[nn, c, oy, ox]",
        f"{o}[nn, c, h, w] = acc"]
    return [per_element(ctx, src, (N, C, H, W), ("nn", "c", "h", "w"), body, note)]

"""The CUDA backend's attention writers: kv_attention (decode over a KV cache), attention and
attention_back (causal self-attention, ops/attention.py)."""
from __future__ import annotations

from jitgraph.plan import CALLER

from ..kernelgen import NP_DTYPE, typed_literal
from .kernel import Source, block_reduce, fill_words, per_element, words
from .spelling import half


def kv_attention(ctx, n, note="") -> list:
    """kv_attention: one block per (query, head): the threads stride over the cache rows
    j <= pos[s] for the scores (into scratch) and their maximum, then the exponentials and
    their sum (float64), then over head_dim for the weighted sum of the values; f16: the
    query and the probabilities rounded to float16, as llama.cpp's F16 cache."""
    g = ctx.g
    q, kt, vt, pos = (g.nodes[i] for i in n.inputs)
    S, H, D = q.type.shape
    Hkv, _, R = kt.type.shape
    rep = H // Hkv
    dt = n.type.dtype
    T = NP_DTYPE[dt]
    f16 = n.attr["f16"]
    scale = typed_literal(float(n.attr["scale"]), dt)
    if n.type.size == 0:
        return []
    src = Source(ctx)
    qa = src.arg(ctx.ref(q.id, (S, H, D)))
    ka, va = src.arg(ctx.ref(kt.id, (Hkv, D, R))), src.arg(ctx.ref(vt.id, (Hkv, D, R)))
    pa = src.arg(ctx.ref(pos.id, (S,)))
    w = src.arg(ctx.scratch(0, (S * H, R), dt), "w")
    o = src.arg(ctx.ref(n.id, (S, H, D)), "o")
    qd = half(f"{qa}[s, h, d]", dt) if f16 else f"{qa}[s, h, d]"
    pr = half("w_ * inv", dt) if f16 else "w_ * inv"
    L = src.lines
    L += [f"sm = cuda.shared.array(TPB, {T})", "sd = cuda.shared.array(TPB, np.float64)",
          "t = cuda.threadIdx.x", "b = cuda.blockIdx.x", f"while b < {S * H}:",
          f"    s = b // {H}", f"    h = b % {H}", f"    gk = h // {rep}", f"    n = {pa}[s] + 1",
          f"    if n > {R}:", f"        n = {R}",
          f"    m = {T}(-math.inf)", "    j = t", "    while j < n:", f"        acc = {T}(0.0)",
          f"        for d in range({D}):", f"            acc += {qd} * {ka}[gk, d, j]",
          f"        acc = acc * {scale}", f"        {w}[b, j] = acc", "        m = max(m, acc)",
          "        j += TPB"]
    L += block_reduce("m", "max", T, "sm", "    ")
    L += ["    tot = 0.0", "    j = t", "    while j < n:",
          f"        e_ = {T}(math.exp(np.float64({w}[b, j] - m)))", f"        {w}[b, j] = e_",
          "        tot += np.float64(e_)", "        j += TPB"]
    L += block_reduce("tot", "sum", "np.float64", "sd", "    ")
    L += [f"    inv = {T}(1.0 / tot) if tot > 0.0 else {T}(0.0)", "    j = t", "    while j < n:",
          f"        w_ = {w}[b, j]", f"        {w}[b, j] = {pr}", "        j += TPB",
          "    cuda.syncthreads()", "    d = t", f"    while d < {D}:", f"        acc = {T}(0.0)",
          "        for j in range(n):",
          f"            acc += {w}[b, j] * {va}[gk, d, j]", f"        {o}[s, h, d] = acc",
          "        d += TPB", "    cuda.syncthreads()", "    b += cuda.gridDim.x"]
    return [src.finish((ctx.blocks(S * H, 1),), (ctx.tpb,), note)]


# ---- causal self-attention (ops/attention.py) ---------------------------------------------------
def _attention_args(ctx, src, n):
    q, k, v = (ctx.g.nodes[i] for i in n.inputs[:3])
    B, S, H, D = q.type.shape
    Hkv = k.type.shape[2]
    return (B, S, H, Hkv, D, src.arg(ctx.ref(q.id, (B, S, H, D))),
            src.arg(ctx.ref(k.id, (B, S, Hkv, D))), src.arg(ctx.ref(v.id, (B, S, Hkv, D))))


def attention(ctx, n, note="") -> list:
    """attention: one thread per query row (b, i, h), online softmax over keys j <= i (running
    maximum and sum, the accumulator rescaled as the maximum grows: flash attention's forward),
    the output row in a local array."""
    dt = n.type.dtype
    T = NP_DTYPE[dt]
    src = Source(ctx)
    B, S, H, Hkv, D, qa, ka, va = _attention_args(ctx, src, n)
    if n.type.size == 0:
        return []
    o = src.arg(ctx.ref(n.id, (B, S, H, D)), "o")
    scale = typed_literal(float(n.attr["scale"]), dt)
    body = [f"g = h // {H // Hkv}", f"acc = cuda.local.array({D}, {T})",
            f"for d in range({D}):", f"    acc[d] = {T}(0.0)",
            f"m = {T}(-math.inf)", "l = 0.0", "for j in range(i + 1):",
            f"    s = {T}(0.0)", f"    for d in range({D}):",
            f"        s += {qa}[b, i, h, d] * {ka}[b, j, g, d]",
            f"    s = s * {scale}", "    mn = max(m, s)",
            f"    c = {T}(math.exp(np.float64(m - mn))) if m > -math.inf else {T}(0.0)",
            f"    pj = {T}(math.exp(np.float64(s - mn)))", "    l = l * c + pj",
            f"    for d in range({D}):", f"        acc[d] = acc[d] * c + pj * {va}[b, j, g, d]",
            "    m = mn", f"inv = {T}(1.0 / l)",
            f"for d in range({D}):", f"    {o}[b, i, h, d] = acc[d] * inv"]
    return [per_element(ctx, src, (B, S, H), ("b", "i", "h"), body, note)]


def attention_back(ctx, n, note="") -> list:
    """attention_back: the dk and dv parts zeroed, then one thread per query row (b, i, h):
    the row's maximum and sum, dout . out, then per key j <= i the probability p, ds = scale p
    (dout . v_j - dout . out), dq accumulated locally, dk and dv added with atomics (the query
    heads of a kv head and every later row add into the same key)."""
    dt = n.type.dtype
    T = NP_DTYPE[dt]
    src = Source(ctx)
    B, S, H, Hkv, D, qa, ka, va = _attention_args(ctx, src, n)
    out, dout = (ctx.g.nodes[i] for i in n.inputs[3:])
    oa, ga = src.arg(ctx.ref(out.id, (B, S, H, D))), src.arg(ctx.ref(dout.id, (B, S, H, D)))
    nq, nk = B * S * H * D, B * S * Hkv * D
    s_ = ctx.plan.slots[n.id]
    base = s_.pointer if s_.region in CALLER else s_.region
    itemsize = n.type.nbytes // max(n.type.size, 1)
    launches = [fill_words(ctx, words(base, s_.offset + nq * itemsize, 2 * nk * itemsize),
                           note + " zero dk dv")]
    r = src.arg(ctx.ref(n.id), "o")
    scale = typed_literal(float(n.attr["scale"]), dt)
    dot = f"        s += {qa}[b, i, h, d] * {ka}[b, j, g, d]"   # s: q_i . k_j, in a j loop
    row = ["for j in range(i + 1):", f"    s = {T}(0.0)", f"    for d in range({D}):", dot]
    body = [f"g = h // {H // Hkv}", f"dq = cuda.local.array({D}, {T})",
            f"for d in range({D}):", f"    dq[d] = {T}(0.0)",
            f"m = {T}(-math.inf)", *row, f"    m = max(m, s * {scale})",
            "l = 0.0", *row, "    l += math.exp(np.float64(s * " + scale + " - m))",
            f"di = {T}(0.0)", f"for d in range({D}):",
            f"    di += {ga}[b, i, h, d] * {oa}[b, i, h, d]",
            *row[:2], f"    dp = {T}(0.0)", row[2], dot,
            f"        dp += {ga}[b, i, h, d] * {va}[b, j, g, d]",
            f"    p = {T}(math.exp(np.float64(s * {scale} - m)) / l)",
            f"    ds = p * (dp - di) * {scale}",
            f"    kb = {nq} + ((b * {S} + j) * {Hkv} + g) * {D}",
            f"    for d in range({D}):", f"        dq[d] += ds * {ka}[b, j, g, d]",
            f"        cuda.atomic.add({r}, kb + d, ds * {qa}[b, i, h, d])",
            f"        cuda.atomic.add({r}, kb + {nk} + d, p * {ga}[b, i, h, d])",
            f"qb = ((b * {S} + i) * {H} + h) * {D}",
            f"for d in range({D}):", f"    {r}[qb + d] = dq[d]"]
    launches.append(per_element(ctx, src, (B, S, H), ("b", "i", "h"), body, note))
    return launches

"""bf16 x bf16 -> f32 GEMM on AVX512-BF16 (vdpbf16ps), callable from @njit code.

c[M, N] = alpha * op(a) @ op(b) + beta * c with a, b bf16 (their uint16 bits, as the CPU
kernels hold half values: runtime/cpu/halfconv.py) and c float32: the products of the bf16
values (exact in f32) summed in f32, as the reference interpreter's bf16 matmul.

vdpbf16ps multiplies 32 bf16 pairs and adds each two neighbouring products into one of 16 f32
lanes: lane j += x[2j] y[2j] + x[2j+1] y[2j+1]. So operands are packed with pairs of k
adjacent (odd K padded with a zero):
  B: panels of NR = 32 columns, [panel][k/2][32] of uint32, each the bf16 pair
     (b[2p, j], b[2p+1, j]): one 64-byte load gives 16 columns x 2 k.
  A: panels of MR rows, [panel][k/2][MR] of uint32, the pair (a[i, 2p], a[i, 2p+1]), which
     the microkernel broadcasts to all 16 lanes (folded into vdpbf16ps's {1to16} operand).
The microkernel (_micro, LLVM IR through a numba intrinsic) keeps MR x 2 accumulators of 16
lanes in registers over a block of KC k-pairs and stores them into an MR x NR tile, which
_update adds into c (alpha, and beta on the first k-block only).

Threads: c's rows in one band per thread of numba's pool (as blas.gemm's bands); B is packed
once for all bands (in parallel, by panels), each band packs its own A rows.

Only for CPUs with AVX512-BF16 (available()); elsewhere the caller keeps the conversion path
(each operand cast to f32, then sgemm: runtime/cpu/blas.py).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .blas import _band_min, _pool_threads
from .lib_common import cpu_has

NR = 32          # columns of a B panel: two vectors of 16 f32 lanes
MR = 12          # rows of an A panel: MR x 2 accumulators (24 of the 32 zmm registers)
KC = 192         # k-pairs per block: a B panel's block (KC x 128 bytes) stays in L1
MC = 192         # rows per block of A (a multiple of MR): MC x KC x 4 bytes stay in L2


def available() -> bool:
    """Whether numba compiles for a CPU with AVX512-BF16 (vdpbf16ps)."""
    return cpu_has("avx512bf16")


class _BFloat(ir.Type):
    """LLVM's bfloat type (llvmlite's IR builder has none): the element type of
    llvm.x86.avx512bf16.dpbf16ps.512's operands since LLVM 17."""
    null = "0.0"

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


def _micro_kernel(mr):
    """The microkernel intrinsic for panels of mr rows:
    _micro(kp, pa, oa, pb, ob, t): t[r*NR + j] = sum over p < kp of the pair products of
    pa[oa + p*mr + r] and pb[ob + p*NR + j] (uint32 bf16 pairs), t float32[mr*NR]."""
    @intrinsic
    def _micro(typingctx, kp, pa, oa, pb, ob, t):
        sig = types.void(types.int64, pa, types.int64, pb, types.int64, t)

        def codegen(context, builder, sig, args):
            kp, pa, oa, pb, ob, t = args
            i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
            v16f, v16i = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
            v32b = ir.VectorType(_BFloat(), 32)
            fnty = ir.FunctionType(v16f, [v16f, v32b, v32b])
            dp = cgutils.get_or_insert_function(builder.module, fnty,
                                                "llvm.x86.avx512bf16.dpbf16ps.512")
            arr = [context.make_array(ty)(context, builder, v)
                   for ty, v in ((sig.args[1], pa), (sig.args[3], pb), (sig.args[5], t))]
            a0 = builder.gep(arr[0].data, [oa])
            b0 = builder.gep(arr[1].data, [ob])
            tp = arr[2].data
            zero = ir.Constant(v16f, None)
            pre = builder.block
            loop = builder.append_basic_block("bf16.loop")
            done = builder.append_basic_block("bf16.done")
            builder.cbranch(builder.icmp_signed(">", kp, i64(0)), loop, done)
            builder.position_at_end(loop)
            p = builder.phi(i64)
            p.add_incoming(i64(0), pre)
            accs = []
            for _ in range(2 * mr):
                phi = builder.phi(v16f)
                phi.add_incoming(zero, pre)
                accs.append(phi)
            bp = builder.gep(b0, [builder.mul(p, i64(NR))])
            bv = [builder.bitcast(builder.load(builder.bitcast(builder.gep(bp, [i64(16 * h)]),
                                                               v16i.as_pointer()), align=4), v32b)
                  for h in range(2)]
            ap = builder.gep(a0, [builder.mul(p, i64(mr))])
            undef = ir.Constant(v16i, ir.Undefined)
            splat = ir.Constant(ir.VectorType(i32, 16), [0] * 16)
            new = []
            for r in range(mr):
                av = builder.load(builder.gep(ap, [i64(r)]), align=4)
                bc = builder.shuffle_vector(builder.insert_element(undef, av, i32(0)), undef,
                                            splat)
                bc = builder.bitcast(bc, v32b)
                for h in range(2):
                    new.append(builder.call(dp, [accs[2 * r + h], bc, bv[h]]))
            p1 = builder.add(p, i64(1))
            p.add_incoming(p1, builder.block)
            for phi, v in zip(accs, new):
                phi.add_incoming(v, builder.block)
            last = builder.block
            builder.cbranch(builder.icmp_signed("<", p1, kp), loop, done)
            builder.position_at_end(done)
            outs = []
            for i in range(2 * mr):
                out = builder.phi(v16f)
                out.add_incoming(zero, pre)
                out.add_incoming(new[i], last)
                outs.append(out)
            for i, out in enumerate(outs):
                dst = builder.bitcast(builder.gep(tp, [i64(16 * i)]), v16f.as_pointer())
                builder.store(out, dst, align=4)
            return context.get_dummy_value()
        return sig, codegen
    return _micro


_micro = _micro_kernel(MR)


def _interleave(w):
    """The intrinsic _ilv(src, o0, o1, dst, od): dst[od + j] = the bf16 pair (src[o0 + j],
    src[o1 + j]) for j < w (src uint16, dst uint32, flat element offsets), as two vector
    loads, one interleaving shuffle and one store (numba's scalar loop of it did not
    vectorise)."""
    @intrinsic
    def _ilv(typingctx, src, o0, o1, dst, od):
        sig = types.void(src, types.int64, types.int64, dst, types.int64)

        def codegen(context, builder, sig, args):
            src, o0, o1, dst, od = args
            i16, i32 = ir.IntType(16), ir.IntType(32)
            vs, vd = ir.VectorType(i16, w), ir.VectorType(i32, w)
            s = context.make_array(sig.args[0])(context, builder, src).data
            d = context.make_array(sig.args[3])(context, builder, dst).data
            x = builder.load(builder.bitcast(builder.gep(s, [o0]), vs.as_pointer()), align=2)
            y = builder.load(builder.bitcast(builder.gep(s, [o1]), vs.as_pointer()), align=2)
            mask = ir.Constant(ir.VectorType(i32, 2 * w),
                               [v for j in range(w) for v in (j, w + j)])
            z = builder.bitcast(builder.shuffle_vector(x, y, mask), vd)
            builder.store(z, builder.bitcast(builder.gep(d, [od]), vd.as_pointer()), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return _ilv


_ilv_b = _interleave(NR)
_ilv_a = _interleave(MR)


@njit(cache=True, nogil=True, inline="always")
def _pair(lo, hi):
    return np.uint32(lo) | (np.uint32(hi) << np.uint32(16))


@njit(cache=True, nogil=True, inline="always")
def _pair_rows(b, p, k, j0, nj, out, o, width):
    """Columns j0..j0+nj of b's rows 2p and 2p + 1 (zeros past row k) as bf16 pairs into
    out[o:], zeros up to `width` (a panel's NR columns of B, MR rows of A)."""
    r0 = b[2 * p]
    if 2 * p + 1 < k:
        r1 = b[2 * p + 1]
        for j in range(nj):
            out[o + j] = _pair(r0[j0 + j], r1[j0 + j])
    else:
        for j in range(nj):
            out[o + j] = _pair(r0[j0 + j], np.uint16(0))
    for j in range(nj, width):
        out[o + j] = 0


@njit(cache=True, nogil=True)
def _pack_b_panel(tb, b, k, n, jp, out):
    """B's columns jp*NR.. into out[jp] ([k2][NR] uint32 pairs), zeros past k and n."""
    k2 = (k + 1) // 2
    j0 = jp * NR
    nj = min(NR, n - j0)
    base = jp * k2 * NR
    zero = np.uint16(0)
    if tb:                                  # b [N, K]: each column of op(b) a row of b
        for j in range(NR):
            if j < nj:
                row = b[j0 + j]
                for p in range(k // 2):
                    out[base + p * NR + j] = _pair(row[2 * p], row[2 * p + 1])
                if k % 2:
                    out[base + (k2 - 1) * NR + j] = _pair(row[k - 1], zero)
            else:
                for p in range(k2):
                    out[base + p * NR + j] = 0
    else:                                   # b [K, N]
        for p in range(k2):
            _pair_rows(b, p, k, j0, nj, out, base + p * NR, NR)


PB = 8            # k-pairs per step of pack_b over B's rows (tb False)
PG = 16           # column panels per group there (fewer pages written at once)


@njit(cache=True, nogil=True)
def _pack_b_rows(b, k, n, q0, q1, out):
    """op(b) = b [K, N]: k-pairs q0..q1 of every panel, PB pairs at a time across all panels
    (b read along its rows: one column panel at a time reads each row's 64 bytes at B's row
    stride, which for 4 KiB rows all fall in one L1 set)."""
    k2 = (k + 1) // 2
    npan = (n + NR - 1) // NR
    for g0 in range(0, npan, PG):
        for s0 in range(q0, q1, PB):
            s1 = min(q1, s0 + PB)
            for jp in range(g0, min(npan, g0 + PG)):
                j0 = jp * NR
                nj = min(NR, n - j0)
                base = jp * k2 * NR
                for p in range(s0, s1):
                    o = base + p * NR
                    if 2 * p + 1 < k and nj == NR:
                        _ilv_b(b, 2 * p * n + j0, (2 * p + 1) * n + j0, out, o)
                    else:
                        _pair_rows(b, p, k, j0, nj, out, o, NR)


@njit(cache=True, nogil=True, parallel=True)
def pack_b(tb, b, k, n, out):
    """op(b) [k, n] packed into out (packed_b_size(k, n) uint32) over the pool: by column
    panels (tb: each a run of b's rows), else by ranges of k-pairs."""
    if tb:
        for jp in prange((n + NR - 1) // NR):
            _pack_b_panel(tb, b, k, n, jp, out)
    else:
        k2 = (k + 1) // 2
        parts = max(1, min(_pool_threads(), k2 // PB))
        step = (k2 + parts - 1) // parts
        for q in prange(parts):
            _pack_b_rows(b, k, n, q * step, min(k2, q * step + step), out)


@njit(cache=True, nogil=True)
def _pack_a(ta, a, i0, m, k, out):
    """op(a)'s rows i0..i0+m packed into out ([m/MR panels][k2][MR] uint32), zeros past k and
    past the last row. ta: a [K, M], each k-pair's MR elements read from two of a's rows
    (contiguous), not down its columns."""
    k2 = (k + 1) // 2
    zero = np.uint16(0)
    lda = a.shape[1]
    for ip in range((m + MR - 1) // MR):
        base = ip * k2 * MR
        mr = min(MR, m - ip * MR)
        if ta:
            c0 = i0 + ip * MR
            for p in range(k2):
                o = base + p * MR
                if 2 * p + 1 < k and mr == MR:
                    _ilv_a(a, 2 * p * lda + c0, (2 * p + 1) * lda + c0, out, o)
                else:
                    _pair_rows(a, p, k, c0, mr, out, o, MR)
        else:
            for r in range(MR):
                if r >= mr:
                    for p in range(k2):
                        out[base + p * MR + r] = 0
                    continue
                row = a[i0 + ip * MR + r]
                for p in range(k // 2):
                    out[base + p * MR + r] = _pair(row[2 * p], row[2 * p + 1])
                if k % 2:
                    out[base + (k2 - 1) * MR + r] = _pair(row[k - 1], zero)


@njit(cache=True, nogil=True, inline="always")
def _update(c, i0, j0, mr, nr, t, alpha, beta):
    """c[i0:i0+mr, j0:j0+nr] = alpha t + beta c (beta 0: c not read, so NaN garbage is
    overwritten)."""
    if beta == 0.0:
        for r in range(mr):
            row = c[i0 + r]
            for j in range(nr):
                row[j0 + j] = alpha * t[r * NR + j]
    else:
        for r in range(mr):
            row = c[i0 + r]
            for j in range(nr):
                row[j0 + j] = alpha * t[r * NR + j] + beta * row[j0 + j]


@njit(cache=True, nogil=True)
def _band(alpha, pb, k, n, beta, c, i0, m, pa, t, ta, a):
    """Rows i0..i0+m of c from op(a)'s rows (packed here into pa) and the packed B pb."""
    k2 = (k + 1) // 2
    npan = (n + NR - 1) // NR
    _pack_a(ta, a, i0, m, k, pa)
    mpan = (m + MR - 1) // MR
    if k2 == 0:
        for i in range(i0, i0 + m):
            for j in range(n):
                c[i, j] = 0.0 if beta == 0.0 else beta * c[i, j]
        return
    for q0 in range(0, k2, KC):
        kq = min(KC, k2 - q0)
        bt = beta if q0 == 0 else np.float32(1.0)
        for mp0 in range(0, mpan, MC // MR):
            for jp in range(npan):
                ob = jp * k2 * NR + q0 * NR
                nr = min(NR, n - jp * NR)
                for ip in range(mp0, min(mpan, mp0 + MC // MR)):
                    _micro(kq, pa, ip * k2 * MR + q0 * MR, pb, ob, t)
                    mr = min(MR, m - ip * MR)
                    _update(c, i0 + ip * MR, jp * NR, mr, nr, t, alpha, bt)


@njit(cache=True, nogil=True, inline="always")
def packed_b_size(k, n):
    """uint32 elements of op(b) [k, n] packed."""
    return (k + 1) // 2 * ((n + NR - 1) // NR) * NR


@njit(cache=True, nogil=True, inline="always")
def _band_rows(m, parts):
    """Rows per band: m over `parts`, rounded up to whole MR panels."""
    h = (m + parts - 1) // parts
    return (h + MR - 1) // MR * MR


@njit(cache=True, nogil=True, parallel=True)
def _bands(ta, alpha, a, pb, k, n, beta, c, parts, pas, ts):
    m = c.shape[0]
    h = _band_rows(m, parts)
    for p in prange(parts):
        i0 = p * h
        if i0 < m:
            _band(alpha, pb, k, n, beta, c, i0, min(h, m - i0), pas[p], ts[p], ta, a)


def workspace(m, n, k, parts):
    """(packed B, packed A per band, tiles per band) buffers gemm_bf16 needs."""
    h = -(-m // parts)
    h = -(-h // MR) * MR
    k2 = (k + 1) // 2
    return (np.empty(packed_b_size(k, n), np.uint32), np.empty((parts, h * k2), np.uint32),
            np.empty((parts, MR * NR), np.float32))


@njit(cache=True, nogil=True)
def gemm_bf16(ta, tb, alpha, a, b, beta, c, pb, pas, ts):
    """c[M, N] = alpha op(a) op(b) + beta c, a and b bf16 bits (uint16, C-contiguous), c
    float32; pb, pas, ts: workspace(M, N, K, parts) for parts = pas.shape[0] bands, run on
    numba's pool when there are several."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    if not (m and n):
        return
    al, be = np.float32(alpha), np.float32(beta)
    pack_b(tb, b, k, n, pb)
    parts = min(pas.shape[0], (m + MR - 1) // MR)
    if parts <= 1:
        _band(al, pb, k, n, be, c, 0, m, pas[0], ts[0], ta, a)
    else:
        _bands(ta, al, a, pb, k, n, be, c, parts, pas, ts)


# ---- the entry generated kernels call: one f32 scratch buffer for all of the workspace -----------
_ALIGN = 16      # f32 elements (64 bytes) each part of the scratch buffer starts on


def _up(x):
    return -(-x // _ALIGN) * _ALIGN


def work_size(m, n, k, parts) -> int:
    """f32 elements of the scratch buffer gemm_bf16_work needs for c[m, n] (inner dimension k)
    in up to `parts` bands: packed B, packed A per band, a tile per band."""
    h = -(-m // max(parts, 1))
    h = -(-h // MR) * MR
    return _up(packed_b_size(k, n)) + max(parts, 1) * (_up(h * ((k + 1) // 2)) + MR * NR)


@njit(cache=True, nogil=True)
def gemm_bf16_work(ta, tb, alpha, a, b, beta, c, work, parts):
    """gemm_bf16 with its buffers carved from `work` (work_size(M, N, K, parts) f32 elements):
    one band, on the calling thread, up to blas's band bound (as blas.gemm runs a GEMM whole
    there), else min(parts, the pool's threads) bands on the pool."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    if m * n * k <= _band_min():
        parts = 1
    parts = max(1, min(parts, _pool_threads()))
    h = (m + parts - 1) // parts
    h = (h + MR - 1) // MR * MR
    k2 = (k + 1) // 2
    nb = (packed_b_size(k, n) + _ALIGN - 1) // _ALIGN * _ALIGN
    na = (h * k2 + _ALIGN - 1) // _ALIGN * _ALIGN
    u = work.view(np.uint32)
    pb = u[:nb]
    pas = u[nb:nb + parts * na].reshape((parts, na))
    ts = work[nb + parts * na:nb + parts * na + parts * MR * NR].reshape((parts, MR * NR))
    gemm_bf16(ta, tb, alpha, a, b, beta, c, pb, pas, ts)


def enabled() -> bool:
    """Whether generated kernels run bf16 operands' GEMMs here (available(), unless
    JITGRAPH_BF16_GEMM=0 keeps the conversion path: each operand cast to f32, then sgemm). Read
    at compile; the kernel's text (hence its cache entry) records the choice."""
    import os
    want = os.environ.get("JITGRAPH_BF16_GEMM", "").strip()
    if want not in ("", "0", "1"):
        raise ValueError(f"JITGRAPH_BF16_GEMM={want!r}: expected 0 (convert to f32 and run "
                         f"sgemm) or 1 (the AVX512-BF16 kernel where the CPU has it)")
    return want != "0" and available()


def gemm(ta, tb, alpha, a, b, beta, c, parts=None):
    """gemm_bf16 with its workspace allocated here, in `parts` bands (default: one per thread
    of numba's pool): for tests and benchmarks."""
    from .blas import _POOL
    k = a.shape[0] if ta else a.shape[1]
    parts = parts or max(1, int(_POOL.value))
    pb, pas, ts = workspace(c.shape[0], c.shape[1], k, parts)
    gemm_bf16(ta, tb, alpha, a, b, beta, c, pb, pas, ts)

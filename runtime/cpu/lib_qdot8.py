"""Decode's row dots with x quantized to 8 bits first, as ggml's CPU backend computes them: x is
quantized to its weight type's "vec_dot_type" (Q8_0 for Q8_0 weights, Q8_K for Q4_K and Q6_K:
ggml-quants.c quantize_row_q8_0_ref / quantize_row_q8_K_ref), and each block's dot is an
integer sum of the weight's and x's quants, scaled once per block in float32
(ggml_vec_dot_q8_0_q8_0, ggml_vec_dot_q4_K_q8_K, ggml_vec_dot_q6_K_q8_K); for F16 weights x is
rounded to f16 (ggml's F16 vec_dot_type: a row of x in half the cache). The matmul attribute
xq="q8_0"/"q8_k"/"f16" asks for it (jitgraph/ops/shape.py, jitgraph/dots.py); the interpreter's
reference is "convert x so, read it back as f32, multiply by the dequantized weight", which the
integer sums equal exactly but for float32 rounding in the scales.

Integer sums are exact, so the only freedom is speed: with AVX2 a block's products are summed by
pmaddubsw (unsigned 8-bit x signed 8-bit -> pairs summed in 16 bits, which the value ranges keep
from saturating) and pmaddwd (16-bit pairs times the sub-block's scale summed in 32 bits), a
few instructions per 32 products where the float32 row dots (lib_qdot.py) convert and multiply
each element. Without AVX2 the same sums run as plain loops (_*_plain: also the kernels' test
oracle).

x's quantized form lives in the caller's float32 scratch (q8_layout): its int8 quants, one
float32 scale per block and, for Q8_K, the sums of each 16 quants (int16, as ggml's block_q8_K).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import carray

from jitgraph.types import STORAGE

from .halfconv import f32_f16
from .lib_common import cpu_has, kernel
from .lib_qdot import half

F16, Q8_0, Q4_K, Q6_K = (STORAGE[t][0] for t in ("f16", "q8_0", "q4_k", "q6_k"))
XQ_KINDS = (F16, Q8_0, Q4_K, Q6_K)      # the weight kinds with a row dot on x converted
QK_K = 256

_inline = njit(cache=True, nogil=True, error_model="numpy", inline="always")
# dot_rows8: the row dots inlined into it, float sums reassociated (vector lanes)
_dot_kernel = njit(cache=True, nogil=True, error_model="numpy",
                   fastmath={"reassoc", "contract", "nsz"})


HAS_AVX2 = cpu_has("avx2")


# ---- x quantized (ggml's reference quantizers) -------------------------------------------------
@kernel
def q8_layout(kind, k):
    """(quants, scales, sums) float32 offsets into the scratch for x of k elements converted for
    weight kind `kind`, and the scratch's float32 length: quants k int8 (k/4 floats), one scale
    per block, for Q8_K one int16 sum per 16 quants; for F16, k f16 values and nothing else."""
    if kind == F16:
        return 0, (k + 1) // 2, (k + 1) // 2, (k + 1) // 2
    blk = 32 if kind == Q8_0 else QK_K
    qn = (k + 3) // 4
    sn = k // 32 if kind != Q8_0 else 0           # k / 16 int16 sums
    return 0, qn, qn + k // blk, qn + k // blk + sn


@_inline
def _quantize_q8_0(x, q, d):
    """ggml's quantize_row_q8_0_ref: per 32, d = amax / 127 stored as f16 (d here: its float32
    value), q = roundf(x * (1 / d)) (halves away from zero; 0 when d is 0)."""
    for b in range(x.shape[0] // 32):
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(x[32 * b + j]))
        dd = amax / np.float32(127.0)
        inv = np.float32(1.0) / dd if dd != 0 else np.float32(0.0)
        for j in range(32):
            v = x[32 * b + j] * inv
            a = abs(v)
            r = np.floor(a)
            if a - r >= np.float32(0.5):      # roundf: halves away from zero
                r += np.float32(1.0)
            q[32 * b + j] = np.int8(-r if v < 0 else r)
        d[b] = half(f32_f16(dd))


@_inline
def _quantize_q8_k(x, q, d, bs):
    """ggml's quantize_row_q8_K_ref: per 256, iscale = -127 / (the element of largest
    magnitude, the first such), q = min(127, nearest_int(iscale x)) (ties to even), d =
    1 / iscale (0 and all quants 0 for a block of zeros), bs the sums of each 16 quants."""
    for b in range(x.shape[0] // QK_K):
        o = QK_K * b
        amax, mx = np.float32(0.0), np.float32(0.0)
        for j in range(QK_K):
            a = abs(x[o + j])
            if a > amax:
                amax, mx = a, x[o + j]
        if amax == 0:
            d[b] = 0.0
            for j in range(QK_K):
                q[o + j] = 0
            for j in range(16):
                bs[16 * b + j] = 0
            continue
        iscale = np.float32(-127.0) / mx
        for j in range(QK_K):
            q[o + j] = np.int8(min(127, np.int32(np.rint(iscale * x[o + j]))))
        for j in range(16):
            s = np.int32(0)
            for i in range(16):
                s += np.int32(q[o + 16 * j + i])
            bs[16 * b + j] = np.int16(s)
        d[b] = np.float32(1.0) / iscale


@kernel
def x_f16(x, work):
    """x (float32 [k]) rounded to f16 (ties to even) into work: its uint16 bits' view."""
    xh = work[:(x.shape[0] + 1) // 2].view(np.uint16)[:x.shape[0]]
    for i in range(x.shape[0]):
        xh[i] = f32_f16(x[i])
    return xh


@kernel
def quantize_x(kind, x, work):
    """x (float32 [k]) quantized for weight kind `kind` into work (float32, q8_layout's
    length): returns the (quants, scales, sums) views."""
    k = x.shape[0]
    o_q, o_d, o_s, n = q8_layout(kind, k)
    q = work[o_q:o_d].view(np.int8)[:k]
    d = work[o_d:o_s]
    bs = work[o_s:n].view(np.int16)
    if kind == Q8_0:
        _quantize_q8_0(x, q, d)
    else:
        _quantize_q8_k(x, q, d, bs)
    return q, d, bs


# ---- LLVM IR helpers for the AVX2 block sums ---------------------------------------------------
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V32B, _V16W, _V8D = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _load(context, builder, arrty, arr, off, vty):
    """A <vty> load (unaligned) from array `arr` at element offset `off`."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.load(builder.bitcast(builder.gep(data, [off]), vty.as_pointer()), align=1)


def _splat8(v):
    return ir.Constant(_V32B, [v] * 32)


class _Sums:
    """pmaddubsw / pmaddwd / reduce over one block, accumulated in an <8 x i32>."""

    def __init__(self, builder):
        self.b = builder
        self.maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16W, [_V32B, _V32B])
        self.maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", _V8D, [_V16W, _V16W])
        self.acc = ir.Constant(_V8D, None)

    def add(self, u8, s8, scale16):
        """acc += pairs of (u8 * s8 summed in pairs) * scale16, summed in pairs."""
        self.madd(self.b.call(self.maddubs, [u8, s8]), scale16)

    def madd(self, a16, b16):
        """acc += pairs of a16 * b16 (<16 x i16>) summed in pairs."""
        self.acc = self.b.add(self.acc, self.b.call(self.maddwd, [a16, b16]))

    def total(self):
        red = _fn(self.b, "llvm.vector.reduce.add.v8i32", _I32, [_V8D])
        return self.b.call(red, [self.acc])


def _bytes16(builder, v64):
    """The 8 bytes of an i64 as <8 x i16> (zero-extended)."""
    return builder.zext(builder.bitcast(v64, ir.VectorType(_I8, 8)), ir.VectorType(_I16, 8))


def _lanes16(builder, v8, idx):
    """<16 x i16> of lanes v8[idx[i]] (v8 an <8 x i16>)."""
    return builder.shuffle_vector(v8, ir.Constant(ir.VectorType(_I16, 8), ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, 16), list(idx)))


def _q4k_sums(context, builder, tw, w, ow, tq, q, oq, scales, tb, bs, obs, mins):
    """(isum, msum) <8 x i32> of a Q4_K block: isum's lanes summing to the sum over the 8
    sub-blocks j of scale j * (sub-block j's 4-bit quants . x's quants), msum's to the sum of
    min j * (x's sum over sub-block j). The block's 128 quant bytes at w[ow:], x's 256 quants at
    q[oq:] and their 16 sums of 16 at bs[obs:] (int16), the 6-bit scales and mins the bytes of
    the int64s `scales` and `mins` (byte j: sub-block j's)."""
    i64 = ir.IntType(64)
    s8 = _bytes16(builder, scales)
    sums = _Sums(builder)
    for g in range(4):
        wv = _load(context, builder, tw, w, builder.add(ow, i64(32 * g)), _V32B)
        lo = builder.and_(wv, _splat8(15))
        hi = builder.lshr(wv, _splat8(4))
        for c, nib in ((2 * g, lo), (2 * g + 1, hi)):
            xv = _load(context, builder, tq, q, builder.add(oq, i64(32 * c)), _V32B)
            sums.add(nib, xv, _lanes16(builder, s8, [c] * 16))
    m16 = _lanes16(builder, _bytes16(builder, mins), [j // 2 for j in range(16)])
    msum = _Sums(builder)
    msum.madd(m16, _load(context, builder, tb, bs, obs, _V16W))
    return sums.acc, msum.acc


def _acc_add(context, builder, tacc, acc, terms):
    """acc[0:8] (float32) += sum of int32 vector * float32 scalar over `terms`."""
    v8f = ir.VectorType(ir.FloatType(), 8)
    ptr = builder.bitcast(context.make_array(tacc)(context, builder, acc).data, v8f.as_pointer())
    a = builder.load(ptr, align=4)
    for vec, scale in terms:
        a = builder.fadd(a, builder.fmul(builder.sitofp(vec, v8f), _fsplat(builder, scale)))
    builder.store(a, ptr, align=4)


def _fsplat(builder, v):
    """<8 x float> of the float v in every lane."""
    v8f = ir.VectorType(ir.FloatType(), 8)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(v8f, ir.Undefined), v,
                                                         _I32(0)),
                                  ir.Constant(v8f, ir.Undefined), ir.Constant(_V8D, [0] * 8))


@intrinsic
def _q4k_block_avx2(typingctx, acc, w, ow, q, oq, scales, mins, bs, obs, dd, dm):
    """acc[0:8] += dd * isum - dm * msum (_q4k_sums' lanes): a Q4_K block's dot with x's
    quants, dd and dm the block's d and dmin times x's block scale."""
    sig = types.void(acc, w, types.int64, q, types.int64, types.int64, types.int64, bs,
                     types.int64, types.float32, types.float32)

    def codegen(context, builder, sig, args):
        acc, w, ow, q, oq, scales, mins, bs, obs, dd, dm = args
        isum, msum = _q4k_sums(context, builder, sig.args[1], w, ow, sig.args[3], q, oq,
                               scales, sig.args[7], bs, obs, mins)
        _acc_add(context, builder, sig.args[0], acc,
                 [(isum, dd), (msum, builder.fneg(dm))])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _q6k_block_avx2(typingctx, acc, w, ob, q, oq, bs, obs, dd):
    """acc[0:8] += dd * (lanes summing to the sum over the 16 groups j of 16 of scale j *
    (group j's quants, -32..31, . x's quants)): a Q6_K block at w[ob:] (ql 128 bytes, qh 64,
    scales 16 int8), x's 256 quants at q[oq:] and their 16 sums of 16 at bs[obs:] (int16) (the
    quants' offset of 32 taken off as 32 * scale j * x's sum j), dd the block's d times x's
    block scale."""
    sig = types.void(acc, w, types.int64, q, types.int64, bs, types.int64, types.float32)

    def codegen(context, builder, sig, args):
        acc, w, ob, q, oq, bs, obs, dd = args
        tw, tq, tb = sig.args[1], sig.args[3], sig.args[5]
        i64 = ir.IntType(64)
        sc = builder.sext(_load(context, builder, tw, w, builder.add(ob, i64(192)),
                                ir.VectorType(_I8, 16)), _V16W)
        off = _Sums(builder)
        off.madd(sc, _load(context, builder, tb, bs, obs, _V16W))
        sums = _Sums(builder)
        for p in range(2):
            ql0 = _load(context, builder, tw, w, builder.add(ob, i64(64 * p)), _V32B)
            ql1 = _load(context, builder, tw, w, builder.add(ob, i64(64 * p + 32)), _V32B)
            qh = _load(context, builder, tw, w, builder.add(ob, i64(128 + 32 * p)), _V32B)
            m4, m3 = _splat8(15), _splat8(3)
            for i, (ql, nib_shift) in enumerate(((ql0, 0), (ql1, 0), (ql0, 4), (ql1, 4))):
                low = builder.and_(builder.lshr(ql, _splat8(nib_shift)), m4)
                high = builder.shl(builder.and_(builder.lshr(qh, _splat8(2 * i)), m3),
                                   _splat8(4))
                c = 4 * p + i                       # x's 32 elements 32c.. of the block
                xv = _load(context, builder, tq, q, builder.add(oq, i64(32 * c)), _V32B)
                scv = builder.shuffle_vector(sc, ir.Constant(_V16W, ir.Undefined), ir.Constant(
                    ir.VectorType(_I32, 16), [2 * c] * 8 + [2 * c + 1] * 8))
                sums.add(builder.or_(low, high), xv, scv)
        isum = builder.sub(sums.acc, builder.shl(off.acc, ir.Constant(_V8D, [5] * 8)))
        _acc_add(context, builder, sig.args[0], acc, [(isum, dd)])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _q8_0_row_avx2(typingctx, w, q, d):
    """A Q8_0 row (w, its bytes) dotted with x's Q8_0 quants q and scales d: per block of 32 the
    integer sum of the quant products (ggml's AVX2 sign trick: |w| unsigned times x with w's
    sign) as 8 int32 lanes, converted and multiplied by the block's two scales into 8 float32
    lanes summed once at the end (no reduction per block: the loop streams W's rows with
    nothing but the accumulator carried from block to block)."""
    sig = types.float32(w, q, d)

    def codegen(context, builder, sig, args):
        w, q, d = args
        tw, tq, td = sig.args
        i64, f32 = ir.IntType(64), ir.FloatType()
        v8f = ir.VectorType(f32, 8)
        qa = context.make_array(tq)(context, builder, q)
        nb = builder.sdiv(builder.extract_value(qa.shape, 0), i64(32))
        wdata = context.make_array(tw)(context, builder, w).data
        ddata = context.make_array(td)(context, builder, d).data
        absf = _fn(builder, "llvm.abs.v32i8", _V32B, [_V32B, ir.IntType(1)])
        sign = _fn(builder, "llvm.x86.avx2.psign.b", _V32B, [_V32B, _V32B])
        pre = builder.block
        loop = builder.append_basic_block("q8_0.loop")
        done = builder.append_basic_block("q8_0.done")
        builder.cbranch(builder.icmp_signed(">", nb, i64(0)), loop, done)
        builder.position_at_end(loop)
        b = builder.phi(i64)
        b.add_incoming(i64(0), pre)
        acc = builder.phi(v8f)
        acc.add_incoming(ir.Constant(v8f, None), pre)
        ob = builder.mul(b, i64(34))
        wv = _load(context, builder, tw, w, builder.add(ob, i64(2)), _V32B)
        xv = _load(context, builder, tq, q, builder.mul(b, i64(32)), _V32B)
        sums = _Sums(builder)
        sums.add(builder.call(absf, [wv, ir.Constant(ir.IntType(1), 0)]),
                 builder.call(sign, [xv, wv]), ir.Constant(_V16W, [1] * 16))
        hbits = builder.load(builder.bitcast(builder.gep(wdata, [ob]), _I16.as_pointer()),
                             align=1)
        scale = builder.fmul(builder.fpext(builder.bitcast(hbits, ir.HalfType()), f32),
                             builder.load(builder.gep(ddata, [b])))
        new = builder.fadd(acc, builder.fmul(builder.sitofp(sums.acc, v8f),
                                             _fsplat(builder, scale)))
        b1 = builder.add(b, i64(1))
        b.add_incoming(b1, builder.block)
        acc.add_incoming(new, builder.block)
        builder.cbranch(builder.icmp_signed("<", b1, nb), loop, done)
        builder.position_at_end(done)
        out = builder.phi(v8f)
        out.add_incoming(ir.Constant(v8f, None), pre)
        out.add_incoming(new, loop)
        red = _fn(builder, "llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f])
        return builder.call(red, [ir.Constant(f32, 0.0), out], fastmath=("reassoc",))
    return sig, codegen


# ---- the same sums as plain loops (no AVX2; the tests' oracle for the AVX2 ones) ----------------
@_inline
def _byte(v, j):
    return np.int32((v >> (8 * j)) & 0xFF)


@_inline
def _q4k_isum_plain(w, ow, q, oq, scales):
    s = np.int32(0)
    for g in range(4):
        s1, s2 = np.int32(0), np.int32(0)
        for l in range(32):
            v = np.int32(w[ow + 32 * g + l])
            s1 += (v & 15) * np.int32(q[oq + 64 * g + l])
            s2 += (v >> 4) * np.int32(q[oq + 64 * g + 32 + l])
        s += _byte(scales, 2 * g) * s1 + _byte(scales, 2 * g + 1) * s2
    return s


@_inline
def _q4k_msum_plain(mins, bs, obs):
    s = np.int32(0)
    for j in range(8):
        s += _byte(mins, j) * (np.int32(bs[obs + 2 * j]) + np.int32(bs[obs + 2 * j + 1]))
    return s


@_inline
def _q6k_isum_plain(w, ob, q, oq, bs, obs):
    s = np.int32(0)
    for p in range(2):
        for i in range(4):
            for h in range(2):
                t = np.int32(0)
                for l in range(16 * h, 16 * h + 16):
                    ql = np.int32(w[ob + 64 * p + 32 * (i & 1) + l])
                    qh = np.int32(w[ob + 128 + 32 * p + l])
                    v = ((ql >> (4 * (i >> 1))) & 15) | (((qh >> (2 * i)) & 3) << 4)
                    t += (v - 32) * np.int32(q[oq + 128 * p + 32 * i + l])
                s += np.int32(np.int8(w[ob + 192 + 8 * p + 2 * i + h])) * t
    return s


@_inline
def _q8_0_isum_plain(w, ow, q, oq):
    s = np.int32(0)
    for j in range(32):
        s += np.int32(np.int8(w[ow + j])) * np.int32(q[oq + j])
    return s


# ---- row dots ---------------------------------------------------------------------------------
# the block sums the row dots use: AVX2's where the CPU has it (chosen at import, so the other is
# never compiled; numba's cache keys compiled code by CPU features)
@_inline
def _q4k_block_plain(acc, w, ow, q, oq, scales, mins, bs, obs, dd, dm):
    acc[0] += dd * np.float32(_q4k_isum_plain(w, ow, q, oq, scales)) - \
        dm * np.float32(_q4k_msum_plain(mins, bs, obs))


@_inline
def _q6k_block_plain(acc, w, ob, q, oq, bs, obs, dd):
    acc[0] += dd * np.float32(_q6k_isum_plain(w, ob, q, oq, bs, obs))


if HAS_AVX2:
    _q4k_block, _q6k_block = _q4k_block_avx2, _q6k_block_avx2
else:
    _q4k_block, _q6k_block = _q4k_block_plain, _q6k_block_plain


@intrinsic
def _lanes8(typingctx):
    """8 float32 on the stack: a row's accumulator, which LLVM keeps in a vector register (it
    aliases neither x nor W)."""
    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=8)
    return types.CPointer(types.float32)(), codegen


@_inline
def _q4k_scales(u, o):
    """A Q4_K block's 8 6-bit scales and 8 mins (the 12 bytes at u[o:], u the row as uint32)
    as the bytes of two int64s (ggml's utmp unpacking)."""
    u0, u1, u2 = np.int64(u[o]), np.int64(u[o + 1]), np.int64(u[o + 2])
    m1, m2, m3 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303
    sc = (u0 & m1) | (((u2 & m2) | (((u0 >> 6) & m3) << 4)) << 32)
    mn = (u1 & m1) | ((((u2 >> 4) & m2) | (((u1 >> 6) & m3) << 4)) << 32)
    return sc, mn


@_inline
def _row_q8_0_plain(w, q, d):
    h = w.view(np.uint16)
    s = np.float32(0.0)
    for b in range(q.shape[0] // 32):
        s += np.float32(_q8_0_isum_plain(w, 34 * b + 2, q, 32 * b)) * (half(h[17 * b]) * d[b])
    return s


_row_q8_0 = _q8_0_row_avx2 if HAS_AVX2 else _row_q8_0_plain


@_inline
def _sum8(acc):
    s = np.float32(0.0)
    for j in range(8):
        s += acc[j]
    return s


@_inline
def _row_q4_k(w, q, d, bs):
    h = w.view(np.uint16)
    u = w.view(np.uint32)             # a block is 144 bytes: its scales at a multiple of 4
    acc = carray(_lanes8(), 8)
    acc[:] = 0.0
    for b in range(q.shape[0] // QK_K):
        sc, mn = _q4k_scales(u, 36 * b + 1)
        _q4k_block(acc, w, 144 * b + 16, q, QK_K * b, sc, mn, bs, 16 * b,
                   half(h[72 * b]) * d[b], half(h[72 * b + 1]) * d[b])
    return _sum8(acc)


@_inline
def _row_q6_k(w, q, d, bs):
    h = w.view(np.uint16)
    acc = carray(_lanes8(), 8)
    acc[:] = 0.0
    for b in range(q.shape[0] // QK_K):
        _q6k_block(acc, w, 210 * b, q, QK_K * b, bs, 16 * b, half(h[105 * b + 104]) * d[b])
    return _sum8(acc)


@_inline
def _rows8(kind, alpha, q, d, bs, w, beta, out, n0, n1):
    a, bt = np.float32(alpha), np.float32(beta)
    for n in range(n0, n1):
        if kind == Q8_0:
            v = _row_q8_0(w[n], q, d)
        elif kind == Q4_K:
            v = _row_q4_k(w[n], q, d, bs)
        else:
            v = _row_q6_k(w[n], q, d, bs)
        out[n] = a * v if beta == 0.0 else a * v + bt * out[n]


@_inline
def _rows_f16(alpha, xh, w, beta, out, n0, n1):
    a, bt = np.float32(alpha), np.float32(beta)
    for n in range(n0, n1):
        h = w[n].view(np.uint16)
        s = np.float32(0.0)
        for i in range(xh.shape[0]):
            s += half(h[i]) * half(xh[i])
        out[n] = a * s if beta == 0.0 else a * s + bt * out[n]


@_dot_kernel
def dot_rows8(kind, alpha, x, w, beta, out, n0, n1, work):
    """out[n] = alpha xc . W[n] + beta out[n] (beta 0: out not read) for W's rows n0..n1, xc
    x (float32 [K]) converted for kind as ggml's dot does (quantize_x, or x_f16 for F16, into
    work, float32 of q8_layout's length), w uint8[rows, row_bytes] of a kind in XQ_KINDS
    (lengths checked by the caller). One loop over the rows per kind, the kind a constant in
    each."""
    if kind == F16:
        _rows_f16(alpha, x_f16(x, work), w, beta, out, n0, n1)
        return
    q, d, bs = quantize_x(kind, x, work)
    if kind == Q8_0:
        _rows8(Q8_0, alpha, q, d, bs, w, beta, out, n0, n1)
    elif kind == Q4_K:
        _rows8(Q4_K, alpha, q, d, bs, w, beta, out, n0, n1)
    else:
        _rows8(Q6_K, alpha, q, d, bs, w, beta, out, n0, n1)


@kernel
def has_row_dot8(kind):
    """Whether dot_rows8 reads storage kind `kind`."""
    return kind in XQ_KINDS

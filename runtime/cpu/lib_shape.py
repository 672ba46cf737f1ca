"""Data-movement kernels: permute, slice, slice_back, pad, concat, get_rows, get_rows_back.

All arrays are C-contiguous; N-D shapes come from the arrays, per-axis parameters are int tuples
with one entry per axis. These kernels are memory-bound and run serially. 0-d arrays are not
supported (a 0-d permute/slice/pad is a plain copy)."""
from __future__ import annotations

from .lib_common import kernel, row_base

_TILE = 32


@kernel
def _transpose_tiles(x3, o3):
    """o3[b] = x3[b].T for x3 [B, R, C], o3 [B, C, R], in _TILE x _TILE blocks."""
    B, R, C = x3.shape
    for b in range(B):
        for i0 in range(0, R, _TILE):
            for j0 in range(0, C, _TILE):
                for j in range(j0, min(j0 + _TILE, C)):
                    for i in range(i0, min(i0 + _TILE, R)):
                        o3[b, j, i] = x3[b, i, j]


@kernel
def permute(x, out, axes):
    """permute: out = np.transpose(x, axes); `axes` is an int tuple with one entry per axis.
    A (batched) swap of the last two axes runs cache-blocked; a 3-D/4-D permute keeping the
    last axis copies whole rows; otherwise each output row is a strided gather along input
    axis axes[-1]."""
    n = x.ndim
    if out.size == 0:
        return
    swap_last = n >= 2 and axes[n - 1] == n - 2 and axes[n - 2] == n - 1
    for k in range(n - 2):
        swap_last = swap_last and axes[k] == k
    if swap_last:
        R, C = x.shape[n - 2], x.shape[n - 1]
        _transpose_tiles(x.reshape((x.size // (R * C), R, C)),
                         out.reshape((out.size // (R * C), C, R)))
        return
    last = out.shape[n - 1] if n else 1
    if 3 <= n <= 4 and axes[n - 1] == n - 1:
        # the last axis stays: a row copy per output row, source rows from nested loops (no
        # per-row divisions and flat offsets as on the general path)
        if n == 4:
            A, B, C = out.shape[0], out.shape[1], out.shape[2]
            ra = x.strides[axes[0]] // x.itemsize // last
            rb = x.strides[axes[1]] // x.itemsize // last
            rc = x.strides[axes[2]] // x.itemsize // last
        else:
            A, B, C = 1, out.shape[0], out.shape[1]
            ra = 0
            rb = x.strides[axes[0]] // x.itemsize // last
            rc = x.strides[axes[1]] // x.itemsize // last
        x2, o2 = x.reshape((x.size // last, last)), out.reshape((out.size // last, last))
        r = 0
        for a in range(A):
            for b in range(B):
                for c in range(C):
                    src, dst = x2[a * ra + b * rb + c * rc], o2[r]
                    for j in range(last):
                        dst[j] = src[j]
                    r += 1
        return
    xf, of = x.reshape(x.size), out.reshape(out.size)
    step = x.strides[axes[n - 1]] // x.itemsize if n else 1
    for r in range(out.size // last):
        rem, off = r, 0
        for k in range(n - 2, -1, -1):
            i = rem % out.shape[k]
            rem //= out.shape[k]
            off += i * (x.strides[axes[k]] // x.itemsize)
        base = r * last
        for j in range(last):
            of[base + j] = xf[off + j * step]


@kernel
def slice(x, out, starts, steps):
    """slice: out[i_0, ...] = x[starts[0] + i_0 * steps[0], ...] (the normalised (start, stop,
    step) triples of the op; steps may be negative)."""
    if out.size == 0:
        return
    xf, of = x.reshape(x.size), out.reshape(out.size)
    last = out.shape[out.ndim - 1]
    st = steps[out.ndim - 1]
    for r in range(out.size // last):
        src, dst = row_base(r, out.shape, x, starts, steps, False), r * last
        for j in range(last):
            of[dst + j] = xf[src + j * st]


@kernel
def slice_back(g, out, starts, steps):
    """slice_back: out = zeros; out[starts + i * steps] = g[i] (the scatter that undoes slice;
    the selected positions are distinct, so this is a plain store)."""
    out[...] = 0
    if g.size == 0:
        return
    gf, of = g.reshape(g.size), out.reshape(out.size)
    last = g.shape[g.ndim - 1]
    st = steps[g.ndim - 1]
    for r in range(g.size // last):
        src, dst = r * last, row_base(r, g.shape, out, starts, steps, False)
        for j in range(last):
            of[dst + j * st] = gf[src + j]


@kernel
def pad(x, out, befores, value):
    """pad: out = value everywhere, x copied in at offset `befores` (one int per axis)."""
    out[...] = value
    embed(x, out, befores)


@kernel
def embed(x, out, starts):
    """concat (one call per operand): out[starts + i] = x[i]; `starts` is zero except at the concat
    axis, where it is the operand's offset. Also the interior copy of pad."""
    if x.size == 0:
        return
    xf, of = x.reshape(x.size), out.reshape(out.size)
    last = x.shape[x.ndim - 1]
    for r in range(x.size // last):
        src, dst = r * last, row_base(r, x.shape, out, starts, starts, True)
        for j in range(last):
            of[dst + j] = xf[src + j]


@kernel
def get_rows(w, idx, out):
    """get_rows: out[i..., :] = w[idx[i...], ...]; w [V, ...], idx i32[...], out idx.shape +
    w.shape[1:]. Raises IndexError for an index outside [0, V)."""
    V = w.shape[0]
    row = w.size // V if V else 0
    wf, of, ix = w.reshape(w.size), out.reshape(out.size), idx.reshape(idx.size)
    for i in range(ix.size):
        k = ix[i]
        if k < 0 or k >= V:
            raise IndexError("get_rows: index out of range")
        of[i * row:(i + 1) * row] = wf[k * row:(k + 1) * row]   # slices: a vectorised copy
        #   (a computed flat index kept its wraparound select, and the loop scalar)


@kernel
def get_rows_back(g, idx, out):
    """get_rows_back: out = zeros [n_rows, ...]; out[idx[i...]] += g[i...] (scatter-add, repeated
    indices accumulate). Raises IndexError for an index outside [0, n_rows)."""
    out[...] = 0
    V = out.shape[0]
    row = out.size // V if V else 0
    gf, of, ix = g.reshape(g.size), out.reshape(out.size), idx.reshape(idx.size)
    for i in range(ix.size):
        k = ix[i]
        if k < 0 or k >= V:
            raise IndexError("get_rows_back: index out of range")
        orow, grow = of[k * row:(k + 1) * row], gf[i * row:(i + 1) * row]
        for j in range(row):
            orow[j] += grow[j]

"""KV-cache ops: set_rows (write rows of a table at run-time indices, ggml_set_rows) and
kv_attention (attention of queries at run-time positions over a KV cache, causal over its filled
part: ggml_flash_attn_ext with llama.cpp's KQ mask).

With them a decode program keeps its KV cache in non-trainable params updated every call
(`g.update(cache=set_rows(cache, pos, k))`) and attends to cache rows 0..pos of each query, the
position an input: the same compiled program serves every position, and a step costs what the
filled part of the cache costs, not its capacity (jitgraph/models/generate.py).

set_rows carries the `inplace=0` fact: its result may take operand 0's buffer (the memory plan
gives it the param's slot when it is that param's update and nothing else reads the param); the
kernel then writes only the rows.

`f16=True` emulates llama.cpp's F16 KV cache in f32 tensors: set_rows rounds the rows it stores
to float16 (ggml_set_rows into an F16 table), kv_attention rounds the queries and the softmax
probabilities to float16 (what ggml converts them to before multiplying them with F16 K and V).
"""
from __future__ import annotations

import numpy as np

from ..registry import register
from ..types import ShapeError
from .common import apply, need_float, norm_axis, same_dtype

__all__ = ["set_rows", "kv_attention"]


def _f16(x):
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(x.dtype)


# ---- set_rows ----------------------------------------------------------------------------------
def _set_rows_infer(args, a):
    table, idx, rows = args
    axis = a["axis"]
    if not 0 <= axis < table.ndim:
        raise ShapeError(f"axis {axis} out of range for table {table}")
    if idx.dtype != "i32" or idx.ndim != 1:
        raise ShapeError(f"indices must be i32[n] (1-D), got {idx}")
    if rows.dtype != table.dtype:
        raise ShapeError(f"rows {rows} and table {table} differ in dtype")
    if a["f16"] and not table.type.is_float:
        raise ShapeError(f"f16=True needs a float table, got {table}")
    want = table.shape[:axis] + idx.shape + table.shape[axis + 1:]
    if rows.shape != want:
        raise ShapeError(f"rows {rows} do not fit table {table} at {idx.shape[0]} indices along "
                         f"axis {axis} (expected shape {list(want)})")
    return table.type


def _set_rows_ref(a, table, idx, rows):
    axis = a["axis"]
    n = table.shape[axis]
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"set_rows: index out of range [0, {n})")
    rows = _f16(rows) if a["f16"] else rows
    out = table.copy()
    for s, k in enumerate(idx.tolist()):         # in order: a repeated index keeps the last row
        out[(slice(None),) * axis + (k,)] = rows[(slice(None),) * axis + (s,)]
    return out


register("set_rows", kind="opaque", arity=3, attrs={"axis": ("int", 0), "f16": ("bool", False)},
         infer=_set_rows_infer, ref=_set_rows_ref, inplace=0,
         index=lambda args, a: [(1, args[0].shape[a["axis"]])],
         flops=lambda ins, out, a: ins[2].size,
         bytes=lambda ins, out, a: ins[1].nbytes + 2 * ins[2].nbytes,   # in place: rows only
         doc="set_rows(table, idx i32[n], rows, axis=0, f16=False): a copy of table whose "
             "slices idx[s] along `axis` are rows' slices s (ggml_set_rows); a repeated index "
             "keeps its last row; f16: rows rounded to float16 as stored. May write into "
             "table's buffer (inplace=0). No gradient.")


# ---- kv_attention ------------------------------------------------------------------------------
def _kv_attention_infer(args, a):
    q, kt, vt, pos = args
    for x in (q, kt, vt):
        need_float(x)
    same_dtype([q, kt, vt], "kv_attention")
    if q.ndim != 3 or kt.ndim != 3 or vt.shape != kt.shape:
        raise ShapeError(f"expected q [seq, heads, head_dim], kt and vt [kv_heads, head_dim, "
                         f"rows]: got {q}, {kt}, {vt}")
    if q.shape[2] != kt.shape[1] or kt.shape[0] < 1 or q.shape[1] % kt.shape[0]:
        raise ShapeError(f"q {q} and kt {kt}: head_dim must match and heads be a multiple of "
                         f"kv_heads")
    if pos.dtype != "i32" or pos.shape != (q.shape[0],):
        raise ShapeError(f"positions {pos} do not fit q {q} (expected i32[{q.shape[0]}])")
    return q.type


def _kv_attention_ref(a, q, kt, vt, pos):
    hkv, rows = kt.shape[0], kt.shape[2]
    if pos.size and (pos.min() < 0 or pos.max() >= rows):
        raise IndexError(f"kv_attention: position out of range [0, {rows})")
    rep = q.shape[1] // hkv
    q = _f16(q) if a["f16"] else q
    out = np.empty_like(q)
    scale = np.asarray(a["scale"], q.dtype)
    for s, p in enumerate(pos.tolist()):
        for h in range(q.shape[1]):
            kk, vv = kt[h // rep, :, :p + 1], vt[h // rep, :, :p + 1]
            sc = (q[s, h] @ kk) * scale
            e = np.exp(sc - sc.max())
            pr = e * np.asarray(1.0 / e.sum(dtype=np.float64), q.dtype)
            out[s, h] = vv @ (_f16(pr) if a["f16"] else pr)
    return out


register("kv_attention", kind="opaque", arity=4,
         attrs={"scale": ("float", 1.0), "f16": ("bool", False)},
         infer=_kv_attention_infer, ref=_kv_attention_ref,
         index=lambda args, a: [(3, args[1].shape[2])],
         flops=lambda ins, out, a: 4 * out.size * ins[1].shape[2],
         bytes=lambda ins, out, a: sum(t.nbytes for t in ins) + out.nbytes,
         doc="kv_attention(q [S, H, hd], kt, vt [Hkv, hd, rows], pos i32[S], scale, f16): "
             "out[s, h] = vt[g] @ softmax_j((q[s, h] . kt[g, :, j]) * scale) over cache rows "
             "j <= pos[s], g = h // (H / Hkv) (GQA); the caches are stored rows last (each "
             "head's keys and values contiguous per dimension); f16: q and the probabilities "
             "rounded to float16 (llama.cpp's F16 cache). No gradient.")


# ---- user-facing functions ---------------------------------------------------------------------
def set_rows(table, idx, rows, axis=0, f16=False):
    """A copy of `table` with its slices idx[s] along `axis` replaced by rows' slices s; `rows`
    has table's shape with len(idx) at `axis`. As a param's update (a KV cache), the compiled
    program writes only the rows into the param."""
    return apply("set_rows", table, idx, rows, axis=norm_axis(axis, table.ndim, "set_rows"),
                 f16=bool(f16))


def kv_attention(q, kt, vt, pos, scale=None, f16=False):
    """Attention of the queries q [S, H, hd] at positions pos i32[S] over a KV cache stored
    rows last, keys kt and values vt [Hkv, hd, rows]: query s sees rows 0..pos[s].
    scale: default 1/sqrt(hd)."""
    scale = 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else float(scale)
    return apply("kv_attention", q, kt, vt, pos, scale=scale, f16=bool(f16))

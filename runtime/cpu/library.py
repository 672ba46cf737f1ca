"""Hand-written numba kernels for the ops the code generator does not emit itself
(generated code does `from jitgraph.runtime.cpu import library as lib` and calls `lib.<kernel>`).

Calling convention: `kernel(in_1, ..., in_k, out, [work], *params)`. Arrays are C-contiguous
numpy arrays (f32/f64; i32 for indices and labels), shapes come from the arrays, `out` is
preallocated and fully overwritten, and nothing is allocated per call. Per-axis parameters are
int tuples with one entry per axis; `axis` parameters may be negative. Each kernel's docstring
names its op, layout and parameters:

  lib_shape  permute(x, out, axes)            slice(x, out, starts, steps)
             slice_back(g, out, starts, steps) pad(x, out, befores, value)
             embed(x, out, starts)  -- concat: one call per operand, starts = offset at the axis
             get_rows(w, idx, out)            get_rows_back(g, idx, out)
  lib_rows   softmax / log_softmax(x, out, axis)   softmax_back(y, g, out, axis)
             max_last / argmax_last / logsumexp_last(x, out)  -- reductions over the last axis
             count_equal(x, y, out)   cross_entropy(logits, target, out)
             cross_entropy_back(logits, target, g, out)
  lib_norm   rms_norm / layer_norm(x, out, eps)  rms_norm_back / layer_norm_back(x, g, out, eps)
             rope_work(x, pos, out, work, theta, neox)  rope_back_work(g, pos, out, work, ...)
             -- work: workspace_size_rope(x_shape, pos_shape) elements (the cos/sin table);
             rope(x, pos, out, theta, neox) / rope_back: the same, allocating the table
             rope_freqs_work(x, pos, factors, out, work, ...) / rope_back_freqs_work: with
             frequency factors (a third operand of the op)
             causal_mask(x, out, n_past, value)
  lib_kv     set_rows(table, idx, rows, out, axis, f16)  -- out may be table's buffer: rows only
             kv_attention(q, k, v, pos, out, work, scale, f16)
             -- work: workspace_size_kv_attention(q_shape, k_shape) elements
  lib_attention attention(q, k, v, out, work, scale)  attention_back(q, k, v, out, dout, grad,
             work, scale) -- work: workspace_size_attention[_back](q_shape, k_shape) elements
             attention_store(q, k, v, stored, work, scale)  attention_back_stored(q, k, v,
             stored, dout, grad, work, scale) -- work: workspace_size_attention_store(...),
             workspace_size_attention_back_stored(...)
  lib_conv   conv2d(x, w, out, work, sh, sw, ph, pw, dh, dw)
             conv2d_back_input(w, g, out, work, ...)   conv2d_back_weight(x, g, out, work, ...)
             -- work: 1-D, workspace_size_conv2d(x_shape, w_shape, y_shape) elements, out's dtype
  lib_quant  qgemm(ta, tb, alpha, x, w, beta, out, kind, work)  -- w: a weight in a storage
             type (jitgraph/types.py STORAGE) as uint8[rows, row bytes], kind its ggml type
             number; work: qgemm_workspace(kind, m, n, k, threads) elements
             qgemm8(alpha, x, w, beta, out, kind, work)  -- x @ W^T, x's rows converted first
             as ggml's dot does (the matmul attribute xq), W f16, q8_0, q4_k or q6_k; work as
             qgemm's
             get_rows_q(w, kind, idx, out)    -- rows of such a table, dequantized
  lib_round  sround_bf16(x, step, out, seed, salt)  -- x, out flat; step float32[1]
  lib_pool   max_pool2d(x, out, kh, kw, sh, sw, ph, pw)   max_pool2d_back(x, g, out, ...)
             avg_pool2d(x, out, ...)                       avg_pool2d_back(g, out, ...)
"""
from __future__ import annotations

from .lib_attention import (attention, attention_back,  # noqa: F401
                            attention_back_stored, attention_store, workspace_size_attention,
                            workspace_size_attention_back, workspace_size_attention_back_stored,
                            workspace_size_attention_store)
from .lib_conv import (conv2d, conv2d_back_input, conv2d_back_weight,  # noqa: F401
                       workspace_size_conv2d)
from .lib_kv import kv_attention, set_rows, workspace_size_kv_attention  # noqa: F401
from .lib_norm import (causal_mask, layer_norm, layer_norm_back, rms_norm,  # noqa: F401
                       rms_norm_back, rope, rope_back, rope_back_freqs_work, rope_back_work,
                       rope_freqs_work, rope_work, workspace_size_rope)
from .lib_quant import get_rows_q, qgemm, qgemm8  # noqa: F401
from .lib_round import sround_bf16  # noqa: F401
from .lib_pool import avg_pool2d, avg_pool2d_back, max_pool2d, max_pool2d_back  # noqa: F401
from .lib_rows import (argmax_last, count_equal, cross_entropy, cross_entropy_back,  # noqa: F401
                       log_softmax, logsumexp_last, max_last, softmax, softmax_back)
from .lib_shape import (embed, get_rows, get_rows_back, pad, permute, slice,  # noqa: F401
                        slice_back)

"""Write a LLaMA-3.2-1B-shaped GGUF with random weights, for speed and memory measurements.

    python bench/make_1b_model.py OUT.gguf --vocab LLAMA_CPP_SOURCE_DIR/models/ggml-vocab-llama-bpe.gguf
        [--layers 16] [--width 2048] [--heads W/64] [--kv-heads HEADS/4] [--ff 4*W] [--seed 0]

The default shape is LLaMA 3.2 1B's (config.json of meta-llama/Llama-3.2-1B): width 2048, 16
layers, 32 query / 8 key-value heads of 64, feed-forward 8192, RMS norm eps 1e-5, rope theta
500000 with LLaMA 3 rope scaling (factor 32, low_freq_factor 1, high_freq_factor 4,
original_max_position_embeddings 8192), context 131072, output tied to token_embd (no
output.weight), vocabulary 128256: 1,235,814,400 parameters, 4.94 GB in F32. `--width` and
`--layers` give smaller models of the same layout (heads of 64, 4 query heads per key-value head).

The metadata keys are the ones llama.cpp's convert_hf_to_gguf.py writes for LLaMA 3.2
(conversion/base.py TextModel.set_gguf_parameters, conversion/llama.py LlamaModel): LLaMA 3 rope
scaling has no metadata key, only the `rope_freqs.weight` tensor (llama3_rope_factors). The
tokenizer.* keys are copied unchanged from llama.cpp's models/ggml-vocab-llama-bpe.gguf (the LLaMA 3
BPE vocabulary: 128256 tokens, 280147 merges, BOS 128000, EOS 128001).

Weights: N(0, 0.02) (`--std`), norm weights 1.0, from numpy's default_rng(seed), drawn in file
order; all F32 (file type 0). Tensors are generated and written one at a time (the writer gets
their shapes first, then the data tensor by tensor), so memory holds one tensor at once (the
largest, token_embd, 1.05 GB), not the whole model. The file is written beside OUT under a
temporary name and renamed when complete.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import gguf
import numpy as np

from jitgraph.formats.paths import temp_path

ARCH = "llama"
HEAD_DIM = 64
ROPE_THETA = 500000.0
ROPE_SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
CONTEXT = 131072
RMS_EPS = 1e-5


def llama3_rope_factors(dim, base, factor, low_freq_factor, high_freq_factor,
                        original_max_position_embeddings):
    """rope_freqs.weight as llama.cpp's converter computes it for rope_type "llama3"
    (llama-cpp-python 0.3.36's vendor/llama.cpp/conversion/llama.py,
    LlamaModel.generate_extra_tensors), in float32 as its torch code does:

        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < high_freq_wavelen: rope_factors.append(1)
            elif wavelen > low_freq_wavelen: rope_factors.append(factor)
            else:
                smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
                rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    """
    f32 = np.float32
    old = original_max_position_embeddings
    freqs = f32(1.0) / (f32(base) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)))
    low_freq_wavelen = old / low_freq_factor
    high_freq_wavelen = old / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (f32(old) / wavelen - f32(low_freq_factor)) / f32(high_freq_factor
                                                                      - low_freq_factor)
            out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.array(out, np.float32)


def vocabulary(path):
    """[(key, value, type, item type)] of every tokenizer.* key of the GGUF at `path`."""
    r = gguf.GGUFReader(path)
    out = []
    for k, f in r.fields.items():
        if k.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            out.append((k, f.contents(), f.types[0], sub))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise SystemExit(f"--vocab {path}: no tokenizer.ggml.tokens key; expected a llama.cpp "
                         f"vocabulary GGUF such as models/ggml-vocab-llama-bpe.gguf")
    return out


def tensor_shapes(width, layers, heads, kv_heads, ff, n_vocab):
    """[(GGUF name, numpy shape, kind)] in file order; kind: "w" random, "norm" ones, "rope"."""
    kv = HEAD_DIM * kv_heads
    out = [("rope_freqs.weight", (HEAD_DIM // 2,), "rope"),
           ("token_embd.weight", (n_vocab, width), "w")]
    for i in range(layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (width,), "norm"),
                (p + "attn_q.weight", (heads * HEAD_DIM, width), "w"),
                (p + "attn_k.weight", (kv, width), "w"),
                (p + "attn_v.weight", (kv, width), "w"),
                (p + "attn_output.weight", (width, heads * HEAD_DIM), "w"),
                (p + "ffn_norm.weight", (width,), "norm"),
                (p + "ffn_gate.weight", (ff, width), "w"),
                (p + "ffn_up.weight", (ff, width), "w"),
                (p + "ffn_down.weight", (width, ff), "w")]
    out.append(("output_norm.weight", (width,), "norm"))
    return out


def write(path, width, layers, heads, kv_heads, ff, vocab, seed, std):
    tokens = next(v for k, v, *_ in vocab if k == "tokenizer.ggml.tokens")
    shapes = tensor_shapes(width, layers, heads, kv_heads, ff, len(tokens))
    rng = np.random.default_rng(seed)
    tmp = temp_path(path)
    w = gguf.GGUFWriter(tmp, ARCH)
    try:
        w.add_name(f"LLaMA-3.2-1B-shaped, random weights (width {width}, {layers} layers, "
                   f"seed {seed})")
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_block_count(layers)
        w.add_context_length(CONTEXT)
        w.add_embedding_length(width)
        w.add_feed_forward_length(ff)
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_rope_freq_base(ROPE_THETA)
        w.add_layer_norm_rms_eps(RMS_EPS)
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_vocab_size(len(tokens))
        w.add_rope_dimension_count(HEAD_DIM)
        for k, value, vtype, sub in vocab:
            w.add_key_value(k, value, vtype, sub)
        for name, shape, _ in shapes:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape, kind in shapes:      # in add_tensor_info's order: the writer checks it
            if kind == "rope":
                a = llama3_rope_factors(HEAD_DIM, ROPE_THETA, **ROPE_SCALING)
            elif kind == "norm":
                a = np.ones(shape, np.float32)
            else:
                a = rng.standard_normal(shape, dtype=np.float32)
                a *= np.float32(std)
            w.write_tensor_data(a)
            del a
        w.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:                  # failed or interrupted: no partial file is left
            for f in (getattr(w, "fout", None) or ()):
                f.close()
            if os.path.exists(tmp):
                os.unlink(tmp)
    return sum(math.prod(s) for _, s, k in shapes if k != "rope")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--vocab", required=True,
                    help="llama.cpp's models/ggml-vocab-llama-bpe.gguf")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, help="query heads (default width / 64)")
    ap.add_argument("--kv-heads", type=int, help="key-value heads (default heads / 4)")
    ap.add_argument("--ff", type=int, help="feed-forward width (default 4 * width)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02)
    a = ap.parse_args(argv)
    heads = a.heads or a.width // HEAD_DIM
    kv_heads = a.kv_heads or max(1, heads // 4)
    ff = a.ff or 4 * a.width
    if heads * HEAD_DIM != a.width:
        raise SystemExit(f"--width {a.width} --heads {heads}: expected width = heads * "
                         f"{HEAD_DIM} (LLaMA 3.2's head dim)")
    if heads % kv_heads:
        raise SystemExit(f"--heads {heads} --kv-heads {kv_heads}: expected heads to be a "
                         f"multiple of kv-heads")
    if a.layers < 1:
        raise SystemExit(f"--layers {a.layers}: expected at least 1")
    n = write(a.out, a.width, a.layers, heads, kv_heads, ff, vocabulary(a.vocab), a.seed, a.std)
    print(f"{a.out}: {n:,} parameters, {os.path.getsize(a.out):,} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])

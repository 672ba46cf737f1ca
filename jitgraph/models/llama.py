"""Llama-family models in llama.cpp's GGUF layout: the config (`<architecture>.*` metadata),
weights (read: F32, F16, BF16, Q8_0 and the other types gguf.quants dequantizes; written: F32,
F16 or Q8_0), the tokenizer (jitgraph.models.tokenizer), and the forward graph llama.cpp's
build_llama computes. The architectures llama, qwen2 and phi3 differ only in what their tables
in jitgraph/models/arch.py hold (fused or separate projections, q/k/v biases, rope_freqs, the
rope variant); `projections`, `ffn` and `_rope` below read the table, for the training graph here
and generation's decoder alike.

Params carry the GGUF tensor names and numpy layout: a GGUF tensor of ggml shape [ne0, ne1] is a
row-major array of shape (ne1, ne0), so a projection `blk.N.attn_q.weight` is [out, in] and is
applied as x @ W^T (matmul tb=True), exactly as ggml_mul_mat(W, x). `token_embd.weight` is
[vocab, dim]; `output.weight` [vocab, dim] is absent when the output is tied to the embedding.

The forward graph (llama_forward): tokens i32[batch, seq] and pos i32[seq] (rope positions,
normally 0..seq-1) -> logits f32[batch, seq, vocab]. Per layer: h += Wo attn(rope(Wq x),
rope(Wk x), Wv x) with x = rms_norm(h) * attn_norm; h += Wdown (silu(Wgate x) * Wup x) with x =
rms_norm(h) * ffn_norm; then rms_norm * output_norm and the output projection. Rope is llama.cpp's
NORM mode for llama (LLAMA_ROPE_TYPE_NORM: adjacent pairs (x[2i], x[2i+1]), angle pos *
base^(-2i/n_rot), divided by rope_freqs[i] where the model has it), NEOX (the two halves) for
qwen2 and phi3, on the first rope_dims of each head (the rest pass through); attention is causal, scaled by
1/sqrt(head_dim), with kv_heads < heads (GQA) sharing each K/V head between heads/kv_heads
consecutive query heads (query head h reads kv head h // (heads / kv_heads), as ggml broadcasts).
Attention is one op (ops.attention: its kernel never stores the S x S scores, its backward
recomputes them), except with kv_f16, which composes it from primitives to round as llama.cpp.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import numpy as np

from .. import init, ops
from ..formats.tensors import FileTensor
from ..ir import Graph
from ..ops.f16 import round_f16
from ..quant import storage_name
from ..types import STORAGE, ShapeError, TensorType
from .arch import get_arch

ARCH = "llama"
_KEYS = {   # LlamaConfig field -> GGUF key after "<architecture>."
    "dim": "embedding_length", "layers": "block_count", "heads": "attention.head_count",
    "kv_heads": "attention.head_count_kv", "ff": "feed_forward_length",
    "rope_base": "rope.freq_base", "rope_dims": "rope.dimension_count",
    "rms_eps": "attention.layer_norm_rms_epsilon", "ctx": "context_length",
    "vocab": "vocab_size",
}


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int | None = None         # None: = heads (no GQA)
    ff: int | None = None               # None: llama's 2/3 * 4 * dim rounded up to 32
    rope_base: float = 10000.0
    rope_dims: int | None = None        # None: the whole head
    rms_eps: float = 1e-5
    ctx: int = 2048
    tied: bool = False                  # output projection = token_embd (no output.weight)
    arch: str = ARCH                    # jitgraph/models/arch.py: "llama", "qwen2", "phi3"
    rope_freqs: bool = False            # rope_freqs.weight divides the rope frequencies
    types: tuple = ()                   # (tensor name, storage type): weights the graphs keep in
                                        # their file's type (read_llama keep_types), sorted

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)   # noqa: E731 (frozen dataclass)
        if self.kv_heads is None:
            set_("kv_heads", self.heads)
        if self.ff is None:
            set_("ff", 32 * -(-int(8 * self.dim / 3) // 32))
        if self.rope_dims is None:
            set_("rope_dims", self.dim // max(self.heads, 1))
        for k in ("vocab", "dim", "layers", "heads", "kv_heads", "ff", "rope_dims", "ctx"):
            set_(k, int(getattr(self, k)))
        set_("rope_base", float(np.float32(self.rope_base)))   # GGUF and llama.cpp: float32
        set_("rms_eps", float(np.float32(self.rms_eps)))
        set_("tied", bool(self.tied))
        set_("rope_freqs", bool(self.rope_freqs))
        set_("types", tuple(sorted((str(k), str(v)) for k, v in dict(self.types).items())))
        bad_types = [f"{k}: {v}" for k, v in self.types if v not in STORAGE]
        if bad_types:
            raise ShapeError(f"LlamaConfig: types {bad_types} are not storage types "
                             f"({', '.join(STORAGE)})")
        description = get_arch(self.arch)
        if self.rope_freqs and "rope_freqs.weight" not in description.optional:
            raise ShapeError(f"LlamaConfig: architecture {self.arch!r} has no rope_freqs")
        bad = [k for k in ("vocab", "dim", "layers", "heads", "kv_heads", "ff", "ctx")
               if getattr(self, k) < 1]
        if bad:
            raise ShapeError(f"LlamaConfig: {', '.join(f'{k}={getattr(self, k)}' for k in bad)} "
                             f"must be >= 1")
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ShapeError(f"LlamaConfig: dim {self.dim} must split into heads {self.heads}, "
                             f"and heads into kv_heads {self.kv_heads} groups")
        if self.rope_dims % 2 or not 0 < self.rope_dims <= self.head_dim:
            raise ShapeError(f"LlamaConfig: rope_dims {self.rope_dims} must be even and in "
                             f"(0, head_dim={self.head_dim}]")
        if not (0 < self.rope_base < math.inf and 0 < self.rms_eps < math.inf):
            raise ShapeError(f"LlamaConfig: rope_base {self.rope_base} and rms_eps "
                             f"{self.rms_eps} must be finite and > 0")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.kv_heads

    @property
    def qkv_dim(self) -> int:
        return self.dim + 2 * self.kv_dim

    @property
    def ff2(self) -> int:
        return 2 * self.ff

    @property
    def rope_half(self) -> int:
        return self.rope_dims // 2

    @property
    def description(self):
        """The architecture's tensor table (jitgraph/models/arch.py)."""
        return get_arch(self.arch)

    # ---- GGUF metadata ---------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, md: dict, tensors: dict | None = None) -> "LlamaConfig":
        """From GGUF metadata {key: value} of any architecture of jitgraph/models/arch.py (keys
        `<architecture>.*`); `tensors` ({name: ggml shape}) supplies the vocabulary size
        (token_embd) when <architecture>.vocab_size is absent, and says whether output is tied
        and whether rope_freqs is present."""
        arch = md.get("general.architecture")
        get_arch(arch)                    # an unknown architecture: one line naming it
        key = {f: f"{arch}.{k}" for f, k in _KEYS.items()}
        need = [k for f, k in key.items() if f in ("dim", "layers", "heads", "ff") and k not in md]
        if need:
            raise ValueError(f"{arch} metadata lacks {', '.join(need)}")
        kw = {f: md[k] for f, k in key.items() if k in md}
        if "vocab" not in kw:
            if tensors and "token_embd.weight" in tensors:
                kw["vocab"] = int(tensors["token_embd.weight"][1])
            elif "tokenizer.ggml.tokens" in md:
                kw["vocab"] = len(md["tokenizer.ggml.tokens"])
            else:
                raise ValueError(f"{arch} metadata: no {arch}.vocab_size, token_embd or "
                                 f"tokenizer")
        if int(md.get(f"{arch}.expert_count", 0) or 0) > 0:
            raise ValueError(f"{arch}: mixture-of-experts models ({arch}.expert_count) are not "
                             f"supported")
        if md.get(f"{arch}.rope.scaling.type", "none") != "none":
            raise ValueError(f"{arch}: rope scaling {md[f'{arch}.rope.scaling.type']!r} is not "
                             f"supported")
        for k in (f"{arch}.attention.key_length", f"{arch}.attention.value_length"):
            if k in md and int(md[k]) != int(kw["dim"]) // int(kw["heads"]):
                raise ValueError(f"{arch}: {k} {md[k]} != embedding_length / head_count; not "
                                 f"supported")
        if tensors is not None:
            kw["tied"] = "output.weight" not in tensors
            kw["rope_freqs"] = "rope_freqs.weight" in tensors
        return cls(**kw, arch=arch)

    def metadata(self) -> dict:
        """{GGUF key: value} (the writer stores counts as UINT32, the floats as FLOAT32)."""
        return {f"{self.arch}.{k}": getattr(self, f) for f, k in _KEYS.items()}

    def to_gguf(self, writer) -> None:
        """Add the <architecture>.* keys to a gguf.GGUFWriter."""
        for k, v in self.metadata().items():
            if isinstance(v, float):
                writer.add_float32(k, v)
            else:
                writer.add_uint32(k, int(v))

    # ---- params ----------------------------------------------------------------------------
    def param_shapes(self) -> dict:
        """{name: numpy shape} of every weight, GGUF names and layout, in the order of the
        architecture's table (jitgraph/models/arch.py); output.weight only when not tied,
        rope_freqs.weight only when the model has it."""
        desc = self.description
        absent = {"output.weight"} if self.tied else set()
        if not self.rope_freqs:
            absent.add("rope_freqs.weight")
        shape = lambda dims: tuple(int(getattr(self, d)) for d in dims)   # noqa: E731
        shapes = {"token_embd.weight": shape(("vocab", "dim"))}
        for i in range(self.layers):
            shapes.update({f"blk.{i}.{k}": shape(dims) for k, dims in desc.layer})
        shapes.update({k: shape(dims) for k, dims in desc.tensors
                       if k != "token_embd.weight" and k not in absent})
        return shapes


# ---- the forward graph -------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightTypes:
    """The dtype of each weight a graph builder makes: `default`, but the storage type
    cfg.types names for a weight kept in its file's type (a frozen param)."""
    default: str
    stored: tuple = ()

    def of(self, name: str) -> str:
        return dict(self.stored).get(name, self.default)


def weight_types(cfg, dtype) -> WeightTypes:
    return dtype if isinstance(dtype, WeightTypes) else WeightTypes(dtype, cfg.types)


def _w(g, name, shape, dtype):
    is_norm = name.endswith("norm.weight")
    init_ = init.ones() if is_norm else init.zeros() if name.endswith(".bias") else \
        init.normal(0.0, 0.02)
    dt = dtype.of(name) if isinstance(dtype, WeightTypes) else dtype
    if dt in STORAGE:           # kept in its file's type: frozen, read dequantized
        return g.param(name, shape, dt, init=init_, trainable=False)
    return g.param(name, shape, dt, init=init_)


def _default(dtype) -> str:
    return dtype.default if isinstance(dtype, WeightTypes) else dtype


def _rope(cfg, t, pos, freqs=None):
    """llama.cpp's rope of the architecture (NORM or NEOX) over the first rope_dims of t
    [B, S, H, hd]; freqs: the rope_freqs param dividing the frequencies, or None."""
    hd, rd, mode = t.shape[-1], cfg.rope_dims, cfg.description.rope
    if rd == hd:
        return ops.rope(t, pos, theta=cfg.rope_base, mode=mode, factors=freqs)
    rot = ops.rope(ops.slice(t, None, None, None, (0, rd)), pos, theta=cfg.rope_base,
                   mode=mode, factors=freqs)
    return ops.concat([rot, ops.slice(t, None, None, None, (rd, hd))], axis=-1)


def rope_freqs(g, cfg, dtype):
    """The rope_freqs.weight param (frozen: a fixed table, not trained), or None."""
    if not cfg.rope_freqs:
        return None
    return g.param("rope_freqs.weight", (cfg.rope_half,), dtype, init=init.ones(),
                   trainable=False)


def projections(g, cfg, p, x, dtype):
    """proj(role, rows_last=False): the projection of x [rows, dim] for role "q" ([rows, dim]),
    "k" or "v" ([rows, kv_dim]; rows_last: [kv_dim, rows], W x^T), from attn_q / attn_k /
    attn_v or from one fused attn_qkv (its output's columns q | k | v, computed once), plus
    the role's bias where the architecture has one. Nodes are made when a role is asked for, so
    a llama graph keeps its order (q, rope, k, rope, v)."""
    desc, d, kv = cfg.description, cfg.dim, cfg.kv_dim
    cols = {"q": (0, d), "k": (d, d + kv), "v": (d + kv, d + 2 * kv)}
    fused = []

    def proj(role, rows_last=False):
        lo, hi = cols[role]
        if desc.has("attn_qkv.weight"):
            if not fused:
                fused.append(ops.matmul(x, _w(g, p + "attn_qkv.weight", (cfg.qkv_dim, d),
                                              dtype), tb=True))
            t = ops.slice(fused[0], None, (lo, hi))
            t = ops.permute(t, (1, 0)) if rows_last else t
        else:
            w = _w(g, p + f"attn_{role}.weight", (hi - lo, d), dtype)
            if rows_last and not w.type.is_storage:
                t = ops.matmul(w, x, tb=True)
            else:       # a storage-typed weight is read as matmul's second operand only
                t = ops.matmul(x, w, tb=True)
                t = ops.permute(t, (1, 0)) if rows_last else t
        if desc.has(f"attn_{role}.bias"):
            b = _w(g, p + f"attn_{role}.bias", (hi - lo,), dtype)
            t = t + (ops.reshape(b, (hi - lo, 1)) if rows_last else b)
        return t
    return proj


def ffn(g, cfg, p, x, dtype):
    """Wdown (silu(Wgate x) * Wup x), with gate and up separate or fused in one ffn_up of 2 ff
    rows (gate first: ggml_swiglu)."""
    d, ff = cfg.dim, cfg.ff
    if cfg.description.has("ffn_gate.weight"):
        gate = ops.matmul(x, _w(g, p + "ffn_gate.weight", (ff, d), dtype), tb=True)
        up = ops.matmul(x, _w(g, p + "ffn_up.weight", (ff, d), dtype), tb=True)
    else:
        t = ops.matmul(x, _w(g, p + "ffn_up.weight", (2 * ff, d), dtype), tb=True)
        gate, up = ops.slice(t, None, (0, ff)), ops.slice(t, None, (ff, 2 * ff))
    return ops.matmul(ops.silu(gate) * up, _w(g, p + "ffn_down.weight", (d, ff), dtype), tb=True)


def _attention(g, cfg, p, x, pos, batch, seq, dtype, kv_f16, freqs):
    d, hd, h, hkv = cfg.dim, cfg.head_dim, cfg.heads, cfg.kv_heads
    rep = h // hkv
    proj = projections(g, cfg, p, x, dtype)
    q = _rope(cfg, ops.reshape(proj("q"), (batch, seq, h, hd)), pos, freqs)   # [B, S, H, hd]
    k = _rope(cfg, ops.reshape(proj("k"), (batch, seq, hkv, hd)), pos, freqs)
    v = ops.reshape(proj("v"), (batch, seq, hkv, hd))
    if not kv_f16:          # one op: the S x S scores are never stored (ops/attention.py)
        att = ops.attention(q, k, v, scale=1.0 / math.sqrt(hd))       # [B, S, H, hd]
    else:                   # llama.cpp's F16 rounding of q, K, V and the probabilities
        q, k, v = (round_f16(ops.permute(t, (0, 2, 1, 3))) for t in (q, k, v))
        # GQA without copies: the `rep` query heads of one kv head are stacked along the rows
        q = ops.reshape(q, (batch, hkv, rep * seq, hd))
        kq = ops.scale(ops.matmul(q, k, tb=True), 1.0 / math.sqrt(hd))  # [B, Hkv, rep*S, S]
        kq = ops.softmax(ops.causal_mask(ops.reshape(kq, (batch, h, seq, seq))))
        att = ops.matmul(round_f16(ops.reshape(kq, (batch, hkv, rep * seq, seq))), v)
        att = ops.permute(ops.reshape(att, (batch, h, seq, hd)), (0, 2, 1, 3))
    att = ops.reshape(att, (batch * seq, d))
    return ops.matmul(att, _w(g, p + "attn_output.weight", (d, d), dtype), tb=True)


def llama_forward(cfg: LlamaConfig, batch: int, seq: int, dtype: str = "f32",
                  name: str = "llama", labels: bool = False, kv_f16: bool = False,
                  correct: bool = False, logits: bool = True) -> Graph:
    """The forward graph: inputs tokens i32[batch, seq], pos i32[seq]; output logits
    f32[batch, seq, vocab]. labels=True adds input labels i32[batch, seq] and output loss (mean
    cross-entropy of the next-token predictions) for training; correct=True (with labels) the
    output correct, how many argmax predictions equal their label (ggml-opt's accuracy).
    logits=False (with labels) leaves the logits out of the outputs: a training step that
    reads only the loss needs no output buffer for them, and their buffer can be reused as
    soon as the loss and its gradient are computed (batch x seq x vocab f32: 250 MB for a 1B
    model's 128,256 tokens at ctx 512).

    kv_f16=True reproduces llama.cpp's default F16 KV cache: K and V are rounded to float16, and
    so are the queries and the softmax probabilities, which ggml converts to F16 to multiply them
    with the cache (ops.f16.round_f16). llama.cpp's logits then agree to ~1e-5 (without:
    ~2e-3 on stories260K)."""
    if batch < 1 or seq < 1:
        raise ShapeError(f"llama_forward: batch {batch} and seq {seq} must be >= 1")
    g = Graph(name)
    rows, d = batch * seq, cfg.dim
    tokens = g.input("tokens", (batch, seq), "i32")
    pos = g.input("pos", (seq,), "i32")
    freqs_dtype, dtype = _default(dtype), weight_types(cfg, dtype)
    embd = _w(g, "token_embd.weight", (cfg.vocab, d), dtype)
    h = ops.get_rows(embd, ops.reshape(tokens, (rows,)))             # [B*S, D]
    freqs = rope_freqs(g, cfg, freqs_dtype)
    for i in range(cfg.layers):
        p = f"blk.{i}."
        x = ops.rms_norm(h, _w(g, p + "attn_norm.weight", (d,), dtype), eps=cfg.rms_eps)
        h = h + _attention(g, cfg, p, x, pos, batch, seq, dtype, kv_f16, freqs)
        x = ops.rms_norm(h, _w(g, p + "ffn_norm.weight", (d,), dtype), eps=cfg.rms_eps)
        h = h + ffn(g, cfg, p, x, dtype)
    h = ops.rms_norm(h, _w(g, "output_norm.weight", (d,), dtype), eps=cfg.rms_eps)
    out_w = embd if cfg.tied else _w(g, "output.weight", (cfg.vocab, d), dtype)
    lg = ops.matmul(h, out_w, tb=True)                               # [B*S, vocab]
    if not labels and not logits:
        raise ValueError("llama_forward: logits=False needs labels=True (the loss is then the "
                         "only output)")
    outs = {"logits": ops.reshape(lg, (batch, seq, cfg.vocab))} if logits else {}
    if labels:
        lab = ops.reshape(g.input("labels", (batch, seq), "i32"), (rows,))
        outs["loss"] = ops.cross_entropy(lg, lab)
        if correct:
            outs["correct"] = ops.count_equal(ops.argmax(lg, -1), lab)
    g.output(**outs)
    return g


def llama_inputs(tokens, seq: int | None = None, pad: int = 0) -> dict:
    """Inputs for llama_forward from token rows (a list of id lists, or one list): right-padded
    with `pad` to `seq` (default: the longest row), pos = 0..seq-1. Padding after a row's tokens
    does not change their logits (the attention is causal)."""
    rows = [list(tokens)] if tokens and np.isscalar(tokens[0]) else [list(r) for r in tokens]
    seq = seq or max(len(r) for r in rows)
    if any(len(r) > seq for r in rows):
        raise ValueError(f"llama_inputs: a row is longer than seq={seq}")
    t = np.full((len(rows), seq), pad, np.int32)
    for i, r in enumerate(rows):
        t[i, :len(r)] = r
    return {"tokens": t, "pos": np.arange(seq, dtype=np.int32)}


def greedy(logits_fn, prompts, n: int, seq: int, eos: int | None = None) -> list:
    """Greedy continuation of each prompt (id lists) by `n` tokens (fewer after `eos`), recomputing
    the whole padded sequence each step: logits_fn(inputs dict) -> logits [rows, seq, vocab] for
    llama_inputs(rows, seq). Returns the new ids of each prompt."""
    rows = [list(p) for p in prompts]
    new = [[] for _ in rows]
    done = [False] * len(rows)
    for _ in range(n):
        logits = logits_fn(llama_inputs(rows, seq))
        for i, r in enumerate(rows):
            if done[i]:
                continue
            if len(r) >= seq:
                raise ValueError(f"greedy: sequence {i} reached seq={seq}")
            tok = int(np.argmax(logits[i, len(r) - 1]))
            r.append(tok)
            new[i].append(tok)
            done[i] = eos is not None and tok == eos
        if all(done):
            break
    return new


# ---- GGUF files --------------------------------------------------------------------------------
def _not_a_model(md: dict) -> None:
    """A LoRA adapter or a training checkpoint given where a model is expected: say which."""
    if md.get("general.type") == "adapter":
        raise ValueError("is a LoRA adapter, not a model; give it with --lora ADAPTER.gguf, "
                         "beside the base model it was trained on")
    if "jitgraph.checkpoint" in md:
        raise ValueError("is a jitgraph training checkpoint, not a model; continue its training "
                         "with --resume (finetune's --out, or train llama's --out, is the model)")


def read_llama(path, keep_types: bool = False, f32_in_file: bool = False):
    """(LlamaConfig, params {GGUF name: f32 array, numpy layout}, Tokenizer or None) from a
    llama.cpp GGUF model of an architecture of jitgraph/models/arch.py (the tokenizer: SPM for
    tokenizer.ggml.model = llama, BPE for gpt2; None without one). The header is bounds-checked
    first, then the metadata's types and the
    vocabulary against token_embd (models/llama_checks.py), before any tensor data is read (a
    malformed file raises jitgraph.ModelFormatError naming it).

    keep_types=True (frozen weights: generation, perplexity, a LoRA finetune's base): nothing
    is read; each weight matrix of type F32 or a storage type (types.STORAGE: F16, BF16, Q8_0,
    Q4_0, Q4_K, Q5_K, Q6_K) is a formats.tensors.FileTensor, which a compiled program reads
    straight into its memory, and cfg.types names the storage-typed ones (the graph builders
    give those params that type); other tensors (norms, biases, other types) are read as f32.
    f32_in_file=True (a full finetune's base): the F32 and BF16 weight matrices are
    FileTensors (cfg.types names none of them: the graphs train them in f32, or bf16 master
    weights), which a program reads into its slots (formats/tensors.py: mapped where the types
    agree, converted a chunk at a time where they do not), so a program's weights are not held
    twice at load; others are read as f32 arrays."""
    import gguf

    from ..errors import ModelFormatError
    from ..formats.gguf import _header, tensor_f32
    from ..formats.gguf_metadata import read_metadata
    from .llama_checks import check_metadata_types, check_vocabulary
    from .tokenizer import TOKENIZERS, Tokenizer
    path = os.fspath(path)
    with open(path, "rb") as f:
        kv, infos, order = _header(f, path)     # every count and extent checked against the size
    try:
        check_metadata_types(kv)
        md = read_metadata(path)
        _not_a_model(md)
        ne = {name: [int(n) for n in dims] for name, _, dims, _, _ in infos}
        cfg = LlamaConfig.from_metadata(md, ne)
        want = cfg.param_shapes()
        missing = [k for k in want if k not in ne]
        if missing:
            raise ValueError(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        embd = ne["token_embd.weight"]
        check_vocabulary(md, embd[1] if len(embd) == 2 else None)   # before any data is read
        extra = [k for k in ne if k not in want]
        if extra:       # e.g. phi3's long-context rope factors, qwen2's output.bias, experts
            raise ValueError(f"tensors {extra[:5]}{' ...' if len(extra) > 5 else ''} are not "
                             f"supported by jitgraph's {cfg.arch} graph")
        params, types = {}, {}
        with open(path, "rb") as f:
            for info in infos:
                name, ttype, dims, start, _ = info
                shape = tuple(reversed(dims))
                if shape != want[name]:
                    raise ValueError(f"tensor {name} has shape {shape} (numpy order), the "
                                     f"config says {want[name]}")
                kept = "f32" if ttype == gguf.GGMLQuantizationType.F32 else storage_name(ttype)
                if len(shape) == 2 and (keep_types and kept or
                                        f32_in_file and kept in ("f32", "bf16")):
                    params[name] = FileTensor(path, name, int(start), TensorType(kept, shape))
                    if kept != "f32" and keep_types:
                        types[name] = kept
                else:
                    params[name] = tensor_f32(f, path, order, *info)
        if types:
            cfg = replace(cfg, types=tuple(sorted(types.items())))
        tok = Tokenizer.from_metadata(md) if md.get("tokenizer.ggml.model") in TOKENIZERS else None
    except (ValueError, TypeError, ShapeError) as e:
        raise ModelFormatError(f"{path}: {e}") from None
    return cfg, params, tok


# llama_ftype (general.file_type) of the types write_llama stores the weight matrices in
_FTYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}


def tokenizer_fields(path) -> dict:
    """The tokenizer.* metadata of a GGUF file as {key: (value, type, array item type)}: what
    write_llama copies when jitgraph has no tokenizer object for the vocabulary (a BPE one), so
    an exported model keeps the vocabulary llama.cpp reads."""
    import gguf
    r = gguf.GGUFReader(os.fspath(path))
    out = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer."):
            sub = f.types[1] if len(f.types) > 1 else None
            out[k] = (f.contents(), f.types[0], sub)
    return out


def write_llama(path, cfg: LlamaConfig, params: dict, tokenizer=None, ftype: str = "f32",
                name: str | None = None, vocabulary: dict | None = None) -> None:
    """A llama.cpp-loadable GGUF: general.*, <architecture>.* (cfg), tokenizer.* (from
    `tokenizer`, else the fields `vocabulary` of tokenizer_fields, if given) and the
    weights under their GGUF names. ftype "f16" / "bf16" / "q8_0" stores the 2-D weights so
    (Q8_0 needs rows a multiple of 32 long; other 2-D weights fall back to F16), the norms stay
    F32; a FileTensor param (read_llama keep_types) is converted from its file's type, and a
    uint16 array is bf16 bits (bf16 master weights, as a program stores them): written as
    those bits where the tensor is BF16, else from their f32 values (exact). The writer gets
    every tensor's type and size first and converts each when it writes it (one converted
    tensor in memory at a time). Written atomically: a temporary file in the same directory,
    fsync, os.replace; nothing is left behind when the write fails or is interrupted."""
    import gguf
    if ftype not in _FTYPES:
        raise ValueError(f"write_llama: ftype must be one of {sorted(_FTYPES)}, got {ftype!r}")
    want = cfg.param_shapes()
    missing = [k for k in want if k not in params]
    if missing:
        raise ValueError(f"write_llama: params lack {missing[:5]}")
    for k, shp in want.items():
        if np.shape(params[k]) != shp:
            raise ValueError(f"write_llama: {k} has shape {np.shape(params[k])}, expected {shp}")
    if tokenizer is not None and len(tokenizer) != cfg.vocab:
        raise ValueError(f"write_llama: tokenizer has {len(tokenizer)} tokens, config vocab "
                         f"{cfg.vocab}")
    from ..formats.gguf import add_weight_later, gguf_writer
    with gguf_writer(path, cfg.arch) as w:
        w.add_name(name or cfg.arch)
        w.add_file_type(_FTYPES[ftype])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        cfg.to_gguf(w)
        if tokenizer is not None:
            tokenizer.write_gguf(w)
        else:
            for k, (value, vtype, sub) in (vocabulary or {}).items():
                w.add_key_value(k, value, vtype, sub)
        for k in want:          # each converted when written: one tensor's copy at a time
            add_weight_later(w, k, params[k], ftype)

"""Text generation with a llama model: a decode program compiled once, a KV cache in the
programs' persistent memory, the position fed at run time, and sampling on the host.

The programs (llama_decoder): one graph computes `seq` tokens at run-time positions pos against a
KV cache of fixed capacity `ctx`:

  inputs   tokens i32[1, seq], pos i32[seq] (and `last` i32[1] for a prompt chunk)
  params   the model's weights (GGUF names), and per layer `cache/k/N`, `cache/v/N`
           f32[kv_heads, head_dim, ctx + 1] (non-trainable, zero-initialised)
  updates  cache/k/N <- set_rows(cache/k/N, pos, k_new, axis=2) (and V): only the new rows are
           written, into the cache param itself (set_rows' `inplace` fact, passes/memory.py)
  output   logits f32[seq, vocab] (a prompt chunk: f32[1, vocab], the row `last`)

kv_attention (jitgraph/ops/kv.py) attends query i at position pos[i] to cache rows 0..pos[i]
(llama.cpp's causal KQ mask, applied by the bound of its loops): a step costs what the filled
part of the cache costs, not its capacity, and the rows after pos[i] (stale, or not yet written)
are never read. The caches keep each head's rows last ([kv_heads, head_dim, rows], V as
llama.cpp stores it transposed): the scores are head_dim contiguous passes over a head's keys and
the output head_dim contiguous dot products over its values, both vectorised. The decode
program has seq=1; the prefill program a chunk of `chunk` tokens. Both are compiled with
`jg.compile(..., share=decode)`: the same weights and the same cache in one persistent region.
Nothing is recompiled per token and the prefix is never recomputed.

The cache has one row more than its capacity: a scratch row (position ctx) where the padding of a
last partial prompt chunk goes once the positions after the prompt run out (padding rows
otherwise take the next positions, rows that later tokens overwrite before any query reads
them). No real query sees it (pos[i] < ctx).

With kv_f16=True (the default) K and V are rounded to float16 as they are stored, and the
queries and attention probabilities as they are used, as llama.cpp's default F16 KV cache does:
the logits agree with llama.cpp's to ~3e-6 and greedy continuations token for token.

Sampling (Sampler) follows llama.cpp's default chain on the host: top-k, then top-p (on the
softmax of the logits), then temperature, then a draw from numpy's PCG64 seeded by `seed`;
temperature 0 is greedy (argmax, the first of equal maxima). A row of logits holding NaN/Inf is
never sampled: generate raises NonFiniteError naming the likely cause (jitgraph/models/finite.py).
"""
from __future__ import annotations

import codecs
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .. import init, ops
from ..ir import Graph
from ..quant import dequantize
from ..types import ShapeError
from .finite import fail, finite_row
from .llama import LlamaConfig, _rope, _w, ffn, projections, rope_freqs, weight_types

__all__ = ["llama_decoder", "Generator", "Sampler", "GenerationResult", "ContextFull",
           "check_context", "cache_names", "stream_text"]


class ContextFull(ValueError):
    """The prompt and the tokens to generate do not fit the KV cache's capacity."""


def check_context(n_prompt: int, n: int, ctx: int) -> None:
    """Raise ContextFull when a prompt of n_prompt tokens and n tokens to generate exceed a
    context (the KV cache's capacity) of ctx tokens."""
    if n_prompt + n > ctx:
        raise ContextFull(f"the prompt ({n_prompt} tokens) + {n} tokens to generate = "
                          f"{n_prompt + n} exceed the context of {ctx} tokens (the KV cache's "
                          f"capacity); use a larger --ctx or a smaller -n")


def cache_names(cfg: LlamaConfig) -> list:
    return [f"cache/{kv}/{i}" for i in range(cfg.layers) for kv in ("k", "v")]


# ---- the graph ---------------------------------------------------------------------------------
def llama_decoder(cfg: LlamaConfig, seq: int, ctx: int, kv_f16: bool = True,
                  dtype: str = "f32", name: str | None = None, last: bool = False) -> Graph:
    """The step graph over a KV cache of capacity `ctx` (see the module docstring): `seq` tokens
    at positions pos (each < ctx; ctx itself only for padding) -> their logits f32[seq, vocab],
    the cache rows at pos written. last=True: an input `last` i32[1] picks the one row whose
    logits are computed (f32[1, vocab]: a prompt chunk needs its last real token's only)."""
    if seq < 1 or ctx < 1:
        raise ShapeError(f"llama_decoder: seq {seq} and ctx {ctx} must be >= 1")
    g = Graph(name or f"llama_decode{seq}")
    d, hd, h, hkv = cfg.dim, cfg.head_dim, cfg.heads, cfg.kv_heads
    rows = ctx + 1
    tokens = g.input("tokens", (1, seq), "i32")
    pos = g.input("pos", (seq,), "i32")
    weights = weight_types(cfg, dtype)
    embd = _w(g, "token_embd.weight", (cfg.vocab, d), weights)
    x_h = ops.get_rows(embd, ops.reshape(tokens, (seq,)))            # [S, D]
    freqs = rope_freqs(g, cfg, dtype)
    updates = {}
    for i in range(cfg.layers):
        p = f"blk.{i}."
        x = ops.rms_norm(x_h, _w(g, p + "attn_norm.weight", (d,), dtype), eps=cfg.rms_eps)
        proj = projections(g, cfg, p, x, weights)

        def roped(role, heads):                        # rope(x W^T) [S, heads, hd]
            t = ops.reshape(proj(role), (1, seq, heads, hd))
            return ops.reshape(_rope(cfg, t, pos, freqs), (seq, heads, hd))

        kc, vc = (g.param(f"cache/{kv}/{i}", (hkv, hd, rows), dtype, init=init.zeros(),
                          trainable=False) for kv in ("k", "v"))
        k = roped("k", hkv)                            # the new rows, rows last: [Hkv, hd, S]
        k = ops.reshape(k, (hkv, hd, 1)) if seq == 1 else ops.permute(k, (1, 2, 0))
        v = proj("v", rows_last=True)                  # W x^T: [Hkv * hd, S]
        kc = ops.set_rows(kc, pos, k, axis=2, f16=kv_f16)
        vc = ops.set_rows(vc, pos, ops.reshape(v, (hkv, hd, seq)), axis=2, f16=kv_f16)
        updates[f"cache/k/{i}"], updates[f"cache/v/{i}"] = kc, vc
        att = ops.kv_attention(roped("q", h), kc, vc, pos,
                               scale=1.0 / math.sqrt(hd), f16=kv_f16)      # [S, H, hd]
        x_h = x_h + ops.matmul(ops.reshape(att, (seq, d)),
                               _w(g, p + "attn_output.weight", (d, d), weights), tb=True)
        x = ops.rms_norm(x_h, _w(g, p + "ffn_norm.weight", (d,), dtype), eps=cfg.rms_eps)
        x_h = x_h + ffn(g, cfg, p, x, weights)
    if last:
        x_h = ops.get_rows(x_h, g.input("last", (1,), "i32"))         # [1, D]
    x_h = ops.rms_norm(x_h, _w(g, "output_norm.weight", (d,), dtype), eps=cfg.rms_eps)
    out_w = embd if cfg.tied else _w(g, "output.weight", (cfg.vocab, d), weights)
    g.output(logits=ops.matmul(x_h, out_w, tb=True))
    g.update(**updates)
    return g


# ---- sampling ----------------------------------------------------------------------------------
class Sampler:
    """Picks the next token from a row of logits, as llama.cpp's default sampler chain does:
    top-k (keep the k largest logits; k <= 0 or >= vocab: all), top-p (keep the smallest set of
    the most likely tokens whose probabilities, a softmax of the logits, sum to >= p; p >= 1:
    all), temperature (divide the logits by it), then a draw from the softmax of what is left,
    with numpy's PCG64 generator seeded by `seed` (None: a random seed, kept in `.seed`).
    temperature <= 0 is greedy: the argmax (the first of equal maxima), no draw."""

    def __init__(self, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                 seed: int | None = None):
        if not math.isfinite(temperature) or not 0.0 < top_p <= 1.0:
            raise ValueError(f"Sampler: temperature {temperature} must be finite and top_p "
                             f"{top_p} in (0, 1]")
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.seed = int(np.random.SeedSequence().entropy % (1 << 63)) if seed is None \
            else int(seed)
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def __call__(self, logits) -> int:
        x = np.asarray(logits).reshape(-1)
        if self.greedy:
            return int(np.argmax(x))
        x = x.astype(np.float64)
        n = x.size
        k = n if self.top_k <= 0 else min(self.top_k, n)
        idx = np.argpartition(-x, k - 1)[:k] if k < n else np.arange(n)
        idx = idx[np.lexsort((idx, -x[idx]))]                    # by logit, ties by id
        z = x[idx]
        if self.top_p < 1.0:
            p = np.exp(z - z[0])
            c = np.cumsum(p / p.sum())
            keep = int(np.searchsorted(c, self.top_p)) + 1      # first prefix reaching top_p
            idx, z = idx[:keep], z[:keep]
        p = np.exp((z - z[0]) / self.temperature)
        c = np.cumsum(p)
        j = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
        return int(idx[min(j, idx.size - 1)])


# ---- the generator -----------------------------------------------------------------------------
@dataclass
class GenerationResult:
    prompt_ids: list
    ids: list                      # the generated tokens (the EOS included when it stopped there)
    text: str                      # their text (tokenizer.decode), "" without a tokenizer
    stop: str                      # "eos" or "length"
    prefill_seconds: float = 0.0   # the prompt, through the prefill / decode programs
    decode_seconds: float = 0.0    # every generated token: sampling, decode steps, streaming
    prompt_chunks: int = 0         # prefill program calls
    decode_steps: int = 0          # decode program calls (prompt remainder included)
    timings: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second, the prompt's processing included (loading and
        compiling not)."""
        return len(self.ids) / self.seconds if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "tokens": len(self.ids),
                "stop": self.stop, "seconds": self.seconds,
                "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
                "tokens_per_second": self.tokens_per_second, "prompt_chunks": self.prompt_chunks,
                "decode_steps": self.decode_steps}


def _load(model):
    from .perplexity import _load as load
    return load(model)


class Generator:
    """A llama model compiled for generation: the decode program (one token) and the prefill
    program (`chunk` tokens), sharing the weights and a KV cache of `ctx` tokens (see the module
    docstring). `n_past`: the tokens in the cache.

    model: a GGUF path or (LlamaConfig, params[, Tokenizer]) as read_llama returns. ctx: the
    cache's capacity in tokens (default: min(512, the model's context length)). chunk: prompt
    tokens per prefill call (1: no prefill program, the prompt runs through decode steps); 16
    keeps stories260K's GEMMs under OpenBLAS's threading threshold (m n k < 2^18), where waking
    its threads for 32-row GEMMs cost far more than the GEMMs.
    kv_f16: llama.cpp's F16 KV cache rounding (see llama_forward). warmup: run one decode
    step at construction (the first call faults in the weights' pages), leaving the cache
    empty; compile_seconds and warmup_seconds say what construction took. lora: a LoRA adapter
    applied unmerged (its GGUF path or (adapter params, alpha), jitgraph.models.lora), scaled
    by lora_scale as llama.cpp's --lora-scaled does. dot: "exact" (x in float32 times each
    dequantized weight) or "ggml": x converted before its products with Q8_0, Q4_K, Q6_K and
    F16 weights as llama.cpp's CPU backend does (8-bit quants and integer dots per block; x in
    f16), faster (jitgraph.dots.ggml_dots; other weights unchanged). mmap: the weights' whole
    pages mapped from the file (fast to load); False: read into the program's memory (llama.cpp's
    --no-mmap: a slower load, then huge pages where the kernel gives them to anonymous memory,
    which decode streams faster than a file's 4 KB pages)."""

    def __init__(self, model, ctx: int | None = None, chunk: int = 16, kv_f16: bool = True,
                 warmup: bool = True, lora=None, lora_scale: float = 1.0, target: str = "cpu",
                 dot: str = "exact", mmap: bool = True):
        from ..compiler import compile as jg_compile
        from .perplexity import load_lora, with_lora
        self.config, params, self.tokenizer = _load(model)
        if not mmap:
            from dataclasses import replace

            from ..formats.tensors import FileTensor
            params = {k: replace(v, mappable=False) if isinstance(v, FileTensor) else v
                      for k, v in params.items()}
        cfg = self.config
        adapter = load_lora(cfg, lora, lora_scale)
        self._weights, self._adapter = list(params), adapter    # to name a NaN's cause
        ctx = min(512, cfg.ctx) if ctx is None else int(ctx)
        if not 1 <= ctx <= cfg.ctx:
            raise ValueError(f"generate: ctx {ctx} must be in [1, {cfg.ctx}] (the model's "
                             f"context length, {cfg.arch}.context_length)")
        chunk = int(chunk)
        if chunk < 1:
            raise ValueError(f"generate: chunk {chunk} must be >= 1")
        if dot not in ("exact", "ggml"):
            raise ValueError(f"generate: dot {dot!r} must be 'exact' or 'ggml'")
        from ..dots import ggml_dots
        graph = ggml_dots if dot == "ggml" else (lambda gr: gr)
        self.ctx, self.chunk, self.kv_f16 = ctx, min(chunk, ctx), kv_f16
        t0 = time.perf_counter()
        # feed() checks token ids and positions itself (scalars, cheaper than the programs'
        # per-step index checks)
        # the weights are written in place of their initialisation (FileTensors read straight in)
        self.decode = jg_compile(graph(with_lora(llama_decoder(cfg, 1, ctx, kv_f16), adapter)),
                                 copy_outputs=False, check_indices=False, target=target,
                                 params={**params, **(adapter[0] if adapter else {})})
        self.prefill = None if self.chunk == 1 else \
            jg_compile(graph(with_lora(llama_decoder(cfg, self.chunk, ctx, kv_f16, last=True),
                                       adapter)),
                       copy_outputs=False, check_indices=False, share=self.decode,
                       target=target)
        self.compile_seconds = time.perf_counter() - t0
        self._tok1 = np.zeros((1, 1), np.int32)
        self._pos1 = np.zeros(1, np.int32)
        self._tokc = np.zeros((1, self.chunk), np.int32)
        self._posc = np.zeros(self.chunk, np.int32)
        self._last = np.zeros(1, np.int32)
        self.n_past = self.prompt_chunks = self.decode_steps = 0
        t0 = time.perf_counter()
        if warmup:      # one token: its first call faults in the weights' pages (mapped from
            self.step(0)        # the file), as llama.cpp's warm-up does; the prefill program
            self.reset()        # shares them, and a second call of either costs a step
        self.warmup_seconds = time.perf_counter() - t0
        self.prompt_chunks = self.decode_steps = 0

    def reset(self) -> None:
        """Start a new sequence at position 0. The cache keeps its rows: kv_attention reads no
        row after a query's position, and each token's row is written before it is read."""
        self.n_past = 0

    def _check_room(self, n: int, what: str) -> None:
        if self.n_past + n > self.ctx:
            raise ContextFull(f"{what}: {self.n_past} tokens in the cache + {n} new = "
                              f"{self.n_past + n} exceed the context of {self.ctx} tokens (the "
                              f"KV cache's capacity); use a larger --ctx (at most "
                              f"{self.config.ctx}) or fewer tokens")

    def step(self, token: int) -> np.ndarray:
        """Feed one token at position n_past (the decode program); its logits f32[vocab], a
        view valid until the next call."""
        self._check_room(1, "generate")
        if not 0 <= token < self.config.vocab:
            raise ValueError(f"generate: token id {token} out of range [0, {self.config.vocab})")
        self._tok1[0, 0], self._pos1[0] = token, self.n_past
        out = self.decode.step(tokens=self._tok1, pos=self._pos1)["logits"]
        self.n_past += 1
        self.decode_steps += 1
        return out[0]

    def feed(self, ids) -> np.ndarray:
        """Feed tokens at positions n_past.. (prefill chunks, the last one padded; a single
        remaining token through the decode program); the logits of the last one, f32[vocab], a
        view valid until the next call."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("generate: nothing to feed (an empty prompt)")
        bad = [i for i in ids if not 0 <= i < self.config.vocab]
        if bad:
            raise ValueError(f"generate: token id {bad[0]} out of range [0, {self.config.vocab})")
        self._check_room(len(ids), "generate")
        out, at = None, 0
        while at < len(ids):
            n = min(self.chunk, len(ids) - at)
            if n == 1 or self.prefill is None:
                out = self.step(ids[at])
                at += 1
                continue
            self._tokc[0, :n] = ids[at:at + n]
            self._tokc[0, n:] = ids[at + n - 1]
            # padding rows go on at the next positions (rows that real tokens overwrite before
            # any query can see them), past the capacity into the scratch row
            self._posc[:] = np.minimum(np.arange(self.n_past, self.n_past + self.chunk),
                                       self.ctx)
            self._last[0] = n - 1
            out = self.prefill.step(tokens=self._tokc, pos=self._posc,
                                    last=self._last)["logits"][0]
            self.n_past += n
            self.prompt_chunks += 1
            at += n
        return out

    def generate(self, prompt, n: int, sampler: Sampler | None = None, stop_at_eos: bool = True,
                 on_token=None, reset: bool = True) -> GenerationResult:
        """Continue `prompt` (text, tokenized with BOS as the vocabulary says, or token ids) by
        up to `n` tokens, stopping after EOS (stop_at_eos). sampler: default greedy.
        on_token(id): called with each new token as it is produced (streaming). Raises
        ContextFull (a ValueError), before computing anything, when the prompt and the n tokens
        exceed the context."""
        tok = self.tokenizer
        if isinstance(prompt, (str, bytes)):
            if tok is None:
                raise ValueError("generate: the model has no tokenizer; pass token ids")
            prompt_ids = tok.encode(prompt, bos=tok.add_bos)
        else:
            prompt_ids = [int(i) for i in prompt]
        if n < 0:
            raise ValueError(f"generate: n {n} must be >= 0")
        if reset:
            self.reset()
        if not prompt_ids:
            raise ValueError("generate: empty prompt (no tokens and no BOS)")
        check_context(self.n_past + len(prompt_ids), n, self.ctx)
        sampler = sampler or Sampler(temperature=0.0)
        eos = tok.eos_id if tok is not None and stop_at_eos else None
        chunks0, steps0 = self.prompt_chunks, self.decode_steps
        t0 = time.perf_counter()
        logits = self.feed(prompt_ids)
        t1 = time.perf_counter()
        ids, stop = [], "length"
        for k in range(n):
            if not finite_row(logits):
                self._nonfinite(f"generate: the logits after "
                                f"{f'generated token {k}' if k else 'the prompt'} are NaN/Inf")
            t = sampler(logits)
            ids.append(t)
            if on_token is not None:
                on_token(t)
            if t == eos:
                stop = "eos"
                break
            if k < n - 1:
                logits = self.step(t)
        t2 = time.perf_counter()
        return GenerationResult(prompt_ids, ids, tok.decode(ids) if tok is not None else "",
                                stop, t1 - t0, t2 - t1, self.prompt_chunks - chunks0,
                                self.decode_steps - steps0)

    def _nonfinite(self, what):
        """Raise NonFiniteError naming the cause (finite.cause), reading the weights back from
        the program one at a time."""
        params, src = self.decode.params, self.decode.source

        def f32(k):
            t = src.nodes[src.params[k]].type
            return dequantize(params[k], t) if t.is_storage else params[k]
        fail(what, ((k, f32(k)) for k in self._weights), self._adapter)


def stream_text(tokenizer, write):
    """on_token for Generator.generate: writes each token's text as it comes (UTF-8 sequences
    split over byte tokens are held until complete)."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")

    def on_token(t):
        s = dec.decode(tokenizer.token_to_piece(t))
        if s:
            write(s)

    on_token.flush = lambda: write(dec.decode(b"", final=True))
    return on_token

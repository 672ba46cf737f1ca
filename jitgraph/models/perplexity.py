"""Perplexity of a llama model on a text, computed with llama.cpp's method (tools/perplexity,
`perplexity()` without --ppl-stride), and the byte-split convention for held-out text.

The method, step by step as llama.cpp does it:

1. The whole text is tokenized once, with BOS added at its start when the vocabulary adds one
   (common_tokenize(ctx, text, add_special=true)).
2. It is cut into n_chunk = n_tokens // n_ctx non-overlapping chunks of n_ctx tokens; the
   remaining tokens are not used. llama.cpp refuses a text of fewer than 2 * n_ctx tokens.
3. The first token of every chunk is replaced by BOS (when the vocabulary adds BOS), and each
   chunk is evaluated on its own (positions 0 .. n_ctx-1, a fresh KV cache).
4. Only the second half is scored: with first = n_ctx // 2, the logits at positions first ..
   n_ctx-2 predict the chunk's tokens first+1 .. n_ctx-1 (n_ctx - 1 - first per chunk; 63 at
   n_ctx 128). Each negative log-likelihood is log(sum(exp(l - max))) + max - l[target]; llama.cpp
   sums the exponentials in double, here the whole log-softmax runs in float64 on the host.
5. nll and nll^2 are accumulated in double; after each chunk the running estimate
   exp(nll / count) is reported (llama.cpp prints `[k]value,`). The final value is
   ppl = exp(mean nll) with uncertainty ppl * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1))
   (the standard error of the mean nll, carried through exp to first order). A NaN/Inf sum
   (NaN/Inf logits), or a mean nll whose exp overflows, raises NonFiniteError naming the likely
   cause (jitgraph/models/finite.py).

The logits come from one compiled forward program of fixed shape [batch, n_ctx] (jg.compile
runs once per call); a last partial batch of chunks is padded with BOS rows whose logits are
ignored. By default K, V, the queries and the attention probabilities are rounded to float16
(kv_f16=True) as llama.cpp's default F16 KV cache does.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .finite import fail

__all__ = ["PerplexityResult", "perplexity", "split_text", "nll_of_logits"]

_MAX_NLL = math.log(sys.float_info.max)     # a mean NLL above this: exp() overflows, PPL is inf


# ---- the held-out split -------------------------------------------------------------------------
def split_text(data, spec: str = "tail:0.1", errors: str | None = "replace"):
    """One part of a text split by bytes: the convention for held-out text.

    `data`: bytes (or a path-like / str naming a file, read in binary). `spec`:
    - "tail:F": the last F of the bytes, data[int((1 - F) * size):] ("tail:0.1": from byte
      int(0.9 * size) to the end, the held-out 10 %);
    - "head:F": the complement, data[:int((1 - F) * size)] (what is left to train on; F is the
      held-out fraction in both);
    - "all": everything.
    The cut is at that byte whatever it falls on. The part is decoded as UTF-8 with Python's
    error handler `errors` (default "replace": bytes of a multibyte character cut by the split
    become U+FFFD, one per invalid byte run as Python decodes them); errors=None returns the
    raw bytes, which perplexity() tokenizes as they are, as llama.cpp does a file cut at that
    byte (a stray continuation byte becomes its <0xXX> byte token)."""
    if isinstance(data, (str, os.PathLike)):
        with open(data, "rb") as f:
            data = f.read()
    data = bytes(data)
    spec = str(spec).strip()
    if spec == "all":
        part = data
    else:
        side, _, frac = spec.partition(":")
        try:
            f = float(frac)
        except ValueError:
            f = float("nan")
        if side not in ("tail", "head") or not 0.0 < f < 1.0:
            raise ValueError(f"split_text: spec must be 'tail:F', 'head:F' (0 < F < 1) or 'all', "
                             f"got {spec!r}")
        cut = int((1.0 - f) * len(data))
        part = data[cut:] if side == "tail" else data[:cut]
    return part if errors is None else part.decode("utf-8", errors)


# ---- results ------------------------------------------------------------------------------------
@dataclass
class PerplexityResult:
    ppl: float                    # exp(mean nll)
    uncertainty: float            # ppl * standard error of the mean nll (llama.cpp's "+/-")
    chunks: int                   # chunks scored
    scored: int                   # tokens scored: chunks * (n_ctx - 1 - n_ctx // 2)
    n_tokens: int                 # tokens of the whole text (with its BOS)
    n_ctx: int
    batch: int
    running: list = field(default_factory=list)   # exp(nll / count) after each chunk
    nll: float = float("nan")     # mean negative log-likelihood (nats)
    nll_std: float = float("nan") # its standard deviation per token
    compile_seconds: float = 0.0
    seconds: float = 0.0          # scoring: forward passes and log-softmax (not compile/tokenize)

    @property
    def value(self) -> float:
        return self.ppl

    @property
    def tokens_per_second(self) -> float:
        """Tokens evaluated (chunks * n_ctx) per second of scoring."""
        return self.chunks * self.n_ctx / self.seconds if self.seconds > 0 else float("nan")

    def log(self) -> str:
        """llama.cpp's output: the running estimates `[1]v1,[2]v2,...` and the final line."""
        run = ",".join(f"[{i + 1}]{v:.4f}" for i, v in enumerate(self.running)) + ","
        return f"{run}\nFinal estimate: PPL = {self.ppl:.4f} +/- {self.uncertainty:.5f}"

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "uncertainty": self.uncertainty, "chunks": self.chunks,
                "scored": self.scored, "n_tokens": self.n_tokens, "n_ctx": self.n_ctx,
                "nll": self.nll, "seconds": self.seconds,
                "compile_seconds": self.compile_seconds,
                "tokens_per_second": self.tokens_per_second}

    def __str__(self):
        return (f"PPL = {self.ppl:.4f} +/- {self.uncertainty:.5f} ({self.chunks} chunks of "
                f"{self.n_ctx}, {self.scored} tokens scored)")


# ---- the method ---------------------------------------------------------------------------------
def nll_of_logits(logits, targets, rows: int = 16) -> np.ndarray:
    """-log softmax(logits)[target] in float64: logits [..., vocab], targets [...] -> [...],
    `rows` rows at a time, on views (a 128k vocabulary's float64 temporaries stay a few MB)."""
    logits, targets = np.asarray(logits), np.asarray(targets)
    if logits.ndim == 1:
        return nll_of_logits(logits[None], targets[None], rows)[0]
    out = np.empty(targets.shape, np.float64)
    for idx in np.ndindex(targets.shape[:-1]):
        x2, t2, o2 = logits[idx], targets[idx], out[idx]
        for i in range(0, x2.shape[0], rows):
            x = np.asarray(x2[i:i + rows], np.float64)
            m = x.max(-1, keepdims=True)
            lse = np.log(np.exp(x - m).sum(-1)) + m[:, 0]
            o2[i:i + rows] = lse - np.take_along_axis(x, t2[i:i + rows, None], -1)[:, 0]
    return out


def _load(model):
    """(cfg, params, tokenizer or None) from a path or read_llama's tuple."""
    from .llama import read_llama
    if isinstance(model, (str, bytes, os.PathLike)):
        return read_llama(model, keep_types=True)
    if isinstance(model, (tuple, list)) and len(model) in (2, 3):
        return (tuple(model) + (None,))[:3]
    raise TypeError("perplexity: model must be a GGUF path or (config, params[, tokenizer]) as "
                    "read_llama returns")


def load_lora(cfg, lora, scale: float = 1.0):
    """(adapter params, alpha, scale) for `lora`: None, an adapter GGUF path (read_adapter, checked
    against cfg), or (adapter params, alpha) as read_adapter returns."""
    from .lora import adapter_pairs, read_adapter
    if lora is None:
        return None
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"lora scale must be finite, got {scale}")
    if isinstance(lora, (str, bytes, os.PathLike)):
        params, alpha = read_adapter(lora, cfg)
    elif isinstance(lora, (tuple, list)) and len(lora) == 2 and isinstance(lora[0], dict):
        params, alpha = dict(lora[0]), float(lora[1])
        adapter_pairs(cfg, params, "lora")
    else:
        raise TypeError("lora: expected an adapter GGUF path or (adapter params, alpha) as "
                        "read_adapter returns")
    return params, alpha, scale


def with_lora(graph, adapter):
    """`graph` with the adapter (load_lora's triple, or None) applied unmerged."""
    if adapter is None:
        return graph
    from .lora import apply_adapter
    params, alpha, scale = adapter
    return apply_adapter(graph, params, alpha, scale)


def perplexity(model, text, n_ctx: int = 128, batch: int = 8, progress=None,
               kv_f16: bool = True, bos=None, lora=None, lora_scale: float = 1.0,
               target: str = "cpu", chunks: int | None = None) -> PerplexityResult:
    """Perplexity of `model` on `text` with llama.cpp's method (see the module docstring).

    model: a llama GGUF path, or (LlamaConfig, params[, Tokenizer]) as read_llama returns.
    text: str or UTF-8 bytes (tokenized with the model's tokenizer, BOS added as the vocabulary
    says: what llama-perplexity does with the file's contents; note that `-f` drops one trailing
    newline of the file), or a sequence of token ids (the tokenized text, its BOS included).
    n_ctx: chunk length (3 .. the model's context). batch: chunks per forward pass (the one
    compiled program is [batch, n_ctx]). progress: None or a callable
    progress(chunks_done, n_chunks, running_ppl), called after every forward pass.
    bos: the id that replaces each chunk's first token; None: the tokenizer's BOS when its
    vocabulary adds BOS (else nothing is replaced), False: never.
    lora: a LoRA adapter applied unmerged (jitgraph.models.lora): its GGUF path or (adapter
    params, alpha); lora_scale: llama.cpp's adapter scale (--lora-scale; 0 = the base model).
    target: the compile target ("cpu", or "cuda"). chunks: score only the first `chunks`
    chunks (llama-perplexity's --chunks); None: all.
    Raises ValueError when the text has fewer than 2 * n_ctx tokens (llama.cpp's rule) or n_ctx
    is out of range."""
    from ..compiler import compile as jg_compile
    from .llama import llama_forward

    cfg, params, tok = _load(model)
    adapter = load_lora(cfg, lora, lora_scale)
    n_ctx, batch = int(n_ctx), int(batch)
    if n_ctx < 3:
        raise ValueError(f"perplexity: n_ctx {n_ctx} must be >= 3 (the second half of each "
                         f"chunk, less its last token, is scored)")
    if n_ctx > cfg.ctx:
        raise ValueError(f"perplexity: n_ctx {n_ctx} is larger than the model's context length "
                         f"{cfg.ctx} ({cfg.arch}.context_length)")
    if batch < 1:
        raise ValueError(f"perplexity: batch {batch} must be >= 1")

    if isinstance(text, (str, bytes, bytearray, memoryview)):
        if tok is None:
            raise ValueError("perplexity: the model has no tokenizer; pass token ids")
        ids = tok.encode(bytes(text) if not isinstance(text, str) else text, bos=tok.add_bos)
    else:
        ids = [int(t) for t in text]
    if bos is None:
        bos = tok.bos_id if tok is not None and tok.add_bos else False
    ids = np.asarray(ids, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab):
        raise ValueError(f"perplexity: token ids must be in [0, {cfg.vocab}), got "
                         f"{ids.min()} .. {ids.max()}")
    if len(ids) < 2 * n_ctx:
        raise ValueError(f"perplexity: the text tokenizes to only {len(ids)} tokens; "
                         f"n_ctx {n_ctx} needs at least {2 * n_ctx} (2 * n_ctx, as llama.cpp)")

    n_chunk = len(ids) // n_ctx
    if chunks is not None:
        if int(chunks) < 1:
            raise ValueError(f"perplexity: chunks {chunks} must be >= 1")
        n_chunk = min(n_chunk, int(chunks))
    first = n_ctx // 2
    per_chunk = n_ctx - 1 - first
    chunks = ids[:n_chunk * n_ctx].reshape(n_chunk, n_ctx)
    inputs = chunks.astype(np.int32)                       # targets stay the original tokens
    if bos is not False:
        inputs[:, 0] = int(bos)
    targets = chunks[:, first + 1:]                        # [n_chunk, per_chunk]
    batch = min(batch, n_chunk)

    t0 = time.perf_counter()
    prog = jg_compile(with_lora(llama_forward(cfg, batch, n_ctx, kv_f16=kv_f16), adapter),
                      copy_outputs=False, target=target,
                      params={**params, **(adapter[0] if adapter else {})})
    compile_seconds = time.perf_counter() - t0

    pos = np.arange(n_ctx, dtype=np.int32)
    pad = inputs[0]
    nll = nll2 = 0.0
    count = 0
    running = []
    t0 = time.perf_counter()
    for start in range(0, n_chunk, batch):
        n = min(batch, n_chunk - start)
        rows = inputs[start:start + n]
        if n < batch:                                      # padded; the extra rows are ignored
            rows = np.concatenate([rows, np.broadcast_to(pad, (batch - n, n_ctx))])
        logits = prog.step(tokens=np.ascontiguousarray(rows), pos=pos)["logits"]
        v = nll_of_logits(logits[:n, first:n_ctx - 1], targets[start:start + n])
        for row in v:                                      # llama.cpp's per-chunk accumulation
            nll += float(row.sum())
            nll2 += float((row * row).sum())
            count += per_chunk
            if not nll / count < _MAX_NLL:                 # NaN/Inf logits, or exp overflows
                what = (f"are so large that PPL overflows (mean NLL {nll / count:.3g} nats)"
                        if math.isfinite(nll) else "are NaN/Inf")
                fail(f"perplexity: the logits of chunk {len(running) + 1} {what}",
                     params.items(), adapter)
            running.append(math.exp(nll / count))
        if progress is not None:
            progress(start + n, n_chunk, running[-1])
    seconds = time.perf_counter() - t0

    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    se = math.sqrt(var / (count - 1)) if var > 0 and count > 1 else float("nan")
    return PerplexityResult(ppl=ppl, uncertainty=ppl * se, chunks=n_chunk, scored=count,
                            n_tokens=len(ids), n_ctx=n_ctx, batch=batch, running=running,
                            nll=mean, nll_std=math.sqrt(var) if var > 0 else 0.0,
                            compile_seconds=compile_seconds, seconds=seconds)

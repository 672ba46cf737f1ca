"""`jitgraph perplexity`, `jitgraph generate` and `jitgraph export` on llama GGUF models (training
and finetuning: cli/llama_train.py), and the --lora options they share."""
from __future__ import annotations

import json
import math
import os
import sys

from .common import (apply_threads, check_model_file, check_outputs, compile_progress,
                     compile_target, float_in, say)


def score_perplexity(args):
    from ..models.llama import read_llama
    from ..models.perplexity import perplexity, split_text
    check_model_file(args.model_file, "model")
    _check_stdout(args)
    model = read_llama(args.model_file, keep_types=True)
    if args.text is None:
        raise ValueError("--text FILE is required: the text to score (e.g. "
                         "../shared/data/text/tinyshakespeare.txt)")
    check_model_file(args.text, "--text", "a text file")
    target = compile_target(args)
    lora = _read_lora(args, model[0])
    part = split_text(args.text, args.split, errors=None)
    text = part.decode("utf-8", "replace")
    say(args, f"{args.model_file}: {model[0].layers} layers, width {model[0].dim}; text "
              f"{args.text} ({args.split}: {len(part)} bytes), n_ctx {args.ctx}")
    bar = None if args.quiet or not sys.stderr.isatty() else _tqdm_bar("perplexity")
    try:
        res = perplexity(model, text, n_ctx=args.ctx, batch=args.batch_size, kv_f16=args.kv_f16,
                         progress=None if bar is None else bar, lora=lora,
                         lora_scale=args.lora_scale, target=target, chunks=args.chunks)
    finally:                        # an error's line is not written over the bar
        if bar is not None:
            bar.close()
    say(args, res)
    if args.json:
        print(json.dumps({"perplexity": res.ppl, "uncertainty": res.uncertainty,
                          "chunks": res.chunks, "scored_tokens": res.scored,
                          "n_ctx": args.ctx, "seconds": res.seconds,
                          "tokens_per_second": res.tokens_per_second}))
    return 0


# C0 controls but newline and tab, DEL, and C1 controls, shown as Python escapes on a terminal:
# a token's bytes (or a prompt) holding ESC ] 0 ; ... BEL would retitle the window, ESC [ 2 J clear
# it. A prompt's undecodable bytes (surrogate escapes) are shown as \xNN too. Piped output is
# written as it is.
_CONTROLS = {**{c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (9, 10)},
             **{c: f"\\x{c - 0xDC00:02x}" for c in range(0xDC80, 0xDD00)}}


def _for_terminal(text: str) -> str:
    return text.translate(_CONTROLS)


def _check_stdout(args):
    """Raise OSError when standard output is closed (`>&-`) and the command has output."""
    if sys.stdout is None and (args.json or not args.quiet):
        raise OSError(f"standard output is closed: nowhere to write the output; redirect it "
                      f"(e.g. >/dev/null){'' if args.json else ' or pass --quiet'}")


def generate_text(args):
    from ..errors import NonFiniteError
    from ..models.generate import Generator, Sampler, check_context, stream_text
    from ..models.llama import read_llama
    check_model_file(args.model_file, "model")
    _check_stdout(args)
    apply_threads(args)
    cfg, params, tok = read_llama(args.model_file, keep_types=True)
    if tok is None:
        raise ValueError(f"{args.model_file}: the model has no tokenizer in its metadata (SPM "
                         f"or BPE: tokenizer.ggml.model llama or gpt2)")
    ctx = args.ctx if args.ctx is not None else min(512, cfg.ctx)
    if ctx > cfg.ctx:
        raise ValueError(f"--ctx {ctx} exceeds the model's context length {cfg.ctx} "
                         f"({cfg.arch}.context_length)")
    prompt_ids = tok.encode(args.prompt, bos=tok.add_bos)
    check_context(len(prompt_ids), args.n_predict, ctx)   # before compiling anything
    target = compile_target(args)
    lora = _read_lora(args, cfg)
    sampler = Sampler(args.temp, args.top_k, args.top_p, args.seed)
    with compile_progress(args, "generate"):
        gen = Generator((cfg, params, tok), ctx=ctx, chunk=args.chunk,
                        kv_f16=not args.no_kv_f16, lora=lora, lora_scale=args.lora_scale,
                        target=target, dot=args.dot, mmap=not args.no_mmap)
    out = sys.stdout
    shown = _for_terminal if out is not None and out.isatty() else str

    def write(text):
        out.write(shown(text))
        out.flush()

    on_token = None
    if not args.quiet:
        write(args.prompt)
        on_token = stream_text(tok, write)
    try:
        res = gen.generate(prompt_ids, args.n_predict, sampler, stop_at_eos=not args.ignore_eos,
                           on_token=on_token)
    except NonFiniteError:
        if on_token is not None:
            write("\n")                 # the error line starts on a line of its own
        raise
    if on_token is not None:
        on_token.flush()
        write("\n")
        per_token = res.decode_seconds / max(len(res.ids), 1) * 1e6
        print(f"jitgraph generate: {len(res.ids)} tokens ({res.stop}) in {res.seconds:.4f} s: "
              f"{res.tokens_per_second:,.0f} tokens/s (prompt {len(prompt_ids)} tokens "
              f"{res.prefill_seconds * 1e3:.2f} ms, {per_token:.1f} us a token); ctx {ctx}, "
              f"compiled in {gen.compile_seconds:.2f} s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({**res.as_dict(), "text": res.text, "ctx": ctx, "seed": sampler.seed,
                          "temp": args.temp, "top_k": args.top_k, "top_p": args.top_p,
                          "kv_f16": not args.no_kv_f16, "dot": args.dot,
                          "mmap": not args.no_mmap,
                          "compile_seconds": gen.compile_seconds,
                          "warmup_seconds": gen.warmup_seconds}))
    return 0


def _read_lora(args, cfg, merged=False):
    """(adapter params, alpha) of --lora, checked against the base model's config; None without
    --lora (then --lora-scale is an error). `merged`: the command merges it into the weights
    (export), else it is applied unmerged."""
    if args.lora is None:
        if args.lora_scale != 1.0:
            raise ValueError("--lora-scale needs --lora ADAPTER.gguf")
        return None
    from ..models.lora import read_adapter
    check_model_file(args.lora, "--lora", "an adapter file")
    params, alpha = read_adapter(args.lora, cfg)
    n = len(params) // 2
    say(args, f"--lora {args.lora}: {n} adapted weights, rank "
              f"{sorted({a.shape[0] for k, a in params.items() if k.endswith('.lora_a')})}, "
              f"alpha {alpha:g}, scale {args.lora_scale:g}"
              f"{'' if merged else ' (applied unmerged)'}")
    return params, alpha


def export_lora(args):
    from ..models.llama import read_llama, tokenizer_fields, write_llama
    from ..models.lora import merge
    check_model_file(args.model_file, "model")
    check_outputs(args, {"the base model": args.model_file, "--lora": args.lora})
    cfg, params, _ = read_llama(args.model_file)
    adapter, alpha = _read_lora(args, cfg, merged=True)
    merged = merge(params, adapter, alpha, args.lora_scale)
    vocabulary = tokenizer_fields(args.model_file)     # the base model's, exactly as it is
    write_llama(args.out, cfg, merged, None, ftype=args.ftype, vocabulary=vocabulary,
                name=f"{os.path.basename(args.model_file)} + {os.path.basename(args.lora)}")
    say(args, f"saved {args.out}: {args.model_file} with {args.lora} merged (scale "
              f"{args.lora_scale:g}, {args.ftype})")
    return 0


class _tqdm_bar:
    """progress(chunks_done, n_chunks, running_ppl) as a tqdm bar on the terminal."""

    def __init__(self, desc):
        self.desc, self.bar = desc, None

    def __call__(self, done, total, ppl):
        from tqdm import tqdm
        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.desc, unit="chunk", leave=False)
        self.bar.update(done - self.bar.n)
        self.bar.set_postfix(ppl=f"{ppl:.2f}")

    def close(self):
        if self.bar is not None:
            self.bar.close()


def add_lora_options(p, required=False):
    p.add_argument("--lora", metavar="ADAPTER.gguf", required=required,
                   help="a llama.cpp LoRA adapter for this base model" +
                        ("" if required else ", applied unmerged at load; default: none"))
    p.add_argument("--lora-scale", type=float_in(-math.inf, what="a finite number"),
                   default=1.0, metavar="S",
                   help="the adapter's scale, as llama.cpp's --lora-scaled (0: the base model)")

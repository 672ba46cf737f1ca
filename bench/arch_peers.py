"""jitgraph against llama.cpp (llama-cpp-python) on the architecture test models
(tests/data/arch: llama3, qwen2, phi3), side by side in one run: tokenizing a text, perplexity
with llama.cpp's method, greedy generation from a prompt's text. F16 KV cache on both sides
(llama.cpp's default). Needs llama-cpp-python 0.3.36.

    python bench/arch_peers.py [--text tests/data/tinyshakespeare_tail.txt] [--ctx 64]
        [--chunks 16] [-n 32] [--prompt "First Citizen:"]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_arch_fixtures import llama_cpp_greedy, llama_cpp_perplexity  # noqa: E402

DATA = os.path.join(HERE, "..", "tests", "data")


def seconds(fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    import llama_cpp

    from jitgraph.cli.roofline import sgemm_gflops
    from jitgraph.models.generate import Generator, Sampler
    from jitgraph.models.llama import read_llama
    from jitgraph.models.perplexity import perplexity
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=os.path.join(DATA, "tinyshakespeare_tail.txt"))
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("-n", type=int, default=32)
    p.add_argument("--prompt", default="First Citizen:")
    a = p.parse_args(argv)
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    print(f"# sgemm 1024^3: {sgemm_gflops():.0f} GFLOP/s; llama-cpp-python {llama_cpp.__version__}"
          f"; text {a.text} ({len(text.encode()):,} bytes), ctx {a.ctx}, {a.chunks} chunks")
    print("| model | tokens (jitgraph / llama.cpp, same ids) | tokenize MB/s | perplexity | "
          f"greedy {a.n} tokens from the prompt's text |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("llama3", "qwen2", "phi3"):
        path = os.path.join(DATA, "arch", f"{name}.gguf")
        cfg, params, tok = read_llama(path)
        llm = llama_cpp.Llama(path, n_ctx=a.ctx, n_batch=a.ctx, logits_all=True, verbose=False,
                              seed=0)
        ids, tj = seconds(tok.encode, text, bos=tok.add_bos)
        ids_l, tl = seconds(llm.tokenize, text.encode(), add_bos=tok.add_bos, special=False)
        mb = len(text.encode()) / 1e6
        need = a.ctx * a.chunks
        res = perplexity((cfg, params, tok), ids[:need], n_ctx=a.ctx, batch=8, kv_f16=True)
        bos = llm.token_bos() if tok.add_bos else None
        ppl_l = llama_cpp_perplexity(llm, ids_l[:need], a.ctx, bos)
        prompt = tok.encode(a.prompt, bos=tok.add_bos)
        gen = Generator((cfg, params, tok), ctx=a.ctx, kv_f16=True)
        out = gen.generate(prompt, a.n, Sampler(0.0), stop_at_eos=False)
        ref = llama_cpp_greedy(llm, prompt, a.n)
        print(f"| {name} ({cfg.arch}) | {len(ids):,} / {len(ids_l):,}, "
              f"{'yes' if list(ids) == list(ids_l) else 'NO'} | {mb / tj:.2f} / {mb / tl:.2f} | "
              f"{res.ppl:.4f} / {ppl_l:.4f} ({100 * (res.ppl / ppl_l - 1):+.3f} %) | "
              f"{'identical' if list(out.ids) == ref else f'differ at {first_diff(out.ids, ref)}'}"
              f" |")
    return 0


def first_diff(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    sys.exit(main())

"""Tokenizer throughput, jitgraph vs llama.cpp (through llama-cpp-python, when installed), on one
text and llama.cpp's test vocabularies; also checks that both give the same ids.

    python bench/tokenize_peers.py [--text FILE] [--vocab NAME ...] [--vocab-dir DIR]

--text defaults to tiny shakespeare where this checkout's shared/ folder has it. The vocabularies
come from tests/data/vocab (decompressed into a temporary folder) unless --vocab-dir names a folder
of ggml-vocab-NAME.gguf files. jitgraph's figure is the first encode after loading (its word cache
empty) and, as "warm", a second encode of the same text; llama.cpp's is the best of --repeat runs.
The machine's load average is printed: other processes on the cores slow both sides.
"""
import argparse
import lzma
import os
import tempfile
import time
from pathlib import Path

from jitgraph.models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "vocab"
SHAKESPEARE = ROOT.parent / "shared" / "data" / "text" / "tinyshakespeare.txt"


def vocab_path(name, vocab_dir, tmp):
    if vocab_dir:
        return Path(vocab_dir) / f"ggml-vocab-{name}.gguf"
    p = Path(tmp) / f"ggml-vocab-{name}.gguf"
    if not p.exists():
        src = DATA / f"ggml-vocab-{name}.gguf.xz"
        if name == "qwen35":
            raise SystemExit("qwen35: pass --vocab-dir (tests/test_tokenizer_vocab.py rebuilds it)")
        p.write_bytes(lzma.decompress(src.read_bytes()))
    return p


def llama_cpp(path, raw, repeat):
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    best = None
    for _ in range(repeat):
        t = time.perf_counter()
        ids = llm.tokenize(raw, add_bos=False, special=False)
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return ids, best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=str(SHAKESPEARE))
    ap.add_argument("--vocab", nargs="+", default=["llama-bpe", "qwen2", "gpt-2", "llama-spm"])
    ap.add_argument("--vocab-dir")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    raw = Path(args.text).read_bytes()
    mb = len(raw) / 1e6
    print(f"text: {args.text} ({mb:.2f} MB); load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    print(f"{'vocab':14s} {'jitgraph':>10s} {'warm':>10s} {'llama.cpp':>10s}  same ids")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.vocab:
            path = vocab_path(name, args.vocab_dir, tmp)
            tok = load_tokenizer(path)
            t = time.perf_counter()
            ids = tok.encode(raw, bos=False)
            cold = time.perf_counter() - t
            t = time.perf_counter()
            tok.encode(raw, bos=False)
            warm = time.perf_counter() - t
            peer = llama_cpp(path, raw, args.repeat)
            ref = "-" if peer is None else f"{mb / peer[1]:7.2f} MB/s"
            same = "-" if peer is None else str(list(peer[0]) == ids)
            print(f"{name:14s} {mb / cold:7.2f} MB/s {mb / warm:7.2f} MB/s {ref:>12s}  {same}")


if __name__ == "__main__":
    main()

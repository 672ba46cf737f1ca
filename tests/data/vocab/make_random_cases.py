"""Writes random_cases.json: llama.cpp's (llama-cpp-python 0.3.36's) tokens, without BOS and
special parsing, for random texts over an alphabet of every code point class its pre-tokenizers
tell apart (ASCII letters, digits, punctuation, controls and whitespace, contraction letters,
non-ASCII whitespace, letters, accent marks, numbers, symbols, CJK, emoji, unassigned code
points, SentencePiece's \u2581)
and for random byte strings with invalid UTF-8.
    python make_random_cases.py DIR_WITH_GGUF_FILES random_cases.json"""
import json
import random
import sys

import llama_cpp

VOCABS = ["llama-bpe", "qwen2", "qwen35", "gpt-2", "falcon", "deepseek-llm", "deepseek-coder",
          "starcoder", "command-r", "aquila", "llama-spm", "phi-3"]
ALPHABET = list("aAzZ sStTmMdDrReEvVlL'\r\n\t\x0b\x0c  0123456789") + list(
    ".,!?;:-_()[]{}<>$+=^~|`@#%&*/\\\"") + [
    "\u00a0", "\u2003", "\u3000", "\u0085", "\u2028", "\u00e9", "\u00c4", "\u0301", "\u0308",
    "\u0915", "\u093f", "\u4e2d", "\u6587", "\u0660", "\u00b2", "\u2160", "\u00bd", "\u00a7",
    "\u00ab", "\u2014", "\u20ac", "\u00a9", "\U0001f999", "\U0001f600", "\u200d", "\ufe0f",
    "\u0378", "\ue000", "\u0410", "\u044f", "\u05d0", "\u0627", "\u1f7d", "\u212a", "\u0130",
    "\u017f", "\u00b5", "\uff21", "\u3002", "\uff01", "\u2018", "\u201c", "\uac00", "\u0800",
    "\u1100", "\u0e01", "\u0e31", "\u00ad", "\u200b", "\u2062", "\x01", "\x1f", "\x7f", "\x80",
    "\x9f", "\u2581", "\u2581 "]
BYTES = [b"a", b" ", b"\n", b"'s", b"1", b"\xc3\xa4", b"\xc3", b"\xa4", b"\xe2\x82",
         b"\xf0\x9f\xa6\x99", b"\xf0\x9f", b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe0\x80\xaf",
         b"."]


def main():
    rng = random.Random(20261204)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60))).encode("utf-8")
             for _ in range(60)]
    texts += [b"".join(rng.choice(BYTES) for _ in range(rng.randint(1, 20))) for _ in range(20)]
    out = {"texts": [t.decode("latin-1") for t in texts]}
    for name in VOCABS:
        llm = llama_cpp.Llama(model_path=f"{sys.argv[1]}/ggml-vocab-{name}.gguf", vocab_only=True,
                              verbose=False)
        out[name] = [list(llm.tokenize(t, add_bos=False, special=False)) for t in texts]
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, separators=(",", ":"))


if __name__ == "__main__":
    main()

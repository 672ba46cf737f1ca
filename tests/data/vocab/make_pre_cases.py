"""Writes pre_cases.json: for one tokenizer.ggml.pre name of each pre-tokenizer type and flag set
jitgraph reads, llama.cpp's (llama-cpp-python 0.3.36's) tokens, BOS as the name says
(add_special on, no special parsing), of llama.cpp's test texts and random texts, with
ggml-vocab-gpt-2.gguf's vocabulary and tokenizer.ggml.pre set to that name.
    python make_pre_cases.py DIR_WITH_GGUF_FILES pre_cases.json"""
import json
import os
import random
import sys
import tempfile

import llama_cpp

from jitgraph.models.pre_regexes import PRE_TYPES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_random_cases import ALPHABET  # noqa: E402


def with_pre(raw: bytes, name: str) -> bytes:
    key = b"tokenizer.ggml.pre"
    i = raw.index(key) + len(key) + 4
    n = int.from_bytes(raw[i:i + 8], "little")
    return raw[:i] + len(name).to_bytes(8, "little") + name.encode() + raw[i + 8 + n:]


base = open(f"{sys.argv[1]}/ggml-vocab-gpt-2.gguf", "rb").read()
inp = open(f"{sys.argv[1]}/ggml-vocab-llama-bpe.gguf.inp", "rb").read()
texts = inp.split(b"\n__ggml_vocab_test__\n")[:-1]
rng = random.Random(7)
texts += ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))).encode("utf-8")
          for _ in range(24)]
names = {}
for n, (kind, flags) in sorted(PRE_TYPES.items()):
    names.setdefault((kind, tuple(sorted(flags.items()))), n)
out = {"texts": [t.decode("latin-1") for t in texts]}
with tempfile.TemporaryDirectory() as tmp:
    for n in sorted(names.values()):
        path = os.path.join(tmp, "v.gguf")
        open(path, "wb").write(with_pre(base, n))
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        out[n] = [list(llm.tokenize(t, add_bos=True, special=False)) for t in texts]
        del llm
with open(sys.argv[2], "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=True, separators=(",", ":"))
print(len(names), "names")

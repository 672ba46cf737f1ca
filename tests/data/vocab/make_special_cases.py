"""Writes special_cases.json: llama.cpp's (llama-cpp-python 0.3.36's) tokens for texts holding
special tokens, with and without add_special / parse_special, and llama_detokenize's text of
them (remove_special=False) for the BPE vocabularies.
    python make_special_cases.py DIR_WITH_GGUF_FILES special_cases.json"""
import ctypes
import json
import random
import sys

import llama_cpp

from jitgraph.models.tokenizer import load_tokenizer

VOCABS = ["llama-bpe", "qwen2", "gpt-2", "command-r", "deepseek-coder", "mpt", "phi-3",
          "llama-spm"]
BASE = ["Hello world", " it's  a\n\n test ", "\u00c4pfel \U0001f999 123456", "", " ",
        "a , b ' c 's"]


def detokenize(llm, ids, unparse):
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    buf = ctypes.create_string_buffer(1 << 16)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, unparse)
    return buf.raw[:n]


out = {}
for name in VOCABS:
    path = f"{sys.argv[1]}/ggml-vocab-{name}.gguf"
    tok = load_tokenizer(path)
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    specials = sorted({t for t, ty in zip(tok.tokens, tok.types) if ty in (2, 3, 4)})
    rng = random.Random(name)
    cases = []
    for _ in range(12):
        parts = []
        for _ in range(rng.randint(1, 4)):
            parts.append(rng.choice(BASE))
            if specials and rng.random() < 0.7:
                parts.append(rng.choice(specials) + rng.choice(["", " ", "  "]))
        text = "".join(parts)
        case = {"text": text}
        for add in (False, True):
            for parse in (False, True):
                case[f"ids_add{int(add)}_parse{int(parse)}"] = list(
                    llm.tokenize(text.encode(), add_bos=add, special=parse))
        ids = case["ids_add0_parse1"]
        if tok.__class__.__name__ == "BpeTokenizer":
            case["detok"] = detokenize(llm, ids, False).decode("latin-1")
            case["detok_special"] = detokenize(llm, ids, True).decode("latin-1")
        cases.append(case)
    out[name] = cases
with open(sys.argv[2], "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=True, indent=0)

"""Make the architecture test models and llama.cpp's outputs for them (tests/data/arch/).

Run once, by hand, where llama-cpp-python 0.3.36 is installed (the tests never run this):

    python bench/make_arch_fixtures.py LLAMA_CPP_SOURCE_DIR [OUT_DIR]

LLAMA_CPP_SOURCE_DIR: llama.cpp's source tree (llama-cpp-python's vendor/llama.cpp, from
`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`), for its
models/ggml-vocab-*.gguf. OUT_DIR defaults to tests/data/arch.

Per architecture it writes <name>.gguf, a small F32 model with random weights in the
architecture's llama.cpp layout (written with the gguf package alone, not with jitgraph) and a
real vocabulary cut to VOCAB tokens, and <name>-reference.json / <name>-logits.npy with what
llama.cpp computes for it:

- llama3: `llama` with LLaMA 3.x rope scaling (rope_freqs.weight, the factors of LLaMA 3.1's
  formula for an original context of 64) and the output tied to token_embd (LLaMA 3.2), the
  llama-bpe vocabulary;
- qwen2: `qwen2` with q/k/v biases and the output tied (the small Qwen2 models), the qwen2
  vocabulary;
- phi3: `phi3` with the fused attn_qkv and ffn_up (gate | up), its own output weight, the phi-3
  (SentencePiece) vocabulary.

The weights are N(0, 0.3) (norm weights 1 + N(0, 0.1)): logits are peaked, so greedy decoding
is not decided by rounding. The vocabulary keeps the file's first VOCAB - k tokens (the byte
tokens and the first merges), the merges among them, and its k special tokens (BOS/EOS) moved to
the end, their ids changed to match.

llama.cpp's outputs (default context parameters: F16 KV cache, CPU): `logits` (the logits of
every position of `prompt_ids`, evaluated as one batch: <name>-logits.npy, float32
[positions, vocab]), `greedy` (argmax continuations of two prompts, one token evaluated at a
time), `text` / `text_ids` (llama.cpp's tokenization of a passage, BOS as the vocabulary says)
and `perplexity` (llama.cpp's method, tools/perplexity: chunks of n_ctx tokens of text_ids, the
first token of each replaced by BOS when the vocabulary adds one, the second half of each chunk
scored, from llama.cpp's logits in float64).
"""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

VOCAB = 512
DIM, LAYERS, HEADS, KV_HEADS, FF, CTX = 64, 2, 4, 2, 128, 256
PPL_CTX, PPL_CHUNKS = 64, 4
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. "
        "resolved.\n\nFirst Citizen:\nFirst, you know Caius Marcius is chief enemy to the "
        "people.\n\nAll:\nWe know't, we know't.\n\nFirst Citizen:\nLet us kill him, and we'll "
        "have corn at our own price.\nIs't a verdict?\n\nAll:\nNo more talking on't; let it be "
        "done: away, away!\n\nSecond Citizen:\nOne word, good citizens.\n\nFirst Citizen:\nWe "
        "are accounted poor citizens, the patricians good.\nWhat authority surfeits on would "
        "relieve us: if they\nwould yield us but the superfluity, while it were\nwholesome, we "
        "might guess they relieved us humanely;\nbut they think we are too dear: the leanness "
        "that\nafflicts us, the object of our misery, is as an\ninventory to particularise their "
        "abundance; our\nsufferance is a gain to them Let us revenge this with\nour pikes, ere we "
        "become rakes: for the gods know I\nspeak this in hunger for bread, not in thirst for "
        "revenge.\n")

MODELS = {
    "llama3": dict(arch="llama", vocab="llama-bpe", base=500000.0, eps=1e-5, tied=True,
                   rope_freqs=True, specials={"bos": "<|begin_of_text|>",
                                              "eos": "<|end_of_text|>"}),
    "qwen2": dict(arch="qwen2", vocab="qwen2", base=1000000.0, eps=1e-6, tied=True,
                  bias=True, specials={"bos": "<|endoftext|>", "eos": "<|endoftext|>",
                                       "padding": "<|endoftext|>"}),
    "phi3": dict(arch="phi3", vocab="phi-3", base=10000.0, eps=1e-5, tied=False, fused=True,
                 specials={"eos": "<|endoftext|>", "padding": "<|endoftext|>"}),
}


def llama3_factors(head_dim, base, factor=8.0, low=1.0, high=4.0, original_ctx=64):
    """LLaMA 3.1's rope scaling factors (convert_hf_to_gguf.py's LlamaModel.generate_extra_
    tensors), one per rotated pair."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / base ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original_ctx / high:
            out.append(1.0)
        elif wavelen > original_ctx / low:
            out.append(factor)
        else:
            smooth = (original_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def cut_vocabulary(path, specials):
    """{tokenizer.* key: (value, type, item type)} of the vocabulary file, cut to VOCAB tokens:
    its first tokens, then the special tokens `specials` {role: text} at the end."""
    import gguf
    r = gguf.GGUFReader(path)
    f = {k: v for k, v in r.fields.items() if k.startswith("tokenizer.")}
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    scores = f["tokenizer.ggml.scores"].contents() if "tokenizer.ggml.scores" in f else None
    extra = list(dict.fromkeys(specials.values()))
    keep = VOCAB - len(extra)
    new_tokens = list(tokens[:keep]) + extra
    old_id = {t: i for i, t in enumerate(tokens)}
    new_types = list(types[:keep]) + [types[old_id[t]] for t in extra]
    T = gguf.GGUFValueType
    out = {"tokenizer.ggml.model": (f["tokenizer.ggml.model"].contents(), T.STRING, None),
           "tokenizer.ggml.tokens": (new_tokens, T.ARRAY, T.STRING),
           "tokenizer.ggml.token_type": (new_types, T.ARRAY, T.INT32)}
    if "tokenizer.ggml.pre" in f:
        out["tokenizer.ggml.pre"] = (f["tokenizer.ggml.pre"].contents(), T.STRING, None)
    if scores is not None:
        out["tokenizer.ggml.scores"] = (list(scores[:keep]) + [scores[old_id[t]] for t in extra],
                                        T.ARRAY, T.FLOAT32)
    if "tokenizer.ggml.merges" in f:
        have = set(new_tokens)
        merges = [m for m in f["tokenizer.ggml.merges"].contents()
                  if all(p in have for p in m.split(" ")) and m.replace(" ", "") in have]
        out["tokenizer.ggml.merges"] = (merges, T.ARRAY, T.STRING)
    for k in ("unknown_token_id",):
        key = f"tokenizer.ggml.{k}"
        if key in f:
            out[key] = (int(f[key].contents()), T.UINT32, None)
    for role, text in specials.items():
        out[f"tokenizer.ggml.{role}_token_id"] = (new_tokens.index(text), T.UINT32, None)
    for k in ("add_bos_token", "add_eos_token"):
        key = f"tokenizer.ggml.{k}"
        if key in f:
            out[key] = (bool(f[key].contents()), T.BOOL, None)
    return out


def weights(spec, rng):
    """{GGUF name: float32 array (numpy order)} in the architecture's layout."""
    hd = DIM // HEADS
    kv = hd * KV_HEADS

    def w(*shape):
        return rng.normal(0.0, 0.3, shape).astype(np.float32)

    def norm():
        return (1.0 + rng.normal(0.0, 0.1, DIM)).astype(np.float32)
    t = {"token_embd.weight": w(VOCAB, DIM)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm()
        if spec.get("fused"):
            t[p + "attn_qkv.weight"] = w(DIM + 2 * kv, DIM)
        else:
            t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"] = \
                w(DIM, DIM), w(kv, DIM), w(kv, DIM)
        if spec.get("bias"):
            t[p + "attn_q.bias"], t[p + "attn_k.bias"], t[p + "attn_v.bias"] = \
                w(DIM), w(kv), w(kv)
        t[p + "attn_output.weight"] = w(DIM, DIM)
        t[p + "ffn_norm.weight"] = norm()
        if spec.get("fused"):
            t[p + "ffn_up.weight"] = w(2 * FF, DIM)
        else:
            t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"] = w(FF, DIM), w(FF, DIM)
        t[p + "ffn_down.weight"] = w(DIM, FF)
    t["output_norm.weight"] = norm()
    if not spec["tied"]:
        t["output.weight"] = w(VOCAB, DIM)
    if spec.get("rope_freqs"):
        t["rope_freqs.weight"] = llama3_factors(hd, spec["base"])
    return t


def write_model(path, name, spec, vocab):
    import gguf
    a = spec["arch"]
    w = gguf.GGUFWriter(path, a)
    w.add_name(f"jitgraph test {name} (random weights)")
    w.add_file_type(0)
    for k, v in (("context_length", CTX), ("embedding_length", DIM), ("block_count", LAYERS),
                 ("feed_forward_length", FF), ("attention.head_count", HEADS),
                 ("attention.head_count_kv", KV_HEADS), ("rope.dimension_count", DIM // HEADS),
                 ("vocab_size", VOCAB)):
        w.add_uint32(f"{a}.{k}", v)
    w.add_float32(f"{a}.rope.freq_base", spec["base"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec["eps"])
    for k, (value, vtype, sub) in vocab.items():
        w.add_key_value(k, value, vtype, sub)
    for k, arr in weights(spec, np.random.default_rng(sum(map(ord, name)))).items():
        w.add_tensor(k, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp_greedy(llm, prompt, n):
    """llama.cpp's argmax continuation of `prompt` (ids), one token evaluated at a time."""
    llm.reset()
    llm.eval(list(prompt))
    new = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        new.append(tok)
        llm.eval([tok])
    return new


def llama_cpp_perplexity(llm, ids, n_ctx, bos):
    """llama.cpp's perplexity method (tools/perplexity) over whole chunks of n_ctx of `ids`: the
    first token of each chunk replaced by `bos` (None: kept), the second half scored, from
    llama.cpp's logits in float64."""
    first = n_ctx // 2
    nll = []
    for c in range(len(ids) // n_ctx):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        targets = chunk[first + 1:]
        if bos is not None:
            chunk[0] = bos
        llm.reset()
        llm.eval(chunk)
        lg = np.array(llm.scores[first:n_ctx - 1], np.float64)
        m = lg.max(axis=1)
        lse = np.log(np.exp(lg - m[:, None]).sum(axis=1)) + m
        nll.extend(lse - lg[np.arange(len(targets)), targets])
    return math.exp(float(np.mean(nll)))


def reference(path):
    """llama.cpp's outputs for the model at `path` (see the module docstring)."""
    import llama_cpp
    llm = llama_cpp.Llama(path, n_ctx=CTX, n_batch=CTX, logits_all=True, verbose=False,
                          seed=0)
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(
        llm.model)))
    bos = llm.token_bos()
    text_ids = llm.tokenize(TEXT.encode(), add_bos=add_bos, special=False)
    prompt = text_ids[:12]
    llm.reset()
    llm.eval(prompt)
    logits = np.array(llm.scores[:len(prompt)], np.float32)

    greedy = [{"prompt_ids": list(map(int, p)), "ids": llama_cpp_greedy(llm, p, 24)}
              for p in (text_ids[:5], text_ids[20:28])]
    need = PPL_CTX * PPL_CHUNKS
    if len(text_ids) < need:
        raise SystemExit(f"{path}: the text has {len(text_ids)} tokens, perplexity needs {need}")
    ppl = llama_cpp_perplexity(llm, text_ids[:need], PPL_CTX, bos if add_bos else None)
    return logits, {"llama_cpp_python": llama_cpp.__version__, "add_bos": add_bos,
                    "bos": int(bos), "eos": int(llm.token_eos()),
                    "prompt_ids": list(map(int, prompt)), "greedy": greedy, "text": TEXT,
                    "text_ids": list(map(int, text_ids)),
                    "perplexity": {"n_ctx": PPL_CTX, "chunks": PPL_CHUNKS,
                                   "bos": int(bos) if add_bos else None, "ppl": ppl}}


def main(argv):
    if len(argv) < 2:
        raise SystemExit(__doc__)
    src = argv[1]
    out = argv[2] if len(argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "tests",
                                                    "data", "arch")
    os.makedirs(out, exist_ok=True)
    for name, spec in MODELS.items():
        vocab = cut_vocabulary(os.path.join(src, "models", f"ggml-vocab-{spec['vocab']}.gguf"),
                               spec["specials"])
        path = os.path.join(out, f"{name}.gguf")
        write_model(path, name, spec, vocab)
        logits, ref = reference(path)
        ref = {"model": f"{name}.gguf", "architecture": spec["arch"],
               "vocabulary": f"ggml-vocab-{spec['vocab']}.gguf (cut to {VOCAB} tokens)", **ref}
        np.save(os.path.join(out, f"{name}-logits.npy"), logits)
        with open(os.path.join(out, f"{name}-reference.json"), "w") as f:
            json.dump(ref, f, indent=1)
        print(f"{name}: ppl {ref['perplexity']['ppl']:.4f}, greedy "
              f"{ref['greedy'][0]['ids'][:8]}, {len(ref['text_ids'])} text ids")


if __name__ == "__main__":
    main(sys.argv)

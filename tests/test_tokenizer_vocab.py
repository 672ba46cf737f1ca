"""The tokenizers against llama.cpp's own tokenizer test suite: every vocabulary of llama.cpp's
models/ggml-vocab-*.gguf set whose tokenizer.ggml.model is "gpt2" (BPE) or "llama" (SPM),
tokenized as tests/test-tokenizer-0.cpp does (no BOS, no special-token parsing) and compared id
for id with the .out files (tests/data/vocab/README.md says where each comes from)."""
import hashlib
import lzma
from pathlib import Path

import pytest

from jitgraph.models.tokenizer import Tokenizer, load_tokenizer

DATA = Path(__file__).parent / "data" / "vocab"
SEP = b"\n__ggml_vocab_test__\n"
# vocabularies with llama.cpp's own .inp/.out, and those whose .out llama-cpp-python wrote
CASES = ["llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "falcon", "gpt-2",
         "mpt", "starcoder", "refact", "command-r", "llama-spm", "phi-3", "aquila", "gpt-neox",
         "baichuan"]
QWEN35_SHA256 = "63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c"


def _qwen35(qwen2: bytes) -> bytes:
    """ggml-vocab-qwen35.gguf is ggml-vocab-qwen2.gguf with tokenizer.ggml.pre "qwen35"."""
    key = b"tokenizer.ggml.pre"
    i = qwen2.index(key) + len(key)
    assert qwen2[i:i + 17] == b"\x08\x00\x00\x00\x05" + b"\x00" * 7 + b"qwen2"
    return qwen2[:i + 4] + (6).to_bytes(8, "little") + b"qwen35" + qwen2[i + 17:]


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    """The committed vocabularies, decompressed into a temporary folder (qwen35 rebuilt from
    qwen2 and checked against the original file's SHA-256)."""
    out = tmp_path_factory.mktemp("vocab")
    for xz in sorted(DATA.glob("ggml-vocab-*.gguf.xz")):
        raw = lzma.decompress(xz.read_bytes())
        (out / xz.name[:-3]).write_bytes(raw)
        if xz.name == "ggml-vocab-qwen2.gguf.xz":
            q = _qwen35(raw)
            assert hashlib.sha256(q).hexdigest() == QWEN35_SHA256
            (out / "ggml-vocab-qwen35.gguf").write_bytes(q)
    return out


def read_cases(name):
    """(texts, expected ids) as test-tokenizer-0.cpp reads X.gguf.inp and X.gguf.out."""
    raw = (DATA / f"ggml-vocab-{name}.gguf.inp").read_bytes()
    texts, pos = [], 0
    while pos < len(raw):
        j = raw.find(SEP, pos)
        if j < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:j])
        pos = j + len(SEP)
    lines = (DATA / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    assert len(lines) >= len(texts)
    return texts, [[int(x) for x in ln.split()] for ln in lines[:len(texts)]]


_tokenizers = {}


def tokenizer(vocab_dir, name):
    if name not in _tokenizers:
        _tokenizers[name] = load_tokenizer(vocab_dir / f"ggml-vocab-{name}.gguf")
    return _tokenizers[name]


@pytest.mark.parametrize("name", CASES)
def test_llama_cpp_cases(vocab_dir, name):
    tok = tokenizer(vocab_dir, name)
    texts, want = read_cases(name)
    assert len(texts) >= 46
    bad = [(t, tok.encode(t, bos=False), w) for t, w in zip(texts, want)
           if tok.encode(t, bos=False) != w]
    assert not bad, f"{name}: {len(bad)} of {len(texts)} differ, first: {bad[0]}"
    # str input gives what its UTF-8 bytes give
    for t, w in zip(texts, want):
        s = t.decode("utf-8", "surrogatepass")
        assert tok.encode(s, bos=False) == w


def test_model_kinds(vocab_dir):
    from jitgraph.models.bpe import BpeTokenizer
    assert isinstance(tokenizer(vocab_dir, "llama-bpe"), BpeTokenizer)
    assert isinstance(tokenizer(vocab_dir, "llama-spm"), Tokenizer)
    # llama.cpp's add_bos: llama3's pre-tokenizer turns it on, the file's key wins
    assert tokenizer(vocab_dir, "llama-bpe").add_bos is True
    assert tokenizer(vocab_dir, "gpt-2").add_bos is False
    assert tokenizer(vocab_dir, "deepseek-llm").add_bos is True       # add_bos_token key
    assert tokenizer(vocab_dir, "command-r").bos_id == 5


def test_decode_roundtrip(vocab_dir):
    """Without llama.cpp's clean_spaces (qwen2, deepseek, command-r), decode(encode(t)) == t for
    every case; with it (gpt-2), its space clean-up applies."""
    for name in ("qwen2", "deepseek-llm", "command-r"):
        tok = tokenizer(vocab_dir, name)
        for t in read_cases(name)[0]:
            assert tok.decode_bytes(tok.encode(t, bos=False)) == t
    g = tokenizer(vocab_dir, "gpt-2")
    assert g.decode(g.encode("Hello , world ! It 's a ' test ' .", bos=False)) == \
        "Hello, world! It's a'test '."


def test_special_tokens(vocab_dir):
    tok = tokenizer(vocab_dir, "llama-bpe")
    bot, eot = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|eot_id|>")
    hello = tok.encode("Hello", bos=False)
    text = "<|begin_of_text|>Hello<|eot_id|>"
    assert tok.encode(text, bos=False, special=True) == [bot] + hello + [eot]
    # without special parsing the control tokens' text is plain text
    assert bot not in tok.encode(text, bos=False) and eot not in tok.encode(text, bos=False)
    assert tok.encode("Hello") == [tok.bos_id] + hello
    assert tok.encode("Hello", eos=True)[-1] == tok.eos_id
    assert tok.decode([bot] + hello) == "Hello"
    assert tok.decode([bot] + hello, special=True) == "<|begin_of_text|>Hello"


def test_unsupported(tmp_path):
    import gguf
    path = tmp_path / "v.gguf"
    for model, pre, words in (("gpt2", "kimi-k2", ("kimi-k2", str(path))),
                              ("bert", "default", ("bert", str(path)))):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model(model)
        w.add_tokenizer_pre(pre)
        w.add_token_list(["a", "b", "ab"])
        w.add_token_merges(["a b"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        with pytest.raises(ValueError) as e:
            load_tokenizer(path)
        msg = str(e.value)
        assert "\n" not in msg and all(x in msg for x in words), msg


def test_special_cases_match_llama_cpp(vocab_dir):
    """Texts holding special tokens, tokenized by llama.cpp with add_special and parse_special
    on and off, and (BPE) llama_detokenize's text (special_cases.json, see the README)."""
    import json
    cases = json.loads((DATA / "special_cases.json").read_text())
    assert len(cases) >= 8
    for name, items in cases.items():
        tok = tokenizer(vocab_dir, name)
        for c in items:
            for add in (0, 1):
                for parse in (0, 1):
                    got = tok.encode(c["text"], bos=bool(add) and tok.add_bos,
                                     eos=bool(add) and tok.add_eos, special=bool(parse))
                    assert got == c[f"ids_add{add}_parse{parse}"], (name, c["text"], add, parse)
            if "detok" in c:
                ids = c["ids_add0_parse1"]
                assert tok.decode_bytes(ids) == c["detok"].encode("latin-1"), (name, c["text"])
                assert tok.decode_bytes(ids, special=True) == \
                    c["detok_special"].encode("latin-1"), (name, c["text"])


def test_random_cases_match_llama_cpp(vocab_dir):
    """Random texts over every code point class the pre-tokenizers tell apart, and random bytes
    with invalid UTF-8, as llama.cpp tokenizes them (random_cases.json, see the README)."""
    import json
    data = json.loads((DATA / "random_cases.json").read_text())
    texts = [t.encode("latin-1") for t in data.pop("texts")]
    assert len(data) >= 12 and len(texts) >= 80
    for name, want in data.items():
        tok = tokenizer(vocab_dir, name)
        bad = [(t, w) for t, w in zip(texts, want) if tok.encode(t, bos=False) != w]
        assert not bad, f"{name}: {len(bad)} of {len(texts)} differ, first: {bad[0]}"


def test_tokenize_command(vocab_dir, tmp_path, capsys):
    """`jitgraph tokenize`: ids as llama.cpp's .out has them (BOS added as the vocabulary says),
    pieces with --json, special tokens with --special, one-line errors."""
    import json

    from jitgraph.cli import main
    texts, want = read_cases("llama-bpe")
    k = texts.index(b" Hello, world!")
    model = str(vocab_dir / "ggml-vocab-llama-bpe.gguf")
    assert main(["tokenize", model, "--prompt", " Hello, world!"]) == 0
    assert capsys.readouterr().out.strip() == str([128000] + want[k])
    f = tmp_path / "t.txt"
    f.write_bytes(texts[k] + b"<|eot_id|>")
    assert main(["tokenize", model, "--file", str(f), "--no-bos", "--special", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ids"] == want[k] + [128009]
    assert "".join(out["pieces"]) == " Hello, world!<|eot_id|>"
    spm = str(vocab_dir / "ggml-vocab-llama-spm.gguf")
    st, sw = read_cases("llama-spm")
    assert main(["tokenize", spm, "--prompt", st[k].decode(), "--no-bos"]) == 0
    assert capsys.readouterr().out.strip() == str(sw[k])
    assert main(["tokenize", str(tmp_path / "none.gguf"), "--prompt", "x"]) == 2
    assert main(["tokenize", str(f), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "none.gguf" in err[0] and "not a GGUF file" in err[1]


def test_write_gguf_roundtrip(vocab_dir, tmp_path):
    """A BPE vocabulary written with write_gguf (as write_llama does) reads back the same."""
    import gguf
    tok = tokenizer(vocab_dir, "qwen2")
    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    tok.write_gguf(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    back = load_tokenizer(path)
    assert (back.tokens, back.merges, back.types, back.pre, back.bos_id, back.eos_id) == \
        (tok.tokens, tok.merges, tok.types, tok.pre, tok.bos_id, tok.eos_id)
    texts, want = read_cases("qwen2")
    assert [back.encode(t, bos=False) for t in texts] == want


def test_truncated_file(vocab_dir, tmp_path):
    """A truncated vocabulary is a one-line error naming the file, whatever the cut."""
    from jitgraph.errors import ModelFormatError
    raw = (vocab_dir / "ggml-vocab-gpt-2.gguf").read_bytes()
    for cut in (10, 30, 200, 5000, len(raw) // 2, len(raw) - 1):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(raw[:cut])
        with pytest.raises(ModelFormatError) as e:
            load_tokenizer(p)
        assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_every_pre_tokenizer_type(vocab_dir):
    """One tokenizer.ggml.pre name of each pre-tokenizer type and flag set jitgraph reads, with
    gpt-2's vocabulary: llama.cpp's tokens, BOS as the name says (pre_cases.json, see the
    README)."""
    import json

    from jitgraph.formats.gguf_metadata import read_metadata
    from jitgraph.models.bpe import BpeTokenizer
    from jitgraph.models.pre_regexes import PRE_TYPES
    data = json.loads((DATA / "pre_cases.json").read_text())
    texts = [t.encode("latin-1") for t in data.pop("texts")]
    kinds = {k for k, _ in PRE_TYPES.values()}
    assert {PRE_TYPES[n][0] for n in data} == kinds and len(texts) >= 70
    md = read_metadata(vocab_dir / "ggml-vocab-gpt-2.gguf", "tokenizer.")
    for name, want in data.items():
        tok = BpeTokenizer.from_metadata({**md, "tokenizer.ggml.pre": name})
        got = [tok.encode(t, bos=tok.add_bos) for t in texts]
        bad = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
        assert not bad, f"{name}: {len(bad)} of {len(texts)} differ, first: {bad[0]}"


def test_mutated_files(tmp_path):
    """Random byte changes to a small vocabulary file: it loads, or the error is one line naming
    the file (a ValueError: ModelFormatError or a bad metadata value), never another exception."""
    import random

    import gguf
    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(["a", "b", "ab", "<|x|>"])
    w.add_token_merges(["a b"])
    w.add_token_types([1, 1, 1, 3])
    w.add_uint32("tokenizer.ggml.bos_token_id", 3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    raw = path.read_bytes()
    assert load_tokenizer(path).encode("abab", bos=False) == [2, 2]
    rng = random.Random(0)
    for k in range(2000):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        p = tmp_path / f"m{k}.gguf"
        p.write_bytes(bytes(b[:rng.randint(len(b) // 2, len(b))] if k % 3 == 0 else b))
        try:
            tok = load_tokenizer(p)
        except ValueError as e:
            assert str(p) in str(e) and "\n" not in str(e), str(e)
            continue
        tok.encode("ab <|x|> ba", bos=False, special=True)

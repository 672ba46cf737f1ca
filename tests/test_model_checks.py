"""A llama GGUF that loads is one llama.cpp would accept, and what it computes reaches the user
safely: the tokenizer agrees with token_embd, metadata has the types llama.cpp reads, token types
and special ids are in range, a tensor's data matches its declared type (ModelFormatError at
load, naming the file); NaN/Inf logits stop generate and perplexity with one line naming the
cause; model text on a terminal has its control characters escaped, piped it is byte-exact; a
closed stdout is one line.

The models are built here: a tiny llama (random weights, or weights that always predict one
chosen token) with a small SPM vocabulary learned by build_vocab, written with gguf's GGUFWriter
through the config's and the tokenizer's own metadata writers."""
import os
import pty
import subprocess
import sys

import gguf
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import cli
from jitgraph.cli import llama as llama_cli
from jitgraph.errors import ModelFormatError, NonFiniteError
from jitgraph.formats.gguf import gguf_writer
from jitgraph.models.generate import Generator
from jitgraph.models.llama import LlamaConfig, llama_forward, read_llama, write_llama
from jitgraph.models.lora import write_adapter
from jitgraph.models.perplexity import perplexity
from jitgraph.models.tokenizer import NORMAL, Tokenizer, build_vocab

V = gguf.GGUFValueType
TEXT = "the cat sat on the mat. the dog ate the log. a cat and a dog sat on a log.\n"
EVIL = "\x1b]0;owned\x07\x1b[2J"           # retitles an xterm window, then clears the screen
JITGRAPH = [sys.executable, "-c", "import sys; from jitgraph.cli import main; sys.exit(main())"]


@pytest.fixture(scope="module")
def vocab():
    """A small SPM vocabulary with one hostile token (last)."""
    t = build_vocab(TEXT, vocab_size=300)
    return Tokenizer(t.tokens + [EVIL], t.scores + [0.0], t.types + [NORMAL])


def config(n):
    return LlamaConfig(vocab=n, dim=32, layers=1, heads=2, ff=64, ctx=64)


@pytest.fixture(scope="module")
def params(vocab):
    return llama_forward(config(len(vocab)), 1, 1).init_params(seed=0)


def write_model(path, cfg, params, tok, kv=None, types=None):
    """A llama GGUF with the keys and tensors write_llama writes (the config's and tokenizer's
    metadata writers), then `kv` {key: (GGUFValueType, value[, array item type])} overriding or
    adding metadata, and `types` {tensor: GGML type} declared in place of F32 for tensors whose
    data stays F32."""
    with gguf_writer(path, "llama") as w:
        cfg.to_gguf(w)
        tok.write_gguf(w)
        for key, (vtype, value, *item) in (kv or {}).items():
            w.add_key_value(key, value, vtype, item[0] if item else None)
        for name in cfg.param_shapes():
            w.add_tensor(name, np.ascontiguousarray(params[name], np.float32),
                         raw_dtype=(types or {}).get(name))
    return str(path)


def rejected(path, *words):
    """read_llama raises ModelFormatError naming the file and `words`."""
    with pytest.raises(ModelFormatError) as e:
        read_llama(path)
    msg = str(e.value)
    assert str(path) in msg and len(msg.splitlines()) == 1, msg
    for w in words:
        assert w in msg, msg
    return msg


# ---- load checks ---------------------------------------------------------------------------
def test_the_helper_writes_what_write_llama_writes(tmp_path, vocab, params):
    cfg = config(len(vocab))
    a = write_model(tmp_path / "a.gguf", cfg, params, vocab)
    write_llama(tmp_path / "b.gguf", cfg, params, vocab)
    (ca, pa, ta), (cb, pb, tb) = read_llama(a), read_llama(tmp_path / "b.gguf")
    assert ca == cb == cfg and ta.tokens == tb.tokens == vocab.tokens
    assert all(np.array_equal(pa[k], pb[k]) and np.array_equal(pa[k], params[k]) for k in params)


@pytest.mark.parametrize("extra", [-5, 3])
def test_tokenizer_and_token_embd_must_agree(tmp_path, vocab, params, extra):
    n = len(vocab)
    if extra < 0:                         # fewer tokens than rows
        tok = Tokenizer(vocab.tokens[:extra], vocab.scores[:extra], vocab.types[:extra])
        cfg, p = config(n), params
    else:                                 # more: a model with fewer rows than the tokenizer
        tok = vocab
        cfg = config(n - extra)
        p = llama_forward(cfg, 1, 1).init_params(seed=0)
    path = write_model(tmp_path / "m.gguf", cfg, p, tok)
    rejected(path, f"{len(tok)} tokens", f"{cfg.vocab} rows", "token_embd.weight")


@pytest.mark.parametrize("key, value, words", [
    ("llama.attention.head_count", (V.STRING, "2"), ["head_count", "STRING '2'", "integer"]),
    ("llama.attention.head_count", (V.FLOAT32, 2.5), ["head_count", "FLOAT32 2.5", "integer"]),
    ("llama.block_count", (V.BOOL, True), ["block_count", "BOOL", "integer"]),
    ("llama.embedding_length", (V.ARRAY, [32], V.UINT32), ["embedding_length", "an array"]),
    ("llama.attention.layer_norm_rms_epsilon", (V.STRING, "1e-5"),
     ["layer_norm_rms_epsilon", "STRING", "a number"]),
    ("llama.rope.freq_base", (V.FLOAT32, float("inf")), ["rope_base inf", "finite"]),
    ("tokenizer.ggml.bos_token_id", (V.FLOAT32, 1.0), ["bos_token_id", "integer"]),
    ("tokenizer.ggml.add_bos_token", (V.STRING, "yes"), ["add_bos_token", "a bool"]),
    ("tokenizer.ggml.token_type", (V.ARRAY, [1.0] * 3, V.FLOAT32),
     ["token_type", "array of FLOAT32", "integers"]),
])
def test_metadata_of_the_wrong_type(tmp_path, vocab, params, key, value, words):
    path = write_model(tmp_path / "m.gguf", config(len(vocab)), params, vocab, kv={key: value})
    rejected(path, *words)


@pytest.mark.parametrize("bad", [7, 255, -1])
def test_token_types_outside_llama_cpp_range(tmp_path, vocab, params, bad):
    types = list(vocab.types)
    types[5] = bad
    path = write_model(tmp_path / "m.gguf", config(len(vocab)), params, vocab,
                       kv={"tokenizer.ggml.token_type": (V.ARRAY, types, V.INT32)})
    rejected(path, "token 5", f"type {bad}", "0..6")


@pytest.mark.parametrize("key, value", [("bos_token_id", 300), ("eos_token_id", 2 ** 32 - 1),
                                        ("unknown_token_id", 300)])
def test_special_ids_outside_the_vocabulary(tmp_path, vocab, params, key, value):
    path = write_model(tmp_path / "m.gguf", config(len(vocab)), params, vocab,
                       kv={f"tokenizer.ggml.{key}": (V.UINT32, value)})
    rejected(path, f"tokenizer.ggml.{key} {value}", f"vocabulary of {len(vocab)} tokens")


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.ffn_gate.weight",
                                  "output.weight"])         # first, middle, last in the file
def test_f32_tensor_labelled_q4_0(tmp_path, vocab, params, name):
    """The data is F32 (4 bytes a value), the header says Q4_0 (18 bytes per 32 values): reading
    it as Q4_0 gave garbage and a numpy overflow warning."""
    path = write_model(tmp_path / "m.gguf", config(len(vocab)), params, vocab,
                       types={name: gguf.GGMLQuantizationType.Q4_0})
    n = params[name].size
    rejected(path, name, f"Q4_0 {list(reversed(params[name].shape))} is {n // 32 * 18} bytes",
             "declared type or shape is wrong")


# ---- the commands refuse such a model before compiling anything ------------------------------
@pytest.fixture
def no_compile(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("compiled before the error was found")
    monkeypatch.setattr(jg, "compile", fail)
    monkeypatch.setattr("jitgraph.compiler.compile", fail)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT * 12)
    return str(path)


@pytest.mark.parametrize("cmd", ["generate", "perplexity", "finetune"])
def test_commands_refuse_a_mismatched_tokenizer(tmp_path, vocab, params, text_file, capsys,
                                                no_compile, cmd):
    short = Tokenizer(vocab.tokens[:-5], vocab.scores[:-5], vocab.types[:-5])
    path = write_model(tmp_path / "m.gguf", config(len(vocab)), params, short)
    argv = {"generate": ["generate", path, "--prompt", "the cat", "-n", "4"],
            "perplexity": ["perplexity", path, "--text", text_file, "--split", "all", "--ctx",
                           "16"],
            "finetune": ["finetune", path, "--text", text_file, "--lora-rank", "2", "--ctx",
                         "16", "--steps", "1", "--out", str(tmp_path / "out.gguf")]}[cmd]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and path in err, err
    assert f"{len(short)} tokens" in err and f"{len(vocab)} rows" in err, err


# ---- NaN / Inf logits ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter(vocab, params):
    """A finite rank-2 adapter on attn_q and attn_v."""
    rng = np.random.default_rng(1)
    ad = {}
    for w in ("blk.0.attn_q.weight", "blk.0.attn_v.weight"):
        out, inn = params[w].shape
        ad[w + ".lora_a"] = rng.normal(0, 0.1, (2, inn)).astype(np.float32)
        ad[w + ".lora_b"] = rng.normal(0, 0.1, (out, 2)).astype(np.float32)
    return ad


def poisoned(params, name, value):
    p = dict(params)
    p[name] = p[name].copy()
    p[name].flat[7] = value
    return p


@pytest.mark.parametrize("case", ["nan_weight", "inf_weight", "nan_adapter", "lora_scale"])
@pytest.mark.parametrize("cmd", ["generate", "perplexity"])
def test_non_finite_logits_are_said_not_printed(tmp_path, vocab, params, adapter, text_file,
                                                capsys, cmd, case):
    cfg = config(len(vocab))
    p, ad, scale = params, adapter, "1"
    if case in ("nan_weight", "inf_weight"):
        p = poisoned(params, "blk.0.ffn_up.weight", np.nan if case == "nan_weight" else np.inf)
        words = ["the model's weight blk.0.ffn_up.weight holds",
                 "NaN" if case == "nan_weight" else "Inf"]
    elif case == "nan_adapter":
        ad = poisoned(adapter, "blk.0.attn_v.weight.lora_b", np.nan)
        words = ["the LoRA adapter's blk.0.attn_v.weight.lora_b holds NaN"]
    else:
        scale = "1e30"
        words = ["scale 1e+30", "--lora-scale"]
    model = str(tmp_path / "m.gguf")
    write_llama(model, cfg, p, vocab)
    write_adapter(tmp_path / "a.gguf", cfg, ad, alpha=2.0)
    lora = ["--lora", str(tmp_path / "a.gguf"), "--lora-scale", scale]
    if cmd == "generate":
        argv = ["generate", model, "--prompt", "the cat", "-n", "5", "--temp", "0", "--chunk",
                "1", "--ctx", "32", *lora]
    else:       # --kv-f16 (llama.cpp's default F16 KV cache): a V scaled by 1e30 overflows it;
        # in float32 rms_norm scales the overflowing stream to zeros (finite, uniform logits)
        argv = ["perplexity", model, "--text", text_file, "--split", "all", "--ctx", "16",
                "--batch-size", "2", "--kv-f16", *lora]
    if case == "lora_scale":              # the control: the same adapter at scale 1 runs
        assert cli.main([a if a != "1e30" else "1" for a in argv]) == 0
        capsys.readouterr()
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    err = err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"jitgraph {cmd}: error: {cmd}: the logits"), err
    assert "NaN/Inf" in err, err
    for w in words:
        assert w in err, err
    if cmd == "generate":                 # the prompt, then no token: the error comes first
        assert out.endswith("the cat\n"), repr(out)
    else:
        assert "PPL" not in out, out


def test_huge_finite_logits_do_not_overflow_perplexity(vocab, params):
    """Logits of ~1e30 are finite, but their PPL (exp of the mean NLL) is not a float: one line,
    not an OverflowError traceback. The reference: a finite PPL for the same model unscaled."""
    cfg = config(len(vocab))
    ids = vocab.encode(TEXT * 12)
    assert np.isfinite(perplexity((cfg, params, vocab), ids, n_ctx=16, batch=2).ppl)
    huge = dict(params)
    huge["output.weight"] = params["output.weight"] * np.float32(1e30)
    with pytest.raises(NonFiniteError,
                       match=r"PPL overflows .*largest \|weight\| is [0-9.]+e\+28, in output"):
        perplexity((cfg, huge, vocab), ids, n_ctx=16, batch=2)


def test_generator_api_raises_non_finite_error(vocab, params):
    cfg = config(len(vocab))
    gen = Generator((cfg, poisoned(params, "output_norm.weight", np.nan), vocab), ctx=32,
                    chunk=1)
    with pytest.raises(NonFiniteError, match="generate: the logits after the prompt are NaN/Inf: "
                                             "the model's weight output_norm.weight holds NaN"):
        gen.generate("the cat", 3)


# ---- terminal safety -------------------------------------------------------------------------
def parrot(cfg, token):
    """Weights under which every position predicts `token`: the layers add nothing (zero output
    projections), every embedding is the ones vector, and only `token`'s output row is non-zero
    (its logit 32, every other 0)."""
    p = {k: np.ones(s, np.float32) for k, s in cfg.param_shapes().items()}
    for k in p:
        if k.endswith(("attn_output.weight", "ffn_down.weight")) or k == "output.weight":
            p[k][:] = 0
    p["output.weight"][token] = 1
    return p


def run_cli(args, stdout):
    return subprocess.run(JITGRAPH + args, stdout=stdout, stderr=subprocess.PIPE, timeout=300,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"))


def read_all(fd):
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:                    # EIO: the child side is closed
            break
        if not chunk:
            break
        out += chunk
    return out


def test_control_characters_are_escaped_on_a_terminal_only(tmp_path, vocab):
    cfg = config(len(vocab))
    evil = len(vocab) - 1
    model = str(tmp_path / "m.gguf")
    write_llama(model, cfg, parrot(cfg, evil), vocab)
    prompt = "hi\x1b[31m red\x9b\tX"
    args = ["generate", model, "--prompt", prompt, "-n", "3", "--temp", "0", "--chunk", "1",
            "--ctx", "32"]
    piped = run_cli(args, subprocess.PIPE)
    assert piped.returncode == 0, piped.stderr.decode()
    assert piped.stdout == (prompt + EVIL * 3 + "\n").encode()     # byte-exact through a pipe
    master, slave = pty.openpty()
    try:
        tty = run_cli(args, slave)
        os.close(slave)
        slave = None
        shown = read_all(master)
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)
    assert tty.returncode == 0, tty.stderr.decode()
    shown = shown.replace(b"\r\n", b"\n")
    escaped = "\\x1b]0;owned\\x07\\x1b[2J"
    assert shown.decode() == "hi\\x1b[31m red\\x9b\tX" + escaped * 3 + "\n", shown
    assert not any(b < 0x20 and b not in b"\t\n" for b in shown), shown


def test_terminal_escapes_cover_c0_del_c1_and_undecodable_bytes():
    text = "".join(map(chr, range(0xA1))) + "\u2581\u00e9"
    shown = llama_cli._for_terminal(text)
    assert shown == "".join(c if c in "\t\n" or 0x20 <= ord(c) < 0x7F or ord(c) >= 0xA0
                            else f"\\x{ord(c):02x}" for c in text)
    raw = b"a\x9b\xc3(".decode("utf-8", "surrogateescape")     # argv's undecodable bytes
    assert llama_cli._for_terminal(raw) == "a\\x9b\\xc3("


@pytest.mark.parametrize("cmd", ["generate", "perplexity"])
def test_closed_stdout_is_one_line(tmp_path, vocab, params, text_file, cmd):
    model = str(tmp_path / "m.gguf")
    write_llama(model, config(len(vocab)), params, vocab)
    args = {"generate": ["--prompt", "the cat", "-n", "3"],
            "perplexity": ["--text", text_file, "--split", "all", "--ctx", "16", "--json"]}[cmd]
    r = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *JITGRAPH, cmd, model, *args],
                       stderr=subprocess.PIPE, timeout=300)
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert "standard output is closed" in err and "Traceback" not in err, err

"""Perplexity with llama.cpp's method (jitgraph.models.perplexity): llama.cpp's value for stories260K on
the held-out tail of tiny shakespeare, the method against an independent float64 numpy
computation on a tiny random model, and the byte-split convention."""
import math

import numpy as np
import pytest

import jitgraph.compiler
from jitgraph.models.llama import LlamaConfig, llama_forward
from jitgraph.models.perplexity import perplexity, split_text
from jitgraph.models.reference import llama_logits
from jitgraph.models.tokenizer import build_vocab


# ---- llama.cpp's value --------------------------------------------------------------------------
def test_stories260k_tinyshakespeare_matches_llama_cpp(testdata):
    """llama-perplexity -m stories260K.gguf -f <last 10 % of tinyshakespeare.txt> -c 128:
    547 chunks, Final estimate: PPL = 156.82. tests/data holds exactly that tail."""
    text = split_text(testdata.shakespeare_tail, "all")
    # in plain f32 (6x faster here than rounding K, V, q and the probabilities to f16 as
    # llama.cpp's F16 KV cache does): 156.824; with kv_f16=True (the default) 156.819
    r = perplexity(testdata.stories, text, n_ctx=128, batch=16, kv_f16=False)
    assert (r.chunks, r.scored) == (547, 34461)
    assert len(r.running) == 547 and r.running[-1] == pytest.approx(r.ppl, rel=1e-12)
    assert abs(r.ppl / 156.82 - 1) < 0.005, r.ppl
    assert 0 < r.uncertainty < 0.05 * r.ppl


def test_the_perplexity_command(testdata, capsys):
    import json

    from jitgraph import cli
    model = str(testdata.stories)
    assert cli.main(["perplexity", model, "--text", str(testdata.shakespeare_tail), "--split",
                     "all", "--ctx", "128", "--batch-size", "16", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["chunks"], out["scored_tokens"]) == (547, 34461)
    assert abs(out["perplexity"] / 156.82 - 1) < 0.005
    assert cli.main(["perplexity", model, "--quiet"]) == 2             # no --text
    assert "--text FILE is required" in capsys.readouterr().err


# ---- the method against numpy -----------------------------------------------------------------
def numpy_perplexity(cfg, params, ids, n_ctx, bos):
    """llama.cpp's perplexity() loop, written out: (ppl, uncertainty, running, count)."""
    first, nll, nll2, count, running = n_ctx // 2, 0.0, 0.0, 0, []
    for c in range(len(ids) // n_ctx):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        target = list(chunk)
        chunk[0] = bos
        logits = llama_logits(cfg, params, chunk)
        for i in range(first, n_ctx - 1):
            lp = logits[i] - logits[i].max()
            v = math.log(np.exp(lp).sum()) - lp[target[i + 1]]
            nll, nll2, count = nll + v, nll2 + v * v, count + 1
        running.append(math.exp(nll / count))
    mean = nll / count
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt((nll2 / count - mean * mean) / (count - 1)), running, count


@pytest.fixture(scope="module")
def tiny():
    text = ("Once upon a time there was a little robot. It liked to count the stars, and every "
            "night it counted again, because the stars moved. ") * 6 + "The end."
    tok = build_vocab(text, vocab_size=300)
    cfg = LlamaConfig(vocab=len(tok), dim=16, layers=2, heads=4, kv_heads=2, ff=24, ctx=64,
                      rope_base=500.0)
    rng = np.random.default_rng(0)
    params = {k: (v + rng.normal(0, 0.5, v.shape)).astype(np.float32)
              for k, v in llama_forward(cfg, 1, 1).init_params(0).items()}
    return cfg, params, tok, text


def test_method_matches_numpy(tiny, monkeypatch):
    cfg, params, tok, text = tiny
    n_ctx, batch = 16, 5
    ids = tok.encode(text)                                   # BOS once, at the start
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    n_chunk = len(ids) // n_ctx
    assert n_chunk >= 4 and n_chunk % batch and len(ids) % n_ctx   # padded batch, unused tail
    calls = []
    real = jitgraph.compiler.compile
    monkeypatch.setattr(jitgraph.compiler, "compile",
                        lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    seen = []
    r = perplexity((cfg, params, tok), text, n_ctx=n_ctx, batch=batch, kv_f16=False,
                   progress=lambda *a: seen.append(a))
    assert len(calls) == 1                                   # one program, [batch, n_ctx]
    assert [a[:2] for a in seen] == [(min(k + batch, n_chunk), n_chunk)
                                     for k in range(0, n_chunk, batch)]
    ppl, unc, running, count = numpy_perplexity(cfg, params, ids, n_ctx, tok.bos_id)
    assert (r.chunks, r.scored, r.n_tokens) == (n_chunk, count, len(ids))
    assert count == n_chunk * (n_ctx - 1 - n_ctx // 2)
    assert r.ppl == pytest.approx(ppl, rel=2e-5)
    assert r.uncertainty == pytest.approx(unc, rel=1e-3)
    np.testing.assert_allclose(r.running, running, rtol=2e-5)
    assert 1 < ppl < cfg.vocab * 10 and unc > 0
    assert r.log().splitlines()[-1] == f"Final estimate: PPL = {r.ppl:.4f} +/- " \
                                       f"{r.uncertainty:.5f}"
    # token ids, bytes or str: the same; llama.cpp's F16 KV cache changes it only a little
    r2 = perplexity((cfg, params, tok), ids, n_ctx=n_ctx, batch=n_chunk, kv_f16=False)
    assert r2.ppl == pytest.approx(r.ppl, rel=1e-5) and r2.running == pytest.approx(r.running)
    r3 = perplexity((cfg, params, tok), text.encode(), n_ctx=n_ctx, batch=batch)
    assert r3.ppl == pytest.approx(ppl, rel=2e-3) and r3.n_tokens == len(ids)


def test_errors(tiny):
    cfg, params, tok, text = tiny
    n = len(tok.encode(text[:60]))
    with pytest.raises(ValueError, match=rf"only {n} tokens; n_ctx 64 needs at least 128"):
        perplexity((cfg, params, tok), text[:60], n_ctx=64)
    with pytest.raises(ValueError, match="n_ctx 128 is larger than the model's context length 64"):
        perplexity((cfg, params, tok), text, n_ctx=128)
    with pytest.raises(ValueError, match="n_ctx 2 must be >= 3"):
        perplexity((cfg, params, tok), text, n_ctx=2)
    with pytest.raises(ValueError, match="no tokenizer"):
        perplexity((cfg, params), text, n_ctx=16)


# ---- the split convention -----------------------------------------------------------------------
def test_split_text_bytes(tmp_path):
    data = b"x" * 89 + "\u65e5".encode() + b"y" * 8          # 100 bytes, e6 97 a5 at 89..91
    assert len(data) == 100 and int(0.9 * len(data)) == 90
    assert split_text(data, errors=None) == data[90:] == b"\x97\xa5" + b"y" * 8
    assert split_text(data, "head:0.1", errors=None) == data[:90]
    # Python's "replace": one U+FFFD per invalid byte here (stray continuation bytes), one for
    # the cut-off lead byte
    assert split_text(data) == "\ufffd\ufffd" + "y" * 8
    assert split_text(data, "head:0.1") == "x" * 89 + "\ufffd"
    assert split_text(data, "tail:0.1", errors="ignore") == "y" * 8
    with pytest.raises(UnicodeDecodeError):
        split_text(data, errors="strict")
    assert split_text(data, "tail:0.12") == "x" + "\u65e5" + "y" * 8   # cut at byte 88
    assert split_text(data, "all") == data.decode()
    (tmp_path / "t.txt").write_bytes(data)
    assert split_text(tmp_path / "t.txt") == split_text(data)
    for bad in ("tail", "tail:0", "tail:1", "mid:0.1", "head:x"):
        with pytest.raises(ValueError, match="spec"):
            split_text(data, bad)


def test_split_text_shakespeare(testdata, tmp_path):
    """tests/data's tail is the held-out split of tiny shakespeare (1,115,394 bytes, cut at
    int(0.9 * size) = 1,003,854): in a file of that size ending in it, the default split is
    exactly the tail, and head + tail is the file."""
    tail = testdata.shakespeare_tail.read_bytes()
    assert len(tail) == 1115394 - 1003854
    data = b"\n" * 1003854 + tail
    (tmp_path / "t.txt").write_bytes(data)
    assert split_text(tmp_path / "t.txt") == tail.decode()
    assert split_text(data, "head:0.1") + split_text(data) == data.decode()

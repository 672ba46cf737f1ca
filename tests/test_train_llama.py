"""`jitgraph train llama` (jitgraph/cli/llama_train.py) and the text windows it trains on
(jitgraph/models/text.py): the split, the byte vocabulary, windows from the right part only,
accumulation == one large batch, loss going down on the shipped corpus, the written GGUF, bit-exact
resume after Ctrl-C, option errors, `dump llama`."""
import json
import math
import os
import signal

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import cli, optim
from jitgraph.cli import llama_train
from jitgraph.models.llama import LlamaConfig, llama_forward, read_llama
from jitgraph.models.perplexity import split_text
from jitgraph.models.text import (Windows, WindowSampler, byte_vocab, fixed_starts, read_corpus,
                                  shipped_corpus, split_bytes, tokenize_split)

TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--ctx", "16", "--batch-size", "4",
        "--quiet"]


def _last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ---- text: split, vocabulary, windows (no compile) ---------------------------------------------
def test_split_is_perplexitys_byte_split(tmp_path):
    data = "h\u00e9llo w\u00f6rld, ".encode() * 37 + b"end"
    head, tail = split_bytes(data)
    cut = int(0.9 * len(data))
    assert head == data[:cut] and tail == data[cut:]
    p = tmp_path / "t.txt"
    p.write_bytes(data)
    assert tail == split_text(str(p), "tail:0.1", errors=None)
    assert read_corpus(None) == open(shipped_corpus(), "rb").read()
    assert 100_000 < len(read_corpus(None)) < 400_000


def test_byte_vocab_one_token_per_byte_and_round_trip(tmp_path):
    tok = byte_vocab()
    text = "ROMEO:\nO, speak again, bright angel!\t\u00e9\u4e2d \U0001f600 ~{}"
    raw = text.encode()
    ids = tok.encode(text, bos=False)
    assert len(ids) == len(raw) + 1              # + the leading space llama.cpp's prefix adds
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, bos=True)) == text
    # the pieces: every byte is its own token ("\u2581" for a space)
    pieces = [tok.token_to_piece(i) for i in ids[1:]]
    assert pieces == [bytes([b]) for b in raw]
    # and it survives the GGUF tokenizer metadata (what llama.cpp reads)
    cfg = LlamaConfig(vocab=len(tok), dim=8, layers=1, heads=2, ctx=16)
    params = llama_forward(cfg, 1, 4).init_params(0)
    from jitgraph.models.llama import write_llama
    write_llama(tmp_path / "m.gguf", cfg, params, tok)
    tok2 = read_llama(tmp_path / "m.gguf")[2]
    assert tok2.encode(text) == tok.encode(text) and tok2.tokens == tok.tokens


def test_windows_come_only_from_their_split():
    # the training part is all 'a'..'m', the held-out part all 'N'..'Z': a window crossing the
    # cut would hold both
    data = bytes(np.random.default_rng(0).integers(ord("a"), ord("m"), 900).astype(np.uint8)) + \
        bytes(np.random.default_rng(1).integers(ord("N"), ord("Z"), 100).astype(np.uint8))
    tok = byte_vocab()
    split = tokenize_split(data, tok)
    assert split.cut == 900 and split.size == 1000
    assert tok.decode(split.train.tolist()) == data[:900].decode()
    assert tok.decode(split.val.tolist()) == data[900:].decode()
    lower = {tok.token_to_id(chr(c)) for c in range(ord("a"), ord("m"))}
    upper = {tok.token_to_id(chr(c)) for c in range(ord("N"), ord("Z"))}
    train, val = Windows(split.train, 17), Windows(split.val, 17)
    assert train.n_starts == len(split.train) - 16
    sampler = WindowSampler(train, 64, seed=3)
    seen = set()
    for _ in range(20):
        starts = sampler.next_starts()
        assert starts.min() >= 0 and starts.max() <= train.n_starts - 1
        x, y = train.batch(starts)
        np.testing.assert_array_equal(x, split.train[starts[:, None] + np.arange(16)])
        np.testing.assert_array_equal(y, split.train[starts[:, None] + np.arange(1, 17)])
        seen |= set(np.unique(x)) | set(np.unique(y))
    assert not seen & upper                          # (the first window may hold the "\u2581")
    vs = fixed_starts(val, 4, 20, seed=3)
    assert vs.shape == (20, 4)
    np.testing.assert_array_equal(vs, fixed_starts(val, 4, 20, seed=3))   # fixed per seed
    for s in vs:
        x, y = val.batch(s)
        assert not (set(np.unique(x)) | set(np.unique(y))) & lower
    with pytest.raises(ValueError, match="fewer than one window"):
        Windows(split.val, 200)


def test_sampler_state_continues_the_same_batches():
    w = Windows(np.arange(1000, dtype=np.int32), 9)
    a = WindowSampler(w, 5, seed=7)
    first = [a.next_starts() for _ in range(3)]
    state = json.loads(json.dumps(a.state))            # through a checkpoint's JSON
    rest = [a.next_starts() for _ in range(3)]
    b = WindowSampler(w, 5, seed=7)
    np.testing.assert_array_equal(np.concatenate(first), np.concatenate(
        [b.next_starts() for _ in range(3)]))
    c = WindowSampler(w, 5, seed=0)
    c.state = state
    np.testing.assert_array_equal(np.concatenate(rest), np.concatenate(
        [c.next_starts() for _ in range(3)]))


@pytest.mark.parametrize("text,want", [("sqrt", "sqrt"), ("budget:64M", f"budget:{64 << 20}"),
                                       ("budget:1000", "budget:1000"), ("budget:0.5", "budget:0.5"),
                                       ("none", None)])
def test_recompute_spec(text, want):
    assert llama_train.recompute_spec(text) == want


# ---- option errors: each named, before anything compiles ---------------------------------------
@pytest.fixture
def no_compile(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("compiled before the options were checked")
    monkeypatch.setattr(jg, "compile", fail)


@pytest.mark.parametrize("argv,words", [
    (["--recompute", "half"], ["argument --recompute", "sqrt", "budget:", "'half'"]),
    (["--recompute", "budget:0"], ["argument --recompute", "budget:0"]),
    (["--vocab", "100"], ["argument --vocab", ">= 260"]),
    (["--logical-batch", "6"], ["argument --logical-batch", "multiple of --batch-size 4"]),
    (["--ctx", "1"], ["argument --ctx", ">= 2"]),
])
def test_bad_options_are_usage_errors(capsys, no_compile, argv, words):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "llama", *TINY, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,words", [
    (["--ctx", "4000"], ["--ctx 4000", "fewer than one window", "held-out"]),
    (["--dim", "31"], ["--dim 31", "multiple of --heads 2"]),
    (["--dim", "36", "--heads", "4"], ["head size 9", "even"]),
    (["--kv-heads", "3"], ["--kv-heads 3", "--heads 2"]),
])
def test_sizes_checked_against_the_text(capsys, no_compile, argv, words, tmp_path):
    text = tmp_path / "small.txt"
    text.write_bytes(b"to be or not to be, that is the question. " * 500)   # 21 KB
    assert cli.main(["train", "llama", *TINY, "--text", str(text), *argv]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_output_paths_checked_first(capsys, no_compile, tmp_path):
    assert cli.main(["train", "llama", *TINY, "--out", str(tmp_path / "no" / "m.gguf")]) == 2
    assert "--out" in capsys.readouterr().err
    p = str(tmp_path / "same.gguf")
    assert cli.main(["train", "llama", *TINY, "--out", p, "--checkpoint", p]) == 2
    assert "same file" in capsys.readouterr().err
    assert cli.main(["train", "llama", *TINY, "--text", str(tmp_path / "none.txt")]) == 2
    assert "--text" in capsys.readouterr().err


# ---- accumulation == one batch of k * B ---------------------------------------------------------
def test_accumulated_micro_batches_equal_one_large_batch():
    cfg = LlamaConfig(vocab=40, dim=16, layers=1, heads=2, ctx=8)
    k, b, s = 3, 2, 8
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 40, (k * b, s + 1)).astype(np.int32)
    pos = np.arange(s, dtype=np.int32)
    opt = dict(lr=0.1)
    small = jg.compile(llama_forward(cfg, b, s, labels=True), loss="loss",
                       optimizer=optim.SGD(accumulate=k, **opt), seed=5)
    big = jg.compile(llama_forward(cfg, k * b, s, labels=True), loss="loss",
                     optimizer=optim.SGD(**opt), seed=5)
    p0 = {n: np.array(v) for n, v in big.params.items()}
    losses = [float(small.step(tokens=toks[i * b:(i + 1) * b, :-1], pos=pos,
                               labels=toks[i * b:(i + 1) * b, 1:])["loss"]) for i in range(k)]
    loss = float(big.step(tokens=toks[:, :-1], pos=pos, labels=toks[:, 1:])["loss"])
    assert np.mean(losses) == pytest.approx(loss, rel=1e-6)
    for n in p0:
        moved = np.abs(np.asarray(big.params[n]) - p0[n]).max()
        assert moved > 0, n
        np.testing.assert_allclose(small.params[n], big.params[n], rtol=1e-5,
                                   atol=1e-6 * max(moved, 1e-3), err_msg=n)


# ---- the command -------------------------------------------------------------------------------
@pytest.fixture
def trainers(monkeypatch):
    """The LMTrainers `train llama` makes while the test runs, in order."""
    made = []

    class Recording(llama_train.LMTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(llama_train, "LMTrainer", Recording)
    return made


@pytest.mark.slow
def test_train_llama_learns_and_writes_a_model_that_reads_back(tmp_path, capsys, trainers):
    out = tmp_path / "m.gguf"
    assert cli.main(["train", "llama", *TINY, "--steps", "40", "--eval-every", "10",
                     "--lr", "3e-3", "--out", str(out), "--json"]) == 0
    res = _last_json(capsys)
    curve = res["curve"]
    assert [c["step"] for c in curve] == [10, 20, 30, 40]
    assert curve[-1]["val"] < curve[0]["val"] - 0.5, curve
    assert curve[-1]["val"] < math.log(354) - 1.0               # well below uniform
    assert res["steps"] == 40 and res["vocab"] == 354 and res["ms_per_step"] > 0
    assert res["tokens_per_second"] == pytest.approx(4 * 16 * 1e3 / res["ms_per_step"])

    cfg, params, tok = read_llama(out)
    assert (cfg.dim, cfg.layers, cfg.heads, cfg.ctx, cfg.vocab) == (32, 1, 2, 16, 354)
    assert tok.tokens == byte_vocab().tokens
    trainer = trainers[0]
    for k, v in trainer.program.params.items():
        np.testing.assert_array_equal(params[k], v, err_msg=k)
    x, y = trainer.val.batch(trainer.val_starts[0])
    want = np.array(trainer.evaluator.run(tokens=x, pos=trainer.pos, labels=y)["logits"])
    fresh = jg.compile(llama_forward(cfg, 4, 16))
    for k, v in params.items():
        fresh.params[k] = v
    np.testing.assert_array_equal(fresh.step(tokens=x, pos=trainer.pos)["logits"], want)
    ref = jg.interp.run(llama_forward(cfg, 4, 16), {"tokens": x, "pos": trainer.pos}, params)
    np.testing.assert_allclose(want, ref["logits"], rtol=1e-4, atol=1e-4)


def test_val_batches_sets_the_validation_batches(tmp_path, capsys, trainers):
    """--val-batches N: each validation is the mean loss of N fixed held-out batches (the first
    N of the default 20: the same draw), checked against a fresh forward program."""
    assert cli.main(["train", "llama", *TINY, "--steps", "2", "--val-batches", "3",
                     "--json"]) == 0
    res = _last_json(capsys)
    trainer = trainers[0]
    assert trainer.val_starts.shape == (3, 4)
    np.testing.assert_array_equal(trainer.val_starts,
                                  fixed_starts(trainer.val, 4, 20, 0)[:3])
    cfg = LlamaConfig(vocab=354, dim=32, layers=1, heads=2, ctx=16)
    fresh = jg.compile(llama_forward(cfg, 4, 16, labels=True))
    for k in fresh.params:
        fresh.params[k] = trainer.program.params[k]
    want = np.mean([float(fresh.step(tokens=x, pos=trainer.pos, labels=y)["loss"])
                    for x, y in (trainer.val.batch(s) for s in trainer.val_starts)])
    assert res["val_loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_ctrl_c_then_resume_is_bit_exact(tmp_path, capsys, monkeypatch):
    """6 steps straight == 3 steps, Ctrl-C (checkpoint saved after the step it fell in), resume,
    3 more: params and optimizer state bitwise; with accumulation and recomputation."""
    args = ["train", "llama", *TINY, "--logical-batch", "8", "--recompute", "sqrt",
            "--eval-every", "2", "--steps", "6", "--save-every", "100"]
    straight, cut = tmp_path / "straight.gguf", tmp_path / "cut.gguf"
    assert cli.main([*args, "--checkpoint", str(straight)]) == 0

    real = llama_train.LMTrainer.train_step

    def interrupted(self):
        loss = real(self)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGINT)       # arrives during the step: deferred
        return loss

    monkeypatch.setattr(llama_train.LMTrainer, "train_step", interrupted)
    capsys.readouterr()
    assert cli.main([*args, "--checkpoint", str(cut)]) == 130
    err = capsys.readouterr().err
    assert f"last checkpoint: {cut} (step 3)" in err, err
    monkeypatch.setattr(llama_train.LMTrainer, "train_step", real)
    assert llama_train.load_llama_checkpoint(cut)[4]["step"] == 3

    assert cli.main([*args[:2], "--resume", str(cut), "--steps", "6", "--lr", "0.5",
                     "--eval-every", "2", "--quiet", "--checkpoint", str(cut), "--json"]) == 0
    cap = capsys.readouterr()
    assert "--lr 0.5 (checkpoint: 0.001)" in cap.err
    res = json.loads(cap.out.strip().splitlines()[-1])
    assert res["steps"] == 6 and [c["step"] for c in res["curve"]] == [2, 4, 6]
    _, _, pa, sa, ma = llama_train.load_llama_checkpoint(straight)
    _, _, pb, sb, mb = llama_train.load_llama_checkpoint(cut)
    assert ma["calls"] == mb["calls"] == 12 and ma["rng"] == mb["rng"]
    assert set(pa) == set(pb) and set(sa) == set(sb) and sa
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    assert ma["curve"] == mb["curve"]


def test_resume_rejects_other_files(tmp_path, capsys):
    from jitgraph.models.llama import write_llama
    cfg = LlamaConfig(vocab=354, dim=8, layers=1, heads=2, ctx=16)
    model = tmp_path / "model.gguf"
    write_llama(model, cfg, llama_forward(cfg, 1, 4).init_params(0), byte_vocab())
    assert cli.main(["train", "llama", *TINY, "--resume", str(model)]) == 2
    assert "not a training checkpoint" in capsys.readouterr().err


def test_dump_llama_programs(capsys, monkeypatch):
    for program in ("train", "prefill", "decode"):
        assert cli.main(["dump", "llama", "--stage", "graph", "--program", program]) == 0
        text = capsys.readouterr().out
        assert text.startswith("graph ")
        assert ("cross_entropy(" in text) == (program == "train")
        assert ("kv_attention(" in text) == (program != "train")
    # a compiled stage, on the small model the CLI test trains (the same kernels)
    monkeypatch.setattr(llama_train, "DEFAULTS", {**llama_train.DEFAULTS, "dim": 32, "layers": 1,
                                                  "heads": 2, "ctx": 16, "batch_size": 4})
    assert cli.main(["dump", "llama", "--stage", "optimizer", "--quiet"]) == 0
    assert "update blk.0.attn_q.weight <- " in capsys.readouterr().out
    assert cli.main(["dump", "llama", "--stage", "autodiff", "--program", "decode",
                     "--quiet"]) == 2
    assert "--stage autodiff" in capsys.readouterr().err

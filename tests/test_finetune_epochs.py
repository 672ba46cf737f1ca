"""`jitgraph finetune --epochs` (llama.cpp's workflow): the data set of windows against
llama.cpp's common_opt_dataset_init computed by hand, the last-fraction split in float32, every
training window once an epoch in order (jitgraph.training.fit), the per-epoch exponential decay
against its closed form, SGD's step against numpy, the option errors, the memory plan's
refusal before anything is built, and a resume in the middle of an epoch bit for bit."""
import json
import os
import signal

import numpy as np
import pytest

from jitgraph import cli, optim
from jitgraph.models.text import StridedWindows, llama_split
from jitgraph.training import Result, fit


# ---- the data set ------------------------------------------------------------------------------
def test_windows_are_llamacpps_dataset():
    tokens = np.random.default_rng(0).integers(0, 500, size=1000).astype(np.int32)
    ds = StridedWindows(tokens, 32)
    # common_opt_dataset_init: ndata = (1000 - 32 - 1) // 16 = 60, window i at 16 i
    assert ds.stride == 16 and len(ds) == 60
    for i in (0, 1, 59):
        np.testing.assert_array_equal(ds.x[[i]][0], tokens[16 * i:16 * i + 32])
        np.testing.assert_array_equal(ds.y[[i]][0], tokens[16 * i + 1:16 * i + 33])
    # the last window's labels end at token 59 * 16 + 32 = 976 < 1000: (T - ctx - 1) // stride
    # leaves the tail llama.cpp leaves
    assert ds.starts[-1] + 32 + 1 <= 1000 and (60 * 16 + 33) > 1000 - 16
    np.testing.assert_array_equal(ds.x[[2, 5]], np.stack([tokens[32:64], tokens[80:112]]))
    with pytest.raises(ValueError, match=r"has 40 tokens: no window of ctx 32 at stride 16"):
        StridedWindows(tokens[:40], 32)


def test_val_split_is_the_last_fraction_in_float32():
    # llama-finetune: idata_split = ndata * (1.0f - val_split), truncated
    assert llama_split(629, 0.05) == 597          # 629 * 0.95 = 597.55
    assert llama_split(60, 0.05) == 57
    # 90 * (1 - 0.3) is 63.000002 in float32 (63 windows train) but 62.99999... in float64
    assert int(90 * (1 - 0.3)) == 62 and llama_split(90, 0.3) == 63
    assert int(380 * (1 - 0.35)) == 247 and llama_split(380, 0.35) == 246
    assert llama_split(10, 0.0) == 10


class _Recorder:
    """A stand-in training program: records the windows it is fed (its first token), loss 1."""

    def __init__(self):
        self.calls, self.trained, self.validated = 0, [], []

    def step(self, tokens, labels, pos):
        self.calls += 1
        self.trained.append(int(tokens[0, 0]))
        return {"loss": 1.0, "correct": 3}

    def evaluator(self, share_memory=False):
        rec = self

        class Ev:
            def run(self, tokens, labels, pos):
                rec.validated.append(int(tokens[0, 0]))
                return {"loss": 2.0, "correct": 1}
        return Ev()


def test_each_training_window_once_an_epoch_in_order():
    tokens = np.arange(1000, dtype=np.int32)          # a window's first token is its start
    ds = StridedWindows(tokens, 32)
    n_train = llama_split(len(ds), 0.05)              # 57 of 60
    prog, pos = _Recorder(), np.arange(32, dtype=np.int32)
    logs = fit(prog, ds, epochs=2, batch_size=1, shuffle=False, n_train=n_train, unit=32,
               inputs=lambda f: {"tokens": f["x"], "labels": f["y"], "pos": pos}, progress=False)
    starts = list(range(0, 16 * 57, 16))
    assert prog.trained == starts + starts
    # the evaluator compiled on the first window, then the last 3 windows after each epoch
    assert prog.validated == [0] + [16 * 57, 16 * 58, 16 * 59] * 2
    tr, va = logs[-1].train, logs[-1].val
    assert tr.ndata == 57 and va.ndata == 3
    # accuracy per predicted token (ggml-opt's): 3 of 32 each window
    assert tr.accuracy()[0] == pytest.approx(3 / 32) and va.accuracy()[0] == pytest.approx(1 / 32)


def test_result_accuracy_counts_predictions():
    r = Result(unit=4)
    r.add(1.0, 2, 3)
    r.add(2.0, 2, 5)
    acc, unc = r.accuracy()
    assert acc == 8 / 16 and unc == pytest.approx(np.sqrt(0.25 / 15))


# ---- the schedule and SGD ----------------------------------------------------------------------
def test_epoch_decay_is_llamacpps_closed_form():
    lr0, lr_min = 1e-3, 1e-5
    s = optim.EpochDecay(lr0, lr_min, epochs=4, steps_per_epoch=10)
    # lr_opt::get_lr: lr0 * 0.5^(e * log2(lr0 / lr_min) / E) = lr0 * (lr_min / lr0)^(e / E)
    for e in range(4):
        want = lr0 * (lr_min / lr0) ** (e / 4)
        for t in (10 * e + 1, 10 * e + 10):
            assert s(t) == pytest.approx(want, rel=1e-6)
    assert s(41) == pytest.approx(lr_min, rel=1e-6)    # from epoch E on: lr_min
    d = optim.EpochDecay(lr0, lr_min, epochs=4, steps_per_epoch=1, decay_epochs=2)
    assert [d(t) for t in (1, 2, 3, 4)] == pytest.approx([lr0, lr0 * 0.1, lr_min, lr_min],
                                                         rel=1e-6)
    with pytest.raises(ValueError, match="lr_min must be in"):
        optim.EpochDecay(lr0, 2e-3, epochs=1, steps_per_epoch=1)


def test_sgd_step_is_ggmls():
    import jitgraph as jg
    from jitgraph import ops
    rng = np.random.default_rng(1)
    w0, x = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(3, 4)).astype(np.float32)
    g = jg.Graph("sgd")
    w = g.param("w", (3, 4), "f32")
    xi = g.input("x", (3, 4), "f32")
    g.output(loss=ops.sum(ops.sqr(w * xi)) * 0.5)   # gradient w * x * x
    lr, wd = 0.1, 0.01
    prog = jg.compile(g, loss="loss", optimizer=optim.SGD(lr=lr, weight_decay=wd),
                      params={"w": w0})
    prog.step(x=x)
    grad = w0 * x * x
    # ggml_compute_forward_opt_step_sgd_f32: w = w * (1 - alpha * wd) - alpha * g
    want = w0 * np.float32(1 - lr * wd) - np.float32(lr) * grad
    np.testing.assert_allclose(prog.params["w"], want, rtol=1e-6, atol=1e-7)


# ---- the command -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text(corpus_file):
    return corpus_file(3000, b"\n")      # llama.cpp's -f drops the last newline


def _tokens(stories, text):
    from jitgraph.models.llama import read_llama
    _, _, tok = read_llama(stories)
    data = open(text, "rb").read()[:-1]                # llama.cpp's -f drops the last newline
    return tok.encode(data, bos=tok.add_bos)


EPOCHS = ["--full", "--ctx", "32", "--batch-size", "1", "--no-ppl", "--quiet", "--json"]


def test_finetune_epochs_walks_the_windows_with_the_schedule(stories, text, tmp_path, capsys):
    log, out = tmp_path / "log.jsonl", tmp_path / "o.gguf"
    assert cli.main(["finetune", stories, "--text", text, *EPOCHS, "--epochs", "2",
                     "--lr", "1e-3", "--lr-min", "1e-4", "--val-split", "0.1",
                     "--log", str(log), "--out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    n = (len(_tokens(stories, text)) - 32 - 1) // 16
    n_train = int(np.float32(n) * np.float32(0.9))
    assert res["windows"] == n and res["train_windows"] == n_train
    assert res["epochs"] == 2 and res["steps"] == 2 * n_train
    recs = [json.loads(ln) for ln in log.read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 2 * n_train + 1))
    # epoch 1 at --lr, epoch 2 at lr0 (lr_min / lr0)^(1/2)
    assert all(r["lr"] == pytest.approx(1e-3, rel=1e-6) for r in steps[:n_train])
    assert all(r["lr"] == pytest.approx(1e-3 * 0.1 ** 0.5, rel=1e-6) for r in steps[n_train:])
    evals = [r for r in recs if r["kind"] == "eval"]
    assert len(evals) == 2 and [c["epoch"] for c in res["curve"]] == [1, 2]
    c = res["curve"][-1]
    assert 0 < c["train_acc"] < 1 and 0 < c["val_acc"] < 1 and c["train_unc"] > 0
    # the train figure is the mean of the epoch's step losses
    assert c["train"] == pytest.approx(np.mean([r["loss"] for r in steps[n_train:]]), rel=1e-6)


def test_finetune_sgd_has_no_optimizer_state(stories, text, tmp_path, capsys):
    assert cli.main(["finetune", stories, "--text", text, *EPOCHS, "--epochs", "1",
                     "--optimizer", "sgd", "--out", str(tmp_path / "o.gguf")]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["optimizer_state_bytes"] == 0 and res["steps"] == res["train_windows"]


@pytest.mark.parametrize("extra, msg", [
    (["--epochs", "1", "--steps", "5"], "argument --epochs: not allowed with argument --steps"),
    (["--val-split", "0.1"], "argument --val-split: needs --epochs"),
    (["--lr-min", "1e-5"], "argument --lr-min: needs --epochs"),
    (["--epochs", "1", "--lr-min", "1e-2"], "argument --lr-min: must be below --lr 0.001"),
    (["--epochs", "1", "--decay-epochs", "1"], "argument --decay-epochs: needs --lr-min"),
])
def test_usage_errors(stories, text, tmp_path, capsys, extra, msg):
    with pytest.raises(SystemExit) as e:
        cli.main(["finetune", stories, "--text", text, "--full", *extra,
                  "--out", str(tmp_path / "o.gguf")])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "o.gguf").exists()


def test_memory_plan_refusal_before_anything_is_built(stories, text, tmp_path, capsys,
                                                      monkeypatch):
    from jitgraph.runtime.cpu import backend, memory
    monkeypatch.setattr(memory, "available", lambda: (1 << 20, "MemAvailable"))
    monkeypatch.setattr(backend.CPU, "build", lambda *a: pytest.fail("built the program"))
    monkeypatch.setattr(backend.CPU, "allocate", lambda *a, **k: pytest.fail("allocated"))
    out = tmp_path / "o.gguf"
    assert cli.main(["finetune", stories, "--text", text, *EPOCHS, "--epochs", "1",
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "the program needs" in err and "1.0 MiB is available (MemAvailable)" in err, err
    assert not out.exists()


def test_resume_in_the_middle_of_an_epoch_is_bit_exact(stories, text, tmp_path, capsys,
                                                       monkeypatch):
    from jitgraph.cli import llama_train
    from jitgraph.models.llama import read_llama
    straight, resumed, ck = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.ckpt"
    run = ["finetune", stories, "--text", text, *EPOCHS, "--epochs", "2", "--val-split", "0.1"]
    assert cli.main([*run, "--out", str(straight)]) == 0
    real = llama_train._Timed.step

    def interrupted(self, **inputs):          # Ctrl-C during the 40th step (epoch 1)
        out = real(self, **inputs)
        if self.calls == 40:
            os.kill(os.getpid(), signal.SIGINT)
        return out
    monkeypatch.setattr(llama_train._Timed, "step", interrupted)
    assert cli.main([*run, "--out", str(resumed), "--checkpoint", str(ck)]) == 130
    monkeypatch.setattr(llama_train._Timed, "step", real)
    capsys.readouterr()
    assert cli.main([*run, "--out", str(resumed), "--resume", str(ck)]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    _, a, _ = read_llama(straight)
    _, b, _ = read_llama(resumed)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert res["epochs"] == 2
    # a checkpoint of --epochs resumes with --epochs only
    assert cli.main(["finetune", stories, "--text", text, "--full", "--ctx", "32",
                     "--no-ppl", "--quiet", "--steps", "3", "--out", str(resumed),
                     "--resume", str(ck)]) == 2
    assert "the checkpoint was made with --epochs; resume it with --epochs N" in \
        capsys.readouterr().err


"""Hostile and careless input to the CLI (issue 13): output paths checked before any work, no
temporary file left by an interrupted write, evaluation of every sample, the data a model was
trained on, options validated in the user's terms, Ctrl-C / SIGTERM, an unusable kernel cache."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import cli
from jitgraph.cli import common
from jitgraph.formats import gguf as gguf_io
from jitgraph.formats.data import Dataset, load_mnist, synthetic_digits
from jitgraph.models import MODELS
from jitgraph.training import evaluate

TINY = ["--n-train", "200", "--val-split", "0", "--n-test", "100", "--quiet"]


def _tmp_files(d):
    return [f for f in os.listdir(d) if f.endswith(".tmp")]


@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if the CLI compiles anything (errors must come first)."""
    def fail(*a, **k):
        raise AssertionError("compiled before the error was found")
    monkeypatch.setattr(jg, "compile", fail)


@pytest.fixture(scope="module")
def model_params():
    return MODELS["mnist-fc"](1).init_params(seed=0)


def _ref_scores(params, ds):
    """Mean cross-entropy and accuracy of mnist-fc in float64 numpy."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    h = np.maximum(ds.x @ p["fc1.weight"] + p["fc1.bias"], 0)
    z = h @ p["fc2.weight"] + p["fc2.bias"]
    m = z.max(1, keepdims=True)
    logp = z - m - np.log(np.exp(z - m).sum(1, keepdims=True))
    return -logp[np.arange(len(ds)), ds.y].mean(), (z.argmax(1) == ds.y).mean()


# ---- A: output paths, atomic writes ------------------------------------------------------------
@pytest.mark.parametrize("case", ["missing_dir", "is_dir", "parent_is_file", "read_only"])
@pytest.mark.parametrize("flag", ["--out", "--checkpoint"])
def test_bad_output_path_fails_before_compiling(tmp_path, capsys, no_compile, flag, case):
    if case == "read_only":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        path = ro / "m.gguf"
    else:
        (tmp_path / "file").write_text("x")
        path = {"missing_dir": tmp_path / "nope" / "m.gguf", "is_dir": tmp_path,
                "parent_is_file": tmp_path / "file" / "m.gguf"}[case]
    assert cli.main(["train", "mnist-fc", *TINY, flag, str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flag} {path}" in err, err
    assert ".tmp" not in err and "Traceback" not in err


def test_out_and_checkpoint_must_differ(tmp_path, capsys, no_compile):
    p = tmp_path / "m.gguf"
    assert cli.main(["train", "mnist-fc", *TINY, "--out", str(p), "--checkpoint", str(p)]) == 2
    assert "same file" in capsys.readouterr().err


def test_save_errors_name_the_path_and_leave_no_temp_file(tmp_path, model_params):
    missing = tmp_path / "nope" / "m.gguf"
    with pytest.raises(FileNotFoundError) as e:
        gguf_io.save_model(missing, "mnist-fc", model_params)
    assert str(missing) in str(e.value) and ".tmp" not in str(e.value)
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError) as e:
        gguf_io.save_model(tmp_path / "d", "mnist-fc", model_params)
    assert str(tmp_path / "d") in str(e.value) and ".tmp" not in str(e.value)
    assert _tmp_files(tmp_path) == []
    # an exception in the middle of the write (here: a bad state dtype found late) leaves none
    with pytest.raises(ValueError):
        gguf_io.save_checkpoint(tmp_path / "c.gguf", "mnist-fc", model_params,
                                {"s": np.zeros(2, np.complex64)}, {})
    assert _tmp_files(tmp_path) == [] and not (tmp_path / "c.gguf").exists()


def test_bench_json_path_checked_first(tmp_path, capsys, monkeypatch):
    from jitgraph.cli import bench
    monkeypatch.setattr(bench, "run_suite", lambda *a, **k: pytest.fail("ran before the check"))
    for bad in (tmp_path, tmp_path / "nope" / "x.json"):
        with pytest.raises(SystemExit) as e:
            bench.main(["--json", str(bad)])
        assert e.value.code == 2 and f"--json {bad}" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError) as e:
        bench.write_json(tmp_path / "nope" / "x.json", {})
    assert "nope" in str(e.value) and ".tmp" not in str(e.value)


_SLOW_WRITE = textwrap.dedent("""
    import pathlib, sys, time
    import gguf
    real = gguf.GGUFWriter.close
    def slow(self, *a, **k):          # the temp file is written; the rename is still to come
        real(self, *a, **k)
        pathlib.Path(sys.argv[1]).write_text("writing")
        time.sleep(120)
    gguf.GGUFWriter.close = slow
    from jitgraph import cli
    sys.exit(cli.main(sys.argv[2:]))
""")


def test_sigterm_during_checkpoint_write_leaves_no_temp_file(tmp_path):
    ck, marker = tmp_path / "ck.gguf", tmp_path / "marker"
    ck.write_bytes(b"the previous checkpoint")
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITE, str(marker), "train", "mnist-fc",
                             *TINY, "--epochs", "1", "--checkpoint", str(ck)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the checkpoint write never started"
            time.sleep(0.05)
        assert len(_tmp_files(tmp_path)) == 1          # caught in the middle of the write
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["jitgraph train: terminated (SIGTERM)"], err
    assert _tmp_files(tmp_path) == []
    assert ck.read_bytes() == b"the previous checkpoint"


# ---- B: evaluation covers every sample; the data a model was trained on -----------------------
def test_evaluate_scores_every_sample(model_params):
    prog = jg.compile(MODELS["mnist-fc"](100))
    for k, v in model_params.items():
        prog.params[k] = v
    for n in (250, 30):         # a last partial batch; fewer samples than one batch
        ds = synthetic_digits(n, seed=7)
        res = evaluate(prog, ds, 100, progress=False)
        loss, acc = _ref_scores(model_params, ds)
        assert res.ndata == n
        assert res.accuracy()[0] == pytest.approx(acc, abs=1.5 / n)   # an argmax tie may flip
        assert res.loss()[0] == pytest.approx(loss, rel=1e-5)
    with pytest.raises(ValueError, match="empty"):
        evaluate(prog, Dataset(np.zeros((0, 784), np.float32), np.zeros(0, np.int32)), 100)


def test_validation_scores_every_sample():
    # 1050 samples, batch 100: 900 train (ggml's split); the 150 left validate, 50 in a padded batch
    logs = jg.fit(MODELS["mnist-fc"](100), synthetic_digits(1050, seed=3), epochs=1,
                  val_split=0.05, progress=False)
    assert logs[0].train.ndata == 900 and logs[0].val.ndata == 150


def test_eval_batch_larger_than_test_set_and_records_data(tmp_path, capsys, model_params):
    m = tmp_path / "m.gguf"
    gguf_io.save_model(m, "mnist-fc", model_params, data="synthetic")
    assert gguf_io.trained_on(m) == "synthetic"
    assert cli.main(["eval", str(m), "--n-test", "100", "--batch-size", "3000", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert res["n"] == 100 and res["data"] == "synthetic"
    loss, acc = _ref_scores(model_params, synthetic_digits(100, seed=1_000_003))
    assert res["test_loss"] == pytest.approx(loss, rel=1e-5)
    assert res["test_acc"] == pytest.approx(acc, abs=0.015)
    assert any(line.startswith("data: built-in synthetic digits") for line in out)


def test_eval_refuses_synthetic_digits_for_a_model_trained_on_mnist(tmp_path, capsys,
                                                                    model_params, no_compile):
    m = tmp_path / "m.gguf"
    gguf_io.save_model(m, "mnist-fc", model_params, data="mnist")
    assert cli.main(["eval", str(m), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "MNIST" in err and str(m) in err


def test_eval_warns_when_a_model_records_no_data(tmp_path, capsys, model_params):
    m = tmp_path / "ggml.gguf"
    gguf_io.save_model(m, "mnist-fc", model_params)      # as ggml writes it: no data key
    assert gguf_io.trained_on(m) is None
    assert cli.main(["eval", str(m), "--n-test", "100", "--json"]) == 0
    cap = capsys.readouterr()
    assert "does not record its training data" in cap.err
    assert json.loads(cap.out.strip().splitlines()[-1])["n"] == 100


def test_eval_on_mnist_with_a_batch_that_does_not_divide(tmp_path, capsys, model_params,
                                                         testdata):
    """tests/data's MNIST subset (2,000 test images) in batches of 600: three full, one of 200."""
    m = tmp_path / "m.gguf"
    gguf_io.save_model(m, "mnist-fc", model_params, data="mnist")
    assert cli.main(["eval", str(m), "--data", str(testdata.mnist), "--batch-size", "600",
                     "--quiet", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["n"] == 2000 and res["data"] == "mnist"
    loss, acc = _ref_scores(model_params, load_mnist(testdata.mnist, "test"))
    assert res["test_loss"] == pytest.approx(loss, rel=1e-5)
    assert res["test_acc"] == pytest.approx(acc, abs=1e-3)


def test_eval_of_a_directory(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "Traceback" not in err


# ---- C: options in the user's terms ------------------------------------------------------------
@pytest.mark.parametrize("argv,flag,words", [
    (["--batch-size", "0"], "--batch-size", [">= 1", "0"]),
    (["--logical-batch", "50"], "--logical-batch", ["multiple of --batch-size", "50"]),
    (["--logical-batch", "150"], "--logical-batch", ["multiple of --batch-size", "150"]),
    (["--epochs", "-3"], "--epochs", [">= 1", "-3"]),
    (["--lr", "0"], "--lr", ["> 0"]),
    (["--lr", "inf"], "--lr", ["> 0"]),
    (["--val-split", "1.5"], "--val-split", ["[0, 1)", "1.5"]),
    (["--n-train", "many"], "--n-train", ["integer", "many"]),
    (["--seed", "-1"], "--seed", [">= 0"]),
])
def test_train_options_validated(capsys, no_compile, argv, flag, words):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "mnist-fc", "--quiet", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and all(w in err for w in words), err
    assert "AdamW" not in err and "Traceback" not in err


@pytest.mark.parametrize("argv,words", [
    (["--batch-size", "500"], ["--batch-size 500", "200 training samples"]),
    (["--val-split", "0.9", "--batch-size", "100"], ["--val-split 0.9", "no training batch"]),
])
def test_train_sizes_checked_against_the_data(capsys, no_compile, argv, words):
    assert cli.main(["train", "mnist-fc", "--n-train", "200", "--n-test", "100", "--quiet",
                     *argv]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_help_shows_every_default_and_no_internal_references(capsys):
    p = cli.parser()
    subs = p._subparsers._group_actions[0].choices
    for name in ("train", "eval", "dump"):
        text = subs[name].format_help()
        for a in subs[name]._actions:
            assert a.help, (name, a.dest)
            if a.option_strings and a.default is not None and a.default is not False \
                    and a.dest != "help":
                assert f"default: {a.default}" in " ".join(text.split()), (name, a.dest)
        assert "issue" not in text.lower() and "143" in text
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "issue" not in text.lower() and "--repeat" in text


def test_ctrl_c_then_resume_ignoring_options(tmp_path, capsys, monkeypatch):
    from jitgraph.training import Trainer
    ck = tmp_path / "ck.gguf"
    real = Trainer.run_one_epoch

    def interrupted_after_one(self, progress=None, on_step=None):
        if self.epoch >= 1:
            raise KeyboardInterrupt
        return real(self, progress, on_step)

    monkeypatch.setattr(Trainer, "run_one_epoch", interrupted_after_one)
    assert cli.main(["train", "mnist-fc", *TINY, "--epochs", "3", "--checkpoint", str(ck)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted (Ctrl-C)" in err[0], err
    assert f"last checkpoint: {ck} (epoch 1)" in err[0]
    monkeypatch.setattr(Trainer, "run_one_epoch", real)

    assert cli.main(["train", "mnist-fc", *TINY, "--epochs", "2", "--resume", str(ck),
                     "--lr", "0.5", "--batch-size", "50", "--seed", "0", "--json"]) == 0
    cap = capsys.readouterr()
    warning = [line for line in cap.err.splitlines() if "warning" in line]
    unsaved = [line for line in warning if "nothing of this run will be saved" in line]
    assert len(warning) == 2 and len(unsaved) == 1, cap.err      # (no --out, no --checkpoint)
    warning = [line for line in warning if line not in unsaved]
    assert "--lr 0.5 (checkpoint: 0.001)" in warning[0]
    assert "--batch-size 50 (checkpoint: 100)" in warning[0]
    assert "--seed" not in warning[0]            # given, but the checkpoint's value
    assert json.loads(cap.out.strip().splitlines()[-1])["epochs"] == 2
    assert gguf_io.trained_on(ck) == "synthetic"


def test_unwritable_cache_dir_warns_once_and_compiles(tmp_path, monkeypatch):
    from jitgraph.runtime.cpu import cache
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    root = str(blocker / "cache")
    monkeypatch.setenv("JITGRAPH_CACHE_DIR", root)
    monkeypatch.setattr(cache, "_FALLBACK", {}, raising=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        d1, d2 = cache.cache_dir(), cache.cache_dir()
        g = jg.Graph("cache_fallback")
        x = g.input("x", (3, 5))
        g.output(y=jg.tanh(x) * 3.25 + 0.5)
        events = []
        old = cache.set_progress(lambda done, total: events.append((done, total)))
        try:
            prog = jg.compile(g)
        finally:
            cache.set_progress(old)
    assert d1 == d2 and d1.is_dir() and not str(d1).startswith(root)
    ours = [str(x.message) for x in w if "kernel cache" in str(x.message)]
    assert len(ours) == 1 and root in ours[0], ours
    xs = np.ones((3, 5), np.float32)
    np.testing.assert_allclose(prog.step(x=xs)["y"], np.tanh(xs) * 3.25 + 0.5, rtol=1e-6)
    assert events[0][0] == 0 and events[-1][0] == events[-1][1] >= 1      # compile progress


def test_compile_progress_bar_only_on_a_terminal(capsys, monkeypatch):
    from jitgraph.runtime.cpu import cache

    class Args:
        quiet = False

    with common.compile_progress(Args, "m"):
        assert cache._progress is None              # stderr is not a terminal here
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with common.compile_progress(Args, "m"):
        cache._progress(0, 4)
        time.sleep(0.6)                             # the bar shows after half a second
        cache._progress(3, 4)
    assert cache._progress is None
    assert "compiling m" in capsys.readouterr().err
    Args.quiet = True
    with common.compile_progress(Args, "m"):
        assert cache._progress is None


@pytest.mark.parametrize("meta", [{}, {"args": {}, "epoch": "1", "calls": 0, "rng": {},
                                       "order": []},
                                  {"args": {}, "epoch": -1, "calls": 0, "rng": {}, "order": []}])
def test_resume_from_a_checkpoint_with_bad_meta_is_one_line(tmp_path, capsys, no_compile, meta):
    ck = tmp_path / "ck.gguf"
    params = {k: v for k, v in MODELS["mnist-fc"](10).init_params(0).items()}
    gguf_io.save_checkpoint(str(ck), "mnist-fc", params, {}, meta, data="synthetic")
    assert cli.main(["train", "mnist-fc", *TINY, "--resume", str(ck)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(ck) in err[0] and "checkpoint meta" in err[0], err

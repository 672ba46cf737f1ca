"""The commands never destroy an input, keep their work when interrupted, check what they will
need before they start, and say the real cause (issue 36: parts 1-3, 6, 7, 9, 10)."""
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import cli
from jitgraph.cli import bench, common, llama_train
from jitgraph.formats.paths import check_not_inputs, check_writable
from jitgraph.models.llama import LlamaConfig, llama_forward, read_llama, write_llama
from jitgraph.models.text import byte_vocab

TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--ctx", "16", "--batch-size", "4",
        "--quiet"]
MNIST = ["--n-train", "200", "--val-split", "0", "--n-test", "100", "--quiet"]


@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if the CLI compiles anything (the error must come first)."""
    def fail(*a, **k):
        raise AssertionError("compiled before the error was found")
    monkeypatch.setattr(jg, "compile", fail)


@pytest.fixture
def files(tmp_path):
    """A small llama base model, a text, and an adapter-shaped file, in tmp_path/in."""
    d = tmp_path / "in"
    d.mkdir()
    cfg = LlamaConfig(vocab=354, dim=8, layers=1, heads=2, ctx=64)
    base = d / "base.gguf"
    write_llama(base, cfg, llama_forward(cfg, 1, 4).init_params(0), byte_vocab())
    text = d / "ts.txt"
    text.write_text("First Citizen: before we proceed any further, hear me speak.\n" * 40)
    return base, text


def _bytes(p):
    return p.read_bytes()


# ---- 1. never overwrite an input -----------------------------------------------------------------
def _spellings(tmp_path, target):
    """Other names of `target`: ./x from its directory, ../in/x, a symlink, a hard link."""
    link = tmp_path / "link.gguf"
    link.symlink_to(target)
    hard = tmp_path / "hard.gguf"
    os.link(target, hard)
    return {"relative": os.path.join("..", "in", target.name), "symlink": str(link),
            "hard link": str(hard), "same": str(target)}


@pytest.mark.parametrize("flag", ["--out", "--checkpoint"])
@pytest.mark.parametrize("mode", [["--lora-rank", "2"], ["--full"]])
def test_finetune_never_overwrites_the_base_model(tmp_path, files, capsys, no_compile,
                                                   monkeypatch, flag, mode):
    base, text = files
    before = _bytes(base)
    monkeypatch.chdir(tmp_path / "in")
    for how, path in _spellings(tmp_path, base).items():
        argv = ["finetune", str(base), *mode, "--text", str(text), "--quiet"]
        argv += [flag, path] if flag == "--out" else ["--out", str(tmp_path / "o.gguf"), flag,
                                                      path]
        assert cli.main(argv) == 2, how
        err = capsys.readouterr().err
        assert f"{flag} {path} is the input the base model" in err, (how, err)
        assert len(err.strip().splitlines()) == 1
    assert _bytes(base) == before


@pytest.mark.parametrize("flag", ["--out", "--checkpoint"])
def test_training_never_overwrites_the_text(tmp_path, files, capsys, no_compile, flag):
    base, text = files
    before = _bytes(text)
    for argv in (["finetune", str(base), "--lora-rank", "2", "--text", str(text)],
                 ["train", "llama", *TINY, "--text", str(text)]):
        extra = [flag, str(text)] if flag == "--out" or argv[0] == "train" else \
            ["--out", str(tmp_path / "o.gguf"), flag, str(text)]
        assert cli.main([*argv, *extra]) == 2
        assert f"is the input --text {text}" in capsys.readouterr().err
    assert _bytes(text) == before


def test_out_is_never_the_resumed_checkpoint(tmp_path, capsys, no_compile):
    ck = tmp_path / "ck.gguf"
    ck.write_bytes(b"a checkpoint")
    assert cli.main(["train", "llama", *TINY, "--resume", str(ck), "--out", str(ck)]) == 2
    assert f"--out {ck} is the input --resume" in capsys.readouterr().err
    assert cli.main(["train", "mnist-fc", *MNIST, "--resume", str(ck), "--out", str(ck)]) == 2
    assert f"--out {ck} is the input --resume" in capsys.readouterr().err
    assert ck.read_bytes() == b"a checkpoint"
    # continuing into the same checkpoint is the normal workflow: allowed by the check
    check_not_inputs({"--out": tmp_path / "m.gguf", "--checkpoint": ck}, {"--resume": ck},
                     allow=(("--checkpoint", "--resume"),))


def test_mnist_out_is_never_a_data_file(tmp_path, testdata, capsys, no_compile):
    data = tmp_path / "mnist"
    data.mkdir()
    for f in testdata.mnist.iterdir():
        os.link(f, data / f.name)
    target = data / "t10k-labels-idx1-ubyte.gz"
    before = target.read_bytes()
    assert cli.main(["train", "mnist-fc", "--data", str(data), "--quiet", "--out",
                     str(target)]) == 2
    assert f"(in --data {data})" in capsys.readouterr().err
    assert target.read_bytes() == before


def test_export_never_overwrites_its_inputs(tmp_path, files, capsys, no_compile):
    base, _ = files
    lora = tmp_path / "in" / "a.gguf"
    lora.write_bytes(b"an adapter")
    for out, what in ((lora, "--lora"), (base, "the base model")):
        alias = tmp_path / f"alias-{out.name}"
        alias.symlink_to(out)
        assert cli.main(["export", str(base), "--lora", str(lora), "--out", str(alias)]) == 2
        assert f"is the input {what}" in capsys.readouterr().err
    assert lora.read_bytes() == b"an adapter"


def test_bench_json_never_replaces_another_file(tmp_path, capsys):
    src = tmp_path / "notes.txt"
    src.write_text("not a benchmark result")
    with pytest.raises(SystemExit) as e:
        bench.main(["--json", str(src), "--only", "nothing-runs"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "not a `jitgraph bench` results file" in err or "unknown workload" in err
    with pytest.raises(SystemExit) as e:                  # a known workload: the file check
        bench.main(["--json", str(src)])
    assert e.value.code == 2 and "not a `jitgraph bench` results file" in \
        capsys.readouterr().err
    assert src.read_text() == "not a benchmark result"
    old = tmp_path / "old.json"                          # an earlier result may be replaced
    old.write_text(json.dumps({"environment": {}, "rows": []}))
    bench.check_json_output(old)


# ---- 3. the output check creates the atomic write's temporary file -------------------------------
def test_unwritable_out_is_refused_before_compiling(tmp_path, capsys, no_compile):
    assert cli.main(["train", "llama", *TINY, "--out", "/proc/version"]) == 2
    err = capsys.readouterr().err
    assert "--out /proc/version: cannot create a file in /proc" in err, err
    with pytest.raises(OSError, match="cannot create a file"):
        check_writable("/proc/version", "--out")
    check_writable(tmp_path / "fine.gguf", "--out")
    assert os.listdir(tmp_path) == []                    # the probe leaves nothing behind


# ---- 2. an interrupted run keeps its work ------------------------------------------------------
def _interrupt_at(monkeypatch, cls, method, when, signum=signal.SIGINT):
    real = getattr(cls, method)
    calls = []

    def wrapped(self, *a, **k):
        out = real(self, *a, **k)
        calls.append(1)
        if len(calls) == when:
            os.kill(os.getpid(), signum)
        return out
    monkeypatch.setattr(cls, method, wrapped)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_train_llama_writes_out_when_interrupted(tmp_path, capsys, monkeypatch, signum, code):
    out = tmp_path / "m.gguf"
    _interrupt_at(monkeypatch, llama_train.LMTrainer, "train_step", 3, signum)
    old = signal.signal(signal.SIGTERM, common.raise_terminated)
    try:
        rc = cli.main(["train", "llama", *TINY, "--steps", "1000", "--out", str(out)])
    finally:
        signal.signal(signal.SIGTERM, old)
    assert rc == code
    err = capsys.readouterr().err
    assert f"{out} holds the model after step 3" in err, err
    cfg, params, tok = read_llama(out)
    assert cfg.dim == 32 and tok is not None and all(np.isfinite(v).all()
                                                    for v in params.values())


def test_train_mnist_writes_out_when_interrupted(tmp_path, capsys, monkeypatch):
    from jitgraph.formats.gguf import load_model
    out = tmp_path / "m.gguf"
    # the interrupt comes from inside an epoch: after the second compiled step
    from jitgraph.runtime.executor import Program
    _interrupt_at(monkeypatch, Program, "step", 2)
    assert cli.main(["train", "mnist-fc", *MNIST, "--epochs", "5", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert re.search(f"{re.escape(str(out))} holds the model after [12] steps? \\(interrupted "
                     f"in epoch 1\\)", err), err
    arch, params = load_model(out)
    assert arch == "mnist-fc" and set(params) == {"fc1.weight", "fc1.bias", "fc2.weight",
                                                  "fc2.bias"}


def test_a_run_that_saves_nothing_says_so(capsys, monkeypatch):
    _interrupt_at(monkeypatch, llama_train.LMTrainer, "train_step", 1)
    assert cli.main(["train", "llama", *TINY, "--steps", "1000"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert "nothing of this run will be saved" in err[0], err
    assert err[-1].endswith("nothing was saved (neither --out nor --checkpoint was given)"), err


# ---- 6. resources bounded before work starts ---------------------------------------------------
def test_threads_are_bounded(capsys, monkeypatch, files, no_compile):
    base, _ = files
    top = 4 * os.cpu_count()
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", str(base), "--threads", "100000"])
    assert e.value.code == 2
    assert f"expected an integer from 1 to {top}" in capsys.readouterr().err
    monkeypatch.setenv("JITGRAPH_NUM_THREADS", "100000")
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "mnist-fc", *MNIST])
    assert e.value.code == 2
    assert "JITGRAPH_NUM_THREADS=100000: expected an integer from 1" in capsys.readouterr().err
    from jitgraph.runtime.cpu.threading import configure
    with pytest.raises(ValueError, match="JITGRAPH_NUM_THREADS"):
        configure()


def test_a_program_larger_than_memory_is_refused_before_it_is_built(tmp_path, capsys,
                                                                   monkeypatch, testdata):
    from jitgraph.runtime.cpu import memory
    cfg, params, tok = read_llama(testdata.stories)
    big = tmp_path / "big.gguf"
    write_llama(big, dataclasses.replace(cfg, ctx=1 << 31), params, tok)
    monkeypatch.setattr(memory, "available", lambda: (64 << 20, "MemAvailable"))
    from jitgraph.runtime.cpu import backend
    monkeypatch.setattr(backend.CPU, "build", lambda *a: pytest.fail("built the program"))
    assert cli.main(["generate", str(big), "--ctx", "200000", "--prompt", "Once"]) == 2
    err = capsys.readouterr().err
    assert "the program needs" in err and "64.0 MiB is available (MemAvailable)" in err, err
    assert err.strip().endswith("try a smaller --ctx"), err
    text = tmp_path / "t.txt"
    text.write_text(testdata.shakespeare_tail.read_text())
    assert cli.main(["perplexity", str(big), "--text", str(text), "--split", "all",
                     "--ctx", "20000", "--quiet"]) == 2
    assert capsys.readouterr().err.strip().endswith("try a smaller --ctx or --batch-size")


def test_available_memory_reads_the_system():
    from jitgraph.runtime.cpu.memory import available
    have, where = available()
    with open("/proc/meminfo") as f:
        total = int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < have <= total and where


# ---- 7. Ctrl-C always works --------------------------------------------------------------------
_SLEEPER = textwrap.dedent("""
    import ctypes, signal, sys
    from jitgraph.cli import common
    signal.signal(signal.SIGTERM, common.raise_terminated)
    libc = ctypes.CDLL(None)
    print("ready", flush=True)
    try:
        common.in_worker(libc.sleep, 120)      # a native call of two minutes that releases the GIL
    except KeyboardInterrupt:
        sys.exit(130)
    except common.Terminated:
        sys.exit(143)
""")


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)    # (a shell's background job ignores it)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_long_native_call_does_not_hold_off_a_signal(signum, code):
    proc = subprocess.Popen([sys.executable, "-c", _SLEEPER], stdout=subprocess.PIPE,
                            text=True, preexec_fn=_default_sigint)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        proc.send_signal(signum)
        t0 = time.monotonic()
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code


@pytest.mark.slow
def test_perplexity_stops_at_ctrl_c(tmp_path, testdata):
    """perplexity of a model declaring a 2^31 context at --ctx 12000: each compiled call runs
    for many seconds; Ctrl-C ends the command within a few."""
    cfg, params, tok = read_llama(testdata.stories)
    big = tmp_path / "big.gguf"
    write_llama(big, dataclasses.replace(cfg, ctx=1 << 31), params, tok)
    text = tmp_path / "t.txt"
    text.write_text(testdata.shakespeare_tail.read_text() * 3)
    proc = subprocess.Popen([sys.executable, "-m", "jitgraph.cli", "perplexity", str(big),
                             "--text", str(text), "--split", "all", "--ctx", "12000",
                             "--batch-size", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    try:
        assert "n_ctx 12000" in proc.stdout.readline()
        time.sleep(8)                   # compiling, or inside the first call
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 5, err
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "jitgraph perplexity: interrupted (Ctrl-C)"


# ---- 9. resume from anywhere -------------------------------------------------------------------
def test_resume_from_another_directory_and_with_a_copy_of_the_text(tmp_path, monkeypatch,
                                                                   capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "ts.txt").write_text("To be, or not to be, that is the question.\n" * 60)
    monkeypatch.chdir(a)
    assert cli.main(["train", "llama", *TINY, "--text", "ts.txt", "--steps", "2",
                     "--checkpoint", "ck.gguf"]) == 0
    meta = llama_train.load_llama_checkpoint(a / "ck.gguf")[4]
    assert meta["args"]["text"] == str(a / "ts.txt")
    monkeypatch.chdir(b)
    assert cli.main(["train", "llama", "--resume", str(a / "ck.gguf"), "--steps", "3",
                     "--quiet", "--checkpoint", "ck.gguf"]) == 0
    assert llama_train.load_llama_checkpoint(b / "ck.gguf")[4]["step"] == 3
    # the text moved: a copy given with --text is accepted by its content
    (b / "copy.txt").write_bytes((a / "ts.txt").read_bytes())
    (a / "ts.txt").unlink()
    assert cli.main(["train", "llama", "--resume", "ck.gguf", "--steps", "4", "--quiet",
                     "--checkpoint", "ck.gguf"]) == 2
    assert "give the same text with --text FILE" in capsys.readouterr().err
    assert cli.main(["train", "llama", "--resume", "ck.gguf", "--text", "copy.txt",
                     "--steps", "4", "--quiet", "--checkpoint", "ck.gguf"]) == 0
    assert "--text" not in capsys.readouterr().err          # no "ignored --text" warning
    (b / "other.txt").write_text("Something else entirely, long enough to train on.\n" * 60)
    assert cli.main(["train", "llama", "--resume", "ck.gguf", "--text", "other.txt",
                     "--steps", "5", "--quiet", "--checkpoint", "ck.gguf"]) == 2
    assert "is not the one the checkpoint was trained on" in capsys.readouterr().err


# ---- 10. messages that name the real cause -----------------------------------------------------
def test_messages_name_the_real_cause(tmp_path, files, capsys, no_compile):
    base, text = files
    assert cli.main(["perplexity", str(base), "--text", str(tmp_path)]) == 2
    assert f"--text {tmp_path}: is a directory, not a text file" in capsys.readouterr().err
    assert cli.main(["train", "llama", *TINY, "--text", str(tmp_path)]) == 2
    assert "is a directory, not a text file" in capsys.readouterr().err
    # an adapter and a training checkpoint given as the model
    from jitgraph.models.lora import write_adapter
    cfg = read_llama(base)[0]
    adapter = tmp_path / "adapter.gguf"
    write_adapter(adapter, cfg, {"blk.0.attn_q.weight.lora_a": np.zeros((2, 8), np.float32),
                                 "blk.0.attn_q.weight.lora_b": np.zeros((8, 2), np.float32)}, 2.0)
    assert cli.main(["generate", str(adapter)]) == 2
    assert "is a LoRA adapter, not a model; give it with --lora" in capsys.readouterr().err
    ck = tmp_path / "ck.gguf"
    cfg, params, tok = read_llama(base)
    llama_train.save_llama_checkpoint(ck, cfg, tok, params, {}, {"kind": "finetune"})
    assert cli.main(["perplexity", str(ck), "--text", str(text)]) == 2
    assert "is a jitgraph training checkpoint, not a model" in capsys.readouterr().err


def test_perplexity_reports_the_split_bytes_before_decoding(tmp_path, files, capsys):
    base, _ = files
    text = tmp_path / "t.txt"
    data = ("naïve café " * 400).encode()          # the 10 % cut falls inside a character
    text.write_bytes(data)
    cut = int(0.9 * len(data))
    assert cli.main(["perplexity", str(base), "--text", str(text), "--ctx", "16"]) == 0
    out = capsys.readouterr().out
    assert f"(tail:0.1: {len(data) - cut} bytes)" in out, out


def test_export_says_merged_only(tmp_path, files, capsys):
    from jitgraph.models.lora import write_adapter
    base, _ = files
    cfg = read_llama(base)[0]
    adapter = tmp_path / "adapter.gguf"
    rng = np.random.default_rng(0)
    write_adapter(adapter, cfg, {
        "blk.0.attn_q.weight.lora_a": rng.normal(size=(2, 8)).astype(np.float32),
        "blk.0.attn_q.weight.lora_b": rng.normal(size=(8, 2)).astype(np.float32)}, 2.0)
    out = tmp_path / "merged.gguf"
    assert cli.main(["export", str(base), "--lora", str(adapter), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "unmerged" not in said and "merged" in said, said

"""Data-parallel training over MPI (jitgraph/distributed.py): 2 ranks under `mpiexec`, each test
a bounded subprocess. Oracles: the same steps in one process without MPI (losses within float
reassociation), the ranks against each other (params bitwise equal), the global order split by
hand (sharding), the files on disk (rank 0 alone writes). Skipped when mpi4py or mpiexec is
missing (pip install -e '.[mpi]')."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import distributed, optim
from jitgraph.models.mnist import mnist_fc

pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install -e '.[mpi]')")
MPIEXEC = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                       f"{os.environ.get('PATH', '')}")
if MPIEXEC is None:
    pytest.skip("no mpiexec on PATH or beside the Python interpreter (pip install mpich)",
                allow_module_level=True)

WORKER = Path(__file__).with_name("mpi_worker.py")
JITGRAPH = Path(sys.executable).parent / "jitgraph"
STEPS, BATCH = 20, 100


def mpirun(args, n=2, timeout=240, env=None):
    """`mpiexec -n n args` with one thread per rank; the CompletedProcess (never a hang)."""
    e = {**os.environ, "JITGRAPH_NUM_THREADS": "1", **(env or {})}
    try:
        return subprocess.run([MPIEXEC, "-n", str(n), *map(str, args)], capture_output=True,
                              text=True, timeout=timeout, env=e)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"mpiexec {' '.join(map(str, args))} still running after {timeout} s: "
                    f"{err.stderr}")


def test_not_under_mpiexec_is_no_world(monkeypatch):
    for k in distributed.SIZE_VARS:
        monkeypatch.delenv(k, raising=False)
    assert distributed.launched_size() == 1 and distributed.world() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert distributed.launched_size() == 4


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("mpi_train")
    r = mpirun([sys.executable, WORKER, "train", out, STEPS, BATCH])
    assert r.returncode == 0, r.stderr[-3000:]
    return [np.load(out / f"rank{k}.npz") for k in range(2)]


def test_two_ranks_train_as_one_process(two_ranks):
    """20 AdamW steps of MNIST FC, global batch 100: the ranks' averaged losses are the losses
    of one process on the whole batches; params equal across ranks and to that process's."""
    a, b = two_ranks
    # one process, the same global batches, no MPI
    prog = jg.compile(mnist_fc(BATCH), loss="loss", optimizer=optim.AdamW(lr=1e-3))
    rng = np.random.default_rng(0)
    x = rng.random((STEPS * BATCH, 784), dtype=np.float32)
    y = rng.integers(0, 10, STEPS * BATCH).astype(np.int32)
    order = rng.permutation(STEPS * BATCH)
    want = []
    for s in range(STEPS):
        idx = order[s * BATCH:(s + 1) * BATCH]
        want.append(float(prog.step(x=x[idx], y=y[idx])["loss"]))
        # sharding: rank r ran samples [r*50, (r+1)*50) of this global batch
        assert np.array_equal(a["slices"][s], idx[:BATCH // 2])
        assert np.array_equal(b["slices"][s], idx[BATCH // 2:])
    np.testing.assert_allclose(a["means"], want, rtol=2e-5)
    assert np.array_equal(a["means"], b["means"])
    np.testing.assert_allclose((a["losses"] + b["losses"]) / 2, a["means"], rtol=1e-6)
    for k in prog.params:
        assert a[k].tobytes() == b[k].tobytes(), k          # ranks agree bit for bit
        np.testing.assert_allclose(a[k], prog.params[k], rtol=1e-3, atol=2e-5)
    assert int(a["allreduces"]) == STEPS and int(a["threads"]) == 1


def test_cli_rank0_prints_and_writes(tmp_path):
    """`mpiexec -n 2 jitgraph train`: one JSON line (rank 0), the model and the checkpoint
    written once (no temporary files left), figures as one process computes them."""
    args = ["train", "mnist-fc", "--n-train", "400", "--n-test", "150", "--epochs", "1",
            "--batch-size", str(BATCH), "--val-split", "0.25", "--json", "--quiet"]
    r = mpirun([JITGRAPH, *args, "--out", tmp_path / "m.gguf",
                "--checkpoint", tmp_path / "ck.gguf"])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, r.stdout
    got = json.loads(lines[0])
    assert got["mpi_ranks"] == 2 and got["epochs"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.gguf", "m.gguf"]
    one = subprocess.run([str(JITGRAPH), *args], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "JITGRAPH_NUM_THREADS": "1"})
    assert one.returncode == 0, one.stderr[-3000:]
    ref = json.loads(one.stdout.strip().splitlines()[-1])
    for k in ("train_loss", "test_loss"):
        assert got[k] == pytest.approx(ref[k], rel=1e-5), k
    for k in ("val_acc", "test_acc"):
        assert got[k] == pytest.approx(ref[k], abs=1.5 / 100), k
    from jitgraph.formats.gguf import load_checkpoint
    _, params, _, meta = load_checkpoint(tmp_path / "ck.gguf")
    assert meta["epoch"] == 1 and set(params) == {"fc1.weight", "fc1.bias", "fc2.weight",
                                                  "fc2.bias"}


def test_resume_under_mpi_equals_uninterrupted(tmp_path):
    """Two epochs, or one with a checkpoint then --resume (params checked across the ranks
    after every step): the same figures bit for bit."""
    args = ["train", "mnist-fc", "--n-train", "400", "--n-test", "100", "--batch-size", "100",
            "--val-split", "0.25", "--json", "--quiet"]
    ck = tmp_path / "c.gguf"
    runs = [[*args, "--epochs", "2"], [*args, "--epochs", "1", "--checkpoint", ck],
            [*args, "--epochs", "2", "--resume", ck]]
    out = []
    for run in runs:
        r = mpirun([JITGRAPH, *run], env={"JITGRAPH_MPI_CHECK": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    for k in ("train_loss", "test_loss", "val_acc", "test_acc"):
        assert out[0][k] == out[2][k], k


def test_batch_must_divide_by_ranks():
    r = mpirun([JITGRAPH, "train", "mnist-fc", "--n-train", "300", "--batch-size", "99",
                "--epochs", "1", "--quiet"], timeout=120)
    assert r.returncode != 0
    assert "must divide by the 2 MPI ranks" in r.stderr


@pytest.mark.parametrize("mode,expect", [
    ("raise", "ValueError: rank 1 lost its data"),
    ("hang", "no answer from the other ranks for 3 s at the test's all-reduce")])
def test_a_failing_rank_ends_the_job(mode, expect):
    r = mpirun([sys.executable, WORKER, mode], timeout=60, env={"JITGRAPH_MPI_TIMEOUT": "3"})
    assert r.returncode != 0
    assert expect in r.stderr, r.stderr[-2000:]
    assert "unreachable" not in r.stdout


# ---- train llama / finetune under 2 ranks (jitgraph/cli/llama_train.py) ----------------------
# test_train_llama's tiny model: its kernels are shared with that file's tests (one compile)
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--ctx", "16", "--batch-size", "4"]


def _json_lines(stdout):
    return [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]


def _same_curve(got, want):
    """Losses of 2 ranks == one process's within float reassociation."""
    assert [c["step"] for c in got] == [c["step"] for c in want]
    for g, w in zip(got, want):
        for k in ("train", "val"):
            assert g[k] == pytest.approx(w[k], rel=1e-5), (g, w)


def _in_process(argv, capsys):
    from jitgraph import cli
    capsys.readouterr()
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
def test_train_llama_two_ranks_as_one_process_and_resume(tmp_path, capsys):
    """`mpiexec -n 2 jitgraph train llama`, global batch 4, 2 batches accumulated per update:
    5 steps with a checkpoint, then --resume to 10 (params hashed across the ranks after every
    update), against 10 steps in one process: the same loss curve within float
    reassociation, rank 0 alone prints and writes, the model's weights those of the one
    process."""
    from jitgraph.cli import llama_train
    from jitgraph.models.llama import read_llama
    args = ["train", "llama", *TINY, "--logical-batch", "8", "--eval-every", "5", "--json",
            "--quiet"]
    one = _in_process([*args, "--steps", "10", "--out", str(tmp_path / "one.gguf")], capsys)
    d = tmp_path / "mpi"
    d.mkdir()
    ck, out = d / "ck.gguf", d / "m.gguf"
    check = {"JITGRAPH_MPI_CHECK": "1"}
    r = mpirun([JITGRAPH, *args, "--steps", "5", "--checkpoint", ck], env=check)
    assert r.returncode == 0, r.stderr[-3000:]
    first = _json_lines(r.stdout)
    assert len(first) == 1, r.stdout                   # rank 0 prints, rank 1 is quiet
    assert sorted(p.name for p in d.iterdir()) == ["ck.gguf"]
    assert llama_train.load_llama_checkpoint(ck)[4]["step"] == 5
    r = mpirun([JITGRAPH, *args[:2], "--resume", ck, "--steps", "10", "--checkpoint", ck,
                "--out", out, "--json", "--quiet"], env=check)
    assert r.returncode == 0, r.stderr[-3000:]
    [got] = _json_lines(r.stdout)
    assert sorted(p.name for p in d.iterdir()) == ["ck.gguf", "m.gguf"]   # no temporaries
    assert got["mpi_ranks"] == 2 and got["steps"] == 10
    assert first[0]["param_checks"] == got["param_checks"] == 5    # after every update
    _same_curve(got["curve"], one["curve"])
    assert got["tokens_per_second"] == pytest.approx(8 * 16 * 1e3 / got["ms_per_step"])
    _, want, _ = read_llama(tmp_path / "one.gguf")
    _, params, _ = read_llama(out)
    for k in want:
        np.testing.assert_allclose(params[k], want[k], rtol=1e-3, atol=2e-5, err_msg=k)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A random tiny llama with the byte vocabulary (write_llama), and a short text."""
    from jitgraph.models.llama import LlamaConfig, llama_forward, write_llama
    from jitgraph.models.text import byte_vocab, read_corpus
    d = tmp_path_factory.mktemp("mpi_base")
    tok = byte_vocab()
    cfg = LlamaConfig(vocab=len(tok), dim=32, layers=1, heads=2, kv_heads=2, ff=None, ctx=16)
    write_llama(d / "base.gguf", cfg, llama_forward(cfg, 1, 16).init_params(3), tok)
    (d / "t.txt").write_bytes(read_corpus()[:20_000])
    return d / "base.gguf", d / "t.txt"


@pytest.mark.slow
def test_finetune_lora_two_ranks_as_one_process(tiny_base, tmp_path, capsys):
    """`mpiexec -n 2 jitgraph finetune --lora-rank 2` on a tiny base model: the loss curve and
    the perplexity before / after of one process, the adapter written once by rank 0 and equal
    to the one process's."""
    from jitgraph.models.llama import read_llama
    from jitgraph.models.lora import read_adapter
    base, text = tiny_base
    args = ["finetune", base, "--text", text, "--lora-rank", "2", "--lora-targets", "q,v",
            "--lr", "1e-2", "--ctx", "16", "--batch-size", "4", "--steps", "6",
            "--eval-every", "3", "--ppl-chunks", "4", "--json", "--quiet"]
    one = _in_process([*map(str, args), "--out", str(tmp_path / "one.gguf")], capsys)
    d = tmp_path / "mpi"
    d.mkdir()
    r = mpirun([JITGRAPH, *args, "--out", d / "ad.gguf"], env={"JITGRAPH_MPI_CHECK": "3"})
    assert r.returncode == 0, r.stderr[-3000:]
    [got] = _json_lines(r.stdout)
    assert sorted(p.name for p in d.iterdir()) == ["ad.gguf"]
    assert got["mpi_ranks"] == 2 and got["param_checks"] == 2 and got["mode"] == "lora"
    _same_curve(got["curve"], one["curve"])
    assert got["ppl_before"] == pytest.approx(one["ppl_before"], rel=1e-6)   # rank 0 alone
    assert got["ppl_after"] == pytest.approx(one["ppl_after"], rel=1e-4)
    cfg = read_llama(base)[0]
    want, got_ad = read_adapter(tmp_path / "one.gguf", cfg), read_adapter(d / "ad.gguf", cfg)
    for k in want[0]:
        np.testing.assert_allclose(got_ad[0][k], want[0][k], rtol=1e-3, atol=2e-5, err_msg=k)


def test_llama_batch_must_divide_by_ranks():
    r = mpirun([JITGRAPH, "train", "llama", *TINY[:-1], "3", "--steps", "1", "--quiet"],
               timeout=120)
    assert r.returncode != 0
    assert "--batch-size 3 is the global batch and must divide by the 2 MPI ranks" in r.stderr

"""The training loop and the CLI on the built-in data: accuracy, resume, JSON, GGUF round trip."""
import json
import math

import numpy as np
import pytest

from jitgraph import cli
from jitgraph.training import Result

SMALL = ["--n-train", "3000", "--n-test", "1000", "--quiet", "--json"]


def _last_json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_result_matches_ggml_formulas():
    r = Result()
    losses = [0.5, 0.7, 0.9, 0.3]
    for l in losses:
        r.add(l, 10, 7)
    mean, unc = r.loss()
    a = np.array(losses)
    assert mean == pytest.approx(a.mean())
    assert unc == pytest.approx(a.std(ddof=0) / math.sqrt(len(a) - 1))
    acc, acc_unc = r.accuracy()
    assert acc == pytest.approx(0.7)
    assert acc_unc == pytest.approx(math.sqrt(0.7 * 0.3 / 39))


@pytest.mark.slow
def test_train_reaches_accuracy_and_eval_agrees(tmp_path, capsys):
    model = tmp_path / "fc.gguf"
    assert cli.main(["train", "mnist-fc", "--epochs", "3", *SMALL, "--out", str(model)]) == 0
    res = _last_json(capsys)
    assert set(res) == {"test_acc", "test_loss", "train_loss", "val_acc", "epochs",
                        "epoch_seconds", "compile_seconds", "samples_per_second", "data",
                        "n_test", "precision", "loss_scale", "skipped_steps", "moments",
                        "master"}
    assert res["data"] == "synthetic" and res["n_test"] == 1000
    assert res["epochs"] == 3 and len(res["epoch_seconds"]) == 3
    # 10 classes: chance is 10 %; three short epochs on 3000 samples reach about 54 %
    assert res["test_acc"] > 0.45, res
    assert cli.main(["eval", str(model), "--n-test", "1000", "--quiet", "--json"]) == 0
    ev = _last_json(capsys)
    assert ev["n"] == 1000
    assert ev["test_acc"] == pytest.approx(res["test_acc"])
    assert ev["test_loss"] == pytest.approx(res["test_loss"], rel=1e-6)


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path, capsys):
    ck, a, b = tmp_path / "ck.gguf", tmp_path / "a.gguf", tmp_path / "b.gguf"
    args = ["train", "mnist-fc", *SMALL, "--logical-batch", "200"]
    assert cli.main([*args, "--epochs", "1", "--checkpoint", str(ck)]) == 0
    assert cli.main([*args, "--epochs", "2", "--resume", str(ck), "--out", str(a)]) == 0
    resumed = _last_json(capsys)
    assert cli.main([*args, "--epochs", "2", "--out", str(b)]) == 0
    straight = _last_json(capsys)
    assert a.read_bytes() == b.read_bytes()
    assert resumed["test_loss"] == straight["test_loss"]


def test_eval_rejects_a_truncated_model(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert cli.main(["eval", str(bad), "--quiet"]) == 2
    assert str(bad) in capsys.readouterr().err


def test_fit_with_accumulation_learns_and_splits():
    import jitgraph as jg
    ds = jg.data.synthetic_digits(1200, seed=3)
    logs = jg.fit(jg.models.mnist_fc(100), ds, epochs=3, logical_batch=200, val_split=0.2,
                  progress=False, seed=1)
    assert [log.epoch for log in logs] == [1, 2, 3]
    # ggml_opt_fit's split: whole logical batches, 80 % of 6 -> 4 batches of 200 for training
    assert logs[0].train.ndata == 800 and logs[0].val.ndata == 400
    assert logs[-1].train.loss()[0] < 0.8 * logs[0].train.loss()[0]
    assert logs[-1].val.accuracy()[0] > 0.3


def test_fit_rejects_bad_batches():
    import jitgraph as jg
    ds = jg.data.synthetic_digits(300, seed=0)
    with pytest.raises(ValueError, match="not a multiple"):
        jg.fit(jg.models.mnist_fc(100), ds, logical_batch=150, progress=False)
    with pytest.raises(ValueError, match="differs from the graph"):
        jg.fit(jg.models.mnist_fc(100), ds, batch_size=50, progress=False)


def test_dump_prints_each_stage(capsys):
    assert cli.main(["dump", "mnist-fc", "--stage", "graph"]) == 0
    graph = capsys.readouterr().out
    assert graph.startswith("graph ")
    assert "matmul(" in graph and "cross_entropy(" in graph
    assert cli.main(["dump", "mnist-fc", "--stage", "optimizer"]) == 0
    opt = capsys.readouterr().out
    assert "update fc1.weight <- " in opt and "state(" in opt
    assert cli.main(["dump", "mnist-fc", "--stage", "kernels"]) == 0
    src = capsys.readouterr().out
    assert "matmul" in src and "; %" in src

"""The training loop and the CLI on the built-in data: accuracy, resume, JSON, GGUF round trip."""
import json
import math

import numpy as np
import pytest

from jitgraph import cli
from jitgraph.train import Result

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
                        "epoch_seconds", "compile_seconds", "samples_per_second"}
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

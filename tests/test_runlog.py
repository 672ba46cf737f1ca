"""Run logs (--log FILE.jsonl): the records' schema against what the loop computed, --resume
appending, a new run truncating, and the reader's handling of a torn last line."""
import json
import math

import pytest

from jitgraph import cli
from jitgraph.formats.runlog import RunLog, read_log

MNIST = ["train", "mnist-fc", "--n-train", "600", "--n-test", "200", "--batch-size", "100",
         "--val-split", "0.2", "--quiet"]


def _kinds(recs, kind):
    return [r for r in recs if r["kind"] == kind]


def test_mnist_log_schema_and_resume_appends(tmp_path):
    log, ck = tmp_path / "run.jsonl", tmp_path / "ck.gguf"
    assert cli.main([*MNIST, "--epochs", "1", "--checkpoint", str(ck), "--log", str(log)]) == 0
    first = log.read_bytes()
    recs = read_log(log)
    assert recs[0]["kind"] == "run" and recs[0]["name"] == "jitgraph train mnist-fc"
    assert recs[0]["resumed"] is False and recs[0]["options"]["batch_size"] == 100
    steps = _kinds(recs, "step")
    # 600 samples, 20 % validate: 4 batches of 100 train
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert set(r) >= {"step", "loss", "lr", "ms", "samples_per_s", "samples"}
        assert r["lr"] == 1e-3 and r["ms"] > 0 and r["samples"] == 100 * r["step"]
        assert r["samples_per_s"] == pytest.approx(100 / (r["ms"] / 1e3), rel=1e-6)
    val, test = _kinds(recs, "eval")
    assert (val["split"], test["split"]) == ("val", "test")
    # the epoch's training loss is the mean of the per-step losses logged
    assert val["train_loss"] == pytest.approx(sum(r["loss"] for r in steps) / len(steps))
    assert 0 <= val["accuracy"] <= 1 and 0 <= test["accuracy"] <= 1
    assert math.isfinite(val["loss"])

    assert cli.main([*MNIST, "--epochs", "2", "--resume", str(ck), "--log", str(log)]) == 0
    assert log.read_bytes().startswith(first)          # appended, the first run unchanged
    recs = read_log(log)
    runs = _kinds(recs, "run")
    assert [r["resumed"] for r in runs] == [False, True]
    assert [r["step"] for r in _kinds(recs, "step")] == [1, 2, 3, 4, 5, 6, 7, 8]

    assert cli.main([*MNIST, "--epochs", "1", "--log", str(log)]) == 0   # a new run truncates
    recs = read_log(log)
    assert len(_kinds(recs, "run")) == 1 and len(_kinds(recs, "step")) == 4


def test_llama_log_records_match_the_curve(tmp_path, capsys):
    log = tmp_path / "llama.jsonl"
    args = ["train", "llama", "--dim", "32", "--layers", "1", "--heads", "2", "--ctx", "16",
            "--batch-size", "2", "--steps", "4", "--eval-every", "2", "--quiet", "--json",
            "--log", str(log)]
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recs = read_log(log)
    steps, evals = _kinds(recs, "step"), _kinds(recs, "eval")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["tokens"] == 2 * 16 * r["step"] for r in steps)   # batch x ctx per step
    assert [(e["step"], e["loss"], e["train_loss"]) for e in evals] == \
        [(c["step"], c["val"], c["train"]) for c in summary["curve"]]
    for e in evals:
        assert e["perplexity"] == pytest.approx(math.exp(e["loss"]))
    # the training loss of an evaluation is the mean of the steps since the previous one
    assert evals[1]["train_loss"] == pytest.approx((steps[2]["loss"] + steps[3]["loss"]) / 2)


def test_reader_skips_a_torn_last_line_and_refuses_others(tmp_path):
    p = tmp_path / "r.jsonl"
    with RunLog(p, "test") as log:
        log.step(1, 2.5, lr=0.1)
        log.eval(1, 2.25, perplexity=math.exp(2.25))
        log.step(2, float("nan"))                      # not finite: null
    whole = read_log(p)
    assert [r["kind"] for r in whole] == ["run", "step", "eval", "step"]
    assert whole[3]["loss"] is None
    with open(p, "ab") as f:
        f.write(b'{"kind": "step", "step": 3, "lo')     # killed mid-write
    assert read_log(p) == whole
    # a resumed run cuts the torn line off and appends on a line of its own
    with RunLog(p, "test", resume=True) as log:
        log.step(3, 2.0)
    recs = read_log(p)
    assert recs[:4] == whole and recs[4]["resumed"] is True and recs[5]["step"] == 3
    # a bad line that is not the last, or a record lacking a field, names the file and line
    lines = p.read_text().splitlines()
    p.write_text(lines[0] + "\n{oops\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match=r"r\.jsonl:2: not a JSON line"):
        read_log(p)
    p.write_text(lines[0] + '\n{"kind": "step", "loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:2: step record field 'step' is missing"):
        read_log(p)


def _events(directory):
    """{tag: {step: value}} of the scalars in the TensorBoard event files of `directory`
    (TFRecord framing: length, its CRC, an Event protobuf, its CRC)."""
    import struct
    from tensorboardX.proto.event_pb2 import Event
    out = {}
    for f in sorted(directory.glob("events.out.tfevents.*")):
        data, at = f.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            ev = Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, {})[ev.step] = v.simple_value
    return out


def test_tensorboard_scalars_match_the_log(tmp_path):
    pytest.importorskip("tensorboardX", reason="tensorboardX is not installed "
                                               "(pip install -e '.[tensorboard]')")
    log, board = tmp_path / "run.jsonl", tmp_path / "tb"
    assert cli.main([*MNIST, "--epochs", "1", "--log", str(log), "--tensorboard",
                     str(board)]) == 0
    recs, ev = read_log(log), _events(board)
    steps = _kinds(recs, "step")
    assert ev["train/loss"] == pytest.approx({r["step"]: r["loss"] for r in steps}, rel=1e-6)
    assert ev["train/samples_per_s"] == pytest.approx(
        {r["step"]: r["samples_per_s"] for r in steps}, rel=1e-6)
    val, test = _kinds(recs, "eval")
    assert ev["val/loss"] == pytest.approx({val["step"]: val["loss"]}, rel=1e-6)
    assert ev["test/accuracy"] == pytest.approx({test["step"]: test["accuracy"]}, rel=1e-6)


def test_tensorboard_without_tensorboardx_names_the_extra(tmp_path, monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    assert cli.main([*MNIST, "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensorboardX" in err[0] and ".[tensorboard]" in err[0]


def test_finetune_log_appends_on_resume(tmp_path, testdata, capsys):
    from jitgraph.models.text import read_corpus
    text = tmp_path / "t.txt"
    text.write_bytes(read_corpus()[:40_000])
    log, ck = tmp_path / "ft.jsonl", tmp_path / "ck.gguf"
    args = ["finetune", str(testdata.stories), "--text", str(text), "--lora-rank", "2",
            "--ctx", "32", "--batch-size", "2", "--eval-every", "1", "--no-ppl", "--quiet",
            "--out", str(tmp_path / "a.gguf"), "--log", str(log)]
    assert cli.main([*args, "--steps", "2", "--checkpoint", str(ck)]) == 0
    assert cli.main([*args, "--steps", "3", "--resume", str(ck), "--json"]) == 0
    curve = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["curve"]
    recs = read_log(log)
    assert [(r["name"], r["resumed"]) for r in _kinds(recs, "run")] == \
        [("jitgraph finetune", False), ("jitgraph finetune", True)]
    assert [r["step"] for r in _kinds(recs, "step")] == [1, 2, 3]
    # the checkpoint carries the curve across the resume: the log's evals are that curve
    assert [(e["step"], e["loss"]) for e in _kinds(recs, "eval")] == \
        [(c["step"], c["val"]) for c in curve]

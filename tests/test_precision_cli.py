"""--precision on the training commands (jitgraph/cli): `train llama` and `finetune` in bf16
(and f16, with its dynamic loss scale) follow the f32 run's losses within the format's
roundings and learn; the precision is in --json and in the checkpoint, and a resume in another
precision is refused before anything compiles; f16 through forced overflows: the steps are
skipped and counted, the scale and count are printed, checkpointed and resumed bit for bit;
`train mnist-fc --precision bf16`."""
import contextlib
import io
import json
import math

import gguf
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import cli
from jitgraph.cli import llama_train

EPS = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11}     # the formats' relative rounding bound
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--ctx", "16", "--batch-size", "4",
        "--quiet"]


def _last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def _losses(res, key):
    return np.array([c[key] for c in res["curve"]])


def _cut_and_resume(args, ck, capsys):
    """`args` for 4 steps, checkpointed to `ck`, then `--resume ck` (no other option) to 8
    steps: the resumed run's --json result."""
    assert cli.main([*args, "--steps", "4", "--checkpoint", str(ck)]) == 0
    capsys.readouterr()
    assert cli.main(["train", "llama", "--resume", str(ck), "--steps", "8", "--quiet",
                     "--checkpoint", str(ck), "--json"]) == 0
    return _last_json(capsys.readouterr().out)


def _same_checkpoints(a, b):
    """The params and optimizer state of llama checkpoints `a` and `b` bit for bit; their
    (state, meta) pairs."""
    _, _, pa, sa, ma = llama_train.load_llama_checkpoint(a)
    _, _, pb, sb, mb = llama_train.load_llama_checkpoint(b)
    assert set(pa) == set(pb) and set(sa) == set(sb) and sa
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    return (sa, ma), (sb, mb)


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    """`train llama` TINY, 8 steps at a high learning rate, in f32, bf16 and f16 (its default
    loss scale), with checkpoints."""
    d = tmp_path_factory.mktemp("prec")
    out = {}
    for p in ("f32", "bf16", "f16"):
        ck = d / f"{p}.ckpt"
        with contextlib.redirect_stdout(io.StringIO()) as got:
            assert cli.main(["train", "llama", *TINY, "--steps", "8", "--eval-every", "1",
                             "--lr", "3e-3", "--precision", p, "--checkpoint", str(ck),
                             "--json"]) == 0
        out[p] = (_last_json(got.getvalue()), ck)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_train_llama_in_half_follows_f32(llama_runs, dt):
    a, _ = llama_runs["f32"]
    b, _ = llama_runs[dt]
    assert a["precision"] == "f32" and b["precision"] == dt
    assert a["loss_scale"] is None and a["skipped_steps"] == 0
    if dt == "f16":          # no step of this small model overflows at the default scale
        assert b["loss_scale"] == 65536.0 and b["skipped_steps"] == 0
    for key in ("train", "val"):
        la, lb = _losses(a, key), _losses(b, key)
        assert len(la) == len(lb) == 8
        assert not np.array_equal(la, lb)                  # the half GEMMs did round
        np.testing.assert_allclose(lb, la, rtol=8 * EPS[dt], atol=0, err_msg=key)
        assert lb[-1] < lb[0] - 0.1                         # and it learns
    # the first step's loss comes from the same initial weights: only the forward's roundings
    assert _losses(b, "train")[0] == pytest.approx(_losses(a, "train")[0], rel=2 * EPS[dt])


@pytest.mark.slow
def test_checkpoint_records_the_precision_and_resume_keeps_it(llama_runs, capsys,
                                                              monkeypatch):
    _, ck = llama_runs["bf16"]
    meta = llama_train.load_llama_checkpoint(ck)[4]
    assert meta["args"]["precision"] == "bf16"
    _, ck32 = llama_runs["f32"]
    assert llama_train.load_llama_checkpoint(ck32)[4]["args"]["precision"] == "f32"

    def fail(*a, **k):
        raise AssertionError("compiled before the precision was checked")
    monkeypatch.setattr(jg, "compile", fail)
    for path, other in ((ck, "f32"), (ck, "f16"), (ck32, "bf16")):
        assert cli.main(["train", "llama", "--resume", str(path), "--steps", "9",
                         "--precision", other, "--quiet"]) == 2
        err = capsys.readouterr().err
        want = "bf16" if path == ck else "f32"
        assert f"trained with --precision {want}, not {other}" in err, err
        assert "Traceback" not in err


@pytest.mark.slow
def test_resume_without_precision_continues_in_the_checkpoints(llama_runs, tmp_path, capsys):
    """8 bf16 steps straight == 4, checkpoint, resume (no --precision given), 4 more: the
    resumed run is bf16 and its params are bitwise the straight run's."""
    _, straight = llama_runs["bf16"]
    ck = tmp_path / "half.ckpt"
    args = ["train", "llama", *TINY, "--eval-every", "1", "--lr", "3e-3", "--precision", "bf16"]
    res = _cut_and_resume(args, ck, capsys)
    assert res["precision"] == "bf16" and res["steps"] == 8
    _same_checkpoints(straight, ck)


@pytest.mark.slow
def test_finetune_bf16_follows_f32(stories, corpus_file, tmp_path, capsys):
    """A LoRA finetune of llama.cpp's stories260K, 4 steps, in f32 and bf16: the same losses
    within bf16 roundings, decreasing."""
    res = {}
    for p in ("f32", "bf16"):
        assert cli.main(["finetune", stories, "--text", corpus_file(40_000),
                         "--lora-rank", "2", "--lora-targets", "q,k,v,o", "--lr", "1e-2",
                         "--steps", "4", "--ctx", "32", "--batch-size", "2",
                         "--eval-every", "1", "--no-ppl", "--quiet", "--json",
                         "--precision", p, "--out", str(tmp_path / f"{p}.gguf")]) == 0
        res[p] = _last_json(capsys.readouterr().out)
    assert res["bf16"]["precision"] == "bf16"
    for key in ("train", "val"):
        la, lb = _losses(res["f32"], key), _losses(res["bf16"], key)
        assert not np.array_equal(la, lb)
        np.testing.assert_allclose(lb, la, rtol=8 * EPS["bf16"], atol=0, err_msg=key)
    assert _losses(res["bf16"], "val")[-1] < _losses(res["bf16"], "val")[0]


@pytest.mark.slow
def test_f16_overflows_are_skipped_counted_and_resumed_bit_exact(llama_runs, tmp_path, capsys):
    """--precision f16 --loss-scale 2**30: the first steps overflow f16 and are skipped (each
    halves the scale), then it trains; with --loss-scale-interval 2 the scale grows back and
    overflows again. 8 steps straight == 4, checkpoint, resume, 4 more: params, AdamW state,
    scale and skip count bit for bit."""
    args = ["train", "llama", *TINY, "--eval-every", "1", "--lr", "3e-3", "--precision", "f16",
            "--loss-scale", str(2.0 ** 30), "--loss-scale-interval", "2"]
    straight, ck = tmp_path / "straight.ckpt", tmp_path / "cut.ckpt"
    assert cli.main([*args, "--steps", "8", "--checkpoint", str(straight), "--json"]) == 0
    res = _last_json(capsys.readouterr().out)
    assert res["precision"] == "f16" and res["steps"] == 8
    n, scale = res["skipped_steps"], res["loss_scale"]
    # 30 - n halvings and at most one doubling per 2 applied steps: a power of two in between
    e = math.log2(scale)
    assert n >= 10 and e == int(e) and 30 - n <= e <= 30 - n + 8 // 2
    val = _losses(res, "val")
    assert val[-1] < val[0] - 0.1

    again = _cut_and_resume(args, ck, capsys)
    assert (again["skipped_steps"], again["loss_scale"]) == (n, scale)
    (_, ma), (_, mb) = _same_checkpoints(straight, ck)
    assert ma["scaler"] == mb["scaler"] and ma["skipped"] == mb["skipped"] == n
    assert ma["calls"] == mb["calls"] == 8


@pytest.mark.slow
def test_train_mnist_bf16(tmp_path, capsys):
    small = ["--n-train", "1200", "--n-test", "400", "--quiet", "--json", "--epochs", "1"]
    res = {}
    for p in ("f32", "bf16"):
        assert cli.main(["train", "mnist-fc", *small, "--precision", p,
                         "--checkpoint", str(tmp_path / f"{p}.ckpt")]) == 0
        res[p] = _last_json(capsys.readouterr().out)
    assert res["bf16"]["precision"] == "bf16" and res["bf16"]["loss_scale"] is None
    # 1 epoch of 11 AdamW steps: the same model within bf16's roundings, learning
    assert res["bf16"]["test_loss"] == pytest.approx(res["f32"]["test_loss"], rel=0.05)
    assert res["bf16"]["test_acc"] == pytest.approx(res["f32"]["test_acc"], abs=0.03)
    assert res["bf16"]["test_loss"] < math.log(10) - 0.2
    assert cli.main(["train", "mnist-fc", "--resume", str(tmp_path / "bf16.ckpt"), "--epochs",
                     "2", "--precision", "f32", "--quiet"]) == 2
    assert "trained with --precision bf16, not f32" in capsys.readouterr().err
    assert cli.main(["train", "mnist-fc", *small, "--loss-scale", "8"]) == 2
    assert "--loss-scale: loss scaling is for --precision f16" in capsys.readouterr().err


@pytest.mark.slow
def test_train_llama_bf16_moments(llama_runs, tmp_path, capsys, testdata):
    """--moments bf16: half the optimizer state, the f32 run's losses within bf16 roundings,
    the bf16 moments checkpointed (as their bits) and resumed bit for bit."""
    a, _ = llama_runs["f32"]
    args = ["train", "llama", *TINY, "--eval-every", "1", "--lr", "3e-3", "--moments", "bf16"]
    straight, ck = tmp_path / "straight.ckpt", tmp_path / "cut.ckpt"
    assert cli.main([*args, "--steps", "8", "--checkpoint", str(straight), "--json"]) == 0
    b = _last_json(capsys.readouterr().out)
    assert b["moments"] == "bf16" and a["moments"] == "f32"
    assert 2 * b["optimizer_state_bytes"] == a["optimizer_state_bytes"]
    for key in ("train", "val"):
        la, lb = _losses(a, key), _losses(b, key)
        assert not np.array_equal(la, lb)
        np.testing.assert_allclose(lb, la, rtol=8 * EPS["bf16"], atol=0, err_msg=key)
    _cut_and_resume(args, ck, capsys)
    (sa, _), _ = _same_checkpoints(straight, ck)
    assert all(v.dtype.itemsize == 2 for v in sa.values())
    moments = {"state." + k for k in sa if k.startswith(("opt/m/", "opt/v/"))}
    assert moments and all(sa[k[6:]].dtype == np.uint16 for k in moments)   # bf16 bits
    assert moments <= {t.name for t in gguf.GGUFReader(ck).tensors
                       if t.tensor_type == gguf.GGMLQuantizationType.BF16}
    with pytest.raises(SystemExit):
        cli.main(["finetune", str(testdata.stories), "--full", "--optimizer", "sgd",
                  "--moments", "bf16", "--out", str(tmp_path / "o.gguf")])
    assert "--optimizer sgd has none" in capsys.readouterr().err


def test_dump_shows_the_precision_stage(capsys):
    """`dump --precision bf16 --stage precision`: each GEMM reads bf16 casts and gives a bf16
    product, the bias adds and relu that follow stay bf16 (x, the weights and the biases cast:
    5 casts), the logits go back to f32; f16's optimizer stage unscales by opt/loss_scale; the
    precision stage of an f32 program is a usage error, as is --loss-scale without f16."""
    assert cli.main(["dump", "mnist-fc", "--stage", "precision", "--precision", "bf16",
                     "--quiet"]) == 0
    out = capsys.readouterr().out
    mm = [line for line in out.splitlines() if "matmul(" in line]
    assert len(mm) == 2 and all(line.rstrip().endswith("bf16[100,500]") or
                                line.rstrip().endswith("bf16[100,10]") for line in mm), mm
    assert out.count("[dtype=bf16]") == 5 and out.count("[dtype=f32]") == 1
    follow = [line for line in out.splitlines() if " add(" in line or " relu(" in line]
    assert len(follow) == 3 and all("bf16[100," in line for line in follow), follow
    assert cli.main(["dump", "mnist-fc", "--stage", "optimizer", "--precision", "f16",
                     "--quiet"]) == 0
    assert "opt/loss_scale" in capsys.readouterr().out
    assert cli.main(["dump", "mnist-fc", "--stage", "precision", "--quiet"]) == 2
    assert "--stage precision: the stage runs with --precision bf16 or f16" in \
        capsys.readouterr().err
    assert cli.main(["dump", "llama", "--stage", "graph", "--loss-scale", "8"]) == 2
    assert "loss scaling is for --precision f16" in capsys.readouterr().err

"""--master bf16 on `train llama`, `train` (MNIST) and `finetune` (LoRA: the adapters): half
the weights' bytes, the f32 run's losses within bf16 roundings, a resumed run bit for bit equal
to an unbroken one, and files written from the weights' f32 values."""
import json
import math

import numpy as np
import pytest

from jitgraph import cli
from jitgraph.cli import llama_train

TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--ctx", "16", "--batch-size", "4",
        "--quiet"]
EPS = 2.0 ** -8


def _last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def _losses(res, key):
    return np.array([c[key] for c in res["curve"]])


def _bf16_exact(a):
    """Whether every value of float32 array a is a bf16 value (its low 16 bits zero)."""
    return not np.any(np.asarray(a, np.float32).view(np.uint32) & 0xFFFF)


@pytest.mark.slow
def test_train_llama_master_bf16(tmp_path, capsys):
    from jitgraph.models.llama import read_llama
    args = ["train", "llama", *TINY, "--eval-every", "1", "--lr", "3e-3"]
    assert cli.main([*args, "--steps", "8", "--json"]) == 0
    a = _last_json(capsys.readouterr().out)
    straight, ck, out = tmp_path / "straight.ckpt", tmp_path / "cut.ckpt", tmp_path / "m.gguf"
    assert cli.main([*args, "--master", "bf16", "--steps", "8", "--checkpoint", str(straight),
                     "--out", str(out), "--json"]) == 0
    b = _last_json(capsys.readouterr().out)
    assert a["master"] == "f32" and b["master"] == "bf16"
    assert 2 * b["weights_bytes"] == a["weights_bytes"]
    assert a["persistent_bytes"] - b["persistent_bytes"] >= b["weights_bytes"] - 4096
    for key in ("train", "val"):
        la, lb = _losses(a, key), _losses(b, key)
        assert not np.array_equal(la, lb)
        np.testing.assert_allclose(lb, la, rtol=8 * EPS, atol=0, err_msg=key)
    assert _losses(b, "val")[-1] < _losses(b, "val")[0] - 0.5
    # 4 steps, checkpoint, resume (no --master given: the checkpoint's), 4 more
    assert cli.main([*args, "--master", "bf16", "--steps", "4", "--checkpoint", str(ck)]) == 0
    assert cli.main(["train", "llama", "--resume", str(ck), "--steps", "8", "--quiet",
                     "--checkpoint", str(ck)]) == 0
    _, _, pa, sa, ma = llama_train.load_llama_checkpoint(straight)
    _, _, pb, sb, mb = llama_train.load_llama_checkpoint(ck)
    assert ma["args"]["master"] == mb["args"]["master"] == "bf16"
    for k in pa:
        assert _bf16_exact(pa[k]), k           # the f32 values of the bf16 weights
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    # the model file: f32 weights, the bf16 weights' values
    _, params, _ = read_llama(out)
    assert all(v.dtype == np.float32 and _bf16_exact(v) for v in params.values())


@pytest.mark.slow
def test_train_mnist_and_lora_finetune_master_bf16(tmp_path, capsys, testdata):
    from jitgraph.models.text import read_corpus
    small = ["--n-train", "704", "--batch-size", "64", "--epochs", "1", "--quiet", "--json"]
    assert cli.main(["train", "mnist-fc", *small]) == 0
    f = _last_json(capsys.readouterr().out)
    assert cli.main(["train", "mnist-fc", *small, "--master", "bf16",
                     "--out", str(tmp_path / "m.gguf")]) == 0
    r = _last_json(capsys.readouterr().out)
    assert r["master"] == "bf16" and f["master"] == "f32"
    # 1 epoch of 11 AdamW steps: the f32 model within bf16's roundings, learning
    assert r["test_loss"] == pytest.approx(f["test_loss"], rel=0.05)
    assert r["test_acc"] == pytest.approx(f["test_acc"], abs=0.03)
    assert r["test_loss"] < math.log(10) - 0.2
    assert cli.main(["eval", str(tmp_path / "m.gguf"), "--quiet", "--json"]) == 0
    e = _last_json(capsys.readouterr().out)
    assert e["test_acc"] == pytest.approx(r["test_acc"], abs=0.01)
    text = tmp_path / "t.txt"
    text.write_bytes(read_corpus()[:40_000])
    ft = ["finetune", str(testdata.stories), "--text", str(text), "--lora-rank", "2",
          "--lora-targets", "q,k,v,o", "--lr", "1e-2", "--steps", "4", "--ctx", "32",
          "--batch-size", "2", "--eval-every", "1", "--no-ppl", "--quiet", "--json"]
    res = {}
    for m in ("f32", "bf16"):
        assert cli.main([*ft, "--master", m, "--out", str(tmp_path / f"{m}.gguf")]) == 0
        res[m] = _last_json(capsys.readouterr().out)
    assert res["bf16"]["master"] == "bf16"
    # the adapters are the trainable weights: stored bf16, 2 bytes less each
    n = res["bf16"]["trainable_params"]
    assert res["f32"]["weights_bytes"] - res["bf16"]["weights_bytes"] == 2 * n > 0
    for key in ("train", "val"):
        np.testing.assert_allclose(_losses(res["bf16"], key), _losses(res["f32"], key),
                                   rtol=8 * EPS, atol=0, err_msg=key)
    # a full finetune: the base's f32 weights (read from the file) rounded into bf16 slots,
    # the model written as f32 values of bf16 weights
    from jitgraph.models.llama import read_llama
    full = tmp_path / "full.gguf"
    assert cli.main([*ft[:4], "--full", *ft[10:], "--master", "bf16", "--out", str(full)]) == 0
    r = _last_json(capsys.readouterr().out)
    assert r["master"] == "bf16" and _losses(r, "val")[-1] < _losses(r, "val")[0]
    _, params, _ = read_llama(full)
    assert all(v.dtype == np.float32 and _bf16_exact(v) for v in params.values())


@pytest.mark.slow
def test_train_mnist_master_bf16_resumes_bit_for_bit(tmp_path, capsys):
    """1 epoch, checkpoint (the weights' f32 values), --resume to 2 epochs: the model file of 2
    unbroken epochs byte for byte (the rounding's bits come from --seed and the step)."""
    ck, a, b = tmp_path / "ck.gguf", tmp_path / "a.gguf", tmp_path / "b.gguf"
    args = ["train", "mnist-fc", "--n-train", "1000", "--n-test", "500", "--quiet", "--json",
            "--logical-batch", "200", "--master", "bf16", "--seed", "3"]
    assert cli.main([*args, "--epochs", "1", "--checkpoint", str(ck)]) == 0
    assert cli.main([*args, "--epochs", "2", "--resume", str(ck), "--out", str(a)]) == 0
    resumed = _last_json(capsys.readouterr().out)
    assert cli.main([*args, "--epochs", "2", "--out", str(b)]) == 0
    straight = _last_json(capsys.readouterr().out)
    assert resumed["master"] == straight["master"] == "bf16"
    assert a.read_bytes() == b.read_bytes()
    assert resumed["test_loss"] == straight["test_loss"]

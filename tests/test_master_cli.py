"""--master bf16 on `train llama`, `train` (MNIST) and `finetune` (LoRA: the adapters): half
the weights' bytes, the f32 run's losses within bf16 roundings, checkpoints holding the weights
(and bf16 moments) as GGUF BF16 tensors of their bits (read with gguf.GGUFReader, an independent
reader), a resumed run bit for bit equal to an unbroken one (from an older checkpoint too, which
held the weights' f32 values and the moments as I16), model and adapter files written from the
weights' f32 values."""
import json
import math

import gguf
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import cli
from jitgraph.cli import llama_train
from jitgraph.formats import gguf as gguf_io
from jitgraph.half import to_f32

BF16, F32 = gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F32

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


def _tensors(path):
    """name -> (GGML type, data bytes, the values: BF16 as uint16 bits) of a GGUF file, read by
    gguf.GGUFReader."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        a = np.array(t.data)
        out[t.name] = (t.tensor_type, int(t.n_bytes),
                       a.view(np.uint16) if t.tensor_type == BF16 else a)
    return out


def _weight_bytes(tensors):
    return sum(n for k, (_, n, _) in tensors.items() if not k.startswith(gguf_io.STATE_PREFIX))


def _as_older_llama_checkpoint(src, dst):
    """The checkpoint `src` as an older jitgraph wrote it: bf16 weights as their f32 values,
    bf16 state as I16 (its bits)."""
    cfg, tok, params, state, meta = llama_train.load_llama_checkpoint(src)
    llama_train.save_llama_checkpoint(
        dst, cfg, tok, {k: to_f32(v, "bf16") if v.dtype == np.uint16 else v
                        for k, v in params.items()},
        {k: v.view(np.int16) if v.dtype == np.uint16 else v for k, v in state.items()},
        {k: v for k, v in meta.items() if k != "shapes"})
    kinds = {t for t, _, _ in _tensors(dst).values()}
    assert BF16 not in kinds and F32 in kinds


# ---- the checkpoint files (no compile) --------------------------------------------------------
def _bits(rng, shape):
    return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(
        np.uint16)


def test_mnist_checkpoint_keeps_bf16_as_bf16_bits(tmp_path):
    """bf16 params and state (uint16 bits) are BF16 tensors of those bits; load_checkpoint
    gives the bits back, load_model their f32 values; other dtypes as they were; a truncated
    file is an error naming it."""
    from jitgraph.models import MODELS
    rng = np.random.default_rng(0)
    params = {k: _bits(rng, s) for k, s in MODELS["mnist-fc"].param_shapes.items()}
    state = {"opt/m/fc1.bias": _bits(rng, (10, 3)), "older": np.arange(4, dtype=np.int16),
             "opt/step": np.array(5)}
    path = tmp_path / "ck.gguf"
    gguf_io.save_checkpoint(str(path), "mnist-fc", params, state, {"epoch": 1})
    t = _tensors(str(path))
    assert {k: v[0] for k, v in t.items()} == {
        **{k: BF16 for k in params}, "state.opt/m/fc1.bias": BF16, "state.older":
        gguf.GGMLQuantizationType.I16, "state.opt/step": gguf.GGMLQuantizationType.I64}
    assert _weight_bytes(t) == 2 * sum(a.size for a in params.values())
    # the bits as written, in ggml's layout (the model's GGMLTensor table: a transpose)
    ggml = MODELS["mnist-fc"].to_ggml(params, keep_bf16=True)
    for k, a in params.items():
        assert ggml[k].dtype == np.uint16, k
        assert np.array_equal(t[k][2].reshape(-1), ggml[k].reshape(-1)), k
    _, p, s, m = gguf_io.load_checkpoint(str(path))
    assert m == {"epoch": 1}
    for k, a in {**params, **state}.items():
        b = p[k] if k in params else s[k]
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b), k
    _, values = gguf_io.load_model(str(path))
    for k, a in params.items():
        assert values[k].dtype == np.float32
        assert np.array_equal(values[k].view(np.uint32), a.astype(np.uint32) << 16), k
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])
    with pytest.raises(jg.ModelFormatError, match="truncated") as e:
        gguf_io.load_checkpoint(str(path))
    assert str(path) in str(e.value)


def test_llama_checkpoint_keeps_bf16_as_bf16_bits(tmp_path):
    """The llama checkpoint: bf16 params and state as BF16 tensors of their bits, read back as
    the same bits; an older one's I16 state reads as I16; a truncated one is an error naming
    the file."""
    from jitgraph.formats.llama_checkpoint import load_llama_checkpoint, save_llama_checkpoint
    from jitgraph.models.llama import LlamaConfig, llama_forward
    from jitgraph.models.text import byte_vocab
    cfg = LlamaConfig(vocab=354, dim=8, layers=1, heads=2, ctx=16)
    rng = np.random.default_rng(1)
    params = {k: _bits(rng, v.shape) for k, v in llama_forward(cfg, 1, 4).init_params(0).items()}
    state = {f"opt/m/{k}": _bits(rng, v.shape) for k, v in params.items()}
    state["older"] = np.arange(6, dtype=np.int16).reshape(2, 3)
    meta = {"kind": "train-llama", "args": {}, "calls": 3, "step": 3, "rng": {"s": 1}}
    path = tmp_path / "ck.gguf"
    save_llama_checkpoint(path, cfg, byte_vocab(), params, state, meta)
    t = _tensors(str(path))
    assert all(t[k][0] == BF16 for k in params)
    assert all(t["state." + k][0] == (gguf.GGMLQuantizationType.I16 if k == "older" else BF16)
               for k in state)
    assert _weight_bytes(t) == 2 * sum(a.size for a in params.values())
    _, _, p, s, m = load_llama_checkpoint(path)
    assert m["step"] == 3
    for k, a in {**params, **state}.items():
        b = p[k] if k in params else s[k]
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b), k
    for k in params:       # GGUFReader's bits of each param
        assert np.array_equal(t[k][2].reshape(params[k].shape), params[k]), k
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) - 64])
    with pytest.raises(jg.ModelFormatError, match="truncated") as e:
        load_llama_checkpoint(path)
    assert str(path) in str(e.value)


@pytest.mark.slow
def test_train_llama_master_bf16(tmp_path, capsys):
    from jitgraph.models.llama import read_llama
    args = ["train", "llama", *TINY, "--eval-every", "1", "--lr", "3e-3"]
    straight, ck, out = tmp_path / "straight.ckpt", tmp_path / "cut.ckpt", tmp_path / "m.gguf"
    f32_ck = tmp_path / "f32.ckpt"
    assert cli.main([*args, "--steps", "8", "--json", "--checkpoint", str(f32_ck)]) == 0
    a = _last_json(capsys.readouterr().out)
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
    # the checkpoint: every weight a BF16 tensor, half the f32-master checkpoint's weight bytes
    tb, tf = _tensors(str(straight)), _tensors(str(f32_ck))
    weights = [k for k in tb if not k.startswith(gguf_io.STATE_PREFIX)]
    assert weights and set(weights) == {k for k in tf if not k.startswith("state.")}
    assert all(tb[k][0] == BF16 and tf[k][0] == F32 for k in weights)
    assert 2 * _weight_bytes(tb) == _weight_bytes(tf) == a["weights_bytes"]
    assert straight.stat().st_size < f32_ck.stat().st_size - _weight_bytes(tb) + 4096
    # 4 steps, checkpoint, resume (no --master given: the checkpoint's), 4 more; and the same
    # from a copy of the 4-step checkpoint as an older jitgraph wrote it (f32 values)
    older = tmp_path / "older.ckpt"
    assert cli.main([*args, "--master", "bf16", "--steps", "4", "--checkpoint", str(ck)]) == 0
    _as_older_llama_checkpoint(ck, older)
    for c in (ck, older):
        assert cli.main(["train", "llama", "--resume", str(c), "--steps", "8", "--quiet",
                         "--checkpoint", str(c)]) == 0
    _, _, pa, sa, ma = llama_train.load_llama_checkpoint(straight)
    for c in (ck, older):
        _, _, pb, sb, mb = llama_train.load_llama_checkpoint(c)
        assert ma["args"]["master"] == mb["args"]["master"] == "bf16"
        assert set(pa) == set(pb) == set(weights) and set(sa) == set(sb) and sa
        for k in pa:
            assert pa[k].dtype == pb[k].dtype == np.uint16, k        # the bits
            np.testing.assert_array_equal(pa[k], tb[k][2].reshape(pa[k].shape), err_msg=k)
            np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
        for k in sa:
            np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    # the model file (--ftype f32): f32 weights, the bf16 weights' values
    _, params, _ = read_llama(out)
    assert set(params) == set(pa)
    for k, v in params.items():
        assert v.dtype == np.float32 and np.array_equal(v, to_f32(pa[k], "bf16")), k


@pytest.mark.slow
def test_train_mnist_and_lora_finetune_master_bf16(tmp_path, capsys, stories, corpus_file):
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
    ft = ["finetune", stories, "--text", corpus_file(40_000), "--lora-rank", "2",
          "--lora-targets", "q,k,v,o", "--lr", "1e-2", "--steps", "4", "--ctx", "32",
          "--batch-size", "2", "--eval-every", "1", "--no-ppl", "--quiet", "--json"]
    res = {}
    for m in ("f32", "bf16"):
        assert cli.main([*ft, "--master", m, "--out", str(tmp_path / f"{m}.gguf"),
                         "--checkpoint", str(tmp_path / f"{m}.ckpt")]) == 0
        res[m] = _last_json(capsys.readouterr().out)
    assert res["bf16"]["master"] == "bf16"
    # the adapters are the trainable weights: stored bf16, 2 bytes less each
    n = res["bf16"]["trainable_params"]
    assert res["f32"]["weights_bytes"] - res["bf16"]["weights_bytes"] == 2 * n > 0
    # the checkpoint holds the adapters alone, BF16 (half the f32 run's bytes); the adapter file
    # (--ftype f32) their f32 values
    tb, tf = _tensors(str(tmp_path / "bf16.ckpt")), _tensors(str(tmp_path / "f32.ckpt"))
    adapters = [k for k in tb if not k.startswith(gguf_io.STATE_PREFIX)]
    assert adapters and all(k.endswith((".lora_a", ".lora_b")) for k in adapters)
    assert all(tb[k][0] == BF16 and tf[k][0] == F32 for k in adapters)
    assert 2 * _weight_bytes(tb) == _weight_bytes(tf) == 4 * n
    ta = _tensors(str(tmp_path / "bf16.gguf"))
    for k in adapters:
        assert ta[k][0] == F32
        np.testing.assert_array_equal(ta[k][2].reshape(-1),
                                      to_f32(tb[k][2], "bf16").reshape(-1), err_msg=k)
    # 2 steps, checkpoint, --resume to 4: the unbroken run's checkpoint bit for bit
    part = tmp_path / "part.ckpt"
    assert cli.main([*ft[:-1], "--steps", "2", "--master", "bf16", "--out",
                     str(tmp_path / "part.gguf"), "--checkpoint", str(part)]) == 0
    assert cli.main([*ft[:-1], "--resume", str(part), "--out", str(tmp_path / "part.gguf"),
                     "--checkpoint", str(part)]) == 0
    _, _, pa, sa, _ = llama_train.load_llama_checkpoint(tmp_path / "bf16.ckpt")
    _, _, pb, sb, mb = llama_train.load_llama_checkpoint(part)
    assert mb["step"] == 4 and set(pa) == set(pb) == set(adapters) and set(sa) == set(sb)
    for k in pa:
        assert pa[k].dtype == np.uint16 and np.array_equal(pa[k], pb[k]), k
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
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
    """1 epoch, checkpoint (the weights and the bf16 moments as BF16 tensors of their bits),
    --resume to 2 epochs: the model file of 2 unbroken epochs byte for byte (the rounding's
    bits come from --seed and the step); the same from the checkpoint as an older jitgraph
    wrote it (the weights' f32 values, the moments as I16); a truncated checkpoint is a
    one-line error naming it."""
    ck, a, b = tmp_path / "ck.gguf", tmp_path / "a.gguf", tmp_path / "b.gguf"
    args = ["train", "mnist-fc", "--n-train", "1000", "--n-test", "500", "--quiet", "--json",
            "--logical-batch", "200", "--master", "bf16", "--moments", "bf16", "--seed", "3"]
    assert cli.main([*args, "--epochs", "1", "--checkpoint", str(ck)]) == 0
    capsys.readouterr()
    t = _tensors(str(ck))
    weights = [k for k in t if not k.startswith(gguf_io.STATE_PREFIX)]
    moments = [k for k in t if k.startswith(("state.opt/m/", "state.opt/v/"))]
    assert weights and len(moments) == 2 * len(weights)
    assert all(t[k][0] == BF16 for k in weights + moments)
    # the checkpoint as an older jitgraph wrote it
    arch, params, state, meta = gguf_io.load_checkpoint(str(ck))
    older = tmp_path / "older.gguf"
    gguf_io.save_checkpoint(str(older), arch, {k: to_f32(v, "bf16") for k, v in params.items()},
                            {k: v.view(np.int16) if v.dtype == np.uint16 else v
                             for k, v in state.items()}, meta, data="synthetic")
    assert {v[0] for k, v in _tensors(str(older)).items() if k in weights} == {F32}
    assert cli.main([*args, "--epochs", "2", "--out", str(b)]) == 0
    straight = _last_json(capsys.readouterr().out)
    for c in (ck, older):
        assert cli.main([*args, "--epochs", "2", "--resume", str(c), "--out", str(a)]) == 0
        resumed = _last_json(capsys.readouterr().out)
        assert resumed["master"] == straight["master"] == "bf16"
        assert a.read_bytes() == b.read_bytes(), c
        assert resumed["test_loss"] == straight["test_loss"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(ck.read_bytes()[:-1000])
    assert cli.main([*args, "--epochs", "2", "--resume", str(cut)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(cut) in err[0] and "truncated" in err[0], err

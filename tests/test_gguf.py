"""jitgraph.formats.gguf: models in ggml's MNIST GGUF layout, checkpoints, atomic writes, bad files."""
import os
import struct

import gguf
import numpy as np
import pytest

from jitgraph import ModelFormatError
from jitgraph.formats.gguf import load_checkpoint, load_model, save_checkpoint, save_model
from jitgraph.models import MODELS

# ne of every tensor as mnist-common.cpp creates it (ggml_new_tensor_Nd arguments)
GGML_NE = {
    "mnist-fc": {"fc1.weight": [784, 500], "fc1.bias": [500], "fc2.weight": [500, 10],
                 "fc2.bias": [10]},
    "mnist-cnn": {"conv1.kernel": [3, 3, 1, 8], "conv1.bias": [1, 1, 8],
                  "conv2.kernel": [3, 3, 8, 16], "conv2.bias": [1, 1, 16],
                  "dense.weight": [784, 10], "dense.bias": [10]},
}


def params_for(arch, seed=0):
    p = MODELS[arch](1).init_params(seed)
    first = next(iter(p))
    flat = p[first].reshape(-1)                     # values a lossy format would not keep
    flat[:5] = [-0.0, np.inf, -np.inf, np.float32(1e-45), np.nan]
    return p


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("arch", list(MODELS))
def test_model_round_trip_is_bit_exact(tmp_path, arch):
    path = str(tmp_path / "m.gguf")
    p = params_for(arch)
    save_model(path, arch, p)
    got_arch, q = load_model(path)
    assert got_arch == arch and set(q) == set(p)
    for k in p:
        assert q[k].dtype == np.float32 and q[k].shape == p[k].shape
        assert np.array_equal(bits(q[k]), bits(p[k])), k
    assert load_model(path, arch=arch)[0] == arch
    assert os.listdir(tmp_path) == ["m.gguf"]


@pytest.mark.parametrize("arch", list(MODELS))
def test_layout_matches_ggml(tmp_path, arch):
    path = str(tmp_path / "m.gguf")
    p = params_for(arch, seed=1)
    save_model(path, arch, p)
    r = gguf.GGUFReader(path)
    f = r.fields["general.architecture"]
    assert bytes(f.parts[f.data[0]]).decode() == arch
    assert {t.name: [int(d) for d in t.shape] for t in r.tensors} == GGML_NE[arch]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in r.tensors)
    flat = {t.name: np.array(t.data).reshape(-1) for t in r.tensors}   # ne[0] varies fastest
    rng = np.random.default_rng(0)
    for _ in range(100):
        if arch == "mnist-fc":          # ggml fc1.weight[i0=in, i1=out]; jitgraph w[in, out]
            i, j = rng.integers(784), rng.integers(500)
            assert flat["fc1.weight"][i + 784 * j] == p["fc1.weight"][i, j]
            i, j = rng.integers(500), rng.integers(10)
            assert flat["fc2.weight"][i + 500 * j] == p["fc2.weight"][i, j]
        else:                           # ggml kernel[i0=kw, i1=kh, i2=in, i3=out]
            o, c, kh, kw = rng.integers(16), rng.integers(8), rng.integers(3), rng.integers(3)
            assert flat["conv2.kernel"][kw + 3 * kh + 9 * c + 72 * o] == p["conv2.kernel"][o, c, kh, kw]
            assert flat["conv2.bias"][o] == p["conv2.bias"][o, 0, 0]


def test_rejects_wrong_params_and_arch(tmp_path):
    path = str(tmp_path / "m.gguf")
    p = params_for("mnist-fc")
    with pytest.raises(ValueError, match="unknown architecture"):
        save_model(path, "mnist-rnn", p)
    with pytest.raises(ValueError, match="missing"):
        save_model(path, "mnist-cnn", p)
    assert os.listdir(tmp_path) == []
    save_model(path, "mnist-fc", p)
    with pytest.raises(ValueError, match="architecture is 'mnist-fc', expected 'mnist-cnn'") as e:
        load_model(path, arch="mnist-cnn")
    assert path in str(e.value)
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("fc1.weight", np.zeros((2, 2), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="unknown architecture 'llama'"):
        load_model(str(tmp_path / "llama.gguf"))


def saved_bytes(tmp_path, arch="mnist-fc"):
    path = str(tmp_path / "m.gguf")
    save_model(path, arch, params_for(arch))
    with open(path, "rb") as f:
        return path, bytearray(f.read())


def rejected(path, data, *words):
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(ModelFormatError) as e:
        load_model(path)
    for w in (path,) + words:
        assert w in str(e.value), str(e.value)


def test_truncated_files_are_rejected(tmp_path):
    path, data = saved_bytes(tmp_path)
    r = gguf.GGUFReader(path)
    first, last = r.tensors[0], r.tensors[-1]
    cuts = (0, 3, 8, 30, 100, 200, int(first.data_offset) + 1000, len(data) // 2,
            int(last.data_offset) + last.n_bytes - 1)
    del r
    for cut in cuts:
        rejected(path, data[:cut])


def test_corrupt_files_are_rejected(tmp_path):
    path, data = saved_bytes(tmp_path)
    rejected(path, b"not a gguf file at all" * 20)
    bad = bytearray(data)
    bad[0:4] = b"GGUX"
    rejected(path, bad)
    info = data.find(struct.pack("<Q", 8) + b"fc2.bias") + 16     # n_dims u32, ne u64..., type u32
    assert struct.unpack_from("<IQI", data, info) == (1, 10, 0)
    bad = bytearray(data)
    struct.pack_into("<Q", bad, info + 4, 11)                       # fc2.bias ne [11]
    rejected(path, bad, "fc2.bias")
    bad = bytearray(data)
    struct.pack_into("<I", bad, info + 12, 1)                       # fc2.bias as F16
    rejected(path, bad, "fc2.bias")
    bad = bytearray(data)
    struct.pack_into("<Q", bad, 8, 2 ** 40)                         # absurd tensor count
    rejected(path, bad)
    at = data.find(b"mnist-fc")
    bad = bytearray(data)
    bad[at:at + 8] = b"mnist-xx"
    rejected(path, bad, "unknown architecture")


def test_atomic_write_keeps_old_file_on_error(tmp_path, monkeypatch):
    path, old = saved_bytes(tmp_path)

    def fail(self, *a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", fail)     # the tensors' data
    with pytest.raises(OSError, match="disk full"):
        save_model(path, "mnist-fc", params_for("mnist-fc", seed=9))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["m.gguf"]
    with open(path, "rb") as f:
        assert f.read() == bytes(old)
    save_model(path, "mnist-fc", params_for("mnist-fc", seed=9))      # overwrite works
    assert os.listdir(tmp_path) == ["m.gguf"]
    assert np.array_equal(load_model(path)[1]["fc2.bias"], params_for("mnist-fc", 9)["fc2.bias"])


def test_checkpoint_round_trip(tmp_path):
    path = str(tmp_path / "ckpt.gguf")
    p = params_for("mnist-cnn", seed=3)
    rng = np.random.default_rng(11)
    state = {"adam.m/dense.weight": rng.standard_normal((784, 10)).astype(np.float32),
             "adam.v/dense.weight": rng.random((784, 10)),                  # f64
             "step": np.array(1234, np.int64), "calls": np.array([7], np.int32),
             "flags": np.arange(6, dtype=np.int8).reshape(2, 3)}
    rng.random(5)
    meta = {"step": 1234, "epoch": np.int64(3), "lr": 1e-3, "rng": rng.bit_generator.state,
            "history": [{"loss": 0.25}], "name": "run"}
    expect_next = np.random.default_rng(11)
    expect_next.bit_generator.state = rng.bit_generator.state
    save_checkpoint(path, "mnist-cnn", p, state, meta)
    arch, q, s, m = load_checkpoint(path)
    assert arch == "mnist-cnn"
    assert all(np.array_equal(bits(q[k]), bits(p[k])) for k in p)
    assert set(s) == set(state)
    for k, v in state.items():
        assert s[k].dtype == v.dtype and s[k].shape == v.shape and np.array_equal(s[k], v), k
    assert m == {**meta, "epoch": 3}
    resumed = np.random.default_rng()
    resumed.bit_generator.state = m["rng"]
    assert np.array_equal(resumed.random(4), expect_next.random(4))
    assert load_model(path)[0] == "mnist-cnn"                   # a checkpoint is also a model
    assert os.listdir(tmp_path) == ["ckpt.gguf"]


def test_checkpoint_errors(tmp_path):
    path = str(tmp_path / "c.gguf")
    p = params_for("mnist-fc")
    with pytest.raises(ValueError, match="state mask has dtype bool"):
        save_checkpoint(path, "mnist-fc", p, {"mask": np.zeros(3, bool)}, {})
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        save_checkpoint(path, "mnist-fc", p, {}, {"x": object()})
    assert os.listdir(tmp_path) == []
    save_model(path, "mnist-fc", p)
    with pytest.raises(ModelFormatError, match="not a training checkpoint"):
        load_checkpoint(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nope.gguf"))

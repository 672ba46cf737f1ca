"""GGUF files in ggml's MNIST layout (examples/mnist): models that ggml's mnist-eval can evaluate,
and training checkpoints.

A model file has `general.architecture` (a key of jitgraph.models.MODELS) and one F32 tensor per
param under ggml's name and dimension order (the model's GGMLTensor table converts). A checkpoint is
a model file plus the optimizer state as tensors `state.<name>` (jitgraph layout, any dtype gguf
stores) and a JSON object under `jitgraph.checkpoint` (step counter, RNG state, ...), so
load_model (and ggml) can read a checkpoint too. Writes are atomic; unreadable, truncated or
mismatched files raise ValueError naming the file.
"""
from __future__ import annotations

import json
import os
import secrets

import gguf
import numpy as np

ARCH_KEY = "general.architecture"
CHECKPOINT_KEY = "jitgraph.checkpoint"
STATE_PREFIX = "state."
_STATE_DTYPES = (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64)


def _spec(arch, path):
    from .models import MODELS
    if arch not in MODELS:
        raise ValueError(f"{path}: unknown architecture {arch!r} (expected one of {sorted(MODELS)})")
    return MODELS[arch]


def save_model(path, arch: str, params: dict) -> None:
    """Write `params` (jitgraph layout, by param name) as ggml's `arch` model."""
    _write(path, arch, _spec(arch, path).to_ggml(params), {})


def load_model(path, arch: str | None = None) -> tuple[str, dict]:
    """(arch, params in jitgraph layout) from a model or checkpoint file; `arch`, if given, must
    match the file's."""
    arch, params, _, _ = _load(path, arch)
    return arch, params


def save_checkpoint(path, arch: str, params: dict, state: dict, meta: dict) -> None:
    """Params (as save_model), optimizer `state` arrays (stored as they are) and a JSON-able `meta`
    dict (e.g. {"step": 12, "rng": generator.bit_generator.state})."""
    tensors = _spec(arch, path).to_ggml(params)
    for k, v in state.items():
        v = np.asarray(v)
        if v.dtype.type not in _STATE_DTYPES:
            raise ValueError(f"{path}: state {k} has dtype {v.dtype}; GGUF stores "
                             f"{', '.join(np.dtype(t).name for t in _STATE_DTYPES)}")
        tensors[STATE_PREFIX + k] = v
    _write(path, arch, tensors, {CHECKPOINT_KEY: json.dumps(meta, default=_numpy_scalar)})


def load_checkpoint(path, arch: str | None = None) -> tuple[str, dict, dict, dict]:
    """(arch, params, state, meta) as given to save_checkpoint."""
    arch, params, state, meta = _load(path, arch)
    if meta is None:
        raise ValueError(f"{path}: a model file, not a training checkpoint (no {CHECKPOINT_KEY})")
    return arch, params, state, meta


def _numpy_scalar(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"checkpoint meta: {type(o).__name__} is not JSON-serialisable (store arrays "
                    f"in `state`)")


# ---- files -------------------------------------------------------------------------------------
def _write(path, arch, tensors, strings):
    """GGUF to a temporary file next to `path`, fsync, then rename over `path`: readers see the old
    file or the new one, never a partial one."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    try:
        w = gguf.GGUFWriter(tmp, arch)
        for k, v in strings.items():
            w.add_string(k, v)
        for name, a in tensors.items():
            w.add_tensor(name, np.asarray(a, order="C"))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _string(reader, key):
    field = reader.fields.get(key)
    if field is None or field.types != [gguf.GGUFValueType.STRING]:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _read(path):
    """(arch, {name: (ggml type, array)}, checkpoint meta text or None); ValueError if unreadable."""
    path = os.fspath(path)
    try:
        reader = gguf.GGUFReader(path)
        arch, meta = _string(reader, ARCH_KEY), _string(reader, CHECKPOINT_KEY)
        # (the reader fails on truncated tensor data: its arrays come up short in a reshape)
        tensors = {t.name: (t.tensor_type, np.array(t.data)) for t in reader.tensors}
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as e:   # the gguf reader fails with whatever numpy or struct raises
        raise ValueError(f"{path}: not a valid GGUF file, truncated or corrupt "
                         f"({type(e).__name__}: {e})") from None
    if arch is None:
        raise ValueError(f"{path}: no {ARCH_KEY} string; not a jitgraph/ggml model file")
    return arch, tensors, meta


def _load(path, want_arch):
    arch, tensors, meta = _read(path)
    if want_arch is not None and arch != want_arch:
        raise ValueError(f"{path}: architecture is {arch!r}, expected {want_arch!r}")
    spec = _spec(arch, path)
    state = {k[len(STATE_PREFIX):]: a for k, (_, a) in tensors.items() if k.startswith(STATE_PREFIX)}
    weights = {k: a for k, (_, a) in tensors.items() if not k.startswith(STATE_PREFIX)}
    bad = [k for k in weights if tensors[k][0] != gguf.GGMLQuantizationType.F32]
    if bad:
        raise ValueError(f"{path}: tensors {bad} are not F32")
    try:
        params = spec.from_ggml(weights)
        meta = None if meta is None else json.loads(meta)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return arch, params, state, meta

"""llama.cpp LoRA adapter files: write, read (checked against the base model), apply, merge.

The file (what convert_lora_to_gguf.py writes and llama.cpp's llama_adapter_lora_init reads):
`general.architecture` = the base model's, `general.type` = adapter, `adapter.type` = lora,
`adapter.lora.alpha` (FLOAT32), and per adapted weight W two tensors `<W>.lora_a` and
`<W>.lora_b`. For W of ggml shape [in, out] (numpy [out, in], applied as x @ W^T) A has ggml shape
[in, rank] (numpy [rank, in]) and B [rank, out] (numpy [out, rank]): llama.cpp checks
W.ne[0] == a.ne[0], W.ne[1] == b.ne[1] and a.ne[1] == b.ne[0], and computes
W x + scale * B (A x) with scale = adapter_scale * alpha / rank (rank = b.ne[0]), or
adapter_scale when alpha is 0 (llama_adapter_lora_weight::get_scale, export-lora's merge).
token_embd adapters (whose A and B llama.cpp stores flipped) are not supported here.

The adapter params are the names jg.lora gives them (`<W>.lora_a` A [rank, in], `<W>.lora_b` B
[out, rank]): what a LoRA finetune's program holds is what the file holds.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ..errors import ModelFormatError
from ..formats.gguf import add_tensor_as
from ..quant import ggml_type
from ..types import STORAGE
from .llama import LlamaConfig

__all__ = ["write_adapter", "read_adapter", "merge", "apply_adapter", "adapter_scale",
           "adapter_pairs", "check_shapes"]

SUFFIX_A, SUFFIX_B = ".lora_a", ".lora_b"
TYPE_KEY, ADAPTER_TYPE_KEY, ALPHA_KEY = "general.type", "adapter.type", "adapter.lora.alpha"


def adapter_scale(alpha: float, rank: int, scale: float = 1.0) -> float:
    """llama.cpp's factor of B A: scale * alpha / rank, or scale when alpha is 0."""
    return float(scale) * float(alpha) / rank if alpha else float(scale)


def adapter_pairs(cfg: LlamaConfig, adapter_params: dict, where: str = "adapter") -> dict:
    """{base weight name: (A, B)} after checking every name and shape against the base model's
    config (check_shapes); a ValueError names the tensor and what was expected."""
    check_shapes(cfg, {k: np.shape(v) for k, v in adapter_params.items()}, where)
    out = {}
    for k, v in adapter_params.items():
        v = np.asarray(v)
        if not np.issubdtype(v.dtype, np.floating):
            raise ValueError(f"{where}: {k}: LoRA tensors must be float, got {v.dtype}")
        base = k[:-len(SUFFIX_A)]
        out.setdefault(base, [None, None])[k.endswith(SUFFIX_B)] = v
    return {k: tuple(v) for k, v in out.items()}


def check_shapes(cfg: LlamaConfig, shapes: dict, where: str = "adapter") -> None:
    """Check {tensor name: numpy shape} of an adapter against the base model's config: names
    `<W>.lora_a` / `<W>.lora_b` in pairs, W a 2-D weight of the model (not token_embd), A [rank,
    in] and B [out, rank] for W [out, in]. Raises ValueError naming the tensor."""
    want = cfg.param_shapes()
    pairs = {}
    for k, shp in shapes.items():
        if not isinstance(k, str) or not k.endswith((SUFFIX_A, SUFFIX_B)):
            raise ValueError(f"{where}: tensor {k!r} is neither <weight>{SUFFIX_A} nor "
                             f"<weight>{SUFFIX_B}")
        pairs.setdefault(k[:-len(SUFFIX_A)], {})[k[-len(SUFFIX_A):]] = tuple(shp)
    for base, ab in pairs.items():
        if len(ab) != 2:
            have = next(iter(ab))
            raise ValueError(f"{where}: {base}{have} has no partner "
                             f"{base}{SUFFIX_B if have == SUFFIX_A else SUFFIX_A} (LoRA tensors "
                             f"come in pairs)")
        if base not in want:
            raise ValueError(f"{where}: {base} is not a weight of the base model (a "
                             f"{cfg.arch} of {cfg.layers} layers"
                             f"{', output tied' if cfg.tied else ''}; wrong base model?)")
        if base.startswith("token_embd") or len(want[base]) != 2:
            raise ValueError(f"{where}: adapters of {base} are not supported (2-D projection "
                             f"and output weights only)")
        a, b = ab[SUFFIX_A], ab[SUFFIX_B]
        out_dim, in_dim = want[base]
        if len(a) != 2 or len(b) != 2 or a[1] != in_dim or b[0] != out_dim or a[0] != b[1] \
                or a[0] < 1:
            raise ValueError(
                f"{where}: {base}: lora_a has shape {list(a)} and lora_b {list(b)} (numpy "
                f"order); the base weight [{out_dim}, {in_dim}] needs lora_a [rank, {in_dim}] "
                f"and lora_b [{out_dim}, rank] (ggml order: [{in_dim}, rank] and [rank, "
                f"{out_dim}]; wrong base model?)")
    if not pairs:
        raise ValueError(f"{where}: no LoRA tensors")


def write_adapter(path, cfg: LlamaConfig, adapter_params: dict, alpha: float,
                  name: str | None = None, ftype: str = "f32") -> None:
    """Write a llama.cpp LoRA adapter GGUF (see the module docstring) for a base model of config
    `cfg`: adapter_params {`<W>.lora_a`: A [rank, in], `<W>.lora_b`: B [out, rank]} (numpy order,
    as jg.lora's params), stored as `ftype` (f32, f16, bf16 or q8_0: llama.cpp's
    convert_lora_to_gguf.py --outtype; a tensor whose rows are not whole q8_0 blocks is F16,
    as there). Written atomically (gguf_writer)."""
    from ..formats.gguf import gguf_writer
    import gguf
    alpha = float(alpha)
    if not math.isfinite(alpha):
        raise ValueError(f"write_adapter: alpha must be finite, got {alpha}")
    pairs = adapter_pairs(cfg, adapter_params, "write_adapter")
    with gguf_writer(path, cfg.arch) as w:
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(ADAPTER_TYPE_KEY, "lora")
        w.add_float32(ALPHA_KEY, alpha)
        w.add_name(name or "jitgraph LoRA adapter")
        for base in sorted(pairs, key=_tensor_order(cfg)):
            a, b = pairs[base]
            for k, x in ((base + SUFFIX_A, a), (base + SUFFIX_B, b)):
                add_tensor_as(w, k, np.ascontiguousarray(x, np.float32), ftype)


def _tensor_order(cfg):
    order = {k: i for i, k in enumerate(cfg.param_shapes())}
    return lambda k: order.get(k, len(order))


def read_adapter(path, cfg: LlamaConfig) -> tuple:
    """(adapter params {`<W>.lora_a`: f32 [rank, in], `<W>.lora_b`: f32 [out, rank]}, alpha) from a
    llama.cpp LoRA adapter GGUF, checked against the base model's config. The header is
    bounds-checked before anything is read, every name and shape before any tensor data.
    Anything wrong raises jitgraph.ModelFormatError (a ValueError) naming the file: truncated or
    corrupt, not a LoRA adapter, another architecture, a tensor the base model does not have or
    of the wrong shape. alpha is 0.0 when the file has none (llama.cpp then scales B A by the
    adapter scale alone)."""
    from ..formats.gguf import _STRING, _header, tensor_f32
    path = os.fspath(path)
    with open(path, "rb") as f:
        try:
            kv, infos, order = _header(f, path)
        except OSError as e:
            raise ModelFormatError(f"{path}: cannot read it as a GGUF file ({e})") from None

        def text(key):
            vtype, v = kv.get(key, (None, None))
            if vtype != _STRING:
                return None
            try:
                return v.decode("utf-8")
            except UnicodeDecodeError:
                raise ModelFormatError(f"{path}: {key} is not valid UTF-8") from None

        kind, atype, arch = text(TYPE_KEY), text(ADAPTER_TYPE_KEY), text("general.architecture")
        if kind != "adapter" or atype != "lora":
            raise ModelFormatError(
                f"{path}: not a LoRA adapter (general.type {kind!r}, adapter.type {atype!r}; "
                f"expected 'adapter' and 'lora')" + (" - a model file?" if kind in (None, "model")
                                                     else ""))
        if arch != cfg.arch:
            raise ModelFormatError(f"{path}: the adapter is for architecture {arch!r}, the base "
                                   f"model is {cfg.arch!r}")
        alpha = 0.0
        if ALPHA_KEY in kv:
            vtype, v = kv[ALPHA_KEY]
            if vtype not in (4, 5, 6, 10, 11, 12) or isinstance(v, (bytes, tuple)) or \
                    not math.isfinite(float(v)):
                raise ModelFormatError(f"{path}: {ALPHA_KEY} must be a finite number, got {v!r}")
            alpha = float(v)
        import gguf
        floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                  gguf.GGMLQuantizationType.F64, *(ggml_type(k) for k in STORAGE))
        infos = [i for i in infos if not i[0].endswith("_norm.weight")]   # llama.cpp skips them
        try:         # names and shapes first, before any tensor data is read
            check_shapes(cfg, {i[0]: tuple(reversed(i[2])) for i in infos}, path)
        except ValueError as e:
            raise ModelFormatError(str(e)) from None
        params = {}
        for info in infos:
            if info[1] not in floats:
                names = ", ".join(t.name for t in dict.fromkeys(floats))
                raise ModelFormatError(f"{path}: tensor {info[0]!r} is {info[1].name}; adapters "
                                       f"are read in {names}")
            params[info[0]] = tensor_f32(f, path, order, *info)
    return params, alpha


def merge(base_params: dict, adapter_params: dict, alpha: float, scale: float = 1.0) -> dict:
    """The merged model's params, as llama.cpp's export-lora computes them: for each adapted W,
    W + adapter_scale(alpha, rank, scale) * B @ A (in float64, stored as W's dtype); every other
    param as it is (the same arrays)."""
    out = dict(base_params)
    for k in adapter_params:
        if not k.endswith((SUFFIX_A, SUFFIX_B)):
            raise ValueError(f"merge: {k!r} is not an adapter tensor")
    bases = sorted({k[:-len(SUFFIX_A)] for k in adapter_params})
    for base in bases:
        if base not in base_params:
            raise ValueError(f"merge: the base model has no {base}")
        a = np.asarray(adapter_params[base + SUFFIX_A], np.float64)
        b = np.asarray(adapter_params[base + SUFFIX_B], np.float64)
        w = np.asarray(base_params[base])
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0] or \
                (b.shape[0], a.shape[1]) != w.shape:
            raise ValueError(f"merge: {base} {list(w.shape)}: lora_a {list(a.shape)} and lora_b "
                             f"{list(b.shape)} do not make a [{w.shape[0] if w.ndim else '?'}, "
                             f"...] update")
        s = adapter_scale(alpha, a.shape[0], scale)
        out[base] = (w.astype(np.float64) + s * (b @ a)).astype(w.dtype)
    return out


def apply_adapter(graph, adapter_params: dict, alpha: float, scale: float = 1.0):
    """`graph` (a llama graph with GGUF param names) with the adapter applied unmerged: jg.lora on
    each adapted weight with llama.cpp's scale (adapter_scale) folded into alpha. Returns the
    new graph; set its params from `adapter_params` (the names match)."""
    from ..lora import lora
    ranks = {}
    for k, v in adapter_params.items():
        if k.endswith(SUFFIX_A):
            ranks[k[:-len(SUFFIX_A)]] = int(np.shape(v)[0])
    if not ranks:
        raise ValueError("apply_adapter: no <weight>.lora_a tensors")
    for r in sorted(set(ranks.values())):        # one jg.lora call per rank: alpha is per call
        names = [k for k, v in ranks.items() if v == r]
        graph = lora(graph, targets=names, rank=r, alpha=adapter_scale(alpha, r, scale) * r)
    return graph

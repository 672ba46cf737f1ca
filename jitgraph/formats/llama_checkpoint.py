"""The llama training checkpoint (`jitgraph train llama`, `jitgraph finetune` write it): a GGUF
file with the model's llama.* and tokenizer metadata, every param under its name, the optimizer
state as `state.<name>` tensors (each in the type the program stores it in: bf16 master weights
and bf16 moments, uint16 bits, as BF16 tensors of those bits) and a JSON object under `jitgraph.checkpoint` (the run's options,
the program's call count, the window sampler's RNG state or finetune --epochs' place in its
epoch, the step, the loss curve). Written atomically; reading bounds every count in the header
by the file's size first, and anything but such a file raises jitgraph.ModelFormatError naming
the file."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np

from ..errors import ModelFormatError
from .gguf import CHECKPOINT_KEY, STATE_PREFIX, _header, add_stored, gguf_writer


# the types a checkpoint's tensors have besides BF16 (gguf.GGUFReader gives them as numpy arrays)
_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
          gguf.GGMLQuantizationType.F64, gguf.GGMLQuantizationType.I8,
          gguf.GGMLQuantizationType.I16, gguf.GGMLQuantizationType.I32,
          gguf.GGMLQuantizationType.I64)


def save_llama_checkpoint(path, cfg, tok, params: dict, state: dict, meta: dict) -> None:
    """A llama training checkpoint, written atomically: `params` and `state` as the program
    stores them (bf16 values, uint16 bits, as BF16 tensors)."""
    arrays = {k: np.asarray(v) for k, v in params.items()}
    arrays.update({STATE_PREFIX + k: np.asarray(v) for k, v in state.items()})
    meta = {**meta, "shapes": {k: list(a.shape) for k, a in arrays.items()}}
    with gguf_writer(path, cfg.arch) as w:
        w.add_name("jitgraph training checkpoint")
        cfg.to_gguf(w)
        if tok is not None:
            tok.write_gguf(w)
        w.add_string(CHECKPOINT_KEY, json.dumps(meta))
        for k, a in arrays.items():
            add_stored(w, k, np.ascontiguousarray(a.reshape(a.shape or (1,))))


def load_llama_checkpoint(path):
    """(LlamaConfig, Tokenizer or None, params, state, meta) of a file save_llama_checkpoint
    wrote, BF16 tensors as uint16 bits (which a program's bf16 slots take bit for bit; I16
    state, as older checkpoints stored bf16 moments, too); anything else raises
    ModelFormatError naming the file."""
    from ..models.llama import LlamaConfig
    from ..models.tokenizer import TOKENIZERS, Tokenizer
    path = os.fspath(path)
    with open(path, "rb") as f:
        _header(f, path)                  # every count and extent bounded by the file's size
    try:
        r = gguf.GGUFReader(path)
        md = {k: fl.contents() for k, fl in r.fields.items()}
        if CHECKPOINT_KEY not in md:
            raise ValueError(f"not a training checkpoint (no {CHECKPOINT_KEY}); a model file?")
        meta = json.loads(md[CHECKPOINT_KEY])
        if not isinstance(meta, dict) or not isinstance(meta.get("shapes"), dict):
            raise ValueError(f"{CHECKPOINT_KEY} is not a jitgraph llama checkpoint's JSON object")
        # where the run is: the window sampler's RNG, or (finetune --epochs) the epoch, the
        # batches done in it and their figures
        at = (("epoch", int), ("batch", int), ("partial", dict)) if "epoch" in meta else \
            (("rng", dict),)
        for k, kind in (("args", dict), ("calls", int), ("step", int), ("kind", str), *at):
            if not isinstance(meta.get(k), kind) or isinstance(meta.get(k), bool):
                raise ValueError(f"checkpoint field {k!r} is missing or not a {kind.__name__}")
        shapes = meta["shapes"]
        params, state, ne = {}, {}, {}
        for t in r.tensors:
            if t.name not in shapes:
                raise ValueError(f"tensor {t.name!r} is not listed in the checkpoint's shapes")
            a = np.array(t.data)
            if t.tensor_type == gguf.GGMLQuantizationType.BF16:
                a = a.view(np.uint16)          # the reader gives its bytes
            elif t.tensor_type not in _TYPES:
                raise ValueError(f"tensor {t.name!r} is {t.tensor_type.name}; a checkpoint holds "
                                 f"{', '.join(k.name for k in _TYPES)} and BF16")
            a = a.reshape(shapes[t.name])
            if t.name.startswith(STATE_PREFIX):
                state[t.name[len(STATE_PREFIX):]] = a
            else:
                params[t.name] = a
                if not t.name.endswith((".lora_a", ".lora_b")):
                    ne[t.name] = [int(n) for n in t.shape]
        cfg = LlamaConfig.from_metadata(md, ne)
        tok = Tokenizer.from_metadata(md) if md.get("tokenizer.ggml.model") in TOKENIZERS else None
    except (ValueError, TypeError, KeyError) as e:
        raise ModelFormatError(f"{path}: {e}") from None
    return cfg, tok, params, state, meta

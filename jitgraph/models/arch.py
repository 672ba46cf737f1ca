"""The decoder architectures jitgraph reads, as data: each is a small table of its GGUF tensors
(names and shapes in terms of the config), which of them may be absent, its rope variant and its
norm. One builder (jitgraph/models/layers.py) reads the table; nothing else branches on a name.

Shapes are numpy order ([out, in] for a projection, ggml's [in, out] reversed) and name config
fields: "dim", "kv_dim" (head_dim * kv_heads), "qkv_dim" (dim + 2 kv_dim: q, k, v stacked),
"ff", "ff2" (2 ff: gate and up stacked), "vocab", "rope_half" (rope_dims / 2). What the layer
holds says how it computes:

- attn_q / attn_k / attn_v, or one attn_qkv whose output rows are q, then k, then v (llama.cpp's
  build_qkv views of the fused product);
- attn_q.bias etc. when present: added after the projection (Qwen2);
- ffn_gate and ffn_up, or one ffn_up of 2 ff rows: silu(first ff) * second ff (ggml_swiglu);
- rope_freqs.weight (LLaMA 3.x rope scaling) when the file has it: each rope frequency is
  divided by its entry (ggml_rope_ext's freq_factors);
- output.weight absent: the output projection is token_embd (tied).

A tensor a table lacks (phi3's long-context rope_factors_long / _short, qwen2's output.bias,
experts) makes read_llama refuse the file, naming it. phi3.attention.sliding_window is read and
ignored, as llama.cpp does (its llama_model_phi3 turns Phi's sliding window off).

Rope "normal" rotates adjacent pairs (LLAMA_ROPE_TYPE_NORM), "neox" the two halves of a head
(LLAMA_ROPE_TYPE_NEOX): llama.cpp's llama_model_rope_type per architecture.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Arch", "ARCHS", "get_arch", "ROLES"]

# LoRA roles -> the weight holding them, separate or (second) fused
ROLES = {"q": ("attn_q", "attn_qkv"), "k": ("attn_k", "attn_qkv"), "v": ("attn_v", "attn_qkv"),
         "o": ("attn_output",), "gate": ("ffn_gate", "ffn_up"), "up": ("ffn_up",),
         "down": ("ffn_down",)}


@dataclass(frozen=True)
class Arch:
    name: str            # general.architecture, and the prefix of its metadata keys
    rope: str            # "normal" or "neox" (ops.rope's modes)
    norm: str            # "rms": rms_norm times the weight (the only kind these models use)
    tensors: tuple       # ((name, shape), ...) outside the layers
    layer: tuple         # ((name, shape), ...) of each blk.N.
    optional: tuple = ()     # names (global or per-layer) a file may leave out

    def has(self, name: str) -> bool:
        """Whether each layer holds `name` (e.g. "attn_qkv.weight")."""
        return any(k == name for k, _ in self.layer)

    def weight_of(self, role: str) -> str:
        """The layer weight computing LoRA role `role` (q k v o gate up down), e.g.
        "attn_qkv.weight" for q on phi3."""
        for part in ROLES[role]:
            if self.has(part + ".weight"):
                return part + ".weight"
        raise ValueError(f"{self.name}: no weight for role {role!r}")

    def fused_roles(self, weight: str) -> list:
        """The roles one layer weight computes: ["q", "k", "v"] for phi3's attn_qkv."""
        return [r for r in ROLES if self.weight_of(r) == weight]


_GLOBAL = (("token_embd.weight", ("vocab", "dim")), ("output_norm.weight", ("dim",)),
           ("output.weight", ("vocab", "dim")))
_ATTN = (("attn_norm.weight", ("dim",)), ("attn_q.weight", ("dim", "dim")),
         ("attn_k.weight", ("kv_dim", "dim")), ("attn_v.weight", ("kv_dim", "dim")))
_FFN = (("attn_output.weight", ("dim", "dim")), ("ffn_norm.weight", ("dim",)),
        ("ffn_gate.weight", ("ff", "dim")), ("ffn_up.weight", ("ff", "dim")),
        ("ffn_down.weight", ("dim", "ff")))

ARCHS = {a.name: a for a in (
    Arch("llama", rope="normal", norm="rms",
         tensors=_GLOBAL + (("rope_freqs.weight", ("rope_half",)),),
         layer=_ATTN + _FFN, optional=("output.weight", "rope_freqs.weight")),
    Arch("qwen2", rope="neox", norm="rms", tensors=_GLOBAL,
         layer=_ATTN + (("attn_q.bias", ("dim",)), ("attn_k.bias", ("kv_dim",)),
                        ("attn_v.bias", ("kv_dim",))) + _FFN,
         optional=("output.weight",)),
    Arch("phi3", rope="neox", norm="rms", tensors=_GLOBAL,
         layer=(("attn_norm.weight", ("dim",)), ("attn_qkv.weight", ("qkv_dim", "dim")),
                ("attn_output.weight", ("dim", "dim")), ("ffn_norm.weight", ("dim",)),
                ("ffn_up.weight", ("ff2", "dim")), ("ffn_down.weight", ("dim", "ff"))),
         optional=("output.weight",)),
)}


def get_arch(name) -> Arch:
    """The description of architecture `name`; an unknown one is a ValueError naming it."""
    if name not in ARCHS:
        raise ValueError(f"architecture {name!r} is not supported (supported: "
                         f"{', '.join(ARCHS)})")
    return ARCHS[name]

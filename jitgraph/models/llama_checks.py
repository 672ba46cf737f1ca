"""What a llama GGUF file must hold beyond a well-formed header (jitgraph.formats.gguf checks
that): metadata of the types llama.cpp reads, token types in llama.cpp's range, special token ids
inside the vocabulary, and as many tokens as token_embd has rows. read_llama calls these before it
reads any tensor data; each failure is a ValueError naming the key or tensor, which read_llama
turns into a ModelFormatError naming the file."""
from __future__ import annotations

import gguf
import numpy as np

from .arch import ARCHS
from .tokenizer import BYTE, K_ADD_BOS, K_ADD_EOS, K_ADD_SPACE, K_BOS, K_EOS, K_MODEL, \
    K_SCORES, K_TOKENS, K_TYPES, K_UNK

_T = gguf.GGUFValueType
_INTS = {int(t) for t in (_T.UINT8, _T.INT8, _T.UINT16, _T.INT16, _T.UINT32, _T.INT32,
                          _T.UINT64, _T.INT64)}
_FLOATS = {int(_T.FLOAT32), int(_T.FLOAT64)}
_COUNTS = ("embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
           "feed_forward_length", "rope.dimension_count", "context_length", "vocab_size",
           "attention.key_length", "attention.value_length", "expert_count")
_FLOAT_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")
# key -> (allowed GGUF value types, what the message calls them), for every architecture's
# "<architecture>." keys
_SCALARS = {**{f"{a}.{k}": (_INTS, "an integer") for a in ARCHS for k in _COUNTS},
            **{k: (_INTS, "an integer") for k in (K_BOS, K_EOS, K_UNK)},
            **{f"{a}.{k}": (_INTS | _FLOATS, "a number") for a in ARCHS for k in _FLOAT_KEYS},
            **{k: ({int(_T.STRING)}, "a string") for k in (K_MODEL, "general.architecture")},
            **{f"{a}.rope.scaling.type": ({int(_T.STRING)}, "a string") for a in ARCHS},
            **{k: ({int(_T.BOOL)}, "a bool") for k in (K_ADD_BOS, K_ADD_EOS, K_ADD_SPACE)}}
_ARRAYS = {K_TOKENS: ({int(_T.STRING)}, "strings"), K_SCORES: (_FLOATS, "floats"),
           K_TYPES: (_INTS, "integers")}
_SPECIAL_IDS = (K_BOS, K_EOS, K_UNK)    # the padding id is unused here (llama.cpp: a warning)


def _type_name(vtype) -> str:
    try:
        return _T(vtype).name
    except ValueError:
        return f"type {vtype}"


def check_metadata_types(kv: dict) -> None:
    """kv: formats.gguf._header's {key: (value type, value)}. Every key jitgraph reads has the
    type llama.cpp reads it as: counts integers (not "8" or 8.5), the norm epsilon and rope base
    numbers, the tokenizer's arrays of strings / floats / integers."""
    for key, (allowed, what) in _SCALARS.items():
        if key not in kv:
            continue
        vtype, value = kv[key]
        if vtype not in allowed:
            shown = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            shown = "an array" if isinstance(value, tuple) else f"{_type_name(vtype)} {shown!r}"
            raise ValueError(f"metadata {key} is {shown}; expected {what}")
    for key, (allowed, what) in _ARRAYS.items():
        if key not in kv:
            continue
        vtype, value = kv[key]
        if vtype != int(_T.ARRAY) or value[1] not in allowed:
            got = (f"an array of {_type_name(value[1])}" if vtype == int(_T.ARRAY)
                   else _type_name(vtype))
            raise ValueError(f"metadata {key} is {got}; expected an array of {what}")


def check_vocabulary(md: dict, rows: int | None) -> None:
    """md: the metadata {key: value}; rows: token_embd.weight's rows (None: no such tensor). The
    tokenizer must have one token per row, llama.cpp's token types (0 undefined .. 6 byte), and
    BOS / EOS / UNK ids inside the vocabulary."""
    tokens = md.get(K_TOKENS)
    if tokens is None:
        return
    n = len(tokens)
    if rows is not None and n != rows:
        raise ValueError(f"the tokenizer has {n} tokens ({K_TOKENS}) but token_embd.weight has "
                         f"{rows} rows; the tokenizer and the model must agree")
    for key in (K_SCORES, K_TYPES):
        if key in md and len(md[key]) != n:
            raise ValueError(f"{key} has {len(md[key])} entries for {n} tokens")
    if K_TYPES in md:
        types = np.asarray(md[K_TYPES], np.int64)
        bad = np.flatnonzero((types < 0) | (types > BYTE))
        if bad.size:
            raise ValueError(f"{K_TYPES}: token {bad[0]} has type {types[bad[0]]} ({bad.size} "
                             f"token(s) outside llama.cpp's token types 0..{BYTE})")
    for key in _SPECIAL_IDS:
        if key in md and not 0 <= int(md[key]) < n:
            raise ValueError(f"{key} {int(md[key])} is outside the vocabulary of {n} tokens")

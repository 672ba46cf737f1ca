"""Random values of the storage types (types.STORAGE) for tests: valid blocks with sane scales,
for the types jitgraph cannot quantize to (the K-quants) as well as the others."""
from __future__ import annotations

import numpy as np

from ..quant import QUANTIZE, as_storage, quantize
from ..types import STORAGE, TensorType

# byte offsets of the f16 scales in a block of each block type (ggml-common.h's block layouts)
SCALE_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_storage(dtype: str, shape, rng, scale: float = 1.0) -> np.ndarray:
    """A value of type dtype[shape]: f16/bf16/q8_0/q4_0 quantized from normal values times
    `scale`, a K-quant as random bytes with its f16 scales set to about scale / 64."""
    t = TensorType(dtype, tuple(shape))
    if dtype in QUANTIZE:
        return quantize(rng.standard_normal(t.shape, dtype=np.float32) * scale, dtype)
    _, block, nb, _ = STORAGE[dtype]
    rows = t.size // t.shape[-1]
    raw = rng.integers(0, 256, (rows, t.shape[-1] // block, nb), dtype=np.uint8)
    for o in SCALE_OFFSETS[dtype]:
        d = (rng.uniform(0.5, 1.5, raw.shape[:2]) * scale / 64).astype(np.float16)
        raw[:, :, o:o + 2] = d.view(np.uint8).reshape(raw.shape[0], raw.shape[1], 2)
    return as_storage(raw.reshape(rows, -1), t)

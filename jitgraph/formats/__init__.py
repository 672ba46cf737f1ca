"""File formats and data sets: GGUF models and checkpoints in ggml's MNIST layout (gguf), the
llama training checkpoint (llama_checkpoint), the MNIST IDX reader, `Dataset` and the built-in
synthetic digits (data)."""
from . import data, gguf  # noqa: F401

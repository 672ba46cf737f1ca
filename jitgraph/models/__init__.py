"""Model zoo: `MODELS[name](batch)` builds a model's forward graph (inputs x, y; outputs loss,
logits, correct). Each model also says how its params are laid out in ggml's GGUF files.
Submodules: mnist, spec, llama (llama.cpp's GGUF models), arch (their architectures' tensor
tables: llama, qwen2, phi3), tokenizer (their SPM tokenizer),
perplexity (llama.cpp's perplexity method), generate (KV-cache decoding), lora (llama.cpp LoRA
adapter files: read, write, merge), text (training/validation windows over a text's bytes)."""
from .mnist import MNIST_CNN, MNIST_FC, mnist_cnn, mnist_fc  # noqa: F401
from .spec import GGMLTensor, ModelSpec  # noqa: F401

MODELS = {m.name: m for m in (MNIST_FC, MNIST_CNN)}

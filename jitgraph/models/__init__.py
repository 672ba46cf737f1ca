"""Model zoo: `MODELS[name](batch)` builds a model's forward graph (inputs x, y; outputs loss,
logits, correct). Each model also says how its params are laid out in ggml's GGUF files.
Submodules: mnist, spec, transformer, llama (llama.cpp's GGUF models), tokenizer (their SPM
tokenizer), perplexity (llama.cpp's perplexity method)."""
from .mnist import MNIST_CNN, MNIST_FC, mnist_cnn, mnist_fc  # noqa: F401
from .spec import GGMLTensor, ModelSpec  # noqa: F401

MODELS = {m.name: m for m in (MNIST_FC, MNIST_CNN)}

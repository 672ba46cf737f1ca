"""jitgraph: a JIT compiler for neural-network training graphs.

The core is this folder's modules (types, registry, ir, ops/, interp, printer, serialize, validate,
errors, init, optim, training, compiler, testing) with the passes (passes/) and the runtime
(runtime/); the applications built on it have subpackages of their own: models/ (model
builders, tokenizer, perplexity), formats/ (GGUF files, data sets) and cli/ (the `jitgraph`
command, benchmarks). The core imports no application (tests/test_layers.py).
"""
from .runtime.cpu.threading import set_blas_defaults as _set_blas_defaults

_set_blas_defaults()   # before numpy/scipy load OpenBLAS (see runtime/cpu/threading.py)
from .types import ShapeError, TensorType  # noqa: F401
from .ir import Graph, Node, Tensor  # noqa: F401
from . import init, interp  # noqa: F401
from .ops import *  # noqa: F401,F403
from .ops import (  # noqa: F401  (names `import *` would skip or shadow)
    sum, max, abs, pow, slice)
from .serialize import GraphFormatError  # noqa: F401
from .errors import DataFormatError, ModelFormatError  # noqa: F401
from .lora import lora  # noqa: F401  (jitgraph/lora.py: LoRA as a graph transform)

__version__ = "0.1.0"


def grad(graph, loss="loss", wrt=None, inputs=()):
    """Forward + backward graph, gradients as outputs `grad/<param>` (see passes/autodiff.py)."""
    from jitgraph.passes.autodiff import grad as _grad
    return _grad(graph, loss, wrt=wrt, inputs=inputs)[0]


# jg.<name> -> the module it names, imported on first use
_MODULES = {"optim": "optim", "testing": "testing", "models": "models", "formats": "formats",
            "data": "formats.data", "gguf_io": "formats.gguf"}


def __getattr__(name):
    # Lazily bound so that importing jitgraph stays cheap (numba loads only when compiling) and
    # loads no application (models/, formats/, cli/) until one is asked for.
    if name in _MODULES:    # import_module: `from . import x` would recurse here
        import importlib
        return importlib.import_module(f"{__name__}.{_MODULES[name]}")
    if name in ("training_graph", "fit", "evaluate"):
        from . import training
        return getattr(training, name)
    if name == "compile":
        from .compiler import compile
        return compile
    raise AttributeError(f"module 'jitgraph' has no attribute {name!r}")

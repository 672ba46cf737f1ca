"""jitgraph: a JIT compiler for neural-network training graphs."""
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

__version__ = "0.1.0"


def grad(graph, loss="loss", wrt=None, inputs=()):
    """Forward + backward graph, gradients as outputs `grad/<param>` (see passes/autodiff.py)."""
    from jitgraph.passes.autodiff import grad as _grad
    return _grad(graph, loss, wrt=wrt, inputs=inputs)[0]


def __getattr__(name):
    # Lazily bound so that importing jitgraph stays cheap (numba loads only when compiling).
    if name in ("optim", "testing", "data", "models", "gguf_io"):    # import_module: `from . import x` would recurse here
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    if name == "training_graph":
        from .training import training_graph
        return training_graph
    if name in ("fit", "evaluate"):
        from . import train
        return getattr(train, name)
    if name == "compile":
        from .compiler import compile
        return compile
    raise AttributeError(f"module 'jitgraph' has no attribute {name!r}")

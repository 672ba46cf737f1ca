"""The op library. Each module registers its ops (jitgraph.registry.OPS) and defines the
user-facing functions re-exported here and in the jitgraph namespace; tensor_methods gives
jitgraph.ir.Tensor its operators (x + y, x @ w, x.T, x.sum(), ...)."""
from ..registry import OPS, OpDef, get_op, register, defvjp  # noqa: F401
from .common import apply, const  # noqa: F401
from .elementwise import (  # noqa: F401
    add, sub, mul, div, maximum, minimum, neg, scale, pow, sqr, sqrt, exp, log, abs, sgn, step,
    relu, leaky_relu, gelu, silu, sigmoid, tanh, softplus, clamp, where, cast, full_like)
from .reduce import sum, mean, max, logsumexp, argmax, count_equal  # noqa: F401
from .shape import (  # noqa: F401
    reshape, permute, transpose, broadcast_to, concat, slice, pad, get_rows, matmul)
from .nn import *  # noqa: F401,F403
from .loss import *  # noqa: F401,F403
from .marks import checkpoint  # noqa: F401
from .f16 import round_f16  # noqa: F401
from .kv import kv_attention, set_rows  # noqa: F401
from .attention import attention  # noqa: F401
from . import update as _update  # noqa: F401  (registers the fused optimizer-update ops)
from . import tensor_methods as _tensor_methods  # noqa: F401  (installs Tensor's operators)

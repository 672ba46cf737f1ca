"""The benchmark workloads of issues 5 (fusion), 8 (checkpointing) and 17 (llama training).

`WORKLOADS[name](scale=1.0, seed=0)` returns a Workload (graph, feeds, loss, optimizer): compile
it with `jg.compile(w.graph, loss=w.loss, optimizer=w.optimizer, ...)` and time
`prog.step(**w.feeds)`. `scale` multiplies the sizes (the tests build them tiny); scale 1 is
the size the issues name. Everything is deterministic in `seed`.

The microbenchmarks keep their data in non-trainable params (the program's persistent region,
filled from the graph's initialisers), so a step times the kernels rather than copying 16 MB
of inputs into the arena; `jitgraph bench` compiles with copy_outputs=False, so no 16 MB output
is copied out either. The softmax benchmark scales its input first (attention's 1/sqrt(d)) and layer_norm has its affine epilogue: each is
a reduction with an elementwise prologue or epilogue, the pattern issue 5 fuses. `softmax`
and `layer_norm` are written from primitives, numpy-style (max, sub, exp, sum, div; mean,
sub, sqr, mean, add, sqrt, div): unfused, one kernel per primitive; fused, the patterns pass
(passes/patterns.py) turns each into its row op and fusion makes that one rows kernel.
`softmax_op` and `layer_norm_op` build the same computations from the row ops themselves.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

import jitgraph as jg
from jitgraph import init, ops
from jitgraph.models import mnist
from jitgraph.models.llama import LlamaConfig, llama_forward

FUSION = ("ew_chain", "ew_chain_math", "ew_chain_exp", "ew_chain_act", "softmax", "softmax_op",
          "layer_norm", "layer_norm_op", "gemm_bias_gelu", "mnist_mlp_b100", "mnist_mlp_b1000", "mnist_cnn_b100",
          "transformer_block", "llama_train")
CHECKPOINT = ("deep_mlp", "transformer_4l")
SAFETY = ("mnist_mlp_b100", "mnist_mlp_b1000", "mnist_cnn_b100")   # jitgraph bench --safety


class Workload(NamedTuple):
    graph: object
    feeds: dict
    loss: str | None
    optimizer: object


def _dim(n, scale, multiple=1):
    """n * scale rounded to a positive multiple of `multiple`."""
    return max(multiple, int(round(n * scale / multiple)) * multiple)


def _data(g, name, shape):
    return g.param(name, shape, init=init.normal(), trainable=False)


def _adamw():
    return jg.optim.AdamW(lr=1e-3)


# ---- microbenchmarks (forward only) ------------------------------------------------------------
def _two_arrays(g, scale):
    shape = (_dim(2048, scale), 2048)
    return _data(g, "x", shape), _data(g, "y", shape)


def ew_chain(scale=1.0, seed=0):
    """Eight arithmetic elementwise ops over two [2048, 2048] arrays (4M floats each): memory
    bound, the case fusion exists for (one pass over the data instead of eight)."""
    g = jg.Graph("ew_chain")
    x, y = _two_arrays(g, scale)
    h = ops.sqr(x * y + x) - y
    g.output(out=ops.scale(ops.relu(h * x), 0.5) + y)
    return Workload(g, {}, None, None)


def ew_chain_math(scale=1.0, seed=0):
    """Eight elementwise ops with tanh and sigmoid over two [2048, 2048] arrays: once fused,
    the exp and division of tanh and sigmoid, not memory, bound the time."""
    g = jg.Graph("ew_chain_math")
    x, y = _two_arrays(g, scale)
    h = ops.tanh(x * y + x)
    g.output(out=ops.relu(ops.sigmoid(ops.sqr(h) - y) * x))
    return Workload(g, {}, None, None)


def ew_chain_exp(scale=1.0, seed=0):
    """tanh(exp(-(a*b + a)^2) * 0.5 - b) / (|a| + 1) over two [2048, 2048] arrays (issue 16):
    exp and tanh in one chain of eleven ops; unfused, eleven passes over 16 MB arrays."""
    g = jg.Graph("ew_chain_exp")
    a, b = _two_arrays(g, scale)
    e = ops.exp(-ops.sqr(a * b + a))
    g.output(out=ops.tanh(ops.scale(e, 0.5) - b) / (ops.abs(a) + 1.0))
    return Workload(g, {}, None, None)


def ew_chain_act(scale=1.0, seed=0):
    """gelu(softplus(a*b - a) * sigmoid(b) - tanh(a + b)) over two [2048, 2048] arrays (issue
    16): four transcendental activations in one fused kernel (slower than unfused while their
    exp/log/tanh were libm calls)."""
    g = jg.Graph("ew_chain_act")
    a, b = _two_arrays(g, scale)
    h = ops.softplus(a * b - a) * ops.sigmoid(b) - ops.tanh(a + b)
    g.output(out=ops.gelu(h))
    return Workload(g, {}, None, None)


def softmax(scale=1.0, seed=0):
    """softmax(x / 32) over rows of [4096, 1024], written from primitives."""
    g = jg.Graph("softmax")
    s = _data(g, "x", (_dim(4096, scale), _dim(1024, scale))) / 32
    e = ops.exp(s - ops.max(s, axis=-1, keepdims=True))
    g.output(out=e / ops.sum(e, axis=-1, keepdims=True))
    return Workload(g, {}, None, None)


def softmax_op(scale=1.0, seed=0):
    """softmax(x / 32) over rows of [4096, 1024], with the softmax op."""
    g = jg.Graph("softmax_op")
    x = _data(g, "x", (_dim(4096, scale), _dim(1024, scale)))
    g.output(out=ops.softmax(ops.scale(x, 1 / 32)))
    return Workload(g, {}, None, None)


def _affine(g, d):
    return _data(g, "w", (d,)), _data(g, "b", (d,))


def layer_norm(scale=1.0, seed=0):
    """(x - mean) / sqrt(var + 1e-5) * w + b over rows of [4096, 1024], from primitives."""
    g = jg.Graph("layer_norm")
    rows, d = _dim(4096, scale), _dim(1024, scale)
    x = _data(g, "x", (rows, d))
    w, b = _affine(g, d)
    xc = x - ops.mean(x, axis=-1, keepdims=True)
    var = ops.mean(xc * xc, axis=-1, keepdims=True)
    g.output(out=xc / ops.sqrt(var + 1e-5) * w + b)
    return Workload(g, {}, None, None)


def layer_norm_op(scale=1.0, seed=0):
    """layer_norm(x) * w + b over rows of [4096, 1024], with the layer_norm op."""
    g = jg.Graph("layer_norm_op")
    rows, d = _dim(4096, scale), _dim(1024, scale)
    x = _data(g, "x", (rows, d))
    g.output(out=ops.layer_norm(x, *_affine(g, d), eps=1e-5))
    return Workload(g, {}, None, None)


def gemm_bias_gelu(scale=1.0, seed=0):
    """gelu(x @ w + b), all sides 1024."""
    g = jg.Graph("gemm_bias_gelu")
    n = _dim(1024, scale)
    x, w, b = _data(g, "x", (n, n)), _data(g, "w", (n, n)), _data(g, "b", (n,))
    g.output(out=ops.gelu(x @ w + b))
    return Workload(g, {}, None, None)


# ---- training steps ----------------------------------------------------------------------------
def _classes(g, rng):
    """x uniform in [0, 1) and labels below the logits' width, for x/y classification graphs."""
    xt, yt = g.nodes[g.inputs["x"]].type, g.nodes[g.inputs["y"]].type
    n_classes = g.nodes[g.outputs["logits"]].type.shape[-1]
    return {"x": rng.random(xt.shape, dtype=np.float32),
            "y": rng.integers(0, n_classes, yt.shape, dtype=np.int32)}


def _mnist(build, batch, scale, seed):
    g = build(_dim(batch, scale))
    return Workload(g, _classes(g, np.random.default_rng(seed)), "loss", _adamw())


def mnist_mlp_b100(scale=1.0, seed=0):
    return _mnist(mnist.mnist_fc, 100, scale, seed)


def mnist_mlp_b1000(scale=1.0, seed=0):
    return _mnist(mnist.mnist_fc, 1000, scale, seed)


def mnist_cnn_b100(scale=1.0, seed=0):
    return _mnist(mnist.mnist_cnn, 100, scale, seed)


def llama_tokens(vocab, batch, seq, rng):
    """Feeds for a llama_forward(labels=True) graph: random token rows, labels = the next token
    of each position, pos = 0..seq-1."""
    text = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    return {"tokens": text[:, :-1].copy(), "labels": text[:, 1:].copy(),
            "pos": np.arange(seq, dtype=np.int32)}


def _llama(name, scale, seed, *, layers, dim, heads, ff, vocab, seq, batch):
    """A llama training step (jitgraph/models/llama.py) at `scale`: width, ff, seq and batch
    scale (width stays a multiple of 2 * heads: rope rotates pairs), the vocabulary does not."""
    seq = _dim(seq, scale)
    cfg = LlamaConfig(vocab=vocab, dim=_dim(dim, scale, 2 * heads), layers=layers, heads=heads,
                      ff=_dim(ff, scale), ctx=seq)
    batch = _dim(batch, scale)
    g = llama_forward(cfg, batch, seq, labels=True, name=name)
    return Workload(g, llama_tokens(vocab, batch, seq, np.random.default_rng(seed)), "loss",
                    _adamw())


def transformer_block(scale=1.0, seed=0):
    """One llama block (width 256, 4 heads, ff 1024 SwiGLU, seq 128, batch 8) with a byte
    vocabulary (256) in and out."""
    return _llama("transformer_block", scale, seed, layers=1, dim=256, heads=4, ff=1024,
                  vocab=256, seq=128, batch=8)


def transformer_4l(scale=1.0, seed=0):
    """Four such blocks with a vocabulary of 512, for the checkpointing curve."""
    return _llama("transformer_4l", scale, seed, layers=4, dim=256, heads=4, ff=1024,
                  vocab=512, seq=128, batch=8)


def llama_train(scale=1.0, seed=0):
    """Issue 17's training-from-scratch shape: byte vocabulary, width 128, 4 layers, 4 heads,
    ff 352, context 128, batch 16 (bench/llama_peers.py runs it on text against PyTorch)."""
    return _llama("llama_train", scale, seed, layers=4, dim=128, heads=4, ff=352, vocab=256,
                  seq=128, batch=16)


def deep_mlp(scale=1.0, seed=0, layers=16):
    """16 ReLU layers of 1024 units at batch 1024, then 10 classes: activations dominate."""
    g = jg.Graph("deep_mlp")
    batch, width = _dim(1024, scale), _dim(1024, scale)
    h, y = g.input("x", (batch, width)), g.input("y", (batch,), "i32")
    for i in range(layers + 1):
        n_out = 10 if i == layers else width
        w = g.param(f"fc{i}.weight", (width, n_out), init=init.he_uniform())
        h = h @ w + g.param(f"fc{i}.bias", (n_out,))
        h = h if i == layers else ops.relu(h)
    g.output(loss=ops.cross_entropy(h, y), logits=h)
    return Workload(g, _classes(g, np.random.default_rng(seed)), "loss", _adamw())


WORKLOADS = {f.__name__: f for f in (
    ew_chain, ew_chain_math, ew_chain_exp, ew_chain_act, softmax, softmax_op, layer_norm,
    layer_norm_op, gemm_bias_gelu,
    mnist_mlp_b100, mnist_mlp_b1000, mnist_cnn_b100, transformer_block, llama_train, deep_mlp,
    transformer_4l)}

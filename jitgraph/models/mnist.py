"""ggml's MNIST models (examples/mnist/mnist-common.cpp), same params under the same names.

Both take x f32 [B, 784] (pixels in [0, 1]) and y i32 [B], and output loss (mean cross entropy),
logits [B, 10] and correct (how many argmax(logits) == y). Initialisation follows PyTorch's
defaults: weights U(+-1/sqrt(fan_in)) (he_uniform), biases the same bound.

Layouts. jitgraph keeps dense weights [in, out] (x @ w) and conv kernels [out, in, kh, kw] with
NCHW activations; ggml stores a dense weight as ne [in, out] (numpy [out, in]) and a kernel as
ne [kw, kh, in, out] (numpy [out, in, kh, kw], the same memory order). ggml's CNN flattens the
pooled [B, 16, 7, 7] activations in (h, w, c) order (ggml_permute(.., 1, 2, 0, 3) then ggml_cont),
jitgraph flattens in (c, h, w) order, so dense.weight's rows are permuted: ggml's [k, h, w, c] is
jitgraph's [c, h, w, k]. The GGMLTensor tables below are the only place these conversions live.
"""
from __future__ import annotations

import math

from .. import init, ops
from ..ir import Graph
from .spec import GGMLTensor, ModelSpec

HW, NINPUT, NHIDDEN, NCLASSES, NCB = 28, 784, 500, 10, 8   # as in mnist-common.h


def _bias_init(fan_in):
    return init.uniform(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))


def _inputs(name, batch):
    g = Graph(name)
    return g, g.input("x", (batch, NINPUT)), g.input("y", (batch,), "i32")


def _dense(g, name, x, n_in, n_out):
    w = g.param(f"{name}.weight", (n_in, n_out), init=init.he_uniform())
    b = g.param(f"{name}.bias", (n_out,), init=_bias_init(n_in))
    return x @ w + b


def _conv_relu_pool(g, name, x, c_in, c_out):
    k = g.param(f"{name}.kernel", (c_out, c_in, 3, 3), init=init.he_uniform())
    b = g.param(f"{name}.bias", (c_out, 1, 1), init=_bias_init(c_in * 9))
    return ops.max_pool2d(ops.relu(ops.conv2d(x, k, padding=1) + b), 2)


def _head(g, logits, y):
    g.output(loss=ops.cross_entropy(logits, y), logits=logits,
             correct=ops.count_equal(ops.argmax(logits, -1), y))
    return g


def mnist_fc(batch: int) -> Graph:
    """784-500-10 with ReLU."""
    g, x, y = _inputs("mnist_fc", batch)
    h = ops.relu(_dense(g, "fc1", x, NINPUT, NHIDDEN))
    return _head(g, _dense(g, "fc2", h, NHIDDEN, NCLASSES), y)


def mnist_cnn(batch: int) -> Graph:
    """conv3x3 1->8 pad 1, ReLU, maxpool 2; conv3x3 8->16 pad 1, ReLU, maxpool 2; dense 784->10."""
    g, x, y = _inputs("mnist_cnn", batch)
    h = _conv_relu_pool(g, "conv1", ops.reshape(x, (batch, 1, HW, HW)), 1, NCB)
    h = _conv_relu_pool(g, "conv2", h, NCB, 2 * NCB)
    n = 2 * NCB * (HW // 4) ** 2
    return _head(g, _dense(g, "dense", ops.reshape(h, (batch, n)), n, NCLASSES), y)


MNIST_FC = ModelSpec("mnist-fc", mnist_fc, {
    "fc1.weight": GGMLTensor((NINPUT, NHIDDEN), axes=(1, 0)),
    "fc1.bias": GGMLTensor((NHIDDEN,)),
    "fc2.weight": GGMLTensor((NHIDDEN, NCLASSES), axes=(1, 0)),
    "fc2.bias": GGMLTensor((NCLASSES,)),
})

_Q = HW // 4
MNIST_CNN = ModelSpec("mnist-cnn", mnist_cnn, {
    "conv1.kernel": GGMLTensor((3, 3, 1, NCB)),
    "conv1.bias": GGMLTensor((1, 1, NCB)),
    "conv2.kernel": GGMLTensor((3, 3, NCB, 2 * NCB)),
    "conv2.bias": GGMLTensor((1, 1, 2 * NCB)),
    "dense.weight": GGMLTensor((_Q * _Q * 2 * NCB, NCLASSES), axes=(3, 1, 2, 0),
                               split=(2 * NCB, _Q, _Q, NCLASSES)),
    "dense.bias": GGMLTensor((NCLASSES,)),
})

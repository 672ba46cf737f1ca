"""The MNIST-shaped MLP (784-500-10) shared by the benchmarks."""
import numpy as np

import jitgraph as jg


def mnist_mlp(batch):
    g = jg.Graph("mnist_mlp")
    x, y = g.input("x", (batch, 784)), g.input("y", (batch,), "i32")
    w1 = g.param("w1", (784, 500), init=jg.init.he_normal())
    b1 = g.param("b1", (500,))
    w2 = g.param("w2", (500, 10), init=jg.init.he_normal())
    b2 = g.param("b2", (10,))
    logits = jg.relu(x @ w1 + b1) @ w2 + b2
    g.output(loss=jg.cross_entropy(logits, y))
    return g


def random_batch(batch, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.random((batch, 784), dtype=np.float32),
            "y": rng.integers(0, 10, batch).astype(np.int32)}

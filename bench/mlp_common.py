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


def jax_mlp_step(xb, yb):
    """One JAX-jit training step of the 784-500-10 MLP with AdamW written in jax.numpy
    (PyTorch's defaults: betas 0.9/0.999, eps 1e-8, weight decay 0.01); returns a callable that
    runs a step and waits for it. Needs jax, not optax."""
    import jax
    jnp = jax.numpy
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {"w1": jax.random.normal(k[0], (784, 500)) * 0.05, "b1": jnp.zeros(500),
              "w2": jax.random.normal(k[1], (500, 10)) * 0.05, "b2": jnp.zeros(10)}
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01

    def loss_fn(p, x, y):
        logits = jnp.maximum(x @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    @jax.jit
    def step(p, m, v, t, x, y):
        loss, gr = jax.value_and_grad(loss_fn)(p, x, y)
        t = t + 1
        m = jax.tree_util.tree_map(lambda a, g: b1 * a + (1 - b1) * g, m, gr)
        v = jax.tree_util.tree_map(lambda a, g: b2 * a + (1 - b2) * g * g, v, gr)
        c1, c2 = 1 / (1 - b1 ** t), 1 / (1 - b2 ** t)
        p = jax.tree_util.tree_map(lambda w, a, b: w * (1 - lr * wd) - lr * (a * c1) /
                                   (jnp.sqrt(b * c2) + eps), p, m, v)
        return p, m, v, t, loss
    x, y = jnp.asarray(xb), jnp.asarray(yb)
    carry = [params, zeros, zeros, jnp.float32(0)]

    def run():
        *carry[:], loss = step(*carry, x, y)
        loss.block_until_ready()
    return run

"""MNIST training steps, jitgraph against PyTorch eager (NCHW and channels_last) and JAX jit when
installed, measured in one process on the same batch: `python bench/mnist_peers.py [--steps N]`.

Shared by bench/test_bench_mnist.py (pytest-benchmark). Each `*_step(model, batch)` returns a
zero-argument function that runs one AdamW training step (lr 1e-3) on a fixed random batch;
a peer that is not installed raises ImportError. Models: mnist-cnn (batch 100) and mnist-fc
(batch 1000) as in jitgraph/models/mnist.py.
"""
import argparse
import time

import numpy as np

import jitgraph as jg
from jitgraph.models import MODELS
from mlp_common import jax_mlp_step, random_batch

BATCH = {"mnist-cnn": 100, "mnist-fc": 1000}


def _batch(batch):
    b = random_batch(batch)
    return b["x"], b["y"]


def jitgraph_step(model, batch):
    prog = jg.compile(MODELS[model](batch), loss="loss", optimizer=jg.optim.AdamW(lr=1e-3))
    x, y = _batch(batch)
    return lambda: prog.step(x=x, y=y)


def _torch_model(torch, model):
    nn = torch.nn
    if model == "mnist-fc":
        return nn.Sequential(nn.Linear(784, 500), nn.ReLU(), nn.Linear(500, 10))
    return nn.Sequential(nn.Unflatten(1, (1, 28, 28)),
                         nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(784, 10))


def torch_step(model, batch, channels_last=False):
    import torch
    torch.manual_seed(0)
    net = _torch_model(torch, model)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    xb, yb = _batch(batch)
    x, y = torch.from_numpy(xb), torch.from_numpy(yb).long()

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
    return step


def jax_step(model, batch):
    xb, yb = _batch(batch)
    return jax_mlp_step(xb, yb)


SYSTEMS = {"jitgraph": jitgraph_step, "torch": torch_step,
           "torch-channels-last": lambda m, b: torch_step(m, b, channels_last=True),
           "jax-jit": jax_step}
PEERS = {"mnist-cnn": ["jitgraph", "torch", "torch-channels-last"],
         "mnist-fc": ["jitgraph", "torch", "jax-jit"]}


def median_ms(step, steps):
    for _ in range(5):
        step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    for model, batch in BATCH.items():
        for name in PEERS[model]:
            try:
                step = SYSTEMS[name](model, batch)
            except ImportError as e:
                print(f"{model:10s} batch {batch:5d}  {name:20s} skipped: {e}")
                continue
            ms = median_ms(step, args.steps)
            epoch = ms * (60000 // batch) / 1e3
            print(f"{model:10s} batch {batch:5d}  {name:20s} {ms:8.2f} ms/step  "
                  f"{epoch:6.2f} s per 60k-sample epoch")


if __name__ == "__main__":
    main()

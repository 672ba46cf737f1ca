"""MNIST training steps, jitgraph against its peers (bench/mnist_peers.py): mnist-cnn at batch
100 (PyTorch eager NCHW and channels_last), mnist-fc at batch 1000 (PyTorch eager, JAX jit).
Peers that are not installed are skipped with a message. Run: see bench/README.md."""
import pytest

from mnist_peers import BATCH, PEERS, SYSTEMS

CASES = [(m, s) for m in BATCH for s in PEERS[m]]


@pytest.mark.parametrize("model,system", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_mnist_step(benchmark, model, system):
    try:
        step = SYSTEMS[system](model, BATCH[model])
    except ImportError as e:
        pytest.skip(f"{system} is not installed: {e}")
    step()
    benchmark(step)

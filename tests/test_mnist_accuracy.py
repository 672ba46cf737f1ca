"""Real MNIST (../shared/data/mnist, or $JITGRAPH_MNIST): mnist-fc trained for 5 epochs at batch
1000 with the defaults (AdamW lr 1e-3, val split 0.05, seed 0) must classify the 10k test images
as well as measured: 95.87 % (30 epochs reach 97.99 %, the issue's target 97.9 %). Skipped when
the IDX files are absent; ~50 s on a loaded 2-core box."""
import os

import pytest

import jitgraph as jg
from jitgraph.formats import data
from jitgraph.models import MODELS
from jitgraph.cli.train import evaluate, fit

MNIST = os.environ.get("JITGRAPH_MNIST") or os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "data", "mnist")
FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
         "t10k-labels-idx1-ubyte"]


def _present():
    return all(os.path.exists(os.path.join(MNIST, f + ext)) or os.path.exists(os.path.join(MNIST, f))
               for f in FILES for ext in [".gz"])


@pytest.mark.slow
@pytest.mark.skipif(not _present(), reason=f"real MNIST IDX files not found in {MNIST} "
                                           "(set JITGRAPH_MNIST to their directory)")
def test_mnist_fc_accuracy_after_5_epochs():
    train, test = data.load_mnist(MNIST, "train"), data.load_mnist(MNIST, "test")
    prog = jg.compile(MODELS["mnist-fc"](1000), loss="loss", optimizer=jg.optim.AdamW(lr=1e-3))
    logs = fit(prog, train, epochs=5, batch_size=1000, val_split=0.05, seed=0)
    assert logs[-1].train.loss()[0] < logs[0].train.loss()[0]
    acc, _ = evaluate(prog.evaluator(), test, 1000).accuracy()
    assert acc >= 0.955, f"mnist-fc test accuracy after 5 epochs {acc:.4f} < 0.955"

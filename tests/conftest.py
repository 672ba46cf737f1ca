"""Shared fixtures: compiled programs use a kernel cache in a temporary directory (never the
user's ~/.cache/jitgraph) reused by every test of the run; every program the suite compiles has
its memory plan verified (passes/memory_check.py); the data files the tests read come from
tests/data (`testdata`), with llama.cpp's stories260K model and reference outputs read from there
(`model`, `ref`), the model file as the command line takes it (`stories`); text files of the
shipped corpus (`corpus_file`); a small classifier graph and its data (`mlp`, `mlp_data`)."""
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ["JITGRAPH_CHECK_PLANS"] = "1"


@pytest.fixture(scope="session", autouse=True)
def jitgraph_cache_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("jitgraph_cache")
    old = os.environ.get("JITGRAPH_CACHE_DIR")
    os.environ["JITGRAPH_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("JITGRAPH_CACHE_DIR", None)
    else:
        os.environ["JITGRAPH_CACHE_DIR"] = old


# ---- the data files the tests read, shipped in tests/data (provenance, licenses and checksums:
# tests/data/README.md). A missing file fails the tests that use it; it never skips them.
DATA = Path(__file__).resolve().with_name("data")


@dataclass(frozen=True)
class DataFiles:
    stories: Path = DATA / "stories260K.gguf"           # llama.cpp's tiny llama test model
    reference: Path = DATA / "stories260K-reference.json"   # what llama.cpp computes for it
    shakespeare_tail: Path = DATA / "tinyshakespeare_tail.txt"   # perplexity's held-out 10 %
    mnist: Path = DATA / "mnist"                        # the first 6,000 train, 2,000 test images


MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
               "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


@pytest.fixture(scope="session")
def testdata():
    """The paths of tests/data's files, each checked to be there."""
    files = DataFiles()
    want = [files.stories, files.reference, files.shakespeare_tail,
            *(files.mnist / f for f in MNIST_FILES)]
    missing = [str(p) for p in want if not p.is_file()]
    assert not missing, f"test data missing (tests/data/README.md lists it): {', '.join(missing)}"
    return files


@pytest.fixture(scope="session")
def stories(testdata):
    """llama.cpp's stories260K model file, as the command line takes it (a str)."""
    return str(testdata.stories)


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    """corpus_file(n, end=b""): the path (a str) of a text file of the shipped corpus's first n
    bytes followed by `end`, for the commands' --text; written once per run for each (n, end)."""
    made = {}

    def make(n, end=b""):
        if (n, end) not in made:
            from jitgraph.models.text import read_corpus
            p = tmp_path_factory.mktemp("text") / "t.txt"
            p.write_bytes(read_corpus()[:n] + end)
            made[n, end] = str(p)
        return made[n, end]
    return make


@pytest.fixture(scope="module")
def model(testdata):
    """llama.cpp's stories260K (config, params, tokenizer), read once per module."""
    from jitgraph.models.llama import read_llama
    return read_llama(testdata.stories)


@pytest.fixture(scope="module")
def ref(testdata):
    """What llama.cpp computes for stories260K (tests/data/README.md describes the fields)."""
    with open(testdata.reference) as f:
        return json.load(f)


# ---- a small classifier and its data (the mixed precision and bf16 master weight tests) -------
@pytest.fixture
def mlp():
    """A fresh 2-layer MLP classifier: inputs x f32[64, 20] and y i32[64] (5 classes), params w1
    and w2, output `loss`."""
    import jitgraph as jg
    n = 64
    g = jg.Graph("mlp")
    x, y = g.input("x", (n, 20)), g.input("y", (n,), "i32")
    w1 = g.param("w1", (20, 48), init=jg.init.normal(0.0, 0.3))
    w2 = g.param("w2", (48, 5), init=jg.init.normal(0.0, 0.3))
    g.output(loss=jg.cross_entropy(jg.rms_norm(jg.relu(x @ w1)) @ w2, y))
    return g


@pytest.fixture
def mlp_data():
    """(x, y) for `mlp`: 64 normal samples labelled by a random linear map of their first 5
    features (seed 7)."""
    import numpy as np
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 20)).astype(np.float32)
    y = (x[:, :5] @ rng.standard_normal((5, 5))).argmax(1).astype(np.int32)
    return x, y

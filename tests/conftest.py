"""Shared fixtures: compiled programs use a kernel cache in a session-wide temporary directory
(never the user's ~/.cache/jitgraph), reused by every test of the session; and every program
the suite compiles has its memory plan verified (passes/memory_check.py)."""
import os

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


# ---- llama.cpp's stories260K model and what llama.cpp computes for it (tests/test_llama.py,
# tests/test_generate.py); skipped with the path when ../shared/data is absent
_GGUF = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gguf")


@pytest.fixture(scope="module")
def model():
    from jitgraph.models.llama import read_llama
    path = os.path.join(_GGUF, "stories260K.gguf")
    if not os.path.exists(path):
        pytest.skip(f"{path} (llama.cpp's stories260K test model) not present")
    return read_llama(path)


@pytest.fixture(scope="module")
def ref():
    import json
    path = os.path.join(_GGUF, "stories260K-reference.json")
    if not os.path.exists(path):
        pytest.skip(f"{path} not present")
    with open(path) as f:
        return json.load(f)

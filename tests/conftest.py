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

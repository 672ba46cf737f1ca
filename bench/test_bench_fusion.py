"""Fused against unfused on the issue 5 workloads, under pytest-benchmark.

Each workload is one benchmark group holding its `unfused` and `fused` programs, so a saved run
compares group by group:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE pytest bench/test_bench_fusion.py \
        --benchmark-autosave          # later: --benchmark-compare

`jitgraph bench` runs the same workloads (jitgraph/cli/workloads.py) and prints the ratios.
"""
from __future__ import annotations

import functools

import pytest

import jitgraph as jg
from jitgraph.cli.bench import load_workloads

WL = load_workloads()


@functools.cache
def _workload(name):
    return WL.WORKLOADS[name]()


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("name", WL.FUSION)
def test_fusion(benchmark, name, fuse):
    w = _workload(name)
    # outputs as views, as `jitgraph bench` does: a 16 MB output copy is no part of fusion
    prog = jg.compile(w.graph, loss=w.loss, optimizer=w.optimizer, fuse=fuse, copy_outputs=False)
    st = prog.stats()
    benchmark.group = name
    benchmark.extra_info.update({k: st.get(k) for k in ("kernels", "bytes_moved", "arena_bytes")})
    for _ in range(2):                  # warm up caches and the thread pools
        prog.step(**w.feeds)
    benchmark(prog.step, **w.feeds)

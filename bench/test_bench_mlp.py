"""MNIST-shaped MLP (784-500-10) AdamW training step: jitgraph vs the numpy interpreter vs
PyTorch eager / JAX jit (when installed), the same step's GEMMs alone (the lower bound), the
per-step overhead of a tiny graph, and cold / warm compile time. Run: see bench/README.md."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jitgraph as jg
from mlp_common import jax_mlp_step, mnist_mlp, random_batch
from mnist_peers import torch_step

BATCHES = [100, 1000]


def _blas_info():
    from threadpoolctl import threadpool_info
    return [(i["prefix"], i.get("architecture"), i["num_threads"]) for i in threadpool_info()]


@pytest.fixture(scope="module", autouse=True)
def report_blas(request):
    yield
    from jitgraph.runtime.cpu import blas
    print("\nBLAS/OpenMP in use:", _blas_info(), "jitgraph GEMMs:", blas.BACKEND, blas.LIBRARY,
          "OPENBLAS_CORETYPE=", os.environ.get("OPENBLAS_CORETYPE"))


@pytest.mark.parametrize("batch", BATCHES)
def test_jitgraph_step(benchmark, batch):
    prog = jg.compile(mnist_mlp(batch), loss="loss", optimizer=jg.optim.AdamW(lr=1e-3))
    b = random_batch(batch)
    benchmark(lambda: prog.step(**b))


@pytest.mark.parametrize("batch", BATCHES)
def test_interpreter_step(benchmark, batch):
    opt = jg.optim.AdamW(lr=1e-3)
    tg = jg.training_graph(mnist_mlp(batch), loss="loss", optimizer=opt)
    state, b = tg.init_params(0), random_batch(batch)
    benchmark(lambda: jg.interp.run(tg, {**b, **opt.runtime_inputs(0)}, state))


@pytest.mark.parametrize("batch", BATCHES)
def test_gemm_lower_bound(benchmark, batch):
    """The step's GEMMs alone, with the same BLAS calls (forward 2, backward dW1, dW2, dH)."""
    from jitgraph.runtime.cpu.blas import gemm_f32
    from numba import njit
    rng = np.random.default_rng(0)
    x, w1 = rng.random((batch, 784), dtype=np.float32), rng.random((784, 500), dtype=np.float32)
    w2, h = rng.random((500, 10), dtype=np.float32), np.empty((batch, 500), np.float32)
    o, g = np.empty((batch, 10), np.float32), rng.random((batch, 10), dtype=np.float32)
    dw1, dw2, dh = np.empty_like(w1), np.empty_like(w2), np.empty_like(h)

    @njit
    def gemms(x, w1, w2, h, o, g, dw1, dw2, dh):
        gemm_f32(False, False, 1.0, x, w1, 0.0, h)
        gemm_f32(False, False, 1.0, h, w2, 0.0, o)
        gemm_f32(True, False, 1.0, h, g, 0.0, dw2)
        gemm_f32(False, True, 1.0, g, w2, 0.0, dh)
        gemm_f32(True, False, 1.0, x, dh, 0.0, dw1)
    args = (x, w1, w2, h, o, g, dw1, dw2, dh)
    gemms(*args)
    benchmark(lambda: gemms(*args))


@pytest.mark.parametrize("batch", BATCHES)
def test_torch_eager_step(benchmark, batch):
    pytest.importorskip("torch", reason="PyTorch is not installed")
    benchmark(torch_step("mnist-fc", batch))


@pytest.mark.parametrize("batch", BATCHES)
def test_jax_jit_step(benchmark, batch):
    """JAX jit with AdamW written in jax.numpy (bench/mlp_common.py), so optax is not needed."""
    pytest.importorskip("jax", reason="JAX is not installed")
    b = random_batch(batch)
    run = jax_mlp_step(b["x"], b["y"])
    run()
    benchmark(run)


def test_tiny_graph_step_overhead(benchmark):
    """A few hundred elements through ~20 kernels: what a step costs besides the math."""
    g = jg.Graph("tiny")
    x = g.input("x", (16, 16))
    w = g.param("w", (16, 16), init=jg.init.normal(0.0, 0.1))
    h = x
    for _ in range(9):
        h = jg.tanh(h @ w)
    g.output(loss=jg.mean(jg.sqr(h)))
    prog = jg.compile(g, fuse=False)      # unfused: ~20 kernels, the overhead being measured
    assert 18 <= prog.stats()["calls_per_step"] <= 22
    xb = np.ones((16, 16), np.float32)
    benchmark(lambda: prog.step(x=xb))


COMPILE = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {bench!r})
    t0 = time.perf_counter()
    import jitgraph as jg
    from mlp_common import mnist_mlp
    prog = jg.compile(mnist_mlp(1000), loss="loss", optimizer=jg.optim.AdamW(lr=1e-3))
    s = prog.stats()
    print(json.dumps({{"seconds": time.perf_counter() - t0, "compiled": s["kernels_compiled"]}}))
""")


def _compile_process(cache_dir):
    env = dict(os.environ, JITGRAPH_CACHE_DIR=str(cache_dir))
    code = COMPILE.format(bench=os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_compile_time_cold_and_warm(benchmark, tmp_path):
    """New process, empty cache (cold), then a new process with that cache (warm); includes
    interpreter start-up and imports."""
    cold = _compile_process(tmp_path)
    warm = benchmark.pedantic(lambda: _compile_process(tmp_path), rounds=3, iterations=1)
    benchmark.extra_info.update(cold_seconds=cold["seconds"], warm_seconds=warm["seconds"])
    print(f"\ncold compile {cold['seconds']:.2f} s ({cold['compiled']} kernels), "
          f"warm start {warm['seconds']:.2f} s ({warm['compiled']} compiled)")
    assert warm["compiled"] == 0

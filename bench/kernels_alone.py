"""Library kernels timed alone on one thread: `python bench/kernels_alone.py [attention] [rope]
[get_rows] [cross_entropy]` (default: all).

Each kernel is called directly on random data of stories260K's and the width-128 llama's shapes
(attention, rope, get_rows), or stepped in a one-op program (cross-entropy loss and gradient over
[2048, 512] with SGD, lr 0). Timed with the thread's CPU time, the minimum of 30 calls after one
untimed: on a busy shared machine that is the kernel's own cost. The figures of bench/README.md
("2026-12-02, after midnight (commit 131ecc9)") come from this script.
"""
import os
import sys
import time

os.environ["JITGRAPH_NUM_THREADS"] = os.environ["NUMBA_NUM_THREADS"] = "1"   # one thread throughout

import numba  # noqa: E402
import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

import jitgraph as jg  # noqa: E402
from jitgraph.cli.roofline import host_header  # noqa: E402
from jitgraph.runtime.cpu import lib_attention, lib_norm, lib_shape  # noqa: E402

RNG = np.random.default_rng(0)


def cpu_ms(f, n=30):
    f()
    best = float("inf")
    for _ in range(n):
        t = time.thread_time()
        f()
        best = min(best, time.thread_time() - t)
    return best * 1e3


def attention():
    for B, S, H, Hkv, D in ((16, 128, 8, 4, 8), (16, 128, 4, 4, 32)):
        q = RNG.standard_normal((B, S, H, D), dtype=np.float32)
        k, v = (RNG.standard_normal((B, S, Hkv, D), dtype=np.float32) for _ in range(2))
        out, dout = np.empty_like(q), RNG.standard_normal(q.shape, dtype=np.float32)
        grad = np.empty(q.size + 2 * k.size, np.float32)
        ws = np.zeros(lib_attention.workspace_size_attention_back(q.shape, k.shape), np.float32)
        sc = 1 / np.sqrt(D)
        f = cpu_ms(lambda: lib_attention.attention(q, k, v, out, ws, sc))
        b = cpu_ms(lambda: lib_attention.attention_back(q, k, v, out, dout, grad, ws, sc))
        print(f"attention [{B}, {S}, {H} over {Hkv}, {D}] (BQ {lib_attention.BQ}): forward "
              f"{f:.2f} ms, backward {b:.2f} ms")


def rope():
    x = RNG.standard_normal((16, 128, 8, 8), dtype=np.float32)
    out, pos = np.empty_like(x), np.arange(128, dtype=np.int32)
    work = np.empty(lib_norm.workspace_size_rope(x.shape, pos.shape), np.float32)
    for neox in (False, True):
        t = cpu_ms(lambda: lib_norm.rope_work(x, pos, out, work, 10000.0, neox)) * 1e3
        print(f"rope [16, 128, 8, 8] {'neox' if neox else 'normal'}: {t:.0f} us")


def get_rows():
    w = RNG.standard_normal((512, 64), dtype=np.float32)
    idx = RNG.integers(0, 512, (16, 128)).astype(np.int32)
    out, gw = np.empty((16, 128, 64), np.float32), np.empty_like(w)
    print(f"get_rows 2048 x 64: {cpu_ms(lambda: lib_shape.get_rows(w, idx, out)) * 1e3:.0f} us, "
          f"get_rows_back {cpu_ms(lambda: lib_shape.get_rows_back(out, idx, gw)) * 1e3:.0f} us")


def cross_entropy():
    g = jg.Graph("ce")
    x = g.param("x", (2048, 512), "f32", init=jg.init.normal())
    g.output(loss=jg.cross_entropy(x, g.input("y", (2048,), "i32")))
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.0))
    y = RNG.integers(0, 512, 2048).astype(np.int32)
    print(f"cross_entropy [2048, 512] step (loss, gradient, SGD): "
          f"{cpu_ms(lambda: prog.step(y=y)):.2f} ms")


if __name__ == "__main__":
    print(host_header())
    numba.set_num_threads(1)
    with threadpool_limits(1):
        for name in sys.argv[1:] or ("attention", "rope", "get_rows", "cross_entropy"):
            globals()[name]()

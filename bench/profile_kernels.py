"""Per-kernel timing of a compiled program: `python bench/profile_kernels.py [batch]`.

Calls each kernel's C entry point on the program's own buffers (after one real step) and prints
the median time per kernel, slowest first, next to the whole step's median."""
import sys
import time

import numpy as np

from mlp_common import mnist_mlp, random_batch


def profile(prog, inputs, repeat=20):
    prog.step(**inputs)
    regions = {"arena": prog._arena.ctypes.data, "persist": prog._persist.ctypes.data}
    rows = []
    for nid, name, addrs in prog._gen.calls:
        fn = getattr(sys.modules[f"jitgraph_cache.{name}"], name).ctypes
        args = [regions[r] + off for r, off in addrs]
        ts = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn(*args)
            ts.append(time.perf_counter() - t)
        n = prog.graph.nodes[nid]
        rows.append((np.median(ts) * 1e6, f"%{nid} {n.op} {n.type}"))
    return sorted(rows, reverse=True)


if __name__ == "__main__":
    import jitgraph as jg
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    g = mnist_mlp(batch)
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-3))
    b = random_batch(batch)
    for _ in range(5):
        prog.step(**b)
    ts = []
    for _ in range(30):
        t = time.perf_counter()
        prog.step(**b)
        ts.append(time.perf_counter() - t)
    rows = profile(prog, b)
    total = sum(r[0] for r in rows) / 1e3
    print(f"step median {np.median(ts) * 1e3:.3f} ms; sum of kernels {total:.3f} ms")
    for us, what in rows:
        print(f"{us:9.1f} us  {what}")

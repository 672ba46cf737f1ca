"""Thread configurations of one training step, interleaved in one process (the two-thread
pathology of issues 17/18: a 2-thread stories260K step 9x slower than a 1-thread one on a busy
host, each small weight-gradient GEMM waiting for OpenBLAS's second thread to be scheduled).

    python bench/llama_threads.py [full|lora|llama_train] [--rounds 4] [--steps 3]

Starts with JITGRAPH_NUM_THREADS=2 unless set, then takes turns, `--steps` steps each, between
  2thr openblas-decides  numba 2 threads, OpenBLAS 2 threads, every GEMM split as OpenBLAS
                         decides (blas.set_serial_max(0): the behaviour before the fix)
  2thr serial-busy      numba 2 threads, OpenBLAS 2 threads for GEMMs with m*n*k above
                         runtime/cpu/blas.py BUSY_BOUND only (the bound on a busy machine)
  2thr serial-quiet     the same above QUIET_BOUND (the bound on an idle machine; by default
                         blas.adapt() picks one of the two before each step)
  1thr                   numba and OpenBLAS on one thread
and prints wall and CPU ms per step (median, minimum) with the load average: a change of load
hits every configuration alike. The active pools are printed first (threadpoolctl, numba's
threading layer).
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JITGRAPH_NUM_THREADS", "2")

import numpy as np  # noqa: E402

import jitgraph as jg  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GGUF = os.path.join(HERE, "..", "..", "shared", "data", "gguf", "stories260K.gguf")


def program(which):
    from jitgraph.models.llama import llama_forward, read_llama
    if which == "llama_train":
        from jitgraph.cli.workloads import WORKLOADS
        w = WORKLOADS["llama_train"]()
        return jg.compile(w.graph, loss=w.loss, optimizer=w.optimizer), w.feeds
    cfg, params, _ = read_llama(GGUF)
    batch, seq = 16, 128
    g = llama_forward(cfg, batch, seq, labels=True)
    if which == "lora":
        g = jg.lora(g, "q,k,v,o", rank=8)
    t = np.random.default_rng(0).integers(0, cfg.vocab, (batch, seq + 1)).astype(np.int32)
    feeds = dict(tokens=np.ascontiguousarray(t[:, :-1]), labels=np.ascontiguousarray(t[:, 1:]),
                 pos=np.arange(seq, dtype=np.int32))
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-3, weight_decay=0.0))
    for k, v in params.items():
        if k in prog.params:
            prog.params[k] = v
    return prog, feeds


def main(argv):
    which = next((a for a in argv if not a.startswith("-") and not a.isdigit()), "full")
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 4
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 3
    prog, feeds = program(which)
    import numba
    from threadpoolctl import threadpool_info, threadpool_limits

    from jitgraph.runtime.cpu import blas
    n = int(os.environ["JITGRAPH_NUM_THREADS"])
    print(f"{which}: numba {numba.get_num_threads()} threads, layer {numba.threading_layer()}; "
          + "; ".join(f"{i['internal_api']} {i['num_threads']} threads "
                      f"({os.path.basename(i['filepath'])})" for i in threadpool_info()))
    confs = [("2thr openblas-decides", 0, n), ("2thr serial-busy", blas.BUSY_BOUND, n),
             ("2thr serial-quiet", blas.QUIET_BOUND, n), ("1thr", blas.BUSY_BOUND, 1)]
    for _ in range(2):
        prog.step(**feeds)
    res = {c[0]: [] for c in confs}
    for _ in range(rounds):
        for name, bound, nt in confs:
            blas.set_serial_max(bound)
            numba.set_num_threads(nt)
            with threadpool_limits(nt, user_api="blas"):
                for _ in range(steps):
                    t, c = time.perf_counter(), time.process_time()
                    prog.step(**feeds)
                    res[name].append(((time.perf_counter() - t) * 1e3,
                                      (time.process_time() - c) * 1e3))
    blas.set_serial_max(blas.SERIAL_MAX_WORK)
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    for name, _, _ in confs:
        w, c = [x for x, _ in res[name]], [y for _, y in res[name]]
        print(f"  {name:22s} wall median {np.median(w):7.1f} min {min(w):7.1f} ms   "
              f"CPU median {np.median(c):7.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])

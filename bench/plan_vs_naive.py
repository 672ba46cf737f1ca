"""Planned against naive memory (issue 6): step time side by side and the memory report.

Usage: python bench/plan_vs_naive.py mnist_cnn_b100 transformer_block mnist_mlp_b100
"""
import statistics, time, sys
import numpy as np
import jitgraph as jg
from jitgraph.cli.workloads import WORKLOADS
for name in sys.argv[1:]:
    w = WORKLOADS[name]()
    progs = {p: jg.compile(w.graph, loss=w.loss, optimizer=w.optimizer, plan_memory=p) for p in (False, True)}
    ts = {False: [], True: []}
    for p in progs.values():
        p.step(**w.feeds)
    for _ in range(30):
        for k, p in progs.items():
            t0 = time.perf_counter(); p.step(**w.feeds); ts[k].append(time.perf_counter() - t0)
    m = progs[True].stats()["memory"]
    print(f"{name}: naive {statistics.median(ts[False])*1e3:.3f} ms, planned {statistics.median(ts[True])*1e3:.3f} ms "
          f"(ratio {statistics.median(ts[True])/statistics.median(ts[False]):.3f}); memory {m}")

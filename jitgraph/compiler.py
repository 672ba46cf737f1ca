"""`jitgraph.compile`: graph -> pipeline of passes -> numba kernels -> a runnable Program."""
from __future__ import annotations


def compile(graph, loss=None, optimizer=None, target="cpu", fuse=True, plan_memory=True,
            checkpoint=None, *, seed=0, check_finite=False, copy_outputs=True):
    """Compile `graph` into a Program (see runtime/executor.py).

    loss: name of a scalar output to differentiate (adds grad/<param> outputs); optimizer: a
    jitgraph.optim optimizer (needs loss): `step` then runs forward, backward and the update.
    target: "cpu" (numba). fuse: group nodes into fused kernels (False: one kernel per node).
    plan_memory: liveness-based arena with in-place reuse (False: one buffer per value).
    checkpoint: None (keep every activation), "marks", "sqrt", or "budget:BYTES" /
    "budget:FRACTION" of the unchecked arena (passes/checkpoint.py).
    seed: initial parameter values (graph.init_params(seed)).
    check_finite: `step` raises FloatingPointError when an output holds NaN or Inf.
    copy_outputs: `step` returns fresh arrays (True) or read-only views of the program's own
    buffers (False): no copy, but a view is valid only until the next `step` overwrites it.
    """
    if target != "cpu":
        raise ValueError(f"compile: unknown target {target!r}; expected 'cpu'")
    from .runtime.cpu.threading import configure
    configure()
    from .passes.pipeline import Options
    from .runtime.executor import Program
    opts = Options(loss=loss, optimizer=optimizer, fuse=fuse, plan_memory=plan_memory,
                   checkpoint=checkpoint)
    return Program(graph, opts, seed=seed, check_finite=check_finite, copy_outputs=copy_outputs)

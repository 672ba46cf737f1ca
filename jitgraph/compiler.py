"""`jitgraph.compile`: graph -> pipeline of passes -> numba kernels -> a runnable Program."""
from __future__ import annotations


def compile(graph, loss=None, optimizer=None, target="cpu", fuse=True, plan_memory=True,
            checkpoint=None, *, seed=0, check_finite=False):
    """Compile `graph` into a Program (see runtime/executor.py).

    loss: name of a scalar output to differentiate (adds grad/<param> outputs); optimizer: a
    jitgraph.optim optimizer (needs loss): `step` then runs forward, backward and the update.
    target: "cpu" (numba). fuse / plan_memory: switches of the fusion and memory-planning passes;
    accepted now, and today both configurations compile to one kernel per node with one buffer
    per value (the real passes land later). checkpoint: a recomputation policy for the
    checkpointing pass (None: keep every activation; see passes/checkpoint.py). seed: initial parameter values (graph.init_params(seed)).
    check_finite: `step` raises FloatingPointError when an output holds NaN or Inf.
    """
    if target != "cpu":
        raise ValueError(f"compile: unknown target {target!r}; expected 'cpu'")
    from .runtime.cpu.threading import configure
    configure()
    from .passes.pipeline import Options
    from .runtime.executor import Program
    opts = Options(loss=loss, optimizer=optimizer, fuse=fuse, plan_memory=plan_memory,
                   checkpoint=checkpoint)
    return Program(graph, opts, seed=seed, check_finite=check_finite)

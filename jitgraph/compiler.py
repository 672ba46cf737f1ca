"""`jitgraph.compile`: graph -> pipeline of passes -> numba kernels -> a runnable Program."""
from __future__ import annotations


def compile(graph, loss=None, optimizer=None, target="cpu", fuse=True, plan_memory=True,
            checkpoint=None, *, seed=0, check_finite=False, check_indices=True,
            copy_outputs=True):
    """Compile `graph` into a Program (see runtime/executor.py).

    loss: name of a scalar output to differentiate (adds grad/<param> outputs); optimizer: a
    jitgraph.optim optimizer (needs loss): `step` then runs forward, backward and the update.
    target: "cpu" (numba). fuse: group nodes into fused kernels (False: one kernel per node).
    plan_memory: liveness-based arena with in-place reuse (False: one buffer per value).
    checkpoint: None (keep every activation), "marks", "sqrt", or "budget:BYTES" /
    "budget:FRACTION" of the unchecked arena (passes/checkpoint.py).
    seed: initial parameter values (graph.init_params(seed)).
    check_finite: a step whose loss, gradients or other float outputs hold NaN or Inf changes
    nothing (params, optimizer state, step count) and raises FloatingPointError naming the
    first such value (passes/guard.py); costs one extra read of the gradients per step.
    check_indices: integer inputs that index (class labels, token ids, get_rows rows) are
    checked against their range before each step, as the interpreter does (IndexError, nothing
    changed); False skips the check, and an out-of-range index then reads outside its table.
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
                   checkpoint=checkpoint, check_finite=check_finite)
    return Program(graph, opts, seed=seed, copy_outputs=copy_outputs,
                   check_indices=check_indices)

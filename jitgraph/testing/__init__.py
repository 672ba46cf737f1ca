"""Testing jitgraph: gradient checks (`check_grad`, grad.py: autodiff against central differences
in float64) and random-graph testing, a module per job: generator.py draws small training
graphs, features.py names the bug-prone shapes a graph holds, reference.py runs the float64
interpreter and tells float32 rounding from real errors, runner.py compiles a case fused/unfused
x planned/naive and checks every program against the reference, shrink.py cuts a failing case
down to a runnable Python repro, fuzz.py drives them all:

    from jitgraph.testing import fuzz
    summary = fuzz.fuzz(graphs=20, seed=0)        # generate, run, triage, shrink failures
    print(summary.report())
"""
from .grad import GradCheck, check_grad  # noqa: F401

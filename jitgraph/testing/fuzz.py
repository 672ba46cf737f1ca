"""The fuzzer: `fuzz` draws cases (`case_at`), checks each (runner.check_case), groups the
failures by signature and shrinks the first of each to a repro (shrink.py); `Summary.report`
prints the outcome."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field



from .features import features
from .generator import FOCI, generate, RandomChooser
from .runner import check_case, _compile, CONFIGS, _error, Result
from .shrink import shrink, to_python


@dataclass
class Summary:
    graphs: int = 0
    programs: int = 0
    steps: int = 0
    redrawn: int = 0
    seconds: float = 0.0
    shrink_seconds: float = 0.0
    failures: list = field(default_factory=list)    # (signature, first Failure, repro, count)
    features: Counter = field(default_factory=Counter)
    modes: Counter = field(default_factory=Counter)

    def report(self):
        out = [f"{self.graphs} graphs ({dict(self.modes)}), {self.programs} programs, "
               f"{self.steps} steps, {self.redrawn} redrawn, {self.seconds:.1f} s "
               f"({self.shrink_seconds:.1f} s shrinking)"]
        if not self.failures:
            out.append("no failures")
        for sig, f, repro, count in self.failures:
            out.append(f"\n=== {count} graph(s) fail as {sig}\nfirst: {f}\n--- shrunk repro:\n"
                       f"{repro}")
        return "\n".join(out)


def case_at(seed, i, max_steps=8, big_every=0):
    """The i-th case fuzz(seed=seed) draws (None: redrawn)."""
    big = bool(big_every) and i % big_every == big_every - 1
    focus = list(FOCI)[i % len(FOCI)]
    case = generate(RandomChooser([seed, i]), max_steps=max_steps, seed=seed + i, big=big,
                    focus=focus)
    if case is not None:
        case.label = f"seed [{seed}, {i}] ({focus}" + (", big)" if big else ")")
    return case


def fuzz(graphs=None, seed=0, time_budget=None, configs=CONFIGS, max_steps=8, do_shrink=True,
         shrink_budget=120.0, log=None, stop_after=None, big_every=0, compile_fn=_compile):
    """Generate and check `graphs` cases (or until `time_budget` seconds pass) drawn from
    seeds [seed, 0], [seed, 1], ... (every big_every-th with big dims); failures are grouped by
    signature and the first of each is shrunk to a repro."""
    t0 = time.monotonic()
    s = Summary()
    by_sig = {}
    i = 0
    while (graphs is None or s.graphs < graphs) and \
            (time_budget is None or time.monotonic() - t0 < time_budget):
        case = case_at(seed, i, max_steps, big_every)
        i += 1
        if case is None:
            s.redrawn += 1
            continue
        s.graphs += 1
        s.modes[case.mode] += 1
        s.features.update(features(case.graph))
        try:
            r = check_case(case, configs=configs, compile_fn=compile_fn)
        except Exception as e:  # noqa: BLE001 - the checker itself (reference, autodiff)
            r = Result([_error(None, -1, e)])
            r.failures[0].kind = "checker error"
        s.programs += r.programs
        s.steps += r.steps
        for sig, f in {f.signature(): f for f in reversed(r.failures)}.items():
            if sig in by_sig:
                by_sig[sig][3] += 1
                continue
            if log:
                log(f"graph {case.label} ({case.mode}): {f}")
            repro = to_python(case, f)
            if do_shrink:
                t1 = time.monotonic()
                small, sf, st = shrink(case, f, budget_s=shrink_budget, log=log,
                                       compile_fn=compile_fn)
                repro = to_python(small, sf, steps=st)
                s.shrink_seconds += time.monotonic() - t1
            by_sig[sig] = [sig, f, repro, 1]
        if log and s.graphs % 10 == 0:
            log(f"{s.graphs} graphs, {s.programs} programs, {time.monotonic() - t0:.0f} s")
        if stop_after is not None and len(by_sig) >= stop_after:
            break
    s.failures = list(map(tuple, by_sig.values()))
    s.seconds = time.monotonic() - t0
    return s

"""`jitgraph bench`: fused against unfused on the workloads of issue 5, and (--checkpoint-curve)
peak arena bytes and step time under each checkpointing policy for the workloads of issue 8.

Each workload is compiled once per configuration; every program runs `warmup` steps, then
the programs take turns (an untimed step, then up to 5 timed ones; `time_steps`) until each has
run `repeat` timed steps (time.perf_counter) and, in a full run, 0.4 s of them, and the median
is reported (the JSON has the minimum and the step count too). For workloads with matmuls the
table also gives the time of their GEMMs alone ("gemm ms", `gemm_programs`, timed in the same
turns) and the ratio it allows at best ("bound": unfused / gemm time): fusion cannot make a
step faster than its GEMMs.
The workloads live in jitgraph/cli/workloads.py.
Benchmarks are meant to run as on a user's machine: `env -u OPENBLAS_CORETYPE -u
OPENBLAS_L2_SIZE jitgraph bench` (those variables halve OpenBLAS's sgemm speed here); the
header and the JSON say which BLAS kernel ran.

A fused step slower than its unfused one (a ratio below 1.00x as printed) is flagged (`!` after
the ratio, a `FUSED SLOWER` line): fusion must never lose. "best" is the ratio of the fastest
steps (unfused min / fused min): a loss in the median that the best steps do not show is marked
`?` instead, with its own line — on a shared host a neighbour's burst of memory traffic slows
the memory-bound kernels several times over for seconds at a time (bench/README.md: "Figures
behind the code", jitgraph bench), and such a burst can land on either program's
turns. `--roofline` times each kernel of
the fused step instead and sets it against the machine's peaks (jitgraph/cli/roofline.py).

    jitgraph bench [--json PATH] [--quick] [--only NAME ...] [--repeat N]
                   [--checkpoint-curve | --safety | --roofline]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .report import describe_environment, environment, table

BUDGETS = (0.75, 0.5, 0.35)       # checkpoint budgets, as fractions of the unchecked peak
QUICK_SCALE = 0.25                # --quick: every workload at a quarter of its size


def load_workloads():
    """The workload builders (jitgraph/cli/workloads.py: WORKLOADS, FUSION, CHECKPOINT)."""
    from . import workloads
    return workloads


BLOCK = 5   # timed steps a program runs per turn (time_steps)


MIN_SECONDS = 0.4   # timed seconds per program at least in a full run (time_steps)
MAX_TURNS = 40      # ... but no more than this many times `repeat` steps


def time_steps(progs, feeds, repeat, warmup=2, block=BLOCK, min_seconds=0.0, feeds_of=None,
               min_for=None) -> list:
    """Median and min seconds of `prog.step(**feeds)` for each program, after `warmup` calls.
    The programs take turns, so a change of load on the machine hits all alike; each turn is
    one untimed step, then up to `block` timed ones (block=1: step by step, none untimed).
    Turns go on past `repeat` timed steps until each program has `min_seconds` of them (at
    most MAX_TURNS * repeat steps): a few short steps last less than one burst of another
    process, and a ratio read from them wanders from run to run. A
    training loop runs one program over and over, with its own data in the caches: the first
    step after another program ran finds the caches full of that program's data instead
    (bench/README.md: "Figures behind the code", jitgraph bench).
    `feeds_of[i]`, when given, replaces `feeds` for program i; only the first `min_for`
    programs (default all) must reach `min_seconds` (the GEMM programs that take turns with a
    workload's steps are short: they run as many turns as the steps, no more)."""
    feeds_of = feeds_of or [feeds] * len(progs)
    for _ in range(warmup):
        for prog, fd in zip(progs, feeds_of):
            prog.step(**fd)
    times = [[] for _ in progs]

    def more():
        done = len(times[0])
        if done < repeat:
            return repeat - done
        short = min(sum(ts) for ts in times[:min_for]) < min_seconds
        return min(block, MAX_TURNS * repeat - done) if short else 0
    while (n := min(block, more())) > 0:
        for prog, fd, ts in zip(progs, feeds_of, times):
            if block > 1:
                prog.step(**fd)
            for _ in range(n):
                t0 = time.perf_counter()
                prog.step(**fd)
                ts.append(time.perf_counter() - t0)
    return [{"median_s": statistics.median(ts), "min_s": min(ts), "steps": len(ts)}
            for ts in times]


def _compile(w, **options):
    """Outputs come back as views (copy_outputs=False) in every configuration: copying a 16 MB
    output costs as much as a fused kernel over it, and is no part of what the suite compares."""
    import jitgraph as jg
    return jg.compile(w.graph, loss=w.loss, optimizer=w.optimizer, copy_outputs=False, **options)


def _stats(prog) -> dict:
    st = prog.stats()
    return {"kernels": st.get("kernels"), "bytes_moved": st.get("bytes_moved"),
            "arena_bytes": st.get("arena_bytes"), "compile_s": st.get("compile_seconds")}


def _error(e) -> str:
    return f"{type(e).__name__}: {e}"


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def _settings(quick, repeat):
    return (QUICK_SCALE if quick else 1.0), (repeat or (3 if quick else 10)), (1 if quick else 2)


def _workloads(names, suite, quick, repeat):
    """(workload, row info, repeat, warmup) for each of `names` (default: the workloads module's
    `suite` tuple), built at the run's scale."""
    wl = load_workloads()
    scale, repeat, warmup = _settings(quick, repeat)
    for name in names or getattr(wl, suite):
        yield wl.WORKLOADS[name](scale=scale), \
            {"workload": name, "scale": scale, "repeat": repeat}, repeat, warmup


def run_suite(names=None, repeat=None, json_path=None, quick=False, out=None) -> list:
    """Fused vs unfused for each workload (default: the issue 5 suite); prints the table,
    writes JSON when asked and returns the rows. A workload that fails gets an `error`."""
    rows = []
    for w, info, repeat, warmup in _workloads(names, "FUSION", quick, repeat):
        row = dict(info)
        _log(f"bench: {info['workload']}")
        try:                            # a failure is reported; the other workloads still run
            progs = {tag: _compile(w, fuse=fuse) for tag, fuse in (("unfused", False),
                                                                    ("fused", True))}
            gemms, counts = gemm_programs(progs["unfused"].graph)
            times = time_steps(list(progs.values()) + gemms, w.feeds, repeat, warmup,
                               min_seconds=0.0 if quick else MIN_SECONDS,
                               feeds_of=[w.feeds] * len(progs) + [{}] * len(gemms),
                               min_for=len(progs))
            for (tag, prog), t in zip(progs.items(), times):
                row[tag] = {**_stats(prog), **t}
            row["ratio"] = row["unfused"]["median_s"] / row["fused"]["median_s"]
            if row["unfused"]["min_s"] > 0 and row["fused"]["min_s"] > 0:
                row["ratio_min"] = row["unfused"]["min_s"] / row["fused"]["min_s"]
            gemm = _gemm_total(counts, times[len(progs):])
            if gemm:
                row["gemm_s"] = gemm
                row["ratio_bound"] = row["unfused"]["median_s"] / gemm
        except Exception as e:
            row["error"] = _error(e)
        rows.append(row)
    print(format_fusion(rows), file=out)
    if json_path:
        write_json(json_path, {"fusion": rows})
    return rows


def gemm_programs(graph) -> tuple:
    """([program], [count]): one program for each distinct matmul of `graph` (shapes, dtype,
    transpose flags), compiled by itself on random data, and how many of the graph's nodes it
    stands for. Timed like a step (each in a loop of its own, its operands in the caches), the
    sum of count x median is the time of the graph's GEMMs alone. Fusion leaves GEMM work as it
    is, so no fused program runs faster than this, and unfused / this bounds the ratio fusion
    can reach (`ratio_bound`). run_suite times these programs in turns with the workload's
    steps, so a change of load on the machine hits both alike (timed on their own after the
    steps, their ratio to the step wandered from run to run)."""
    import jitgraph as jg
    from jitgraph import init
    progs, counts = {}, {}
    for n in graph.nodes:
        if n.op != "matmul":
            continue
        a, b = (graph.nodes[i].type for i in n.inputs)
        key = (a.shape, b.shape, a.dtype, n.attrs)
        if key not in progs:
            g = jg.Graph("gemm")
            pa = g.param("a", a.shape, a.dtype, init=init.normal(), trainable=False)
            pb = g.param("b", b.shape, b.dtype, init=init.normal(), trainable=False)
            g.output(out=jg.apply("matmul", pa, pb, **dict(n.attrs)))
            progs[key] = jg.compile(g, fuse=False, copy_outputs=False)
        counts[key] = counts.get(key, 0) + 1
    return list(progs.values()), [counts[k] for k in progs]


def gemm_seconds(graph, repeat, warmup=2) -> float:
    """Seconds of the matmuls of `graph` alone (gemm_programs), timed on their own."""
    progs, counts = gemm_programs(graph)
    if not progs:
        return 0.0
    return _gemm_total(counts, time_steps(progs, {}, repeat, warmup))


def _gemm_total(counts, times) -> float:
    """Seconds of a graph's GEMMs from its gemm_programs' times: count x median, summed."""
    return sum(c * t["median_s"] for c, t in zip(counts, times))


def _curve_point(w, policy, fraction=None, **info):
    """(row, program) for one checkpoint policy; program None and an `error` in the row when
    it does not compile (an infeasible budget)."""
    row = {**info, "policy": policy, "budget_fraction": fraction}
    _log(f"bench: {info['workload']} checkpoint={policy}")
    try:
        prog = _compile(w, checkpoint=None if policy == "none" else policy)
    except Exception as e:
        row["error"] = _error(e)
        return row, None
    row.update(_stats(prog))
    return row, prog


def checkpoint_curve(names=None, repeat=None, json_path=None, quick=False, budgets=BUDGETS,
                     out=None) -> list:
    """Peak arena bytes and step time under checkpoint None, "sqrt" and byte budgets at
    `budgets` fractions of the unchecked program's planned peak (fused, memory planned); the
    programs of one workload are timed taking turns. Returns the rows (see `_curve_point`)."""
    rows = []
    for w, info, repeat, warmup in _workloads(names, "CHECKPOINT", quick, repeat):
        points = [_curve_point(w, "none", **info)]
        base = points[0][0]
        if points[0][1] is not None:
            points.append(_curve_point(w, "sqrt", **info))
            points += [_curve_point(w, f"budget:{int(f * base['arena_bytes'])}", f, **info)
                       for f in budgets]
            done = [(row, prog) for row, prog in points if prog is not None]
            times = time_steps([prog for _, prog in done], w.feeds, repeat, warmup)
            for (row, _), t in zip(done, times):
                row.update(t, peak_vs_none=row["arena_bytes"] / base["arena_bytes"],
                           time_vs_none=t["median_s"] / times[0]["median_s"])
        rows += [row for row, _ in points]
    print(format_curve(rows), file=out)
    if json_path:
        write_json(json_path, {"checkpoint": rows})
    return rows


SAFETY = {"unchecked": dict(check_indices=False), "indices": {},
          "finite": dict(check_finite=True)}


def safety_costs(names=None, repeat=None, json_path=None, quick=False, out=None) -> list:
    """What the step's checks cost (workloads.SAFETY: the MNIST training steps): each workload
    compiled without the index range check (`unchecked`), as by default (`indices`: labels
    checked before the step) and with check_finite (`finite`: the guard pass), timed taking
    turns; ratios are against `unchecked`."""
    rows = []
    for w, info, repeat, warmup in _workloads(names, "SAFETY", quick, repeat):
        row = dict(info)
        _log(f"bench: {info['workload']} safety checks")
        try:
            progs = {tag: _compile(w, **opts) for tag, opts in SAFETY.items()}
            times = time_steps(list(progs.values()), w.feeds, repeat, warmup)
            for (tag, prog), t in zip(progs.items(), times):
                row[tag] = {**_stats(prog), **t}
            for tag in ("indices", "finite"):
                row[f"{tag}_ratio"] = row[tag]["median_s"] / row["unchecked"]["median_s"]
        except Exception as e:
            row["error"] = _error(e)
        rows.append(row)
    print(format_safety(rows), file=out)
    if json_path:
        write_json(json_path, {"safety": rows})
    return rows


def roofline_suite(names=None, repeat=None, json_path=None, quick=False, out=None) -> list:
    """Per kernel of each workload's fused step (default: the issue 5 suite): time, GFLOP/s,
    GB/s against the peaks measured first (jitgraph/cli/roofline.py)."""
    from . import roofline
    _log("bench: measuring the peaks (sgemm 1024^3, parallel copy)")
    peak = roofline.peaks()
    rows = []
    for w, info, repeat, warmup in _workloads(names, "FUSION", quick, repeat):
        row = {**info, **peak}
        _log(f"bench: {info['workload']} roofline")
        try:
            prog = _compile(w)
            for _ in range(warmup):
                prog.step(**w.feeds)
            row.update(roofline.roofline(prog, w.feeds, peak, max(repeat, 10)))
            print(roofline.format_roofline(info["workload"], row, peak) + "\n", file=out)
        except Exception as e:
            row["error"] = _error(e)
            print(f"FAILED {info['workload']}: {row['error']}\n", file=out)
        rows.append(row)
    if json_path:
        write_json(json_path, {"roofline": rows})
    return rows


# ---- output ------------------------------------------------------------------------------------
def _ms(s):
    return "-" if s is None else f"{s * 1e3:.3f}"


def _mb(n):
    return "-" if n is None else f"{n / 2**20:.1f}M"


def _pair(row, key, fmt):
    return f"{fmt(row['unfused'][key])} -> {fmt(row['fused'][key])}"


def format_fusion(rows) -> str:
    lines, errors, slower, median_only = [], [], [], []
    for r in rows:
        if "error" in r:
            errors.append(f"{r['workload']}: {r['error']}")
            continue
        bound, best = r.get("ratio_bound"), r.get("ratio_min")
        below = round(r["ratio"], 2) < 1.0          # below 1.00x as printed
        lose = below and (best is None or round(best, 2) < 1.0)
        if lose:
            slower.append(f"{r['workload']} ({r['ratio']:.2f}x)")
        elif below:
            median_only.append(f"{r['workload']} ({r['ratio']:.2f}x, best {best:.2f}x)")
        lines.append([r["workload"], _ms(r["unfused"]["median_s"]), _ms(r["fused"]["median_s"]),
                      f"{r['ratio']:.2f}x" + (" !" if lose else " ?" if below else ""),
                      "-" if best is None else f"{best:.2f}x",
                      _ms(r.get("gemm_s")),
                      "-" if bound is None else f"{bound:.2f}x",
                      _pair(r, "kernels", lambda k: "-" if k is None else k),
                      _pair(r, "bytes_moved", _mb)])
    header = ["workload", "unfused ms", "fused ms", "ratio", "best", "gemm ms", "bound",
              "kernels", "bytes moved"]
    return "\n".join([table(header, lines), *[f"FAILED {e}" for e in errors],
                      *([f"FUSED SLOWER than unfused: {', '.join(slower)}"] if slower else []),
                      *([f"fused slower in the median only, faster at best (a busy host? run "
                         f"again): {', '.join(median_only)}"] if median_only else [])])


def format_safety(rows) -> str:
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["workload"], "-", "-", "-", "-", "-", r["error"][:100]])
            continue
        lines.append([r["workload"], *(_ms(r[t]["median_s"]) for t in SAFETY),
                      f"{r['indices_ratio']:.3f}x", f"{r['finite_ratio']:.3f}x",
                      _mb(r["finite"]["arena_bytes"] - r["unchecked"]["arena_bytes"])])
    header = ["workload", "unchecked ms", "+indices ms", "+check_finite ms", "indices",
              "check_finite", "arena +"]
    return table(header, lines)


def _policy(row):
    f = row.get("budget_fraction")
    return row["policy"] if f is None else f"{row['policy']} ({100 * f:.0f}%)"


def format_curve(rows) -> str:
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["workload"], _policy(r), "-", "-", "-", "-", r["error"][:100]])
            continue
        lines.append([r["workload"], _policy(r), _mb(r["arena_bytes"]),
                      f"{100 * r['peak_vs_none']:.0f}%", _ms(r["median_s"]),
                      f"{r['time_vs_none']:.2f}x", ""])
    header = ["workload", "checkpoint", "peak arena", "vs none", "step ms", "vs none", "error"]
    return table(header, lines)


def check_json_output(path) -> None:
    """--json PATH: writable, and when it exists, a results file this command wrote (it is
    replaced; any other file, a source file or a data set, is refused)."""
    from ..formats.paths import check_writable
    check_writable(path, "--json")
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = None
        if not (isinstance(old, dict) and "environment" in old):
            raise ValueError(f"--json {path}: exists and is not a `jitgraph bench` results file; "
                             f"give a new file name (it would be replaced)")


def write_json(path, results: dict) -> None:
    """Write {"environment": ..., **results} atomically (a temp file renamed over `path`). The
    temp file is removed on every exit (exceptions, Ctrl-C, SIGTERM turned into an exception by
    the CLI); errors name `path`."""
    path = Path(path)
    data = {"environment": environment(), **results}
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise type(e)(e.errno, e.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        if e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror, str(path)) from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def main(argv=None) -> int:
    from .common import HelpFormatter, int_at_least
    names = ", ".join(load_workloads().WORKLOADS)
    p = argparse.ArgumentParser(
        prog="jitgraph bench", formatter_class=HelpFormatter,
        description="Time compiled training steps fused against unfused on each workload, or "
                    "(--checkpoint-curve) peak memory and step time under each activation "
                    "checkpointing policy, or (--roofline) each kernel's GFLOP/s and GB/s "
                    "against the machine's peaks. Every workload is compiled once per "
                    "configuration; the median of the timed steps is reported.",
        epilog="exit status: 0 success, 1 a workload failed, 2 a usage error, 130 Ctrl-C, "
               "143 SIGTERM")
    p.add_argument("--json", metavar="PATH",
                   help="also write the results as JSON (atomically); default: not written")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: every size x{QUICK_SCALE}, 3 repeats (not the reference "
                        f"figures)")
    p.add_argument("--only", nargs="+", action="extend", metavar="NAME",
                   help=f"run only these workloads (of {names}); default: the whole suite")
    p.add_argument("--repeat", type=int_at_least(1), metavar="N",
                   help="timed steps per configuration; default: 10, 3 with --quick")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--checkpoint-curve", action="store_true",
                      help="measure the checkpointing curve instead of fused against unfused")
    mode.add_argument("--safety", action="store_true",
                      help="measure what the step's checks cost (index range check, "
                           "check_finite) on the MNIST training steps")
    mode.add_argument("--roofline", action="store_true",
                      help="time each kernel of the fused step and set its GFLOP/s and GB/s "
                           "against the machine's peaks (sgemm, stream copy), measured first")
    args = p.parse_args(argv)
    known = load_workloads().WORKLOADS
    unknown = [n for n in args.only or () if n not in known]
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; expected some of {', '.join(known)}")
    if args.json:
        try:
            check_json_output(args.json)
        except (OSError, ValueError) as e:
            p.error(str(e))
    run = checkpoint_curve if args.checkpoint_curve else safety_costs if args.safety else \
        roofline_suite if args.roofline else run_suite
    rows = run(args.only, args.repeat, args.json, args.quick)
    print(describe_environment(environment()))
    from .roofline import sgemm_gflops
    print(f"# sgemm 1024^3 (numpy's BLAS, median of 7): {sgemm_gflops():.0f} GFLOP/s")
    # an infeasible budget is a result of the curve, not a failure of the run
    failed = [r for r in rows if "error" in r and r.get("budget_fraction") is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

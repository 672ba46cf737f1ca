"""The bench workloads (jitgraph/cli/workloads.py; the transformer ones are llama training steps,
jitgraph/models/llama.py) and the suite runner's bookkeeping (jitgraph/cli/bench.py), at tiny sizes
under the interpreter."""
from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest

import jitgraph as jg
from jitgraph.cli import bench
from jitgraph.interp import check_feed

WL = bench.load_workloads()


# ---- the llama workloads (jitgraph/models/llama.py) -----------------------------------------------
LLAMAS = ("transformer_block", "transformer_4l", "llama_train")


def test_llama_feeds_are_next_token_labels_and_positions():
    f = WL.llama_tokens(11, 3, 5, np.random.default_rng(0))
    np.testing.assert_array_equal(f["tokens"][:, 1:], f["labels"][:, :-1])
    np.testing.assert_array_equal(f["pos"], np.arange(5))
    assert f["tokens"].shape == f["labels"].shape == (3, 5) and f["tokens"].max() < 11


@pytest.mark.parametrize("name", LLAMAS)
def test_llama_workload_loss_is_the_reference_cross_entropy(name):
    """The loss a workload's graph computes = the mean next-token cross-entropy of the float64
    numpy llama (jitgraph/models/reference.py, written from llama.cpp's build_llama); with the
    initial weights (std 0.02) it is ~log(vocab)."""
    from jitgraph.models.llama import LlamaConfig
    from jitgraph.models.reference import llama_logits
    w = WL.WORKLOADS[name](scale=1 / 32)
    g, f = w.graph, w.feeds
    shape = lambda k: g.nodes[g.params[k]].type.shape      # noqa: E731
    vocab, dim = shape("token_embd.weight")
    layers = sum(k.endswith("attn_q.weight") for k in g.params)
    cfg = LlamaConfig(vocab=vocab, dim=dim, layers=layers, heads=4,
                      ff=shape("blk.0.ffn_gate.weight")[0])

    def reference_loss(p):
        ce = []
        for toks, labs in zip(f["tokens"], f["labels"]):
            z = llama_logits(cfg, p, list(toks))
            z = z - z.max(-1, keepdims=True)
            ce.extend(np.log(np.exp(z).sum(-1)) - z[np.arange(len(labs)), labs])
        return np.mean(ce)

    params = g.init_params(0)
    loss = float(jg.interp.run(g, f, params)["loss"])
    np.testing.assert_allclose(loss, reference_loss(params), rtol=1e-4)
    assert abs(loss - math.log(vocab)) < 0.05
    rng = np.random.default_rng(1)
    noisy = {k: v + rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in params.items()}
    np.testing.assert_allclose(jg.interp.run(g, f, noisy)["loss"], reference_loss(noisy),
                               rtol=1e-4)


# ---- workloads ---------------------------------------------------------------------------------
def test_suites_name_known_workloads():
    assert set(WL.FUSION) | set(WL.CHECKPOINT) == set(WL.WORKLOADS)


@pytest.mark.parametrize("name", sorted(WL.WORKLOADS))
def test_workload_builds_and_runs(name):
    w = WL.WORKLOADS[name](scale=1 / 32)
    w.graph.validate()
    check_feed(w.graph, w.feeds, w.graph.init_params(0))
    out = jg.interp.run(w.graph, w.feeds, w.graph.init_params(0))
    assert all(np.isfinite(v).all() for v in out.values())
    assert (w.loss is None) == (w.optimizer is None)
    if w.loss is not None:
        assert w.graph.nodes[w.graph.outputs[w.loss]].type.shape == ()
    again = WL.WORKLOADS[name](scale=1 / 32)
    assert again.graph.fingerprint() == w.graph.fingerprint()
    for k in w.feeds:
        np.testing.assert_array_equal(again.feeds[k], w.feeds[k])


def test_workload_sizes_at_scale_one():
    """Spot-check the sizes the issues name (graphs only; nothing is run)."""
    def shape(w, name):
        g = w.graph
        return g.nodes[{**g.inputs, **g.params}[name]].type.shape
    assert np.prod(shape(WL.ew_chain(), "x")) == 4 * 2**20
    assert shape(WL.softmax(), "x") == shape(WL.layer_norm(), "x") == (4096, 1024)
    assert shape(WL.softmax_op(), "x") == shape(WL.layer_norm_op(), "x") == (4096, 1024)
    assert shape(WL.gemm_bias_gelu(), "w") == (1024, 1024)
    assert shape(WL.mnist_mlp_b1000(), "x") == (1000, 784)
    assert shape(WL.mnist_cnn_b100(), "x") == (100, 784)
    assert shape(WL.transformer_block(), "tokens") == (8, 128)
    assert shape(WL.transformer_block(), "blk.0.ffn_gate.weight") == (1024, 256)
    assert shape(WL.transformer_block(), "token_embd.weight") == (256, 256)
    assert shape(WL.transformer_4l(), "blk.3.ffn_down.weight") == (256, 1024)
    assert shape(WL.transformer_4l(), "output.weight") == (512, 256)
    llama = WL.llama_train()        # issue 17: byte vocab, width 128, 4 layers, ff 352, 16 x 128
    assert shape(llama, "tokens") == shape(llama, "labels") == (16, 128)
    assert shape(llama, "token_embd.weight") == shape(llama, "output.weight") == (256, 128)
    assert shape(llama, "blk.3.ffn_up.weight") == (352, 128) and "blk.4.attn_q.weight" not in \
        llama.graph.params
    assert sum(k.endswith(".weight") for k in WL.deep_mlp().graph.params) == 17
    assert shape(WL.deep_mlp(), "fc0.weight") == (1024, 1024)


@pytest.mark.parametrize("name", ["softmax", "layer_norm"])
def test_primitive_workloads_are_their_op_versions(name):
    """softmax / layer_norm (numpy-style primitives) compute what softmax_op / layer_norm_op
    compute, and the patterns pass turns the first into the second."""
    from jitgraph.passes.patterns import recognise_patterns
    prim = WL.WORKLOADS[name](scale=1 / 32).graph
    op = WL.WORKLOADS[name + "_op"](scale=1 / 32).graph
    assert name not in {n.op for n in prim.nodes}
    params = op.init_params(0)
    np.testing.assert_allclose(jg.interp.run(prim, {}, params)["out"],
                               jg.interp.run(op, {}, params)["out"], rtol=1e-5, atol=1e-6)
    rewritten, _ = recognise_patterns(prim)
    assert [n.op for n in rewritten.nodes] == [n.op for n in op.nodes]


@pytest.mark.parametrize("name", ["ew_chain", "ew_chain_math"])
def test_ew_chains_are_eight_elementwise_ops(name):
    from jitgraph.registry import get_op
    g = WL.WORKLOADS[name](scale=1 / 64).graph
    ops_ = [n.op for n in g.nodes if n.op not in ("param", "input")]
    assert len(ops_) == 8 and all(get_op(o).kind == "elementwise" for o in ops_)
    assert ("tanh" in ops_ and "sigmoid" in ops_) == (name == "ew_chain_math")


def test_issue16_chains_compute_their_formulas():
    """ew_chain_exp and ew_chain_act: elementwise only, with the issue's formulas."""
    from jitgraph.registry import get_op
    for name, want_ops, formula in [
            ("ew_chain_exp", {"exp", "tanh", "abs", "div"},
             lambda a, b: np.tanh(np.exp(-(a * b + a) ** 2) * 0.5 - b) / (np.abs(a) + 1)),
            ("ew_chain_act", {"softplus", "sigmoid", "tanh", "gelu"},
             lambda a, b: _gelu(np.logaddexp(0, a * b - a) / (1 + np.exp(-b)) - np.tanh(a + b)))]:
        w = WL.WORKLOADS[name](scale=1 / 64)
        ops_ = {n.op for n in w.graph.nodes if n.op not in ("param", "input")}
        assert want_ops <= ops_ and all(get_op(o).kind == "elementwise" for o in ops_)
        params = w.graph.init_params(0)
        a, b = (params[k].astype(np.float64) for k in ("x", "y"))
        np.testing.assert_allclose(jg.interp.run(w.graph, {}, params)["out"], formula(a, b),
                                   rtol=2e-5, atol=2e-6)


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


# ---- the suite runner (compiling stubbed out: that is the runtime's tests' job) ---------------
class _FakeProgram:
    """Unfused: 12 kernels, 40 ms; fused: 4 kernels, 10 ms. Checkpointing: "sqrt" peaks at
    400 bytes (none: 1000), a budget at its bytes (feasible down to 500) and costs 2x time."""

    def __init__(self, fuse=True, checkpoint=None):
        self.fuse, self.time, self.arena = fuse, (0.01 if fuse else 0.04), 1000
        self.graph = None
        if checkpoint == "sqrt":
            self.arena = 400
        elif checkpoint is not None:
            self.arena = int(checkpoint.split(":")[1])
            if self.arena < 500:
                raise ValueError("infeasible budget; smallest feasible is 500")
            self.time = 0.02

    def stats(self):
        return {"kernels": 4 if self.fuse else 12, "arena_bytes": self.arena,
                "compile_seconds": 0.0}


@pytest.fixture
def fake_compile(monkeypatch):
    monkeypatch.setattr(bench, "_compile", lambda w, **options: _FakeProgram(**options))
    gemm = types.SimpleNamespace(time=0.01)       # stands for two matmul nodes: 0.02 s
    monkeypatch.setattr(bench, "gemm_programs", lambda graph: ([gemm], [2]))
    monkeypatch.setattr(bench, "time_steps", lambda progs, feeds, repeat, warmup, **kw: [
        {"median_s": p.time, "min_s": p.time} for p in progs])


def test_gemm_seconds_times_each_distinct_matmul_once_and_counts_every_node(monkeypatch):
    g = jg.Graph("two")
    x = g.input("x", (8, 6))
    w = g.param("w", (6, 6))
    g.output(y=(x @ w) @ w, z=jg.apply("matmul", x, w, ta=False, tb=True))
    timed = []
    monkeypatch.setattr(bench, "time_steps", lambda progs, feeds, repeat, warmup, **kw: (
        timed.append(progs), [{"median_s": 0.5 + i, "min_s": 0.5} for i in range(len(progs))])[1])
    # three matmul nodes: two alike ([8,6] @ [6,6]) and one with tb: two programs, in turns
    assert bench.gemm_seconds(g, repeat=1) == pytest.approx(2 * 0.5 + 1.5)
    assert len(timed) == 1 and len(timed[0]) == 2
    progs, counts = bench.gemm_programs(g)
    assert counts == [2, 1]
    ins = [[p.graph.nodes[i].type.shape for i in p.graph.nodes[-1].inputs] for p in progs]
    assert ins == [[(8, 6), (6, 6)], [(8, 6), (6, 6)]]
    assert bench.gemm_seconds(jg.Graph("none"), repeat=1) == 0


def _recording_programs(calls, *names):
    class Prog:
        def __init__(self, name):
            self.name = name

        def step(self, **feeds):
            calls.append((self.name, feeds))
    return [Prog(n) for n in names]


def test_time_steps_interleaves():
    calls = []
    res = bench.time_steps(_recording_programs(calls, "a", "b"), {"x": 1}, repeat=3, warmup=1,
                           block=1)
    assert calls == [("a", {"x": 1}), ("b", {"x": 1})] * 4
    assert all(0 <= r["min_s"] <= r["median_s"] for r in res) and len(res) == 2


def test_time_steps_runs_until_each_program_has_min_seconds(monkeypatch):
    """Past `repeat`, turns go on (in blocks) until every program has min_seconds of timed steps,
    and stop at MAX_TURNS * repeat steps when they never get there."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    class Prog:
        def __init__(self, dt):
            self.dt, self.n = dt, 0

        def step(self, **feeds):
            clock[0] += self.dt
            self.n += 1
    fast, slow = Prog(0.01), Prog(0.03)
    res = bench.time_steps([fast, slow], {}, repeat=2, warmup=0, block=5, min_seconds=0.25)
    # the fast one needs 25 timed steps: 2, then blocks of 5 (+1 untimed each turn) up to 27
    assert [r["steps"] for r in res] == [27, 27]
    assert sum([0.01] * 27) >= 0.25 and res[0]["median_s"] == pytest.approx(0.01)
    never = Prog(0.0)
    res = bench.time_steps([never], {}, repeat=2, warmup=0, block=5, min_seconds=1.0)
    assert res[0]["steps"] == bench.MAX_TURNS * 2
    # min_for=1: only the first program's seconds count (a GEMM program taking turns with a
    # step runs as many turns as the step); feeds_of gives each program its own feeds
    fed = []
    fast.step = lambda **feeds: (fed.append(feeds), Prog.step(fast))
    res = bench.time_steps([slow, fast, never], {"x": 1}, repeat=2, warmup=0, block=5,
                           min_seconds=0.25, feeds_of=[{}, {"x": 1}, {}], min_for=1)
    # slow needs 9 timed steps (0.27 s): 2, then one block of 5 and one of 5 -> 12
    assert [r["steps"] for r in res] == [12, 12, 12]
    assert fed and all(f == {"x": 1} for f in fed)


def test_time_steps_takes_turns_in_blocks_after_an_untimed_step():
    calls = []
    res = bench.time_steps(_recording_programs(calls, "a", "b"), {}, repeat=7, warmup=1, block=3)
    # warmup a b; then turns of 1 untimed + 3, 3, 1 timed steps each
    assert [c[0] for c in calls] == ["a", "b"] + ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + \
        ["b"] * 4 + ["a"] * 2 + ["b"] * 2
    assert len(res) == 2


def test_run_suite_table_and_json(tmp_path, fake_compile, capsys):
    path = tmp_path / "out.json"
    assert bench.main(["--only", "softmax", "--quick", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    (row,) = data["fusion"]
    assert row["workload"] == "softmax" and row["ratio"] == pytest.approx(4.0)
    assert row["scale"] == bench.QUICK_SCALE
    assert "threadpools" in data["environment"]
    table = capsys.readouterr().out
    assert "4.00x" in table and "12 -> 4" in table and "- -> -" in table   # no bytes_moved
    assert row["gemm_s"] == 0.02 and row["ratio_bound"] == pytest.approx(2.0) and "2.00x" in table
    assert not list(tmp_path.glob(".*tmp"))                               # atomic: no leftovers


def test_checkpoint_curve_budgets(fake_compile, capsys):
    rows = bench.checkpoint_curve(["deep_mlp"], quick=True, budgets=(0.75, 0.3))
    assert [r["policy"] for r in rows] == ["none", "sqrt", "budget:750", "budget:300"]
    assert rows[1]["peak_vs_none"] == pytest.approx(0.4)
    assert rows[2]["peak_vs_none"] == pytest.approx(0.75) and rows[2]["time_vs_none"] == 2.0
    assert "smallest feasible is 500" in rows[3]["error"]
    out = capsys.readouterr().out
    assert "budget:300 (30%)" in out and "40%" in out
    assert bench.main(["--checkpoint-curve", "--quick", "--only", "deep_mlp"]) == 0


def test_main_rejects_unknown_workload():
    with pytest.raises(SystemExit):
        bench.main(["--only", "no_such_workload"])


def test_failed_workload_is_reported(monkeypatch, capsys):
    def broken(w, fuse=True, **options):
        if fuse:
            raise RuntimeError("fusion exploded")
        return _FakeProgram(fuse=False)
    monkeypatch.setattr(bench, "_compile", broken)
    assert bench.main(["--only", "ew_chain", "--quick"]) == 1
    assert "FAILED ew_chain: RuntimeError: fusion exploded" in capsys.readouterr().out


def test_fused_slower_than_unfused_is_flagged(monkeypatch, capsys):
    monkeypatch.setattr(bench, "_compile", lambda w, **options: _FakeProgram(**options))
    monkeypatch.setattr(bench, "gemm_programs", lambda graph: ([], []))
    monkeypatch.setattr(bench, "time_steps", lambda progs, feeds, repeat, warmup, **kw: [
        {"median_s": 0.01 if p.fuse else 0.008, "min_s": 0.0} for p in progs])
    assert bench.main(["--only", "ew_chain", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "0.80x !" in out and "FUSED SLOWER than unfused: ew_chain (0.80x)" in out


@pytest.mark.parametrize("fused_min, flagged", [(0.006, False), (0.009, True)])
def test_a_loss_in_the_median_only_is_told_apart(monkeypatch, capsys, fused_min, flagged):
    """Median 0.80x: with the fastest fused step faster than the fastest unfused one (best
    1.33x) it is marked `?` (noise, run again); with both behind (best 0.89x), a loss."""
    monkeypatch.setattr(bench, "_compile", lambda w, **options: _FakeProgram(**options))
    monkeypatch.setattr(bench, "gemm_programs", lambda graph: ([], []))
    monkeypatch.setattr(bench, "time_steps", lambda progs, feeds, repeat, warmup, **kw: [
        {"median_s": 0.01 if p.fuse else 0.008, "min_s": fused_min if p.fuse else 0.008}
        for p in progs])
    assert bench.main(["--only", "ew_chain", "--quick"]) == 0
    out = capsys.readouterr().out
    assert ("FUSED SLOWER than unfused: ew_chain (0.80x)" in out) == flagged
    assert ("0.80x !" in out) == flagged and ("0.80x ?" in out) != flagged
    best = 0.008 / fused_min
    assert f"{best:.2f}x" in out
    if not flagged:
        assert f"median only, faster at best (a busy host? run again): ew_chain (0.80x, best " \
               f"{best:.2f}x)" in out


# ---- the roofline (jitgraph/cli/roofline.py) ---------------------------------------------------
@pytest.mark.parametrize("fuse", [True, False])
def test_roofline_rows_are_the_kernels_with_their_costs(fuse):
    from jitgraph.cli import roofline
    from jitgraph.registry import cost
    w = WL.ew_chain_exp(scale=1 / 64)
    prog = jg.compile(w.graph, fuse=fuse, copy_outputs=False)
    kg = prog._products.kernels
    peak = {"sgemm_gflops": 100.0, "stream_gbps": 10.0}
    res = roofline.roofline(prog, w.feeds, peak, repeat=2)
    rows = res["kernels"]
    assert [r["id"] for r in rows] == [k.id for k in kg.kernels] and res["step_s"] > 0
    assert sum(r["bytes"] for r in rows) == kg.bytes_moved()
    g = prog.graph
    assert sum(r["flops"] for r in rows) == sum(cost(g, g.nodes[i]).flops
                                                for k in kg.kernels for i in k.nodes)
    for r in rows:
        assert r["seconds"] > 0 and r["bound"] == "memory"        # ~1 flop per 4 bytes here
        assert r["roof"] == pytest.approx(r["bytes"] / 10e9 / r["seconds"])
    table = roofline.format_roofline("ew_chain_exp", res, peak)
    assert "sgemm 100 GFLOP/s" in table and table.count("\n") == len(rows) + 1
    # kernel by kernel, hot in cache: the same kernels
    assert [kt.kernel.id for kt in roofline.time_kernels(prog, w.feeds, 2, in_order=False)] == \
        [k.id for k in kg.kernels]


def test_bench_roofline_option(monkeypatch, capsys, tmp_path):
    from jitgraph.cli import roofline
    monkeypatch.setattr(roofline, "peaks", lambda: {"sgemm_gflops": 100.0, "stream_gbps": 10.0})
    path = tmp_path / "roof.json"
    assert bench.main(["--roofline", "--only", "ew_chain", "--quick", "--repeat", "2",
                       "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ew_chain: step" in out and "k0 elementwise" in out and "roof" in out
    (row,) = json.loads(path.read_text())["roofline"]
    assert row["workload"] == "ew_chain" and len(row["kernels"]) == 1

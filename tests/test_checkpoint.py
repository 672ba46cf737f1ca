"""Gradient checkpointing: every policy gives the unchecked gradients and optimizer steps, and
lowers the liveness peak as promised; the checkpoint mark op."""
import itertools
import math

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp, optim
from jitgraph.passes.autodiff import grad
from jitgraph.passes import checkpoint as ckpt
from jitgraph.passes.checkpoint import flops
from jitgraph.passes.optimizer import apply_optimizer
from jitgraph.passes import pipeline
from jitgraph.passes.pipeline import Options
from jitgraph.passes.simplify import simplify
from jitgraph.testing import check_grad
from jitgraph.cli.workloads import WORKLOADS

POLICIES = [None, "marks", "sqrt", "budget:0.75", "budget:0.6"]


# Memory is measured on unfused kernels: there the checkpoint, schedule and memory passes alone
# decide the arena (fusion changes which values need buffers; tests/test_memory.py compiles).
UNFUSED = Options(fuse=False)


def checkpoint(g, policy):
    return ckpt.checkpoint(g, policy, measure=arena_peak)


def arena_peak(g):
    return pipeline.arena_peak(g, UNFUSED)


def mlp(layers=16, width=64, batch=256, dtype="f64", mark_every=0, act=jg.relu):
    g = jg.Graph("mlp")
    h = g.input("x", (batch, width), dtype)
    y = g.input("y", (batch,), "i32")
    for i in range(layers):
        w = g.param(f"w{i}", (width, width), dtype, init=jg.init.normal(0, 1.5 / math.sqrt(width)))
        b = g.param(f"b{i}", (width,), dtype, init=jg.init.normal(0, 0.1))
        h = act(h @ w + b)
        if mark_every and (i + 1) % mark_every == 0:
            h = jg.checkpoint(h)
    g.output(loss=jg.cross_entropy(h, y))
    return g


def transformer(layers=2, batch=4, seq=16, d=16, heads=2, dtype="f64"):
    """Pre-norm blocks: rms_norm, causal multi-head attention (softmax), a silu MLP, residuals."""
    g = jg.Graph("block")
    x = g.input("x", (batch * seq, d), dtype)
    t = g.input("t", (batch * seq, d), dtype)
    hd = d // heads

    def p(name, shape, std=0.3):           # std=None: a norm weight around 1
        mean, std = (1.0, 0.1) if std is None else (0.0, std)
        return g.param(name, shape, dtype, init=jg.init.normal(mean, std))

    def split(v):       # [b*s, d] -> [b, heads, s, hd]
        return jg.permute(v.reshape(batch, seq, heads, hd), (0, 2, 1, 3))

    for i in range(layers):
        h = jg.rms_norm(x, p(f"n1.{i}", (d,), None))
        q, k, v = (split(h @ p(f"w{c}.{i}", (d, d))) for c in "qkv")
        s = jg.scale(jg.matmul(q, k, tb=True), 1 / math.sqrt(hd))
        o = jg.matmul(jg.softmax(jg.causal_mask(s)), v)
        x = x + jg.permute(o, (0, 2, 1, 3)).reshape(batch * seq, d) @ p(f"wo.{i}", (d, d))
        h = jg.rms_norm(x, p(f"n2.{i}", (d,), None))
        x = x + jg.silu(h @ p(f"up.{i}", (d, 2 * d))) @ p(f"down.{i}", (2 * d, d))
    g.output(loss=jg.mean(jg.sqr(x - t)))
    return g


def feeds(g, seed=0):
    """Random float inputs; integer inputs are class labels in [0, 4) (every width is >= 4)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, i in g.inputs.items():
        t = g.nodes[i].type
        out[name] = rng.standard_normal(t.shape).astype(t.np_dtype) if t.is_float else \
            rng.integers(0, 4, t.shape).astype(t.np_dtype)
    return out


def trained(g, opt):
    tg, _ = apply_optimizer(grad(g)[0], opt)
    return simplify(tg)[0]


def recomputed_ops(rep):
    return [line.split()[2] for line in rep.lines if "recompute" in line]


@pytest.fixture(scope="module")
def mlp_grads():
    return simplify(grad(mlp(mark_every=4))[0])[0]


@pytest.fixture(scope="module")
def block_grads():
    return simplify(grad(transformer())[0])[0]


# ---- results never change ----------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", ["mlp_grads", "block_grads"])
def test_gradients_equal_the_unchecked_graph(model, policy, request):
    g = request.getfixturevalue(model)
    out, rep = checkpoint(g, policy)
    assert "checkpoint" not in [n.op for n in out.nodes]
    inputs, params = feeds(g), g.init_params(seed=1)
    want, got = interp.run(g, inputs, params), interp.run(out, inputs, params)
    assert want.keys() == got.keys() and any(k.startswith("grad/") for k in got)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-14, err_msg=k)
    if policy is not None:
        assert rep.stats["recomputed"] > 0, str(rep)


@pytest.mark.parametrize("policy", POLICIES[1:])
@pytest.mark.parametrize("build", [lambda: mlp(layers=8, mark_every=2),
                                   lambda: transformer()], ids=["mlp", "block"])
def test_optimizer_steps_equal_the_unchecked_graph(build, policy):
    opt = optim.AdamW(lr=1e-2, weight_decay=0.1)
    g = trained(build(), opt)
    out, _ = checkpoint(g, policy)
    p_ref, p_out = g.init_params(seed=2), g.init_params(seed=2)
    for call in range(3):
        batch = {**feeds(g, seed=call), **opt.runtime_inputs(call)}
        want, got = interp.run(g, batch, p_ref), interp.run(out, batch, p_out)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-12)
    for k in p_ref:
        np.testing.assert_allclose(p_out[k], p_ref[k], rtol=1e-12, atol=1e-14, err_msg=k)


# ---- memory ------------------------------------------------------------------------------------
def test_sqrt_cuts_the_deep_mlp_peak():
    g = trained(mlp(dtype="f32"), optim.Adam())
    out, rep = checkpoint(g, "sqrt")
    ratio = arena_peak(out) / arena_peak(g)
    print(f"sqrt: peak {arena_peak(out)} / {arena_peak(g)} B = {ratio:.3f}")
    # the unchecked plan keeps one activation a layer (relu's gradient reads its output; with
    # the pre-activations kept as well: 2.16 MB unchecked, 0.61 MB sqrt, ratio 0.28)
    assert arena_peak(out) <= 0.48e6 and ratio <= 0.45, str(rep)
    assert rep.stats["peak_ratio"] == pytest.approx(ratio, abs=1e-3)
    # sqrt(n) segments: a few layer outputs kept, about one extra forward pass recomputed
    fwd = 16 * 2 * 256 * 64 * 64                 # the forward GEMMs: layers * 2 * batch * width^2
    assert 0.3 * fwd <= rep.stats["extra_flops"] <= 1.1 * fwd


def test_sqrt_keeps_the_cuts_an_exhaustive_search_keeps():
    """deep_mlp's shape (ReLU layers, AdamW, fused kernels): sqrt's arena is within one
    activation of the least over every choice of one to four kept layer outputs. The even
    split of the activation bytes stayed further above it: the cuts kept below a segment are
    live while it is recomputed, so the lower segments should be the longer. (While relu's
    gradient read its pre-activation, sqrt met the exhaustive least, 29,248 B, to a sliver;
    reading its output, the unchecked arena halves and sqrt plans 29,376 B where keeping the
    outputs of layers 3, 5, 7 and 8 reaches 25,536: one activation, 4,096 B, of room left.)"""
    w = WORKLOADS["deep_mlp"](scale=1 / 32, layers=8)
    g = trained(w.graph, w.optimizer)
    _, rep = ckpt.checkpoint(g, "sqrt", measure=pipeline.arena_peak)
    fw = ckpt._Forward(g, "loss", pipeline.arena_peak)
    pre = [i for i in fw.acts if g.nodes[i].op == "relu" and i in fw.candidates]
    assert len(pre) == 8
    least = min(pipeline.arena_peak(fw.rebuild(fw.candidates - set(keep))[0])
                for r in range(1, 5) for keep in itertools.combinations(pre, r))
    assert rep.stats["peak_after"] <= least + g.nodes[pre[0]].type.nbytes, str(rep)


def test_sqrt_lowers_the_transformer_peak():
    g = trained(transformer(layers=4, batch=4, seq=16, d=32, dtype="f32"), optim.Adam())
    out, rep = checkpoint(g, "sqrt")
    assert rep.stats["peak_after"] <= 0.5 * rep.stats["peak_before"], str(rep)


@pytest.mark.parametrize("fraction", [0.8, 0.6, 0.45])
def test_feasible_budgets_are_met(fraction):
    g = trained(mlp(dtype="f32"), optim.SGD(lr=0.1))
    budget = int(fraction * arena_peak(g))
    for policy in (f"budget:{budget}", f"budget:{fraction}"):
        out, rep = checkpoint(g, policy)
        assert arena_peak(out) <= budget, str(rep)
        assert rep.stats["peak_after"] == arena_peak(out)


def test_a_budget_that_cheap_recomputation_meets_recomputes_no_matmul():
    # silu layers: the backward reads each pre-activation (silu_back) and each output (the next
    # layer's weight gradient), so recomputing the outputs alone (cheap) saves memory; a relu
    # layer leaves only its output to the backward, nothing cheap to recompute
    g = trained(mlp(dtype="f32", act=jg.silu), optim.SGD(lr=0.1))
    sqrt_rep = checkpoint(g, "sqrt")[1]
    assert "matmul" in recomputed_ops(sqrt_rep)
    out, rep = checkpoint(g, "budget:0.6")
    ops = recomputed_ops(rep)
    assert ops and "matmul" not in ops, str(rep)
    assert 0 < rep.stats["extra_flops"] < sqrt_rep.stats["extra_flops"] / 10


def test_an_infeasible_budget_names_the_smallest_feasible_one():
    g = trained(mlp(layers=8, dtype="f32"), optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match=r"budget 1000 B is infeasible for graph mlp: the smallest "
                                         r"peak reachable by recomputation is \d+ B") as e:
        checkpoint(g, "budget:1000")
    least = int(str(e.value).split("use budget:")[1].split()[0])
    assert least < arena_peak(g)
    out, _ = checkpoint(g, f"budget:{least}")
    assert arena_peak(out) <= least
    with pytest.raises(ValueError, match="infeasible"):
        checkpoint(g, f"budget:{least - 1}")


@pytest.mark.parametrize("bad", ["budget:", "budget:1.5", "budget:x", "segments", 3])
def test_unknown_policies_are_rejected(bad):
    g = simplify(grad(mlp(layers=2, batch=4, width=4))[0])[0]
    with pytest.raises(ValueError, match="unknown policy"):
        checkpoint(g, bad)


# ---- marks -------------------------------------------------------------------------------------
def test_marks_keep_the_marked_values_and_recompute_the_segments():
    g = simplify(grad(mlp(layers=8, mark_every=4))[0])[0]
    marked = [n.inputs[0] for n in g.nodes if n.op == "checkpoint"]
    assert len(marked) == 2
    out, rep = checkpoint(g, "marks")
    # every layer is recomputed except the two marked ones: their relu outputs are kept, and
    # relu's gradient reads nothing else of them (the loss reads the last one)
    ops = recomputed_ops(rep)
    assert ops.count("matmul") == 6 and ops.count("add") == 6 and ops.count("relu") == 6, ops
    unmarked, _ = checkpoint(g, None)
    assert arena_peak(out) < 0.7 * arena_peak(unmarked)


def test_no_policy_only_removes_the_marks():
    g = simplify(grad(mlp(layers=4, mark_every=1, batch=8, width=8))[0])[0]
    out, rep = checkpoint(g, None)
    assert rep.stats["marks_removed"] == 4
    assert [n.op for n in out.nodes] == [n.op for n in g.nodes if n.op != "checkpoint"]


def test_the_checkpoint_op_is_an_identity_with_identity_gradient():
    g = jg.Graph("mark")
    x = g.input("x", (3, 4), "f64")
    w = g.param("w", (4,), "f64", init=jg.init.normal())
    y = jg.checkpoint(jg.tanh(x * w))
    assert y.type == x.type and y.node.op == "checkpoint"
    g.output(out=jg.exp(y))
    check_grad(g, feeds(g), g.init_params(), wrt_inputs=("x",))
    v = np.random.default_rng(0).standard_normal((3, 4))
    got = jg.ops.get_op("checkpoint").ref({}, v)
    assert got is not v and np.array_equal(got, v)


def test_recomputation_is_placed_right_before_its_first_backward_use():
    g = simplify(grad(mlp(layers=4, batch=8, width=8))[0])[0]
    out, rep = checkpoint(g, "sqrt")
    clones = {int(line.split()[0][1:]) for line in rep.lines if "recompute" in line}
    assert clones
    users = out.users()
    for c in clones:
        first = min(users[c])
        # between a clone and its first reader there are only other clones
        assert all(i in clones for i in range(c + 1, first)), (c, first)


def test_flop_estimates():
    g = jg.Graph("f")
    x, w = g.input("x", (5, 3)), g.input("w", (3, 7))
    im, k = g.input("im", (2, 3, 8, 8)), g.input("k", (4, 3, 3, 3))
    mm, mt = x @ w, jg.matmul(x, x, ta=True)
    conv = jg.conv2d(im, k, padding=1)
    e, r = jg.relu(mm), jg.sum(mm, axis=0)
    assert flops(g, mm.node) == 2 * 5 * 7 * 3 and flops(g, mt.node) == 2 * 3 * 3 * 5
    assert flops(g, conv.node) == 2 * 2 * 4 * 8 * 8 * 3 * 3 * 3
    assert flops(g, e.node) == 35 and flops(g, r.node) == 35
    assert flops(g, mm.reshape(35).node) == 0


@pytest.mark.parametrize("fraction", [0.9, 0.75, 0.6, 0.45])
def test_a_budget_plan_is_the_cheapest_of_every_candidate_measured(fraction):
    """The budget policy measures few candidates (a doubling search and bisection over the
    cheap prefixes; segment plans only when they could cost less than a fit found): its plan
    costs what the cheapest fitting plan costs when every candidate is measured, the
    exhaustive oracle here, with fewer measures than candidates."""
    g = trained(transformer(layers=4, batch=4, seq=16, d=32, dtype="f32"), optim.Adam())
    peak0 = arena_peak(g)
    budget = int(fraction * peak0)
    calls = []

    def counted(graph):
        calls.append(1)
        return arena_peak(graph)
    fw = ckpt._Forward(g, "loss", counted)
    cheap = sorted((i for i in fw.candidates if not ckpt.expensive(g.nodes[i])),
                   key=lambda i: (fw.flops(i) / max(g.nodes[i].type.nbytes, 1), i))
    prefixes = [frozenset(cheap[:m]) for m in range(1, len(cheap) + 1)]
    segments = [frozenset(p(k)) for k in range(1, len(fw.cuts) + 2)
                for p in (fw.segments, fw.balanced)]
    oracle = ckpt._Forward(g, "loss", arena_peak)
    first = next(([p] for p in prefixes if oracle.evaluate(p).peak <= budget), [])
    fits = first + [p for p in segments if oracle.evaluate(p).peak <= budget]
    if not fits:
        with pytest.raises(ValueError, match="infeasible"):
            fw.fit(budget, peak0)
        return
    chosen = fw.fit(budget, peak0)
    assert oracle.evaluate(chosen).peak <= budget
    assert oracle.evaluate(chosen)[:2] == min(map(oracle.evaluate, fits))[:2]
    assert len(calls) < len(set(prefixes) | set(segments))

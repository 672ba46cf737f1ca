"""The update boundary (compile(hook=...), passes/boundary.py): gradients, a hook, the update.

Oracles: the same program compiled without a hook (bitwise), closed-form gradients of a linear
least-squares model and the SGD update written out, the reference interpreter's autodiff, and
the phase facts recomputed from the graph."""

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp, optim
from jitgraph.models.mnist import mnist_fc
from jitgraph.passes.autodiff import grad
from jitgraph.passes.boundary import boundary_values, phase_two
from jitgraph.registry import get_op
from jitgraph.types import ShapeError

N, D, K = 8, 5, 3


def linear(scale=1.0, dtype="f64", n=N):
    """loss = scale * mean((x @ w + b - t)^2); gradient of the unscaled loss in closed form."""
    g = jg.Graph("linear")
    x, t = g.input("x", (n, D), dtype), g.input("t", (n, K), dtype)
    w = g.param("w", (D, K), dtype, init=jg.init.normal())
    b = g.param("b", (K,), dtype, init=jg.init.normal())
    loss = jg.mean(jg.sqr(x @ w + b - t))
    g.output(loss=loss if scale == 1.0 else loss * scale)
    return g


def closed_form(p, x, t):
    r = 2 * (x @ p["w"] + p["b"] - t) / t.size
    return {"w": x.T @ r, "b": r.sum(0)}


def batch(seed, n=N, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, D)).astype(dtype),
            "t": rng.standard_normal((n, K)).astype(dtype)}


class Record:
    """A hook that copies what it sees (and checks the flat views alias the gradients)."""

    def __init__(self, change=None):
        self.seen, self.change = [], change

    def __call__(self, grads):
        for k, v in grads.items():
            flat = grads.buckets[v.dtype.name.replace("float", "f")]
            assert np.shares_memory(v, flat), k
            o = grads.offsets[k]
            assert np.array_equal(flat[o:o + v.size], v.reshape(-1)), k
        for dt, flat in grads.buckets.items():      # the bytes between gradients are zero
            covered = np.zeros(flat.size, bool)
            for k, v in grads.items():
                if flat.dtype == v.dtype:
                    covered[grads.offsets[k]:grads.offsets[k] + v.size] = True
            assert not flat[~covered].any(), dt
        self.seen.append((grads.step, {k: v.copy() for k, v in grads.items()}))
        if self.change is not None:
            self.change(grads)


def test_sgd_hook_scaling_gradients_is_the_scaled_loss():
    """A hook halving the gradients == compiling 0.5 * loss == p - lr * 0.5 * closed form."""
    lr = 0.125                       # exact in f32 (opt/lr is an f32 input)
    opt = optim.SGD(lr=lr)

    def halve(grads):
        grads.flat *= 0.5            # one flat array over every gradient, in place

    rec = Record(halve)
    a = jg.compile(linear(), loss="loss", optimizer=opt, hook=rec)
    b = jg.compile(linear(0.5), loss="loss", optimizer=opt)
    p = {k: a.params[k] for k in a.params}
    for s in range(3):
        f = batch(s)
        a.step(**f)
        b.step(**f)
        want = closed_form(p, f["x"], f["t"])
        for k in p:                                   # the hook saw the unscaled gradient
            np.testing.assert_allclose(rec.seen[-1][1][k], want[k], rtol=1e-12, atol=1e-14)
            p[k] = p[k] - lr * 0.5 * want[k]
            np.testing.assert_allclose(a.params[k], p[k], rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(a.params[k], b.params[k], rtol=1e-12, atol=1e-14)
    assert [s for s, _ in rec.seen] == [1, 2, 3]


@pytest.fixture(scope="module")
def fc_pair():
    """MNIST FC (batch 16) compiled without and with a do-nothing hook, AdamW."""
    opt = optim.AdamW(lr=1e-3)
    rec = Record()
    plain = jg.compile(mnist_fc(16), loss="loss", optimizer=opt)
    hooked = jg.compile(mnist_fc(16), loss="loss", optimizer=opt, hook=rec)
    return plain, hooked, rec


def test_noop_hook_is_bitwise_the_program_without_boundary(fc_pair):
    plain, hooked, rec = fc_pair
    rng = np.random.default_rng(1)
    for _ in range(4):
        f = {"x": rng.random((16, 784), dtype=np.float32),
             "y": rng.integers(0, 10, 16).astype(np.int32)}
        pa, pb = dict(plain.params), dict(hooked.params)
        a, b = plain.step(**f), hooked.step(**f)
        assert a["loss"].tobytes() == b["loss"].tobytes() and a["correct"] == b["correct"]
        # the hook's gradients are autodiff's, by the reference interpreter
        g, _ = grad(mnist_fc(16), "loss")
        ref = interp.run(g, f, pa)
        for k in pa:
            np.testing.assert_allclose(rec.seen[-1][1][k], ref[f"grad/{k}"], rtol=2e-4,
                                       atol=2e-6)
        assert pa.keys() == pb.keys()
    for k in plain.params:
        assert plain.params[k].tobytes() == hooked.params[k].tobytes(), k
    for k in plain.state:
        assert plain.state[k].tobytes() == hooked.state[k].tobytes(), k
    assert len(rec.seen) == 4


def test_fusion_respects_the_phases(fc_pair):
    plain, hooked, _ = fc_pair
    # without a hook: the same kernels as before the boundary existed (an update in a GEMM
    # epilogue, no boundary), and no phase facts
    kp = plain._products.kernels
    assert kp.boundary is None and not boundary_values(kp.graph)
    assert any(k.kind == "gemm" and any("update" in get_op(kp.graph.nodes[m].op).fusion
                                        for m in k.nodes) for k in kp.kernels)
    # with a hook: every kernel lies in one phase, phase 1 first, no update in phase 1
    kh = hooked._products.kernels
    g = kh.graph
    two = phase_two(g)
    assert two and kh.boundary is not None
    phases = [{m in two for m in k.nodes} for k in kh.kernels]
    assert all(len(p) == 1 for p in phases)
    assert [p.pop() for p in phases] == [False] * kh.boundary + [True] * (len(kh.kernels) -
                                                                          kh.boundary)
    assert not any("update" in get_op(g.nodes[m].op).fusion
                   for k in kh.kernels[:kh.boundary] for m in k.nodes)
    # the gradients lie in one f32 bucket: one flat region as large as the params
    mem = hooked._products.memory
    assert [b[0] for b in mem.buckets] == ["f32"]
    assert sum(s.nbytes for s in mem.gradients.values()) == \
        sum(v.nbytes for v in hooked.params.values())
    assert hooked.stats()["memory"]["gradient_bucket_bytes"] == mem.buckets[0][2]
    assert "update boundary" in hooked.ir("schedule")


@pytest.mark.parametrize("fuse,plan", [(False, True), (True, False)])
def test_noop_hook_unfused_or_unplanned(fuse, plan):
    opt = optim.Adam(lr=0.05)
    a = jg.compile(linear(), loss="loss", optimizer=opt, fuse=fuse, plan_memory=plan)
    b = jg.compile(linear(), loss="loss", optimizer=opt, fuse=fuse, plan_memory=plan,
                   hook=Record())
    for s in range(3):
        f = batch(s)
        assert a.step(**f)["loss"] == b.step(**f)["loss"]
    for k in a.params:
        assert np.array_equal(a.params[k], b.params[k])


def test_accumulation_calls_the_hook_on_the_applying_micro_step():
    """accumulate=3: the hook runs on micro-steps 3 and 6 only and sees the mean of the three
    micro-batch gradients; a no-op hook changes nothing."""
    opt = optim.SGD(lr=0.125, accumulate=3)
    rec = Record()
    a = jg.compile(linear(), loss="loss", optimizer=opt, hook=rec)
    b = jg.compile(linear(), loss="loss", optimizer=opt)
    p = {k: a.params[k] for k in a.params}
    acc = {k: 0.0 for k in p}
    assert [a.applies_update(c) for c in range(6)] == [False, False, True] * 2
    for c in range(6):
        f = batch(c)
        a.step(**f)
        b.step(**f)
        gr = closed_form(p, f["x"], f["t"])
        acc = {k: acc[k] + gr[k] / 3 for k in p}
        if c % 3 == 2:
            assert len(rec.seen) == c // 3 + 1 and rec.seen[-1][0] == c // 3 + 1
            for k in p:
                np.testing.assert_allclose(rec.seen[-1][1][k], acc[k], rtol=1e-12, atol=1e-14)
            p = {k: p[k] - 0.125 * acc[k] for k in p}
            acc = {k: 0.0 for k in p}
        else:
            assert len(rec.seen) == c // 3
    for k in p:
        np.testing.assert_allclose(a.params[k], p[k], rtol=1e-12)
        assert np.array_equal(a.params[k], b.params[k])


def test_raising_hook_changes_nothing_and_guard_sees_the_hooks_gradients():
    opt = optim.AdamW(lr=0.1)
    calls = []

    def fail(grads):
        calls.append(1)
        raise RuntimeError("peer lost")

    prog = jg.compile(linear(), loss="loss", optimizer=opt, hook=fail)
    before = dict(prog.params), dict(prog.state)
    with pytest.raises(RuntimeError, match="peer lost"):
        prog.step(**batch(0))
    assert prog.calls == 0 and calls == [1]
    for k, v in before[0].items():
        assert np.array_equal(prog.params[k], v)
    for k, v in before[1].items():
        assert np.array_equal(prog.state[k], v)

    def poison(grads):               # what an all-reduce with a rank's NaN would bring
        grads["b"][1] = np.nan

    guarded = jg.compile(linear(), loss="loss", optimizer=opt, check_finite=True, hook=poison)
    before = dict(guarded.params)
    with pytest.raises(FloatingPointError, match="b"):
        guarded.step(**batch(0))
    for k, v in before.items():
        assert np.array_equal(guarded.params[k], v)
    guarded.hook = None               # the same program, no hook: the step applies
    guarded.step(**batch(0))
    assert guarded.calls == 1 and not np.array_equal(guarded.params["w"], before["w"])


def test_f32_and_f64_params_make_two_buckets():
    g = jg.Graph("mixed")
    x = g.input("x", (4, 3))
    w = g.param("w", (3, 2), init=jg.init.normal())
    v = g.param("v", (2,), "f64", init=jg.init.normal())
    g.output(loss=jg.sum(jg.sqr(x @ w)) + jg.cast(jg.sum(jg.sqr(v)), "f32"))
    rec = Record()
    prog = jg.compile(g, loss="loss", optimizer=optim.SGD(lr=0.1), hook=rec)
    v0 = prog.params["v"]
    prog.step(x=np.ones((4, 3), np.float32))
    grads = rec.seen[0][1]
    np.testing.assert_allclose(grads["v"], 2 * v0, rtol=1e-6)
    assert sorted(b[0] for b in prog._products.memory.buckets) == ["f32", "f64"]


def test_bad_hooks_are_clear_errors():
    with pytest.raises(TypeError, match="hook"):
        jg.compile(linear(), loss="loss", optimizer=optim.SGD(lr=0.1), hook=3)
    with pytest.raises(ShapeError, match="needs an optimizer"):
        jg.compile(linear(), loss="loss", hook=print)
    prog = jg.compile(linear(), loss="loss", optimizer=optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match="without an update boundary"):
        prog.hook = print


@pytest.mark.slow
def test_noop_hook_llama_bitwise():
    """A small llama-shaped graph (rms_norm, rope, attention, get_rows): bitwise equal."""
    from jitgraph.models.llama import LlamaConfig, llama_forward
    cfg = LlamaConfig(vocab=32, dim=16, layers=1, heads=2, ctx=16)
    opt = optim.AdamW(lr=1e-2)
    rng = np.random.default_rng(0)
    a = jg.compile(llama_forward(cfg, 2, 8, labels=True), loss="loss", optimizer=opt)
    rec = Record()
    b = jg.compile(llama_forward(cfg, 2, 8, labels=True), loss="loss", optimizer=opt, hook=rec)
    for _ in range(3):
        f = {"tokens": rng.integers(0, 32, (2, 8)).astype(np.int32),
             "pos": np.arange(8, dtype=np.int32),
             "labels": rng.integers(0, 32, (2, 8)).astype(np.int32)}
        assert a.step(**f)["loss"].tobytes() == b.step(**f)["loss"].tobytes()
    for k in a.params:
        assert a.params[k].tobytes() == b.params[k].tobytes(), k
    assert set(rec.seen[0][1]) == set(a.params)

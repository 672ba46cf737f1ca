"""jg.compile end to end: training steps match the interpreter step for step; the Program API."""
import os

import numpy as np
import pytest

import jitgraph as jg
from jitgraph.registry import OPS, register
from jitgraph.types import ShapeError, TensorType

RTOL, ATOL = 2e-4, 2e-5   # float32 after several steps (BLAS vs numpy summation order)


def mlp(batch=16, n_in=13, hidden=11, n_out=5, labels=True):
    g = jg.Graph("mlp")
    x = g.input("x", (batch, n_in))
    y = g.input("y", (batch,), "i32") if labels else g.input("y", (batch, n_out))
    w1 = g.param("w1", (n_in, hidden), init=jg.init.he_normal())
    b1 = g.param("b1", (hidden,), init=jg.init.normal(0.0, 0.1))
    w2 = g.param("w2", (hidden, n_out), init=jg.init.he_normal())
    b2 = g.param("b2", (n_out,))
    logits = jg.relu(x @ w1 + b1) @ w2 + b2
    loss = jg.cross_entropy(logits, y) if labels else jg.mean(jg.sqr(logits - y))
    g.output(loss=loss, logits=logits)
    return g


def batches(g, n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = {}
        for name, nid in g.inputs.items():
            t = g.nodes[nid].type
            if name == "y" and t.dtype == "i32":
                b[name] = rng.integers(0, 5, t.shape).astype(np.int32)
            elif name == "tok":
                b[name] = rng.integers(0, 11, t.shape).astype(np.int32)
            elif name == "pos":
                b[name] = np.arange(t.shape[0], dtype=np.int32)
            else:
                b[name] = rng.standard_normal(t.shape).astype(t.np_dtype)
        out.append(b)
    return out


def assert_close(a, b, what):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=what)


def train_and_compare(g, opt, steps=4):
    """Compiled training steps vs jg.training_graph run by the interpreter, step for step."""
    prog = jg.compile(g, loss="loss", optimizer=opt)
    tg = jg.training_graph(g, loss="loss", optimizer=opt)
    state = tg.init_params(0)
    for k in prog.params:
        assert_close(prog.params[k], state[k], f"initial {k}")
    for i, b in enumerate(batches(g, steps)):
        got = prog.step(**b)
        ref = jg.interp.run(tg, {**b, **opt.runtime_inputs(i)}, state)
        for k in g.outputs:
            assert_close(got[k], ref[k], f"step {i} output {k}")
        for k in prog.params:
            assert_close(prog.params[k], state[k], f"step {i} param {k}")
        for k in prog.state:
            assert_close(prog.state[k], state[k], f"step {i} state {k}")
    return prog


def sgd_by_hand(lr=0.1):
    """An MLP whose update is written with Graph.update (no optimizer pass)."""
    g = jg.grad(mlp(labels=False), "loss")
    for p in ("w1", "b1", "w2", "b2"):
        g.update(**{p: g.tensor(g.params[p]) - g.tensor(g.outputs[f"grad/{p}"]) * lr})
    return g


def test_hand_written_sgd_matches_interpreter_step_for_step():
    g = sgd_by_hand()
    prog = jg.compile(g)
    params = g.init_params(0)
    for i, b in enumerate(batches(g, 5)):
        got = prog.step(**b)
        ref = jg.interp.run(g, b, params)
        assert_close(got["loss"], ref["loss"], f"loss step {i}")
        for k in params:
            assert_close(prog.params[k], params[k], f"{k} step {i}")
    assert prog.stats()["steps"] == 5


def test_grad_only_program_returns_gradients():
    g = mlp()
    prog = jg.compile(g, loss="loss")
    b = batches(g, 1)[0]
    got = prog.step(**b)
    ref = jg.interp.run(jg.grad(g, "loss"), b, g.init_params(0))
    assert {"grad/w1", "grad/b2", "loss"} <= set(got)
    for k in ref:
        assert_close(got[k], ref[k], k)


def test_parallel_update_kernel_with_large_and_small_domains_matches_interpreter():
    """One optimizer kernel updating a parameter big enough for a parallel loop (a flat prange,
    written in place) and small ones (serial loops) in the same generated function."""
    g = jg.Graph("wide")
    x = g.input("x", (700, 600))
    a = g.param("a", (700, 600), init=jg.init.normal(0.0, 0.1))
    b = g.param("b", (600,), init=jg.init.normal(0.0, 0.1))
    c = g.param("c", (600,), init=jg.init.normal(0.0, 0.1))
    g.output(loss=jg.mean(jg.sqr(x * a + b) * c))
    prog = train_and_compare(g, jg.optim.AdamW(lr=1e-2), steps=3)
    kernels = prog.ir("kernels")
    assert "prange(420000)" in kernels and "range(600)" in kernels


def test_reduction_kept_between_reduced_axes_runs_parallel_and_matches_interpreter():
    """A channel gradient (a CNN bias: sum over batch and pixels, channels kept) with its fused
    relu-backward prologue: the kept axis sits between reduced ones, and the kernel runs a
    prange over it (each iteration owns one channel's sum and its prologue's elements)."""
    from jitgraph.runtime.cpu.lower import PARALLEL_MIN_WORK
    g = jg.Graph("chan")
    x = g.input("x", (40, 8, 1700))
    b = g.param("b", (8, 1), init=jg.init.normal(0.0, 0.5))
    g.output(loss=jg.sum(jg.relu(x + b) * x) * (1.0 / x.type.size))
    assert 40 * 8 * 1700 >= PARALLEL_MIN_WORK
    prog = train_and_compare(g, jg.optim.SGD(lr=0.5), steps=3)
    kernels = prog.ir("kernels")
    assert "for i1 in prange(n1):" in kernels, kernels


@pytest.mark.slow
def test_adamw_mlp_matches_interpreter():
    train_and_compare(mlp(), jg.optim.AdamW(lr=1e-2))


@pytest.mark.slow
def test_cnn_block_matches_interpreter():
    g = jg.Graph("cnn")
    x, y = g.input("x", (3, 2, 9, 9)), g.input("y", (3,), "i32")
    k = g.param("k", (4, 2, 3, 3), init=jg.init.he_normal())
    w = g.param("w", (4 * 4 * 4, 5), init=jg.init.he_normal())
    h = jg.max_pool2d(jg.relu(jg.conv2d(x, k, padding=1)), 2)
    h = jg.avg_pool2d(h, 1)
    logits = jg.reshape(h, (3, 64)) @ w
    g.output(loss=jg.cross_entropy(logits, y))
    train_and_compare(g, jg.optim.SGD(lr=0.05, momentum=0.9), steps=3)


@pytest.mark.slow
def test_attention_block_matches_interpreter():
    T, D, V = 6, 8, 11
    g = jg.Graph("attn")
    tok, pos, y = g.input("tok", (T,), "i32"), g.input("pos", (T,), "i32"), g.input("y", (T,), "i32")
    emb = g.param("emb", (V, D), init=jg.init.normal(0.0, 0.5))
    wq, wk, wv = (g.param(n, (D, D), init=jg.init.glorot_uniform()) for n in ("wq", "wk", "wv"))
    wo = g.param("wo", (D, 5), init=jg.init.glorot_uniform())
    h = jg.rms_norm(jg.get_rows(emb, tok))
    def heads(t):
        return jg.reshape(t, (T, 2, D // 2))
    q, k = jg.rope(heads(h @ wq), pos), jg.rope(heads(h @ wk), pos)
    v = jg.permute(heads(h @ wv), (1, 0, 2))
    att = jg.matmul(jg.permute(q, (1, 0, 2)), jg.permute(k, (1, 0, 2)), tb=True) * (D // 2) ** -0.5
    a = jg.softmax(jg.causal_mask(att))
    o = jg.reshape(jg.permute(a @ v, (1, 0, 2)), (T, D))
    logits = jg.layer_norm(o + h) @ wo
    g.output(loss=jg.cross_entropy(logits, y))
    train_and_compare(g, jg.optim.Adam(lr=1e-2), steps=3)


def test_update_read_after_it_is_computed_is_not_clobbered():
    # p's update is computed before `later` reads p: the update must not overwrite p early
    g = jg.Graph("order")
    x = g.input("x", (3,))
    p = g.param("p", (3,), init=jg.init.constant(2.0))
    new = p * 0.5
    later = p + x
    g.update(p=new)
    g.output(later=later)
    prog = jg.compile(g)
    assert prog._products.memory.copies == [("p", new.id)]
    out = prog.step(x=np.ones(3, np.float32))
    np.testing.assert_array_equal(out["later"], 3.0)
    np.testing.assert_array_equal(prog.params["p"], 1.0)


@pytest.fixture(scope="module")
def trained():
    g = sgd_by_hand()
    prog = jg.compile(g)
    for b in batches(g, 2):
        prog.step(**b)
    return g, prog


def test_evaluator_shares_params_and_drops_outputs_missing_inputs(trained):
    g, prog = trained
    ev = prog.evaluator()
    x = batches(g, 1, seed=5)[0]["x"]
    logits = ev.run(x=x)
    assert set(logits) == {"logits"}
    ref = jg.interp.run(mlp(labels=False), {"x": x, "y": np.zeros((16, 5), np.float32)},
                        {k: prog.params[k] for k in ("w1", "b1", "w2", "b2")})
    assert_close(logits["logits"], ref["logits"], "logits")
    prog.params["b2"] = prog.params["b2"] + 1.0          # the evaluator sees new values
    assert_close(ev.run(x=x)["logits"], ref["logits"] + 1.0, "shifted logits")


def test_evaluator_sharing_the_training_arena():
    """evaluator(share_memory=True): its arena and outputs lie inside the training program's
    block (no memory of its own), it computes what a separate evaluator does, and training
    after its runs goes on bit for bit as a program that never evaluated."""
    g = mlp(batch=64, n_in=40, hidden=48)
    progs = [jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-2), seed=3)
             for _ in range(3)]
    shared, alone = progs[0].evaluator(share_memory=True), progs[0].evaluator()
    data = batches(g, 4, seed=4)
    for b in data[:2]:
        for p in progs:
            p.step(**b)
    got, want = shared.run(**data[2]), alone.run(**data[2])
    for k in ("loss", "logits"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    ev, block = shared._programs[frozenset(data[2])], progs[0]._block
    lo, hi = block.ctypes.data, block.ctypes.data + block.nbytes
    assert lo <= ev._block.ctypes.data and ev._block.ctypes.data + ev._block.nbytes <= hi
    assert alone._programs[frozenset(data[2])]._block.ctypes.data not in range(lo, hi)
    progs[1].evaluator(share_memory=True).run(**data[3])
    for b in data[2:]:
        for p in progs:
            p.step(**b)
    for k in progs[0].params:
        for p in progs[1:]:
            np.testing.assert_array_equal(progs[0].params[k], p.params[k], err_msg=k)


def test_a_params_view_is_the_program_memory_read_only(trained):
    """Program.params.view(k): the array where it lives (a step's update shows in it), not
    writeable; params[k] stays a copy."""
    g, prog = trained
    v, c = prog.params.view("w1"), prog.params["w1"]
    np.testing.assert_array_equal(v, c)
    assert not v.flags.writeable and c.flags.writeable
    with pytest.raises(ValueError):
        v[0, 0] = 1.0
    prog.step(**batches(g, 1, seed=9)[0])
    np.testing.assert_array_equal(v, prog.params["w1"])
    assert not np.array_equal(v, c)


def test_step_validates_inputs(trained):
    g, prog = trained
    b = batches(g, 1)[0]
    with pytest.raises(ShapeError, match=r"input x: expected shape float32\[16,13\], got "
                                         r"float32\[8,13\]"):
        prog.step(x=b["x"][:8], y=b["y"])
    with pytest.raises(ShapeError, match="missing input y"):
        prog.step(x=b["x"])
    with pytest.raises(ShapeError, match="unknown input 'z'"):
        prog.step(z=1, **b)
    with pytest.raises(ShapeError, match="input y: expected dtype float32, got bool"):
        prog.step(x=b["x"], y=b["y"] > 0)


def test_params_read_copies_and_assignment_validates(trained):
    g, prog = trained
    w = prog.params["w1"]
    w += 1.0
    assert not np.array_equal(prog.params["w1"], w)
    prog.params["w1"] = np.zeros((13, 11))
    assert prog.params["w1"].dtype == np.float32 and not prog.params["w1"].any()
    with pytest.raises(ShapeError, match=r"param w1: expected float32\[13,11\], got float64\[2\]"):
        prog.params["w1"] = np.zeros(2)
    with pytest.raises(KeyError, match="no param 'nope'"):
        prog.params["nope"]
    assert set(prog.params) == {"w1", "b1", "w2", "b2"} and len(prog.state) == 0


def test_check_finite_names_the_output():
    g = jg.Graph("nan")
    x = g.input("x", (2,))
    g.output(loss=jg.sum(jg.log(x)))
    prog = jg.compile(g, check_finite=True)
    assert prog.step(x=np.ones(2, np.float32))["loss"] == 0.0
    with pytest.raises(FloatingPointError, match="output loss is not finite"):
        prog.step(x=-np.ones(2, np.float32))


def test_outputs_as_views_equal_copies_and_are_overwritten_by_the_next_step():
    g = jg.Graph("views")
    x = g.input("x", (3, 4))
    g.output(y=jg.exp(x) * 2.0, s=jg.sum(x))
    copying, viewing = jg.compile(g), jg.compile(g, copy_outputs=False)
    a, b = (np.random.default_rng(i).standard_normal((3, 4)).astype(np.float32) for i in (1, 2))
    first = viewing.step(x=a)
    want = copying.step(x=a)
    for k in want:
        np.testing.assert_array_equal(first[k], want[k])
        np.testing.assert_allclose(first[k], jg.interp.run(g, {"x": a}, {})[k], rtol=1e-5)
        assert not first[k].flags.writeable
    with pytest.raises(ValueError):
        first["y"][0, 0] = 1.0
    kept = {k: v.copy() for k, v in first.items()}
    viewing.step(x=b)      # the views now show the new step's values
    np.testing.assert_array_equal(first["y"], copying.step(x=b)["y"])
    assert not np.array_equal(first["y"], kept["y"])


def test_ir_stages_dump_and_stats(tmp_path, monkeypatch):
    monkeypatch.setenv("JITGRAPH_DUMP", str(tmp_path))
    prog = jg.compile(mlp(), loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    for stage in ("graph", "autodiff", "optimizer", "simplify", "fuse", "memory", "kernels"):
        assert prog.ir(stage)
        assert (tmp_path / f"{stage}.txt").read_text().strip() == prog.ir(stage).strip()
    src = prog.ir("kernels")
    assert "= matmul(x, w1)" in src and "@cfunc(" in src and "define void @d_" in src
    s = prog.stats()
    assert s["calls_per_step"] >= s["kernels"] > 0
    assert s["arena_bytes"] > 0 and s["persistent_bytes"] >= 4 * (13 * 11 + 11 + 11 * 5 + 5)
    assert set(s["stage_seconds"]) >= {"autodiff", "optimizer", "fuse", "memory", "lower"}
    with pytest.raises(KeyError, match="no IR for stage 'nope'"):
        prog.ir("nope")


def test_unlowered_op_fails_at_compile_time_and_bad_target():
    if "test_only_op" not in OPS:
        register("test_only_op", arity=1, infer=lambda args, a: args[0].type,
                 ref=lambda a, x: x.copy())
    g = jg.Graph("odd")
    x = g.input("x", (2,))
    g.output(y=g.add("test_only_op", [x]))
    with pytest.raises(NotImplementedError, match="op test_only_op has no CPU lowering"):
        jg.compile(g)
    with pytest.raises(ValueError, match="unknown target 'tpu'"):
        jg.compile(g, target="tpu")


def test_identical_kernels_compile_once_per_program():
    g = jg.Graph("twins")
    x, y = g.input("x", (4, 3)), g.input("y", (4, 3))
    g.output(a=x + y, b=y + x, c=jg.relu(x), d=jg.relu(y))
    prog = jg.compile(g)
    s = prog.stats()
    assert s["calls_per_step"] == 4 and s["kernel_functions"] == 2
    out = prog.step(x=np.ones((4, 3)), y=-np.ones((4, 3)))
    np.testing.assert_array_equal(out["d"], 0.0)


def test_a_programs_initial_params_and_state_are_init_params():
    """A program fills its params one at a time, leaving zero-initialised ones (AdamW's
    moments) unwritten in its zeroed memory: the values are graph.init_params(seed)'s."""
    g = mlp()
    g.param("z", (7,), init=jg.init.zeros())
    g.param("c", (3, 2), init=jg.init.constant(-1.5))
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=1e-3), seed=11)
    want = prog.graph.init_params(11)
    assert set(want) == set(prog.params) | set(prog.state)
    for k, v in want.items():
        got = prog.params[k] if k in prog.params else prog.state[k]
        np.testing.assert_array_equal(got, v, err_msg=k)
    assert want["c"].min() == -1.5 and any(k.startswith("opt/") for k in prog.state)

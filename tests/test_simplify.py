"""The simplify pass: every rule fires, and results never change beyond float reassociation."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jitgraph as jg
from jitgraph import interp, optim
from jitgraph.passes.simplify import simplify


def ops_of(g):
    return [n.op for n in g.nodes if n.op not in ("input", "param")]


def feeds_for(g, seed=0):
    rng = np.random.default_rng(seed)
    def value(nid):
        t = g.nodes[nid].type
        if t.is_float:
            return rng.standard_normal(t.shape).astype(t.np_dtype)
        return rng.integers(-3, 4, t.shape).astype(t.np_dtype)
    return ({k: value(i) for k, i in g.inputs.items()}, {k: value(i) for k, i in g.params.items()})


def same_results(g, s, seed=0, rtol=1e-5):
    inputs, params = feeds_for(g, seed)
    a, b = interp.run(g, inputs, params), interp.run(s, inputs, params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=rtol, atol=1e-6, err_msg=k)


def check(g, rule, count=1):
    s, rep = simplify(g)
    assert rep.stats.get(rule, 0) == count, str(rep)
    same_results(g, s)
    return s, rep


def graph(*shapes, dtype="f32"):
    g = jg.Graph("t")
    return g, [g.input(f"x{i}", s, dtype) for i, s in enumerate(shapes)]


def test_dead_code_is_removed_and_ids_are_dense():
    g, (x, y) = graph((3, 4), (3, 4))
    unused = jg.exp(x) * y
    jg.tanh(unused)
    g.param("never_read", (2,))
    g.output(out=jg.relu(x) + y)
    s, rep = check(g, "dead", 3)
    assert ops_of(s) == ["relu", "add"]
    assert [n.id for n in s.nodes] == list(range(len(s.nodes)))
    assert set(s.inputs) == {"x0", "x1"} and set(s.params) == {"never_read"}
    assert rep.stats["nodes_before"] == len(g.nodes) and rep.stats["nodes_after"] == len(s.nodes)


def test_cse_merges_equal_nodes():
    g, (x, w) = graph((3, 4), (4, 5))
    a, b = jg.relu(x @ w), jg.relu(x @ w)
    g.output(out=a + b, other=jg.tanh(x @ w))
    s, _ = check(g, "cse", 3)           # two matmuls and one relu merge
    assert ops_of(s).count("matmul") == 1 and ops_of(s).count("relu") == 1
    assert s.outputs["out"] != s.outputs["other"]


def test_constant_folding_of_full_arithmetic():
    g, (x,) = graph((2, 3))
    c = jg.full_like(x, 2.0) * 3.0 + jg.exp(jg.full_like(x, 0.0))     # = 7 everywhere
    g.output(out=x + c, k=jg.broadcast_to(jg.reshape(jg.const(g, 0.5), (1, 1)), (4, 2)))
    s, rep = simplify(g)
    same_results(g, s)
    assert rep.stats["fold"] >= 5
    fulls = {s.nodes[i].attr["value"] for i in s.nodes[s.outputs["out"]].inputs
             if s.nodes[i].op == "full"}
    assert fulls == {7.0}
    k = s.nodes[s.outputs["k"]]
    assert k.op == "full" and k.attr["value"] == 0.5 and k.type.shape == (4, 2)


@pytest.mark.parametrize("rule, build, gone", [
    ("mul_one", lambda x: x * jg.const(x.graph, 1.0), "mul"),
    ("mul_one", lambda x: jg.mul(jg.full_like(x, 1.0), x), "mul"),
    ("add_zero", lambda x: jg.const(x.graph, 0.0) + x, "add"),
    ("add_zero", lambda x: x - jg.full_like(x, 0.0), "sub"),
    ("noop", lambda x: jg.scale(x, 1.0), "scale"),
    ("noop", lambda x: jg.pow(x, 1.0), "pow"),
    ("noop", lambda x: jg.reshape(x, x.shape), "reshape"),
    ("noop", lambda x: jg.permute(x, (0, 1, 2)), "permute"),
    ("noop", lambda x: jg.cast(x, "f32"), "cast"),
    ("neg_neg", lambda x: -(-x), "neg"),
    ("reshape_reshape", lambda x: jg.reshape(jg.reshape(x, (6, 5)), (3, 10)), None),
    ("permute_permute", lambda x: jg.permute(jg.permute(x, (1, 2, 0)), (2, 0, 1)), "permute"),
    ("permute_permute", lambda x: jg.permute(jg.permute(x, (1, 2, 0)), (1, 0, 2)), None),
    ("scale_scale", lambda x: jg.scale(jg.scale(x, 3.0), 0.25), None),
    ("mul_const", lambda x: x * jg.full_like(x, 3.0), "mul"),
])
def test_algebraic_rules(rule, build, gone):
    g, (x,) = graph((2, 3, 5))
    g.output(out=jg.tanh(build(x)))
    s, _ = simplify(g)
    same_results(g, s)
    _, rep = simplify(g)
    assert rep.stats.get(rule, 0) >= 1, str(rep)
    if gone:
        assert gone not in ops_of(s)
    assert len(ops_of(s)) <= 2


def test_chains_collapse_to_one_node():
    g, (x,) = graph((2, 3, 4))
    r = jg.reshape(jg.reshape(jg.reshape(x, (6, 4)), (24,)), (4, 6))
    p = jg.permute(jg.permute(jg.permute(x, (1, 0, 2)), (0, 2, 1)), (2, 1, 0))
    sc = jg.scale(jg.scale(jg.scale(x, 2.0), 4.0), 0.125)           # = x
    g.output(r=r, p=p, sc=sc)
    s, _ = simplify(g)
    same_results(g, s)
    assert ops_of(s) == ["reshape", "permute"]
    assert s.outputs["sc"] == s.inputs["x0"]
    a = np.arange(24).reshape(2, 3, 4)
    np.testing.assert_array_equal(
        np.transpose(a, s.nodes[s.outputs["p"]].attr["axes"]),
        np.transpose(np.transpose(np.transpose(a, (1, 0, 2)), (0, 2, 1)), (2, 1, 0)))


def test_bad_looking_identities_are_not_applied():
    g, (x, y) = graph((3, 1), (3, 4))
    g.output(a=x * jg.full_like(y, 1.0),       # broadcasts x: the mul is not an identity
             b=jg.full_like(x, 0.0) - x,       # 0 - x is not x
             c=x * jg.const(g, 0.0))           # x * 0 is not 0 for inf/nan: kept (as a scale)
    s, _ = simplify(g)
    same_results(g, s)
    assert s.nodes[s.outputs["a"]].type.shape == (3, 4)
    assert s.outputs["b"] != s.inputs["x0"] and s.outputs["c"] != s.inputs["x0"]
    inputs, params = feeds_for(g)
    inputs["x0"][0, 0] = np.inf
    with np.errstate(invalid="ignore"):
        assert np.isnan(interp.run(s, inputs, params)["c"][0, 0])


@pytest.mark.parametrize("xs, ws, build, flags", [
    ((4, 3), (4, 5), lambda x, w: x.T @ w, (True, False)),
    ((3, 4), (5, 4), lambda x, w: x @ w.T, (False, True)),
    ((4, 3), (5, 4), lambda x, w: x.T @ w.T, (True, True)),
    ((2, 4, 3), (2, 4, 5), lambda x, w: jg.permute(x, (0, 2, 1)) @ w, (True, False)),
    ((3, 4), (4, 5), lambda x, w: jg.matmul(x.T, w, ta=True), (False, False)),
])
def test_transpose_folds_into_matmul_flags(xs, ws, build, flags):
    g, (x, w) = graph(xs, ws)
    g.output(out=build(x, w))
    s, rep = simplify(g)
    same_results(g, s)
    assert ops_of(s) == ["matmul"]
    mm = s.nodes[s.outputs["out"]]
    assert (mm.attr["ta"], mm.attr["tb"]) == flags
    assert [s.label(i) for i in mm.inputs] == ["x0", "x1"]


def test_transpose_that_is_not_the_last_two_axes_stays():
    g, (x, w) = graph((4, 2, 3), (3, 2, 5))
    g.output(out=jg.permute(x, (1, 0, 2)) @ jg.permute(w, (1, 0, 2)))
    s, rep = simplify(g)
    assert ops_of(s).count("permute") == 2 and "matmul_transpose" not in rep.stats


@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_transpose_of_a_matmul_swaps_its_operands(ta, tb):
    g, (a, b) = graph((2, 3, 4) if ta else (2, 4, 3), (2, 5, 3) if tb else (2, 3, 5))
    g.output(out=jg.permute(jg.matmul(a, b, ta=ta, tb=tb), (0, 2, 1)))
    s, rep = simplify(g)
    same_results(g, s)
    assert ops_of(s) == ["matmul"] and rep.stats["transpose_matmul"] == 1
    mm = s.nodes[s.outputs["out"]]
    assert [s.label(i) for i in mm.inputs] == ["x1", "x0"]


def test_transpose_of_a_shared_matmul_stays():
    g, (a, b) = graph((4, 3), (3, 5))
    p = a @ b
    g.output(out=p.T, p=p)
    s, rep = simplify(g)
    assert ops_of(s) == ["matmul", "permute"] and "transpose_matmul" not in rep.stats


def mlp():
    g = jg.Graph("mlp")
    x, t = g.input("x", (8, 5)), g.input("t", (8, 3))
    w1 = g.param("w1", (5, 4), init=jg.init.he_uniform())
    b1 = g.param("b1", (4,))
    w2 = g.param("w2", (3, 4), init=jg.init.he_uniform())
    out = jg.tanh(x @ w1 + b1) @ w2.T                       # tied-embedding style transpose
    g.output(loss=jg.mean(jg.sqr(out - t)), out=out)
    return g


@pytest.mark.parametrize("opt", [optim.AdamW(0.01, accumulate=2, clip_norm=1.0),
                                 optim.SGD(0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_training_graph_steps_are_unchanged(opt):
    tg = jg.training_graph(mlp(), optimizer=opt)
    s, rep = simplify(tg)
    assert len(s.nodes) < len(tg.nodes) and rep.stats["dead"] > 0
    assert "permute" not in ops_of(s)
    assert set(s.updates) == set(tg.updates) and set(s.outputs) == set(tg.outputs)
    assert s.inits == tg.inits and list(s.inputs) == list(tg.inputs)
    inputs, _ = feeds_for(tg)
    a, b = tg.init_params(), s.init_params()
    for call in range(4):
        feed = {"x": inputs["x"], "t": inputs["t"], **opt.runtime_inputs(call)}
        oa, ob = interp.run(tg, feed, a), interp.run(s, feed, b)
        np.testing.assert_allclose(ob["loss"], oa["loss"], rtol=1e-5)
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_simplify_is_idempotent_and_serialisable():
    s, _ = simplify(jg.training_graph(mlp(), optimizer=optim.Adam()))
    s2, rep = simplify(s)
    assert s2.fingerprint() == s.fingerprint()
    assert rep.stats["dead"] == 0 and rep.stats["nodes_before"] == rep.stats["nodes_after"]
    assert jg.Graph.from_json(s.to_json()).fingerprint() == s.fingerprint()


# ---- random graphs ---------------------------------------------------------------------------
SHAPE = (3, 4)
UNARY = [jg.tanh, jg.relu, jg.neg, jg.exp, jg.sigmoid, lambda x: jg.scale(x, 0.5),
         lambda x: jg.scale(x, 1.0), lambda x: jg.pow(x, 1.0), lambda x: x.T.T,
         lambda x: jg.reshape(jg.reshape(x, (12,)), SHAPE), lambda x: x * 1.0 + 0.0,
         lambda x: jg.broadcast_to(jg.sum(x, axis=0, keepdims=True), SHAPE),
         lambda x: jg.scale(jg.scale(x, 2.0), 3.0)]
BINARY = [jg.add, jg.sub, jg.mul, jg.maximum, lambda a, b: a @ b.T @ a,
          lambda a, b: jg.where(jg.step(a), a, b)]


def random_graph(draw):
    g = jg.Graph("random")
    vals = [g.input("a", SHAPE), g.input("b", SHAPE), g.param("p", SHAPE),
            jg.full_like(g.tensor(0), 1.0), jg.full_like(g.tensor(0), 0.0)]
    for _ in range(draw(st.integers(3, 14))):
        if draw(st.booleans()):
            f = draw(st.sampled_from(UNARY))
            vals.append(f(vals[draw(st.integers(0, len(vals) - 1))]))
        else:
            f = draw(st.sampled_from(BINARY))
            i, j = draw(st.integers(0, len(vals) - 1)), draw(st.integers(0, len(vals) - 1))
            vals.append(jg.tanh(f(vals[i], vals[j])))     # tanh keeps values bounded
    g.output(out=vals[-1], mid=vals[len(vals) // 2])
    return g


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_graphs_give_the_same_results(data):
    g = random_graph(data.draw)
    s, _ = simplify(g)
    s.validate()
    assert len(s.nodes) <= len(g.nodes)
    same_results(g, s)

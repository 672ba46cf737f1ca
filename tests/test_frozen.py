"""Frozen parameters (trainable=False) cost nothing: no gradient, no optimizer state, no update,
no weight-gradient GEMM; the gradient w.r.t. the activations flowing through a frozen weight to
earlier trainable params is still computed (checked against finite differences and the
interpreter's training step)."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp, optim
from jitgraph.passes.autodiff import grad
from jitgraph.printer import param_roles, role_sizes
from jitgraph.testing import check_grad

B, IN, H1, H2, OUT = 4, 8, 16, 12, 5       # distinct sizes: a [H1, H2] value is W2's gradient


def mlp(frozen=("w2",)):
    g = jg.Graph("mlp3")
    x, y = g.input("x", (B, IN)), g.input("y", (B,), "i32")
    ws = {}
    for name, shape in (("w1", (IN, H1)), ("w2", (H1, H2)), ("w3", (H2, OUT))):
        ws[name] = g.param(name, shape, init=jg.init.normal(0.0, 0.5),
                           trainable=name not in frozen)
    h = jg.tanh(x @ ws["w1"])
    h = jg.tanh(h @ ws["w2"])
    g.output(loss=jg.cross_entropy(h @ ws["w3"], y))
    return g


def feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((B, IN)).astype(np.float32),
            "y": rng.integers(0, OUT, B).astype(np.int32)}


def test_frozen_param_gets_no_gradient_nodes_and_report_counts_the_saving():
    g = mlp()
    gg, rep = grad(g)
    assert set(k for k in gg.outputs if k.startswith("grad/")) == {"grad/w1", "grad/w3"}
    backward = gg.nodes[len(g.nodes):]
    assert not [n for n in backward if n.type.shape == (H1, H2)], "a gradient of frozen w2"
    # the gradient still flows through w2 to w1: w2 is read by a backward matmul
    w2 = gg.params["w2"]
    assert any(n.op == "matmul" and w2 in n.inputs for n in backward)
    s = rep.stats
    assert s["frozen_params"] == 1 and s["grads"] == 2
    # the whole saving is W2's weight-gradient GEMM: 2 * B * H1 * H2 FLOPs
    assert s["full_backward_flops"] - s["backward_flops"] == 2 * B * H1 * H2
    assert any("frozen: 1 params" in line for line in rep.lines)
    # every trainable param frozen but the last: nothing flows below w3
    gg3, rep3 = grad(mlp(frozen=("w1", "w2")))
    assert not [n for n in gg3.nodes[len(g.nodes):] if n.op == "matmul" and
                n.type.shape in ((B, H1), (IN, H1), (H1, H2))]
    assert rep3.stats["frozen_params"] == 2


def test_gradient_through_a_frozen_weight_matches_finite_differences():
    g = mlp()
    params = g.init_params(3)
    res = check_grad(g, feeds(1), params, loss="loss", max_elements=40)
    assert set(res.errors) == {"w1", "w3"} and res.ok


def test_printer_and_roles_tell_frozen_weights_from_optimizer_state():
    g = mlp()
    head = str(g).splitlines()[0]
    assert "params(w1: f32[8,16], w3: f32[12,5]) frozen(w2: f32[16,12])" in head
    tg = jg.training_graph(g, optimizer=optim.AdamW(lr=1e-2))
    roles = param_roles(tg)
    assert roles["w2"] == "frozen" and roles["w1"] == roles["w3"] == "trainable"
    assert {k for k, r in roles.items() if r == "state"} == \
        {f"opt/{m}/{p}" for m in "mv" for p in ("w1", "w3")}
    head = str(tg).splitlines()[0]
    assert "frozen(w2: f32[16,12]) state(opt/m/w1" in head
    sizes = role_sizes(tg)
    assert sizes["frozen"] == (1, H1 * H2, 4 * H1 * H2)
    assert sizes["trainable"] == (2, IN * H1 + H2 * OUT, 4 * (IN * H1 + H2 * OUT))
    assert sizes["state"] == (4, 2 * (IN * H1 + H2 * OUT), 8 * (IN * H1 + H2 * OUT))


def test_frozen_param_keeps_its_value_and_gets_no_state_under_adamw():
    g = mlp()
    opt = optim.AdamW(lr=5e-2)
    prog = jg.compile(g, loss="loss", optimizer=opt, seed=2)
    assert sorted(prog.state) == sorted(f"opt/{m}/{p}" for m in "mv" for p in ("w1", "w3"))
    # the oracle: the interpreter running the same training graph from the same values
    tg = jg.training_graph(g, optimizer=opt)
    ref = {k: np.array(v) for k, v in tg.init_params(0).items()}
    ref.update({k: np.array(prog.params[k]) for k in g.params})
    w2 = np.array(prog.params["w2"])
    start = {k: np.array(prog.params[k]) for k in ("w1", "w3")}
    for step in range(3):
        f = feeds(10 + step)
        prog.step(**f)
        interp.run(tg, {**f, **opt.runtime_inputs(step)}, ref)
    assert np.array_equal(prog.params["w2"], w2)
    assert np.array_equal(ref["w2"], w2)
    for k in ("w1", "w3"):
        assert not np.array_equal(prog.params[k], start[k])
        np.testing.assert_allclose(prog.params[k], ref[k], rtol=1e-5, atol=1e-6)
    assert prog._products.reports[1].stats["frozen_params"] == 1


def _weight_grad_matmuls(graph, weights):
    """Matmul nodes of `graph` whose result has the shape of one of `weights` (2-D params)."""
    shapes = {graph.nodes[graph.params[w]].type.shape for w in weights}
    return [n for n in graph.nodes if n.op == "matmul" and n.type.shape in shapes]


@pytest.mark.slow
def test_lora_llama_training_step_has_no_weight_gradient_gemm_for_the_base():
    from jitgraph.models.llama import LlamaConfig, llama_forward
    from jitgraph.passes.simplify import simplify
    cfg = LlamaConfig(vocab=40, dim=32, layers=2, heads=4, kv_heads=2, ff=48, ctx=64)
    g = llama_forward(cfg, 2, 12, labels=True)       # activations are [24, *]: no weight shape
    weights = [k for k, i in g.params.items() if g.nodes[i].type.ndim == 2
               and k != "token_embd.weight"]
    # the detector sees the full finetune's weight gradients: one per weight
    full, _ = grad(g)
    assert len(_weight_grad_matmuls(simplify(full)[0], weights)) == len(weights)
    lg = jg.lora(g, targets="q,v", rank=4)
    opt = optim.AdamW(lr=1e-3)
    prog = jg.compile(lg, loss="loss", optimizer=opt)
    final = prog._products.kernels.graph
    assert _weight_grad_matmuls(final, weights) == []
    # what the kernels run: every GEMM in the list and its shape; none is [out, in]-sized
    gemms = [final.nodes[n].type.shape for k in prog._products.kernels.kernels for n in k.nodes
             if final.nodes[n].op == "matmul"]
    wshapes = {final.nodes[final.params[w]].type.shape for w in weights}
    assert gemms and not wshapes & set(gemms)
    # optimizer state: the adapters' moments only
    adapters = [k for k in lg.params if k.endswith((".lora_a", ".lora_b"))]
    assert len(adapters) == 2 * 2 * cfg.layers
    assert sorted(prog.state) == sorted(f"opt/{m}/{a}" for m in "mv" for a in adapters)
    rep = prog._products.reports[1]
    assert rep.name == "autodiff" and rep.stats["frozen_params"] == len(g.params)
    assert rep.stats["backward_flops"] < rep.stats["full_backward_flops"]
    # a step moves the adapters and nothing of the base
    base = {k: np.array(prog.params[k]) for k in g.params}
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.vocab, (2, 13)).astype(np.int32)
    for _ in range(2):
        prog.step(tokens=tok[:, :12], labels=tok[:, 1:], pos=np.arange(12, dtype=np.int32))
    assert all(np.array_equal(prog.params[k], v) for k, v in base.items())
    assert any(np.any(prog.params[k]) for k in adapters if k.endswith(".lora_b"))

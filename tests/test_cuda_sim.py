"""The CUDA target (runtime/cuda) on numba's CUDA simulator, small shapes, against the reference
interpreter and the CPU target.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, and the rest of the suite
imports numba without it, so the simulator tests run in a subprocess of their own
(test_simulator_suite runs this file again with the variable set); in the main run they skip
saying so. Everything skips when numba-cuda is not installed (`pip install -e '.[cuda]'`)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import init, ops
from jitgraph.interp import run as interp
from jitgraph.ir import Graph
from jitgraph.ops.common import apply

HAVE = importlib.util.find_spec("numba_cuda") is not None
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
pytestmark = pytest.mark.skipif(not HAVE, reason="numba-cuda not installed "
                                "(pip install -e '.[cuda]')")
if SIM:
    # the simulator's block loop polls its threads: a short GIL switch interval runs a step
    # ~3x faster (a 1-layer llama step: 16 s -> 5 s)
    sys.setswitchinterval(1e-5)
sim_only = pytest.mark.skipif(not SIM, reason="runs in the simulator subprocess of "
                              "test_simulator_suite (NUMBA_ENABLE_CUDASIM=1)")


@pytest.mark.slow
@pytest.mark.skipif(SIM, reason="this is the subprocess")
def test_simulator_suite():
    run_simulator_suite(Path(__file__))


def run_simulator_suite(path):
    """Run the test file `path` again in a subprocess with numba-cuda's simulator on; its
    tests must pass (tests/test_cuda_half.py runs its own so too)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", str(path), "-q", "-x",
                        "-p", "no:cacheprovider", "-p", "no:randomly"], env=env,
                       capture_output=True, text=True, timeout=900,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-3000:]


@pytest.mark.skipif(SIM, reason="the simulator is on in this process")
def test_no_gpu_is_a_clear_error():
    """No GPU and no simulator: compile names the cause and the remedy."""
    code = ("import jitgraph as jg; from jitgraph.ir import Graph\n"
            "g = Graph('t'); x = g.input('x', (2,)); g.output(y=x * 2.0)\n"
            "try:\n    jg.compile(g, target='cuda')\nexcept RuntimeError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    if "target cuda" not in out.stdout:
        pytest.skip(f"a CUDA device is present here: {out.stdout[-300:]} {out.stderr[-300:]}")
    assert "no CUDA GPU found" in out.stdout and "NUMBA_ENABLE_CUDASIM=1" in out.stdout


# ---- in the simulator ---------------------------------------------------------------------
def mlp(B=8, D=12, H=16, C=5):
    g = Graph("mlp_small")
    x = g.input("x", (B, D))
    y = g.input("y", (B,), "i32")
    w1 = g.param("fc1.weight", (D, H), init=init.he_uniform())
    b1 = g.param("fc1.bias", (H,), init=init.uniform(-0.1, 0.1))
    w2 = g.param("fc2.weight", (H, C), init=init.he_uniform())
    b2 = g.param("fc2.bias", (C,), init=init.uniform(-0.1, 0.1))
    logits = ops.relu(x @ w1 + b1) @ w2 + b2
    g.output(loss=ops.cross_entropy(logits, y), logits=logits,
             correct=ops.count_equal(ops.argmax(logits, -1), y))
    return g


def rows_graph():
    """Row ops (and, trained, their backward row kernels) with prologues and epilogues."""
    g = Graph("rows_train")
    x, t = g.input("x", (6, 10)), g.input("t", (6, 10))
    w = g.param("w", (10, 10), init=init.he_uniform())
    s = g.param("s", (10,), init=init.uniform(0.5, 1.5))
    h = ops.layer_norm(ops.rms_norm(x @ w, s), s, s)
    g.output(loss=ops.cross_entropy(ops.log_softmax(h) * 2.0 + ops.softmax(h), t))
    return g


def llama_graph():
    """A 1-layer llama training graph (tokens [2, 4], vocabulary 11, width 8, 2 heads)."""
    from jitgraph.models.llama import LlamaConfig, llama_forward
    cfg = LlamaConfig(vocab=11, dim=8, layers=1, heads=2, ff=16, ctx=8)
    return llama_forward(cfg, 2, 4, labels=True)


def batch(seed, B=8, D=12, C=5):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, D)).astype(np.float32), rng.integers(0, C, B).astype(np.int32)


@sim_only
def test_mlp_adamw_steps_match_the_cpu_target():
    """An MNIST-FC-like training step (GEMM + bias + ReLU epilogues, cross entropy with its
    gradient, bias-gradient sums, the fused AdamW update), several steps: outputs and params
    equal to the CPU target's within float tolerance."""
    opt = dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-2, weight_decay=0.1))
    cpu = jg.compile(mlp(), **opt)
    gpu = jg.compile(mlp(), target="cuda", **opt)
    assert gpu.stats()["device"] == "simulator"
    for k in cpu.params:
        np.testing.assert_array_equal(cpu.params[k], gpu.params[k])
    for s in range(3):
        x, y = batch(s)
        rc, rg = cpu.step(x=x, y=y), gpu.step(x=x, y=y)
        assert set(rc) == set(rg)
        for k in rc:
            np.testing.assert_allclose(rg[k], rc[k], rtol=1e-5, atol=1e-6, err_msg=f"step {s} {k}")
    for k in cpu.params:
        np.testing.assert_allclose(gpu.params[k], cpu.params[k], rtol=1e-5, atol=1e-6,
                                   err_msg=k)
        for m in ("m", "v"):
            np.testing.assert_allclose(gpu.state[f"opt/{m}/{k}"], cpu.state[f"opt/{m}/{k}"],
                                       rtol=1e-5, atol=1e-8)
    # the params moved (the update ran on the device), and the state is on the device too
    assert not np.allclose(gpu.params["fc1.weight"], jg.compile(mlp()).params["fc1.weight"])


@sim_only
def test_params_assigned_step_into_and_evaluator():
    """Params written from the host reach the device; step_into writes into the caller's
    arrays; the evaluator shares the device params."""
    g = mlp()
    cpu = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    gpu = jg.compile(g, target="cuda", loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    rng = np.random.default_rng(5)
    for k in cpu.params:
        v = rng.standard_normal(cpu.params[k].shape).astype(np.float32) * 0.3
        cpu.params[k] = v
        gpu.params[k] = v
    x, y = batch(7)
    out = {"logits": np.empty((8, 5), np.float32), "loss": np.empty((), np.float32)}
    rg = gpu.step_into(out, x=x, y=y)
    rc = cpu.step(x=x, y=y)
    assert rg["logits"] is out["logits"]
    np.testing.assert_allclose(out["logits"], rc["logits"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["loss"], rc["loss"], rtol=1e-5)
    ev_c, ev_g = cpu.evaluator(), gpu.evaluator()
    np.testing.assert_allclose(ev_g.run(x=x)["logits"], ev_c.run(x=x)["logits"], rtol=1e-5,
                               atol=1e-6)
    # int64 labels are converted on the host (the program's staging buffer), as on the CPU
    r64 = gpu.step(x=x, y=y.astype(np.int64))
    assert np.isfinite(r64["loss"])


def _forward_cases():
    """Forward graphs covering every kernel kind the CUDA backend lowers."""
    cases = []
    g = Graph("elementwise")
    a, b, s = g.input("a", (3, 4, 5)), g.input("b", (4, 1)), g.input("s", ())
    e = ops.tanh(a * b + s) - ops.exp(b) / (1.0 + ops.abs(a))
    g.output(e=e, r=ops.relu(e) * 2.0, s2=s * s + 1.0, w=ops.where(a, b, e))
    cases.append(g)
    g = Graph("reductions")
    a = g.input("a", (6, 7, 3))
    g.output(s0=ops.sum(a, (0,)), s1=ops.mean(a, (1,)), s=ops.sum(a), m=ops.max(a, 2),
             am=ops.argmax(a, 1), lse=ops.logsumexp(a, 2), sq=ops.sum(ops.exp(a) * a, (1, 2)))
    cases.append(g)
    for ta in (False, True):
        for tb in (False, True):
            g = Graph(f"matmul_{ta}_{tb}")
            x = g.input("x", (11, 9) if ta else (9, 11))
            w = g.input("w", (13, 11) if tb else (11, 13))
            g.output(y=ops.relu(ops.matmul(x, w, ta=ta, tb=tb) + 1.0))
            cases.append(g)
    g = Graph("rows")
    a, w, b = g.input("a", (5, 37)), g.input("w", (37,)), g.input("b", (5, 1))
    g.output(p=ops.softmax(a * 2.0 + b) * 3.0, l=ops.log_softmax(a), r=ops.rms_norm(a, w),
             n=ops.layer_norm(ops.tanh(a), w, w), q=ops.softmax(ops.exp(b) + a))
    cases.append(g)
    g = Graph("data_movement")
    a, i = g.input("a", (7, 3, 4)), g.input("i", (5,), "i32")
    m = g.input("m", (2, 3, 5, 5))
    g.output(p=ops.permute(a, (2, 0, 1)), r=ops.get_rows(a, i),
             c=ops.causal_mask(m, n_past=1), c0=ops.causal_mask(m * 2.0))
    cases.append(g)
    g = Graph("batched_matmul")
    x, w, v = g.input("x", (2, 3, 5, 4)), g.input("w", (3, 6, 4)), g.input("v", (2, 1, 5, 6))
    g.output(y=ops.matmul(x, w, tb=True), z=ops.matmul(x, v, ta=True))
    cases.append(g)
    g = Graph("cross_entropy")
    lg, y = g.input("lg", (6, 9)), g.input("y", (6,), "i32")
    t = g.input("t", (6, 9))
    g.output(l1=ops.cross_entropy(lg, y), l2=ops.cross_entropy(lg, t),
             c=ops.count_equal(ops.argmax(lg, -1), y))
    cases.append(g)
    g = Graph("shapes")
    a, b = g.input("a", (3, 4, 5)), g.input("b", (3, 2, 5))
    g.output(c1=ops.concat([a, b, a * 2.0], axis=1), c0=ops.concat([a, a], axis=0),
             s=ops.slice(a, (1, 3), (3, None, -2), (None, None, 2)),
             p=ops.pad(ops.exp(b), [(1, 0), (0, 2), (2, 1)], value=-1.5),
             h=ops.round_f16(a * 1000.0 + 0.3),
             sb=apply("slice_back", b, shape=(4, 3, 5), slices=((3, 0, -1), (1, 3, 1), (0, 5, 1))))
    cases.append(g)
    g = Graph("kv")
    kt, vt = g.input("kt", (2, 4, 6)), g.input("vt", (2, 4, 6))
    q, i, r = g.input("q", (3, 4, 4)), g.input("i", (3,), "i32"), g.input("r", (2, 4, 3))
    k2 = ops.set_rows(kt, i, r, axis=2)
    g.output(k2=k2, v2=ops.set_rows(vt, i, r * 3.0, axis=2, f16=True),
             o=ops.kv_attention(q, k2, vt, i), o16=ops.kv_attention(q, kt, vt, i, f16=True))
    cases.append(g)
    g = Graph("attention")
    q, k, v = g.input("q", (2, 5, 4, 3)), g.input("k", (2, 5, 2, 3)), g.input("v", (2, 5, 2, 3))
    o = ops.attention(q, k, v)
    g.output(o=o, back=apply("attention_back", q, k, v, o, g.input("go", (2, 5, 4, 3)),
                             scale=0.7))
    cases.append(g)
    return cases


def _feed(g, rng):
    out = {}
    for k, i in g.inputs.items():
        t = g.nodes[i].type
        if g.name == "kv" and k == "i":     # positions / cache rows, one repeated
            out[k] = np.array([4, 1, 4], np.int32)
        elif t.dtype == "i32":
            out[k] = rng.integers(0, 7, t.shape).astype(np.int32)   # rows of the tables
        elif k == "t":
            p = rng.random(t.shape).astype(np.float32)
            out[k] = p / p.sum(-1, keepdims=True)
        else:
            out[k] = rng.standard_normal(t.shape).astype(np.float32)
    return out


@sim_only
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_kernel_kinds_against_the_interpreter(fuse):
    rng = np.random.default_rng(1)
    for g in _forward_cases():
        feed = _feed(g, rng)
        want = interp(g, feed)
        got = jg.compile(g, target="cuda", fuse=fuse).step(**feed)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-5,
                                       err_msg=f"{g.name} {k} fuse={fuse}")


@sim_only
def test_an_op_without_a_cuda_lowering_is_a_compile_error(monkeypatch):
    from jitgraph.runtime.cuda import table
    monkeypatch.delitem(table.TABLE, "concat")      # as if concat had no lowering
    g = Graph("rows")
    a = g.input("a", (4, 6))
    g.output(p=ops.concat([a, a * 2.0], axis=0))
    with pytest.raises(NotImplementedError, match=r"op concat has no CUDA lowering.*node %"):
        jg.compile(g, target="cuda")
    monkeypatch.undo()
    g = Graph("rows0")
    a = g.input("a", (4, 6))
    g.output(p=ops.softmax(a, 0))
    with pytest.raises(NotImplementedError, match=r"op softmax .*another axis than the last"):
        jg.compile(g, target="cuda")
    # x converted as ggml's CPU dot does (jitgraph.dots): refused, not run as the exact dot
    from jitgraph.dots import ggml_dots
    g = Graph("xq")
    x = g.input("x", (1, 64))
    g.output(y=ops.matmul(x, g.param("w", (8, 64), "f16", trainable=False), tb=True))
    with pytest.raises(NotImplementedError, match=r"xq=f16.*--dot exact"):
        jg.compile(ggml_dots(g), target="cuda")


@sim_only
def test_row_ops_and_their_backward_train_as_on_the_cpu():
    """softmax, rms_norm and layer_norm with their backward row kernels inside a training step
    (SGD), equal to the CPU target."""
    graph = rows_graph
    opt = dict(loss="loss", optimizer=jg.optim.SGD(lr=0.5))
    cpu, gpu = jg.compile(graph(), **opt), jg.compile(graph(), target="cuda", **opt)
    rng = np.random.default_rng(3)
    for _ in range(2):
        x = rng.standard_normal((6, 10)).astype(np.float32)
        t = rng.random((6, 10)).astype(np.float32)
        t /= t.sum(-1, keepdims=True)
        np.testing.assert_allclose(gpu.step(x=x, t=t)["loss"], cpu.step(x=x, t=t)["loss"],
                                   rtol=1e-5)
    for k in cpu.params:
        np.testing.assert_allclose(gpu.params[k], cpu.params[k], rtol=1e-5, atol=1e-6)


@sim_only
def test_update_hook_sees_and_changes_the_device_gradients():
    """compile(hook=): the gradients are device views the hook may change in place; halving
    them there equals a CPU program whose hook halves them."""
    def halve(grads):
        for k in grads:
            grads[k][...] = np.asarray(grads[k]) * 0.5
    opt = dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-2), hook=halve)
    cpu, gpu = jg.compile(mlp(), **opt), jg.compile(mlp(), target="cuda", **opt)
    for s in range(2):
        x, y = batch(10 + s)
        np.testing.assert_allclose(gpu.step(x=x, y=y)["loss"], cpu.step(x=x, y=y)["loss"],
                                   rtol=1e-5)
    for k in cpu.params:
        np.testing.assert_allclose(gpu.params[k], cpu.params[k], rtol=1e-5, atol=1e-6)


@sim_only
def test_planned_bytes_beyond_free_device_memory_is_a_clear_error():
    from jitgraph.runtime.cuda.backend import CUDA
    from jitgraph.runtime.cuda.kernel import Generated

    class Ctx:
        def get_memory_info(self):
            return 1000, 4000

    be = CUDA()
    be.cuda = type("C", (), {"current_context": staticmethod(lambda: Ctx())})()
    gen = Generated({}, [], "", 0, plan_bytes={"arena": 800, "persist": 300, "outputs": 0})
    with pytest.raises(MemoryError, match=r"needs 1100 B of device memory.*1000 B free"):
        be._check_fits(gen)


@sim_only
def test_llama_training_steps_match_the_cpu_target():
    """A 1-layer llama (get_rows, rms_norm, rope, batched attention matmuls, causal mask,
    softmax, silu, cross entropy and their backward: get_rows_back scatter-adds, rope_back)
    trained with AdamW: loss and params equal to the CPU target's."""
    opt = dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-2))
    cpu = jg.compile(llama_graph(), **opt)
    gpu = jg.compile(llama_graph(), target="cuda", **opt)
    rng = np.random.default_rng(4)
    pos = np.arange(4, dtype=np.int32)
    for s in range(2):
        tok = rng.integers(0, 11, (2, 4)).astype(np.int32)
        lab = rng.integers(0, 11, (2, 4)).astype(np.int32)
        rc, rg = cpu.step(tokens=tok, pos=pos, labels=lab), gpu.step(tokens=tok, pos=pos,
                                                                      labels=lab)
        np.testing.assert_allclose(rg["loss"], rc["loss"], rtol=1e-5, err_msg=f"step {s}")
        np.testing.assert_allclose(rg["logits"], rc["logits"], rtol=1e-4, atol=1e-5)
    for k in cpu.params:
        np.testing.assert_allclose(gpu.params[k], cpu.params[k], rtol=1e-4, atol=1e-6, err_msg=k)


def cnn_graph():
    """A CNN block: conv2d (padding, stride), bias, ReLU, max and average pooling, dense."""
    g = Graph("cnn_small")
    x, y = g.input("x", (2, 2, 6, 6)), g.input("y", (2,), "i32")
    k = g.param("conv.kernel", (3, 2, 3, 3), init=init.he_uniform())
    b = g.param("conv.bias", (3, 1, 1), init=init.uniform(-0.1, 0.1))
    k2 = g.param("conv2.kernel", (2, 3, 2, 2), init=init.he_uniform())
    h = ops.max_pool2d(ops.relu(ops.conv2d(x, k, padding=1) + b), 2)          # [2, 3, 3, 3]
    h = ops.avg_pool2d(ops.conv2d(h, k2, stride=1, padding=1), 2, stride=1)    # [2, 2, 3, 3]
    w = g.param("dense.weight", (18, 4), init=init.he_uniform())
    g.output(loss=ops.cross_entropy(ops.reshape(h, (2, 18)) @ w, y))
    return g


@sim_only
def test_cnn_block_trains_as_on_the_cpu():
    """conv2d, its backward kernels (input and weight), max / average pooling and their
    backward, trained with SGD (AdamW would amplify the rounding of near-zero gradients;
    its update kernel is checked above): equal to the CPU target."""
    opt = dict(loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    cpu, gpu = jg.compile(cnn_graph(), **opt), jg.compile(cnn_graph(), target="cuda", **opt)
    rng = np.random.default_rng(6)
    # one step (the simulator's slowest test; a forward on updated device params is the MLP's)
    x = rng.standard_normal((2, 2, 6, 6)).astype(np.float32)
    y = rng.integers(0, 4, 2).astype(np.int32)
    np.testing.assert_allclose(gpu.step(x=x, y=y)["loss"], cpu.step(x=x, y=y)["loss"], rtol=1e-5)
    for k in cpu.params:
        np.testing.assert_allclose(gpu.params[k], cpu.params[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _same_params(progs, seed, scale=0.4):
    """The same random values (norms near 1) into each program's params."""
    rng = np.random.default_rng(seed)
    for k in progs[0].params:
        if k.startswith("cache/"):
            continue
        shape = progs[0].params[k].shape
        v = (1.0 + 0.1 * rng.standard_normal(shape) if k.endswith("norm.weight") else
             scale * rng.standard_normal(shape)).astype(np.float32)
        for p in progs:
            p.params[k] = v


def _steps_agree(cpu, gpu, rng, steps=2):
    """`steps` llama training steps on random tokens: the CUDA program's losses and params equal
    the CPU program's."""
    pos = np.arange(4, dtype=np.int32)
    for s in range(steps):
        tok = rng.integers(0, 11, (1, 4)).astype(np.int32)
        lab = rng.integers(0, 11, (1, 4)).astype(np.int32)
        rc = cpu.step(tokens=tok, pos=pos, labels=lab)
        rg = gpu.step(tokens=tok, pos=pos, labels=lab)
        np.testing.assert_allclose(rg["loss"], rc["loss"], rtol=1e-5, err_msg=f"step {s}")
    for k in cpu.params:
        np.testing.assert_allclose(gpu.params[k], cpu.params[k], rtol=1e-4, atol=1e-6,
                                   err_msg=k)


@sim_only
def test_partial_rope_llama_and_lora_steps_match_the_cpu_target():
    """A 1-layer llama with rope on part of each head (slice, concat, and their gradients)
    trained with AdamW, then a LoRA step on it (jg.lora: frozen weights, adapters
    on q and v): loss and params equal to the CPU target's."""
    from jitgraph.models.llama import LlamaConfig, llama_forward
    cfg = LlamaConfig(vocab=11, dim=8, layers=1, heads=2, ff=8, ctx=8, rope_dims=2)
    rng = np.random.default_rng(8)
    for graph in (lambda: llama_forward(cfg, 1, 4, labels=True),
                  lambda: jg.lora(llama_forward(cfg, 1, 4, labels=True), rank=2, alpha=4.0)):
        opt = dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-2))
        cpu, gpu = jg.compile(graph(), **opt), jg.compile(graph(), target="cuda", **opt)
        used = {getattr(n, "op", None) for n in cpu._products.graph.nodes}
        assert {"slice", "concat"} <= used, used
        _same_params([cpu, gpu], 9)
        _steps_agree(cpu, gpu, rng)


@sim_only
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_architecture_steps_match_the_cpu_target(arch):
    """jitgraph/models/arch.py's tables on the CUDA target: LLaMA 3.x rope_freqs (rope's
    frequency factors, forward and backward), qwen2's biases with NEOX rope, phi3's fused
    attn_qkv and ffn_up: AdamW steps give the CPU target's loss and params."""
    from jitgraph.models.llama import LlamaConfig, llama_forward
    cfg = LlamaConfig(vocab=11, dim=8, layers=1, heads=2, kv_heads=1, ff=8, ctx=8, arch=arch,
                      rope_freqs=arch == "llama", tied=arch != "phi3")
    rng = np.random.default_rng(3)
    opt = dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-2))
    cpu = jg.compile(llama_forward(cfg, 1, 4, labels=True), **opt)
    gpu = jg.compile(llama_forward(cfg, 1, 4, labels=True), target="cuda", **opt)
    _same_params([cpu, gpu], 4)
    for prog in (cpu, gpu):
        for k in prog.params:
            if k.endswith((".bias", "rope_freqs.weight")):     # not their zero / one inits
                prog.params[k] = np.random.default_rng(5).uniform(0.5, 4.0, prog.params[k].shape)
    _steps_agree(cpu, gpu, rng)


@sim_only
def test_decode_and_prefill_steps_match_the_cpu_target():
    """jitgraph/models/generate.py's programs: a prefill chunk and decode steps sharing the
    weights and the KV cache (compile(share=)), positions fed at run time (set_rows into the
    cache params in place, kv_attention over the filled rows, round_f16 with kv_f16): the
    logits of every call and the caches equal to the CPU target's."""
    from jitgraph.models.generate import llama_decoder
    from jitgraph.models.llama import LlamaConfig
    cfg = LlamaConfig(vocab=13, dim=8, layers=1, heads=2, kv_heads=1, ff=16, ctx=8)
    kv_f16 = True
    progs = {}
    for target in ("cpu", "cuda"):
        dec = jg.compile(llama_decoder(cfg, 1, 6, kv_f16), target=target, copy_outputs=False)
        pre = jg.compile(llama_decoder(cfg, 3, 6, kv_f16, last=True), target=target,
                         copy_outputs=False, share=dec)
        progs[target] = (dec, pre)
    _same_params([progs["cpu"][0], progs["cuda"][0]], 3)
    calls = [("pre", [5, 2, 9], [0, 1, 2], 2), ("dec", [7], [3], None), ("dec", [1], [4], None),
             ("pre", [4, 4, 0], [5, 6, 6], 0)]   # the last: one real token, padding at the
    for which, tok, pos, last in calls:            # scratch row (position ctx)
        feed = dict(tokens=np.array([tok], np.int32), pos=np.array(pos, np.int32))
        if last is not None:
            feed["last"] = np.array([last], np.int32)
        got = {t: np.array(progs[t][0 if which == "dec" else 1].step(**feed)["logits"])
               for t in progs}
        np.testing.assert_allclose(got["cuda"], got["cpu"], rtol=1e-4, atol=1e-5,
                                   err_msg=f"{which} at {pos}")
    dc, dg = progs["cpu"][0], progs["cuda"][0]
    for k in ("cache/k/0", "cache/v/0"):
        np.testing.assert_allclose(dg.params[k], dc.params[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert np.abs(dg.params["cache/k/0"][..., :7]).min(axis=(0, 1)).max() > 0   # rows written


@pytest.mark.skipif(SIM, reason="the simulator is on in this process")
def test_cli_target_cuda_without_a_gpu_is_a_usage_error():
    """`--target cuda` where no GPU is: exit status 2 and the cause, before compiling;
    `--device` without it: a usage error too."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = ("import sys; from jitgraph.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "dump", "mnist-fc", "--target", "cuda"],
                       env=env, capture_output=True, text=True, timeout=300)
    if r.returncode == 0:
        pytest.skip("a CUDA device is present here")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "jitgraph dump: error: target cuda: no CUDA GPU found" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", code, "dump", "mnist-fc", "--device", "1"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--device 1: only with --target cuda" in r.stderr, r.stderr


@sim_only
def test_cli_dump_compiles_for_the_cuda_target(capsys):
    """`jitgraph dump MODEL --target cuda` compiles with the CUDA backend (its launch listing);
    `--device 1` names the simulator's single device."""
    from jitgraph.cli import main
    assert main(["dump", "mnist-fc", "--batch-size", "4", "--target", "cuda", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# jitgraph CUDA step for graph") and "cuda.grid(1)" in out
    assert main(["dump", "mnist-fc", "--target", "cuda", "--device", "1", "--quiet"]) == 2
    assert "the CUDA simulator has device 0 only" in capsys.readouterr().err


@sim_only
def test_cuda_graph_replay_logic_with_the_recording_stand_in(monkeypatch):
    """JITGRAPH_CUDA_GRAPHS=record (runtime/cuda/graphs.py): the first step of each phase runs
    plainly, the next captures its launches once, every later step replays them; a program with
    an update hook has one graph per phase; the results stay the CPU target's. A capture that
    fails falls back to plain launches, saying why."""
    from jitgraph.runtime.cuda import graphs

    def halve(grads):
        for k in grads:
            grads[k][...] = np.asarray(grads[k]) * 0.5
    monkeypatch.setenv("JITGRAPH_CUDA_GRAPHS", "record")
    opt = dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-2), hook=halve)
    cpu, gpu = jg.compile(mlp(), **opt), jg.compile(mlp(), target="cuda", **opt)
    plain = jg.compile(mlp(), target="cuda", loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    drv = gpu._products.driver
    assert gpu.stats()["cuda_graphs"] == "record"
    for s in range(3):
        x, y = batch(20 + s)
        np.testing.assert_allclose(gpu.step(x=x, y=y)["loss"], cpu.step(x=x, y=y)["loss"],
                                   rtol=1e-5, err_msg=f"step {s}")
    assert drv.graph_stats == {"mode": "record", "captures": 2, "replays": 4, "fallback": None}
    for k in cpu.params:
        np.testing.assert_allclose(gpu.params[k], cpu.params[k], rtol=1e-5, atol=1e-6)
    # a new arena binding (another buffer behind an output) is captured again
    out = {"logits": np.empty((8, 5), np.float32)}
    drv._key = None
    gpu.step_into(out, x=x, y=y)
    assert drv.graph_stats["captures"] == 4
    # a capture the driver refuses: plain launches from then on, the reason kept
    def refuse(self, stream, issue):
        raise RuntimeError("capture refused")
    monkeypatch.setattr(graphs.Recorder, "capture", refuse)
    ref = jg.compile(mlp(), loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    for s in range(3):
        x, y = batch(30 + s)
        np.testing.assert_allclose(plain.step(x=x, y=y)["loss"], ref.step(x=x, y=y)["loss"],
                                   rtol=1e-5)
    st = plain._products.driver.graph_stats
    assert st["fallback"] == "RuntimeError: capture refused" and st["replays"] == 0
    monkeypatch.setenv("JITGRAPH_CUDA_GRAPHS", "0")
    assert jg.compile(mlp(), target="cuda").stats()["cuda_graphs"] == "plain"
    monkeypatch.setenv("JITGRAPH_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="JITGRAPH_CUDA_GRAPHS='yes': expected 0, 1 or record"):
        jg.compile(mlp(), target="cuda")


@sim_only
def test_gemm_library_seam_runs_every_marked_gemm(monkeypatch):
    """runtime/cuda/gemm.py: every non-batched GEMM launch carries a GemmSpec the driver hands
    to a library in place of the numba kernel. A numpy stand-in for nvmath's Matmul, reading
    only the spec and the launch's arrays, gives the CPU target's training steps (so the spec
    says what the kernel computes); the simulator itself picks the numba kernels."""
    from jitgraph.runtime.cuda import gemm
    assert jg.compile(mlp(), target="cuda").stats()["gemm_library"].startswith("numba tiled")
    calls = []

    class HostGemm:
        def __init__(self, spec, stream):
            self.spec = spec

        def __call__(self, a, b, c):
            s = self.spec
            x, w = a.copy_to_host(), b.copy_to_host()
            x, w = (x.T if s.ta else x), (w.T if s.tb else w)
            assert x.shape == (s.M, s.K) and w.shape == (s.K, s.N) and c.shape == (s.M, s.N)
            c.copy_to_device(np.ascontiguousarray(x @ w, dtype=c.dtype))
            calls.append(s)
    monkeypatch.setattr(gemm, "library", lambda simulator: "nvmath")
    monkeypatch.setattr(gemm, "NvmathGemm", HostGemm)
    opt = dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-2))
    cpu, gpu = jg.compile(mlp(), **opt), jg.compile(mlp(), target="cuda", **opt)
    assert gpu.stats()["gemm_library"] == "cuBLASLt (nvmath-python Matmul)"
    for s in range(2):
        x, y = batch(40 + s)
        np.testing.assert_allclose(gpu.step(x=x, y=y)["loss"], cpu.step(x=x, y=y)["loss"],
                                   rtol=1e-5)
    for k in cpu.params:
        np.testing.assert_allclose(gpu.params[k], cpu.params[k], rtol=1e-5, atol=1e-6)
    # forward 2 GEMMs, backward 3 (no input gradient for x): all through the stand-in
    assert len(calls) == 2 * 5 and {(c.ta, c.tb) for c in calls} >= {(False, False)}
    monkeypatch.undo()
    monkeypatch.setenv("JITGRAPH_CUDA_GEMM", "cublas")
    with pytest.raises(ValueError, match="JITGRAPH_CUDA_GEMM='cublas': expected auto, numba"):
        jg.compile(mlp(), target="cuda")

"""Half types (f16, bf16) on the CUDA target (runtime/cuda: halfconv.py, spelling.py): casts
against jitgraph/half.py's reference bit for bit, elementwise, row and reduction kernels over
half values against the numpy interpreter, GEMMs with half operands, mixed-precision training
(precision="bf16" / "f16" with loss scaling) against the CPU target, sround_bf16 against its
numpy reference and a bf16-master, bf16-moments step equal to the CPU's bit for bit; and the
same programs' kernels compiled to sm_90 PTX and assembled.

As tests/test_cuda_sim.py: the simulator tests run in a subprocess of their own with
NUMBA_ENABLE_CUDASIM=1 (test_simulator_suite), the PTX tests in the main run; everything skips
without numba-cuda (`pip install -e '.[cuda]'`). Shapes are small: the simulator runs every
thread as a Python thread."""
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import init, ops
from jitgraph.half import round_to, to_f32
from jitgraph.interp import run as interp
from jitgraph.ir import Graph
from jitgraph.ops.common import apply
from jitgraph.ops.update import sround_bf16_bits
from jitgraph.optim import LossScale

HAVE = importlib.util.find_spec("numba_cuda") is not None
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
pytestmark = pytest.mark.skipif(not HAVE, reason="numba-cuda not installed "
                                "(pip install -e '.[cuda]')")
if SIM:
    sys.setswitchinterval(1e-5)      # the simulator's block loop polls its threads (faster)
sim_only = pytest.mark.skipif(not SIM, reason="runs in the simulator subprocess of "
                              "test_simulator_suite (NUMBA_ENABLE_CUDASIM=1)")
ptx_only = pytest.mark.skipif(SIM, reason="the CUDA simulator has no PTX compiler")
EPS = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11}     # unit roundoff


@pytest.mark.slow
@pytest.mark.skipif(SIM, reason="this is the subprocess")
def test_simulator_suite():
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_sim import run_simulator_suite
    run_simulator_suite(Path(__file__))


def bits(a):
    """A half array's 16 bits (f16: float16, bf16: uint16), a float32 array's 32."""
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def special_values():
    """float32 values exercising every rounding case of both half types: signed zeros, inf,
    NaNs (quiet, signalling, with payloads), f32 and half subnormals, the largest finite
    values and their overflow boundaries, and exact ties (to even, down and up)."""
    u = np.array([
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,     # zeros, infinities
        0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FA5A5A5,     # NaNs: quiet, payloads, signalling
        0x00000001, 0x807FFFFF, 0x00400000,                 # f32 subnormals
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,     # bf16: ties down / up, off-tie
        0x7F7FFFFF, 0x7F7F8000, 0xFF7F7FFF,                 # bf16: overflow to inf, largest
        0x3F801000, 0x3F803000, 0x3F801001,                 # f16: ties to even, off-tie
        0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000,     # f16: 65504, near and at overflow
        0x33800000, 0x33000000, 0x33000001, 0x387FC000,     # f16: smallest subnormal, ties
        0x38800000, 0x38000000, 0x337FFFFF,                 # f16: smallest normal, subnormals
    ], np.uint32).view(np.float32)
    rng = np.random.default_rng(3)
    r = (rng.standard_normal(27) * 10.0 ** rng.uniform(-9, 6, 27)).astype(np.float32)
    return np.concatenate([u, r])


@sim_only
def test_casts_match_the_reference_bit_for_bit():
    """cast f32 -> f16 / bf16, back, between the half types, and f64 -> half (rounded to f32
    first): the CUDA kernels' bits equal jitgraph/half.py's round_to / to_f32."""
    xs = special_values()
    g = Graph("casts")
    x, d = g.input("x", xs.shape), g.input("d", xs.shape, "f64")
    b, h = ops.cast(x, "bf16"), ops.cast(x, "f16")
    g.output(b=b, h=h, b32=ops.cast(b, "f32"), h32=ops.cast(h, "f32"), hb=ops.cast(h, "bf16"),
             bh=ops.cast(b, "f16"), db=ops.cast(d, "bf16"), dh=ops.cast(d, "f16"),
             b64=ops.cast(b, "f64"))
    prog = jg.compile(g, target="cuda")
    with np.errstate(invalid="ignore"):      # not f32 values: the casts round them to f32 first
        d64 = xs.astype(np.float64) * (1.0 + 2.0 ** -30)
    got = prog.step(x=xs, d=d64)
    rb, rh = round_to(xs, "bf16"), round_to(xs, "f16")
    want = {"b": rb, "h": rh, "b32": to_f32(rb, "bf16"), "h32": to_f32(rh, "f16"),
            "hb": round_to(to_f32(rh, "f16"), "bf16"), "bh": round_to(to_f32(rb, "bf16"), "f16"),
            "db": round_to(d64.astype(np.float32), "bf16"),
            "dh": round_to(d64.astype(np.float32), "f16"),
            "b64": to_f32(rb, "bf16").astype(np.float64)}
    for k, w in want.items():
        assert got[k].dtype == w.dtype, k
        np.testing.assert_array_equal(bits(got[k]), bits(w), err_msg=k)
    # the reference's own cases: ties to even, NaN stays NaN, overflow to inf
    v = to_f32(got["b"], "bf16")
    assert v[11] == 1.0 and v[12] == np.float32(1.015625) and np.all(np.isnan(v[4:8]))
    assert to_f32(got["b"], "bf16")[15] == np.inf and np.isinf(got["h"][23])
    # the interpreter (the graph's reference) agrees
    ref = interp(g, {"x": xs, "d": d64})
    for k in want:
        np.testing.assert_array_equal(bits(got[k]), bits(np.asarray(ref[k], want[k].dtype)),
                                      err_msg=k)


def _half_ops(dt):
    """Elementwise (with broadcast and a scalar), row and reduction ops over `dt` values, and
    a half GEMM (the half pass runs them in f32 between casts, fused into the kernels)."""
    g = Graph(f"half_ops_{dt}")
    a, b = g.input("a", (5, 12), dt), g.input("b", (12,), dt)
    s, w = g.input("s", (), dt), g.input("w", (12, 7), dt)
    e = ops.tanh(a * b + s) - ops.exp(b) / (1.0 + ops.abs(a))
    g.output(e=e, r=ops.relu(e) * 2.0, sm=ops.softmax(a * 2.0),
             rn=ops.rms_norm(a, b), ln=ops.layer_norm(e, b, b), ls=ops.log_softmax(a),
             su=ops.sum(a * a, (1,)), mx=ops.max(e, 0), mm=ops.matmul(e, w) + 1.0,
             s2=s * s + 1.0)
    return g


def _feed_half(g, dt, seed):
    rng = np.random.default_rng(seed)
    return {k: round_to(rng.standard_normal(g.nodes[i].type.shape).astype(np.float32), dt)
            for k, i in g.inputs.items()}


@sim_only
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_half_elementwise_row_and_reduction_ops_match_the_interpreter(dt):
    """Every output within one unit in the last place of the half type of the interpreter's
    (it rounds its f32 result; the kernels' f32 math may differ in f32's last bit, which can
    move a rounding), and most outputs equal to it bit for bit."""
    g = _half_ops(dt)
    feed = _feed_half(g, dt, 1)
    got = jg.compile(g, target="cuda").step(**feed)
    ref = interp(g, feed)
    same = total = 0
    for k, r in ref.items():
        r = np.asarray(r)
        t = g.nodes[g.outputs[k]].type
        assert got[k].dtype == t.np_dtype and got[k].shape == t.shape, k
        gv, rv = to_f32(got[k], dt), to_f32(r, dt)
        np.testing.assert_allclose(gv, rv, rtol=2 * EPS[dt], atol=1e-6, err_msg=k)
        same += int(np.sum(bits(got[k]) == bits(r)))
        total += r.size
    assert same >= 0.9 * total, f"{same} of {total} equal"


@sim_only
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_half_data_movement_matches_the_interpreter_bit_for_bit(dt):
    """Ops that move half values (permute, concat, slice, slice_back's zeros, causal_mask's and
    pad's fill values, odd byte counts) and get_rows reading a half table as f32 rows."""
    g = Graph(f"moves_{dt}")
    a, m = g.input("a", (3, 2, 5), dt), g.input("m", (2, 3, 5, 5), dt)
    i = g.input("i", (4,), "i32")
    g.output(sb=apply("slice_back", a, shape=(4, 2, 5),
                      slices=((3, 0, -1), (0, 2, 1), (0, 5, 1))),
             p=ops.permute(a, (2, 0, 1)), c=ops.concat([a, a], axis=1),
             s=ops.slice(a, (0, 3), (1, None), (None, None, 2)), cm=ops.causal_mask(m),
             pd=ops.pad(a, [(1, 0), (0, 1), (0, 0)], value=-1.5),
             gr=ops.get_rows(ops.reshape(a, (3, 10)), i))
    feed = _feed_half(g, dt, 2)
    feed["i"] = np.array([0, 2, 1, 2], np.int32)
    got = jg.compile(g, target="cuda").step(**feed)
    for k, r in interp(g, feed).items():
        assert got[k].dtype == g.nodes[g.outputs[k]].type.np_dtype, k
        np.testing.assert_array_equal(bits(got[k]), bits(np.asarray(r, got[k].dtype)), err_msg=k)


def mlp(B=8, D=12, H=16, C=5):
    g = Graph("mlp_half")
    x = g.input("x", (B, D))
    y = g.input("y", (B,), "i32")
    w1 = g.param("w1", (D, H), init=init.he_uniform())
    b1 = g.param("b1", (H,), init=init.uniform(-0.1, 0.1))
    w2 = g.param("w2", (H, C), init=init.he_uniform())
    h = ops.rms_norm(ops.relu(x @ w1 + b1), b1)
    g.output(loss=ops.cross_entropy(h @ w2, y))
    return g


def batch(seed, B=8, D=12, C=5):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, D)).astype(np.float32), rng.integers(0, C, B).astype(np.int32)


@sim_only
@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_mixed_precision_mlp_steps_match_the_cpu_target(precision):
    """precision="bf16" / "f16" (f16: dynamic loss scaling, from a scale so large the first
    step overflows f16 and is skipped): the same steps applied and skipped, losses and params
    as the CPU target's within the half type's rounding (both run the GEMMs in f32 over half
    operands, summing in other orders)."""
    ls = dict(loss_scale=LossScale(init=2.0 ** 20, interval=2)) if precision == "f16" else {}
    opt = dict(loss="loss", optimizer=jg.optim.AdamW(lr=1e-2), precision=precision, **ls)
    cpu, gpu = jg.compile(mlp(), **opt), jg.compile(mlp(), target="cuda", **opt)
    for k in cpu.params:
        np.testing.assert_array_equal(cpu.params[k], gpu.params[k])
    skips = []
    for s in range(6):
        x, y = batch(s)
        lc, lg = float(cpu.step(x=x, y=y)["loss"]), float(gpu.step(x=x, y=y)["loss"])
        assert gpu.last_skipped == cpu.last_skipped, f"step {s}"
        skips.append(gpu.last_skipped)
        if not gpu.last_skipped:
            np.testing.assert_allclose(lg, lc, rtol=8 * EPS[precision], err_msg=f"step {s}")
    if precision == "f16":
        assert skips[0] and not all(skips) and gpu.scaler.scale == cpu.scaler.scale
        assert gpu.skipped == cpu.skipped
    for k in cpu.params:
        np.testing.assert_allclose(gpu.params[k], cpu.params[k], rtol=0, atol=1e-3, err_msg=k)
    f32 = jg.compile(mlp())
    assert not np.allclose(gpu.params["w1"], f32.params["w1"])      # it trained


@sim_only
def test_bf16_llama_step_with_bf16_master_and_moments_matches_the_cpu_target():
    """A 1-layer llama (tests/test_cuda_sim.py llama_graph: get_rows, rope, batched attention
    GEMMs, softmax and their backward) with precision="bf16", bf16 master weights and bf16
    moments: a step's loss and the bf16 params as the CPU target's, within bf16's rounding
    (the GEMMs sum in other orders; a weight's stochastic rounding may then go the other way:
    one bf16 step)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_sim import llama_graph
    opt = dict(loss="loss", precision="bf16",
               optimizer=jg.optim.AdamW(lr=1e-2, master="bf16", moments="bf16"))
    cpu, gpu = jg.compile(llama_graph(), **opt), jg.compile(llama_graph(), target="cuda", **opt)
    rng = np.random.default_rng(4)
    pos = np.arange(4, dtype=np.int32)
    for s in range(1):      # one step: the simulator takes minutes over a llama step
        tok, lab = (rng.integers(0, 11, (2, 4)).astype(np.int32) for _ in range(2))
        lc = float(cpu.step(tokens=tok, pos=pos, labels=lab)["loss"])
        lg = float(gpu.step(tokens=tok, pos=pos, labels=lab)["loss"])
        np.testing.assert_allclose(lg, lc, rtol=4 * EPS["bf16"], err_msg=f"step {s}")
    for k in cpu.params:
        c, d = (to_f32(v, "bf16") if v.dtype == np.uint16 else v
                for v in (cpu.params[k], gpu.params[k]))
        np.testing.assert_allclose(d, c, rtol=2 * 2 * EPS["bf16"], atol=1e-3, err_msg=k)


@sim_only
def test_sround_bf16_matches_its_reference_bit_for_bit():
    x = special_values()
    x = np.concatenate([x, np.random.default_rng(4).standard_normal(40).astype(np.float32)])
    g = Graph("sround")
    xi, t = g.input("x", x.shape), g.input("t", ())
    g.output(r=apply("sround_bf16", xi, t, seed=5, salt=3_000_000_011))
    prog = jg.compile(g, target="cuda")
    for step in (1, 7, 123456):
        got = prog.step(x=x, t=np.float32(step))["r"]
        np.testing.assert_array_equal(got, sround_bf16_bits(x, step, 5, 3_000_000_011))


@sim_only
def test_bf16_master_and_moments_step_equals_the_cpu_bit_for_bit():
    """AdamW with bf16 master weights and bf16 moments: loss = sum(w * x) has the gradient x
    exactly (no summation order), so the update's elementwise f32 arithmetic and its
    roundings (stochastic for the weights, to nearest for the moments) give the CPU's bits."""
    g = Graph("master")
    x = g.input("x", (9, 7))
    w = g.param("w", (9, 7), init=init.uniform(-1.0, 1.0))
    v = g.param("v", (7,), init=init.uniform(-1.0, 1.0))
    g.output(loss=ops.sum(w * x) + ops.sum(v * v))
    opt = dict(loss="loss", optimizer=jg.optim.AdamW(lr=0.05, master="bf16", moments="bf16",
                                                     seed=9))
    cpu, gpu = jg.compile(g, **opt), jg.compile(g, target="cuda", **opt)
    assert np.asarray(gpu.state["opt/m/w"]).dtype == np.uint16       # bf16 moments' bits
    rng = np.random.default_rng(2)
    for s in range(3):
        xs = rng.standard_normal((9, 7)).astype(np.float32)
        cpu.step(x=xs)
        gpu.step(x=xs)
        for k in ("w", "v"):
            np.testing.assert_array_equal(gpu.params[k], cpu.params[k], err_msg=f"{s} {k}")
        for k in cpu.state:
            np.testing.assert_array_equal(np.asarray(gpu.state[k]), np.asarray(cpu.state[k]),
                                          err_msg=f"step {s} {k}")


@sim_only
def test_storage_types_stay_a_clear_error():
    g = Graph("q")
    x = g.input("x", (2, 32))
    w = g.param("w", (4, 32), "q8_0", trainable=False)
    g.output(y=ops.matmul(x, w, tb=True))
    with pytest.raises(NotImplementedError, match="storage types.*q8_0"):
        jg.compile(g, target="cuda")


# ---- sm_90 PTX ----------------------------------------------------------------------------
def _ptx():
    sys.path.insert(0, str(Path(__file__).parent))
    import test_cuda_ptx
    return test_cuda_ptx


@ptx_only
@pytest.mark.slow
def test_half_kernels_assemble_for_sm90(tmp_path):
    """The casts, the half ops' kernels, sround_bf16 and a bf16-master, bf16-moments,
    precision="bf16" / "f16" training program compile to sm_90 PTX and assemble without
    spills; f16 converts by cvt.rn.f16.f32 / cvt.f32.f16, bf16 by integer arithmetic on the
    float's bits (no float16 instruction)."""
    t = _ptx()
    xs = special_values()
    g = Graph("casts")
    x = g.input("x", xs.shape)
    g.output(b=ops.cast(x, "bf16"), h=ops.cast(x, "f16"),
             r=apply("sround_bf16", x, g.input("t", ()), seed=1, salt=2))
    progs = [("casts", g, {}), ("half_ops_bf16", _half_ops("bf16"), {}),
             ("half_ops_f16", _half_ops("f16"), {})]
    for prec in ("bf16", "f16"):
        progs.append((f"mlp_{prec}", mlp(64, 64, 128, 10),
                      dict(loss="loss", precision=prec,
                           optimizer=jg.optim.AdamW(lr=1e-3, master="bf16", moments="bf16"))))
    progs.append(("llama_bf16", t.sim_graph("llama_graph"),
                  dict(loss="loss", precision="bf16",
                       optimizer=jg.optim.AdamW(lr=1e-3, master="bf16", moments="bf16"))))
    for title, graph, opts in progs:
        gen = t.generated(graph, **opts)
        res = t.compile_all(gen, tmp_path)
        t.report(title, gen, res)
        assert len(res) == len(gen.kernels)
        assert not {k: s for k, (_, s, _) in res.items() if s}, f"{title}: spills"
        ptx = "\n".join(gen.ptx.values())
        if title in ("casts", "half_ops_f16", "mlp_f16"):
            assert "cvt.rn.f16.f32" in ptx, title
        if title in ("half_ops_bf16", "mlp_bf16", "llama_bf16"):          # integer arithmetic on the bits
            assert "cvt.rn.f16" not in ptx and ".bf16" not in ptx, title


@pytest.mark.skipif(SIM, reason="no device needed: the main run")
@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_half_gemms_name_their_half_operands_for_the_library_hook(precision):
    """precision="bf16" / "f16": every GEMM launch a library may run names the half values its
    prologue converted (GemmSpec.half, what runtime/cuda/gemm.py half_operands would read), and
    the hook declines (None): the f32 path runs."""
    from jitgraph.runtime.cuda import gemm
    gen = _ptx().generated(mlp(), loss="loss", optimizer=jg.optim.SGD(lr=0.1),
                           precision=precision)
    specs = [ln.gemm for ln in gen.launches if ln.gemm is not None]
    assert len(specs) >= 3              # forward and backward GEMMs
    assert all(s.half is not None and s.half[0] == precision for s in specs)
    assert gemm.half_operands(specs[0], None) is None
    f32 = _ptx().generated(mlp(), loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    assert all(ln.gemm.half is None for ln in f32.launches if ln.gemm is not None)

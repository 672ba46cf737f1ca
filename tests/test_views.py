"""Contiguous slices as views (passes/views.py, the "window" op): which slices qualify, the op
against numpy and finite differences, and compiled programs reading windows against the
interpreter, with the memory plan checked (conftest: JITGRAPH_CHECK_PLANS=1)."""
import itertools

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp, ops
from jitgraph.ops.common import apply
from jitgraph.passes.memory_check import check_plan
from jitgraph.passes.views import contiguous_run, window_slices
from jitgraph.testing import check_grad
from jitgraph.types import ShapeError


def _slices(d):
    """Every normalised (start, stop, step) of an axis of size d with step 1, 2 or -1."""
    out = [(s, e, 1) for s in range(d + 1) for e in range(s, d + 1)]
    out += [(s, e, 2) for s in range(d) for e in range(s + 1, d + 1)]
    out += [(s, e, -1) for s in range(d) for e in range(-1, s)]
    return out


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 2)])
def test_contiguous_run_against_numpy(shape):
    """contiguous_run gives an offset exactly when numpy's slice of arange is one run of
    consecutive elements starting there (every slice of these shapes; empty slices: none)."""
    x = np.arange(int(np.prod(shape))).reshape(shape)
    for sl in itertools.product(*(_slices(d) for d in shape)):
        got = x[tuple(slice(s, None if e < 0 else e, st) for s, e, st in sl)].ravel()
        run = got.size > 0 and np.array_equal(got, np.arange(got[0], got[0] + got.size))
        off = contiguous_run(shape, sl)
        assert (off is not None) == run, (shape, sl, got)
        if run:
            assert off == got[0], (shape, sl)


def test_window_op_reference_errors_and_gradient():
    g = jg.Graph("w")
    x = g.param("x", (3, 4), "f64")
    g.output(y=apply("window", x * 2.0, offset=5, shape=(2, 3)))
    xv = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(interp.run(g, {}, {"x": xv})["y"],
                                  (2 * xv).ravel()[5:11].reshape(2, 3))
    res = check_grad(g, {}, {"x": xv})
    assert res.errors["x"][2] > 0
    with pytest.raises(ShapeError, match=r"window of \[2, 4\] \(8 elements\) at element 5 of"):
        apply("window", x, offset=5, shape=(2, 4))


def graph(dt="f32"):
    """Slices of a computed value: two contiguous (rows 1..3 of a matrix, a flat range), one
    strided, one of an input, one that is an output; an elementwise op on a window at an
    offset whose base dies there (it must not take the base's buffer in place)."""
    g = jg.Graph("views")
    x = g.input("x", (4, 6), dt)
    w = g.param("w", (6, 6), dt)
    h = ops.matmul(x, w) * 1.5                                   # computed: [4, 6]
    rows = ops.slice(h, (1, 3))                               # contiguous: rows 1, 2
    flat = ops.slice(ops.reshape(h, (24,)), (7, 19))          # contiguous: elements 7..18
    odd = apply("slice", h, slices=((0, 4, 1), (1, 6, 2)))      # strided: stays a copy
    of_input = ops.slice(x, (2, 4))                           # an input: stays a copy
    g.output(a=ops.sum(ops.matmul(rows, w)) + ops.sum(odd) + ops.sum(of_input),
             b=flat * 2.0 + 1.0,
             c=ops.slice(h * 3.0, (0, 2)))                    # an output: stays a copy
    return g


def feeds(dt="f32"):
    rng = np.random.default_rng(0)
    t = np.float32 if dt == "f32" else np.float64
    return {"x": rng.standard_normal((4, 6)).astype(t)}, \
        {"w": rng.standard_normal((6, 6)).astype(t)}


def test_the_pass_makes_contiguous_internal_slices_windows():
    g = graph()
    g2, rep = window_slices(g)
    assert rep.stats["windows"] == 2
    ops_after = [n.op for n in g2.nodes]
    assert ops_after.count("window") == 2 and ops_after.count("slice") == 3
    offs = sorted(n.attr["offset"] for n in g2.nodes if n.op == "window")
    assert offs == [6, 7]                             # row 1 of [4, 6]; element 7
    from jitgraph.runtime.cuda.backend import KINDS
    g3, rep3 = window_slices(g, KINDS)                # CUDA keeps its slice kernels
    assert g3 is g and rep3.stats["windows"] == 0


@pytest.mark.parametrize("dt", ["f32", "f64"])
@pytest.mark.parametrize("plan_memory", [True, False])
def test_compiled_windows_equal_the_interpreter(dt, plan_memory):
    """Kernels read windows at their offsets (a GEMM, an elementwise kernel whose window's
    base dies there); the plan passes the independent checker, and each window's slot is its
    range of its base's slot."""
    x, p = feeds(dt)
    g = graph(dt)
    ref = interp.run(g, x, p)
    prog = jg.compile(g, plan_memory=plan_memory)
    for k, v in p.items():
        prog.params[k] = v
    out = prog.run(**x)
    tol = 1e-5 if dt == "f32" else 1e-12
    for k in ("a", "b", "c"):
        np.testing.assert_allclose(out[k], ref[k], rtol=tol, atol=tol)
    pr = prog._products
    pg = pr.graph
    wins = [n for n in pg.nodes if n.op == "window"]
    assert len(wins) == 2
    kinds = [pg.nodes[k.root].op for k in pr.kernels.kernels]
    assert kinds.count("slice") == 3
    check_plan(pr.kernels, pr.memory)
    for n in wins:
        s, b = pr.memory.slots[n.id], pr.memory.slots[n.inputs[0]]
        assert s.offset == b.offset + n.attr["offset"] * n.type.np_dtype.itemsize
        assert s.region == b.region and s.nbytes == n.type.nbytes


def test_the_checker_rejects_a_window_at_the_wrong_offset():
    from dataclasses import replace
    prog = jg.compile(graph())
    pr = prog._products
    win = next(n for n in pr.graph.nodes if n.op == "window")
    slots = dict(pr.memory.slots)
    slots[win.id] = replace(slots[win.id], offset=slots[win.id].offset - 4)
    with pytest.raises(AssertionError, match="is not its range of its operand's slot"):
        check_plan(pr.kernels, replace(pr.memory, slots=slots))


def test_training_through_windows_equals_the_interpreter():
    """Gradients flow through slices of a computed value (concat's backward slices too) in a
    compiled SGD step, as the interpreter computes them."""
    g = jg.Graph("train")
    x = g.input("x", (8, 6), "f32")
    w = g.param("w", (6, 12), "f32")
    h = ops.matmul(x, w)
    top, bottom = ops.slice(h, (0, 4)), ops.slice(h, (4, 8))
    y = ops.concat([ops.tanh(top), bottom * bottom], axis=0)
    g.output(loss=ops.mean(y * y))
    rng = np.random.default_rng(1)
    xv = rng.standard_normal((8, 6)).astype(np.float32)
    wv = rng.standard_normal((6, 12)).astype(np.float32) * 0.3
    ref = interp.run(jg.grad(g, "loss"), {"x": xv}, {"w": wv})
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    prog.params["w"] = wv
    loss = prog.step(x=xv)["loss"]
    np.testing.assert_allclose(loss, ref["loss"], rtol=1e-6)
    np.testing.assert_allclose(prog.params["w"], wv - 0.1 * ref["grad/w"], rtol=1e-5, atol=1e-6)
    assert sum(n.op == "window" for n in prog._products.graph.nodes) >= 2


def test_a_window_output_writes_only_its_range_into_the_callers_array():
    """An output that is a window of a computed value is copied out of it: step_into writes
    the window's elements into the caller's array and nothing past it (the value itself stays
    in the arena, not in the caller's buffer)."""
    g = jg.Graph("wout")
    a = g.input("a", (4, 5), "f32")
    g.output(y=apply("window", a * 3.0, offset=4, shape=(2, 3)))
    prog = jg.compile(g)
    av = np.arange(20, dtype=np.float32).reshape(4, 5)
    buf = np.full((3, 3), -1.0, np.float32)
    prog.step_into({"y": buf[:2]}, a=av)
    np.testing.assert_array_equal(buf[:2], (3 * av).ravel()[4:10].reshape(2, 3))
    assert (buf[2] == -1).all()
    np.testing.assert_array_equal(prog.run(a=av)["y"], (3 * av).ravel()[4:10].reshape(2, 3))

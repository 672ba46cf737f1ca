"""The CPU driver (runtime/cpu/codegen.py, runtime/cpu/backend.Driver): LLVM IR calling the kernels
in order, compiled by llvmlite without numba, so its build does not grow with the program's
length; a deep program of identical layers compiles no numba function at all once its layer's
kernels are loaded, and computes what the interpreter computes."""
import numpy as np
import pytest
from numba.core import compiler

import jitgraph as jg

RTOL, ATOL = 2e-4, 2e-5


def deep(layers, width=6, batch=4):
    g = jg.Graph(f"deep{layers}")
    x = g.input("x", (batch, width))
    y = g.input("y", (batch, width))
    h = x
    for i in range(layers):
        w = g.param(f"w{i}", (width, width), init=jg.init.normal(0.0, 0.4))
        b = g.param(f"b{i}", (width,), init=jg.init.normal(0.0, 0.1))
        h = jg.tanh(h @ w + b) + h
    g.output(loss=jg.mean(jg.sqr(h - y)), h=h)
    return g


def batches(g, n):
    rng = np.random.default_rng(1)
    return [{k: rng.standard_normal(g.nodes[i].type.shape).astype(np.float32)
             for k, i in g.inputs.items()} for _ in range(n)]


def numba_compiles(fn, monkeypatch):
    """(fn's result, the names of the functions numba compiled while it ran: @njit and cfunc
    compiles all go through numba.core.compiler.compile_extra)."""
    seen, real = [], compiler.compile_extra

    def counting(typingctx, targetctx, func, *args, **kw):
        seen.append(getattr(func, "__qualname__", repr(func)))
        return real(typingctx, targetctx, func, *args, **kw)
    with monkeypatch.context() as m:
        m.setattr(compiler, "compile_extra", counting)
        out = fn()
    return out, seen


def train_and_compare(prog, g, opt, steps=3):
    tg = jg.training_graph(g, loss="loss", optimizer=opt)
    state = tg.init_params(0)
    for i, b in enumerate(batches(g, steps)):
        got = prog.step(**b)
        ref = jg.interp.run(tg, {**b, **opt.runtime_inputs(i)}, state)
        for k in g.outputs:
            np.testing.assert_allclose(got[k], ref[k], rtol=RTOL, atol=ATOL, err_msg=f"{i} {k}")
        for k in prog.params:
            np.testing.assert_allclose(prog.params[k], state[k], rtol=RTOL, atol=ATOL,
                                       err_msg=f"step {i} param {k}")


@pytest.mark.parametrize("hook", [False, True], ids=["one call", "two phases"])
def test_deep_program_driver_compiles_no_numba_function_and_matches_interpreter(hook,
                                                                               monkeypatch):
    opt = jg.optim.SGD(lr=0.05)
    kw = {"hook": lambda grads: None} if hook else {}
    small = jg.compile(deep(4), loss="loss", optimizer=opt, **kw)    # every kind of layer
    g = deep(24)
    prog, compiled = numba_compiles(lambda: jg.compile(g, loss="loss", optimizer=opt, **kw),
                                    monkeypatch)
    s = prog.stats()
    assert compiled == []                     # the kernels were loaded; the driver is not numba's
    assert s["kernels_compiled"] == 0 and s["kernel_functions"] == small.stats()["kernel_functions"]
    assert s["calls_per_step"] > 3 * small.stats()["calls_per_step"]
    src = prog.ir("kernels")
    assert src.count("  call void @jitgraph_k_") == s["calls_per_step"]
    assert "define void @d_" in src and "; %" in src      # IR nodes shown as comments
    train_and_compare(prog, g, opt)


def test_driver_refuses_other_arrays_and_binds_its_own_again():
    """The driver caches the regions' addresses; arrays of the wrong kind are refused before
    any native call, and the program's own are bound again after them."""
    g = deep(1)
    a = jg.compile(g)
    x = batches(g, 1)[0]
    want = jg.interp.run(g, x, g.init_params(0))["h"]
    np.testing.assert_allclose(a.step(**x)["h"], want, rtol=RTOL, atol=ATOL)
    with pytest.raises(TypeError, match="C-contiguous uint8"):
        a._driver(a._arena.astype(np.float32), a._persist, a._io)
    np.testing.assert_allclose(a.step(**x)["h"], want, rtol=RTOL, atol=ATOL)

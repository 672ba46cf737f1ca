"""User strings never become code: graph, input, param, output and update names that try to
break out of generated source (docstrings, comments, string literals) compile and run as data.

Each payload, if it reached generated source as code, would create the file `owned.txt` in the
working directory or set a flag in `builtins`; the tests compile and run graphs named with them
(through the API and through JSON, forward and training, fused and unfused) and check that
neither happened and that the results agree with the reference interpreter.
"""
import builtins

import numpy as np
import pytest

import jitgraph as jg

RUN = 'open("owned.txt", "w").write("owned"); import builtins; builtins.JG_OWNED = 1'
PAYLOADS = [
    f'z"""\n{RUN}\n"""',                    # the docstring escape
    f"z'''\n{RUN}\n'''",
    f"z\n{RUN}\n#",                          # a newline out of a comment line
    f"z\r{RUN}\r#",                          # a bare carriage return ends a line too
    f"z\r\n{RUN}\r\n#",
    f'z")\n{RUN}\nprint("',                 # a string literal escape
    f"z\x00\n{RUN}",                         # NUL: a source file may not hold one
    f"z\u2028{RUN}\x0c\x0b{{}}%s\\",         # other separators, format characters, braces
]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delattr(builtins, "JG_OWNED", raising=False)
    yield tmp_path
    assert not (tmp_path / "owned.txt").exists(), "a name ran as code"
    assert not hasattr(builtins, "JG_OWNED"), "a name ran as code"


def _graph(name, train):
    g = jg.Graph(name)
    x = g.input(name + "_x", (2, 3))
    w = g.param(name + "_w", (3, 3), init=jg.init.normal(0.0, 0.5))
    s = g.param(name + "_s", (3,), init=jg.init.zeros(), trainable=False)
    h = jg.tanh(x @ w) + s
    g.update(**{name + "_s": s + jg.sum(h, axis=0)})
    if train:
        g.output(**{name + "_loss": jg.mean(jg.sqr(h))})
    else:
        g.output(**{name + "_y": h * 2.0})
    return g


@pytest.mark.parametrize("via", ["api", "json"])
@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
def test_hostile_names_compile_and_run_as_data(sandbox, payload, via):
    g = _graph(payload, train=False)
    if via == "json":
        g = jg.Graph.from_json(g.to_json())
    assert g.name == payload
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    params = g.init_params(seed=0)
    want = jg.interp.run(g, {payload + "_x": x}, params)
    for fuse in (True, False):
        prog = jg.compile(g, fuse=fuse)
        got = prog.step(**{payload + "_x": x})
        np.testing.assert_allclose(got[payload + "_y"], want[payload + "_y"], rtol=1e-5,
                                   atol=1e-6)
        assert payload in prog.ir("kernels") or "\\" in prog.ir("kernels")


@pytest.mark.parametrize("payload", PAYLOADS[:3], ids=range(3))
def test_hostile_names_in_a_training_step(sandbox, payload):
    g = jg.Graph.from_json(_graph(payload, train=True).to_json())
    prog = jg.compile(g, loss=payload + "_loss", optimizer=jg.optim.SGD(lr=0.1))
    x = np.ones((2, 3), np.float32)
    before = prog.params[payload + "_w"]
    loss = prog.step(**{payload + "_x": x})[payload + "_loss"]
    assert np.isfinite(loss)
    assert not np.array_equal(prog.params[payload + "_w"], before)


def test_generated_comments_escape_every_line_break():
    from jitgraph.runtime.cpu.codegen import comment
    for p in PAYLOADS:
        c = comment(p)
        assert c.startswith("# ") and len(c.splitlines()) == 1 and "\x00" not in c
        compile(c + "\n", "<comment>", "exec")    # one comment line is valid source

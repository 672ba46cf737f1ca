"""The on-disk kernel cache: a second process compiles nothing; corrupt entries are rebuilt."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np

import jitgraph as jg
from jitgraph.runtime.cpu import cache

SCRIPT = textwrap.dedent("""
    import json, numpy as np, jitgraph as jg
    g = jg.Graph("cached")
    x = g.input("x", (5, 3))
    w = g.param("w", (3, 2), init=jg.init.constant(0.5))
    g.output(loss=jg.mean(jg.sqr(jg.tanh(x @ w))))
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.SGD(lr=0.1))
    out = prog.step(x=np.ones((5, 3), np.float32))
    s = prog.stats()
    print(json.dumps({"loss": float(out["loss"]), "compiled": s["kernels_compiled"],
                      "loaded": s["kernels_loaded"], "driver_cached": s["driver_cached"]}))
""")


def run_process(cache_dir):
    env = dict(os.environ, JITGRAPH_CACHE_DIR=str(cache_dir))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing(tmp_path):
    first = run_process(tmp_path)
    assert first["compiled"] > 0 and not first["driver_cached"]
    second = run_process(tmp_path)
    assert second == {**first, "compiled": 0, "loaded": first["compiled"] + first["loaded"],
                      "driver_cached": True}


def test_corrupt_entries_are_rebuilt(tmp_path):
    first = run_process(tmp_path)
    root = tmp_path / f"v{cache.FORMAT}"
    kernel = sorted(root.glob("k_*.py"))[0]
    kernel.write_text(kernel.read_text().replace("cfunc", "cfunk", 1))      # edited source
    for index in (root / "__pycache__").glob("d_*.nbi"):
        index.write_bytes(b"not a pickle")                                  # corrupt index
    again = run_process(tmp_path)
    assert again["loss"] == first["loss"]
    assert again["compiled"] >= 1 and "cfunk" not in kernel.read_text()


def test_file_names_hash_text_options_and_toolchain():
    a = cache.module_name("k", "@cfunc(...)\ndef f(): pass")
    b = cache.module_name("k", '@njit(parallel=True)\n@cfunc(...)\ndef f(): pass')
    assert a != b and a == cache.module_name("k", "@cfunc(...)\ndef f(): pass")
    assert "numba" in cache.toolchain() and "llvmlite" in cache.toolchain()


def test_module_names_change_with_the_runtime_library_source(monkeypatch):
    """A generated kernel calls library kernels that numba compiles into it: when their source
    changes (a jitgraph upgrade), the kernel must get a new name, not stale machine code."""
    import hashlib
    from pathlib import Path
    h = hashlib.sha256()
    for f in sorted(Path(cache.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    assert cache.runtime_source_hash() == h.hexdigest()[:16]
    assert cache.runtime_source_hash() in cache.toolchain()
    before = cache.module_name("k", "text")
    cache.toolchain.cache_clear()
    monkeypatch.setattr(cache, "runtime_source_hash", lambda: "edited")
    try:
        assert cache.module_name("k", "text") != before
    finally:
        cache.toolchain.cache_clear()


def test_store_detects_truncated_file(tmp_path, monkeypatch):
    monkeypatch.setenv("JITGRAPH_CACHE_DIR", str(tmp_path))
    path, written = cache.store("k_test", "x = 1\n")
    assert written and cache.store("k_test", "x = 1\n") == (path, False)
    path.write_text(path.read_text()[:-3])
    assert cache.store("k_test", "x = 1\n") == (path, True)
    assert path.read_text().endswith("x = 1\n")


def test_cache_dir_defaults_under_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("JITGRAPH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "jitgraph" / f"v{cache.FORMAT}"


def test_program_in_same_process_reuses_loaded_kernels():
    g = jg.Graph("reuse")
    x = g.input("x", (4,))
    g.output(y=jg.exp(x) * 2.0)
    jg.compile(g)
    again = jg.compile(g)
    s = again.stats()
    assert s["kernels_compiled"] == 0 and s["kernels_reused"] == s["kernel_functions"]
    np.testing.assert_allclose(again.step(x=np.zeros(4))["y"], 2.0)


def test_runtime_library_cache_goes_stale_when_any_runtime_source_changes():
    """numba stamps a cached function with its own file; the runtime's functions inline each
    other (lib_conv holds blas's GEMM), so their stamp also carries the hash of every
    runtime/cpu source, and an index saved under another runtime is not loaded."""
    from jitgraph.runtime.cpu import blas
    a, c = np.ones((2, 2), np.float32), np.zeros((2, 2), np.float32)
    blas.gemm_f32(False, False, 1.0, a, a, 0.0, c)
    np.testing.assert_array_equal(c, a @ a)
    f = blas.gemm_f32._cache
    assert f._impl.locator.get_source_stamp()[1] == cache.runtime_source_hash()
    assert f._cache_file._load_index(), "gemm_f32 was saved under the current runtime"
    own = f._cache_file._source_stamp
    f._cache_file._source_stamp = (own[0], "another runtime")
    try:
        assert f._cache_file._load_index() == {}
    finally:
        f._cache_file._source_stamp = own


HELPERS = textwrap.dedent("""
    import json, sys, numpy as np, jitgraph as jg
    from jitgraph.runtime.cpu import cache
    if sys.argv[1] == "failing":      # helpers that die at once: this process compiles all
        import subprocess
        cache._start_helpers = lambda todo, claims: [subprocess.Popen(
            [sys.executable, "-c", "raise SystemExit(3)"])]
    g = jg.Graph("helpers")
    x = g.input("x", (6, 5))
    w = g.param("w", (5, 4), init=jg.init.constant(0.25))
    h = jg.tanh(x @ w)
    y = jg.softmax(h * 2.0) + jg.exp(-h) / (1.0 + jg.abs(h))
    g.output(loss=jg.mean(jg.sqr(y)) + jg.max(jg.logsumexp(y, 0)))
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=0.1))
    xs = np.linspace(-1, 1, 30, dtype=np.float32).reshape(6, 5)
    losses = [float(prog.step(x=xs)["loss"]) for _ in range(3)]
    s = prog.stats()
    root = cache.cache_dir()
    mods = sorted(p.stem for p in root.glob("k_*.py"))
    cached = [m for m in mods if list((root / "__pycache__").glob(m + ".*.nbi"))]
    print(json.dumps({"losses": losses, "compiled": s["kernels_compiled"],
                      "loaded": s["kernels_loaded"], "modules": len(mods),
                      "cached": len(cached)}))
""")


def _helpers_run(tmp_path, workers, mode="normal"):
    env = dict(os.environ, JITGRAPH_CACHE_DIR=str(tmp_path), JITGRAPH_COMPILE_WORKERS=workers)
    r = subprocess.run([sys.executable, "-c", HELPERS, mode], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cold_compile_shares_modules_with_helper_processes(tmp_path):
    """A cold program compiled with a helper process (and with helpers that die at once) steps
    exactly as one compiled alone; every module ends up in numba's cache, counted compiled."""
    alone = _helpers_run(tmp_path / "alone", "0")
    assert alone["modules"] >= cache.MIN_PARALLEL_MODULES, alone
    for mode in ("normal", "failing"):
        shared = _helpers_run(tmp_path / mode, "1", mode)
        assert shared["losses"] == alone["losses"], mode
        assert shared["compiled"] == alone["compiled"] == shared["modules"] == \
            shared["cached"], (mode, shared)

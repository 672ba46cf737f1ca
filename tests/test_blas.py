"""The GEMM entry points (runtime/cpu/blas.py) under each BLAS backend, against float64 numpy.

The backend is chosen when the module loads, so each backend runs in a process of its own."""
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

CHECK = r"""
import json, sys
import numpy as np
from jitgraph.runtime.cpu import blas
rng = np.random.default_rng(0)
worst = 0.0
for gemm, dt, tol in ((blas.gemm_f32, np.float32, 1e-5), (blas.gemm_f64, np.float64, 1e-12)):
    for m, n, k in ((1, 1, 1), (7, 3, 5), (13, 1, 29), (64, 10, 100), (3, 17, 1),
                    (1, 200, 37)):
        for ta in (False, True):
            for tb in (False, True):
                a = rng.standard_normal((k, m) if ta else (m, k)).astype(dt)
                b = rng.standard_normal((n, k) if tb else (k, n)).astype(dt)
                c0 = rng.standard_normal((m, n)).astype(dt)
                for alpha, beta in ((1.0, 0.0), (0.5, 1.0), (-2.0, 0.25)):
                    c = c0.copy()
                    gemm(ta, tb, alpha, a, b, beta, c)
                    a64, b64 = a.astype(np.float64), b.astype(np.float64)
                    want = alpha * ((a64.T if ta else a64) @ (b64.T if tb else b64)) + beta * c0
                    err = float(np.abs(c - want).max() / (np.abs(want).max() + 1))
                    assert err < tol, (dt.__name__, m, n, k, ta, tb, alpha, beta, err)
                    worst = max(worst, err)
print(json.dumps({"backend": blas.BACKEND, "library": blas.LIBRARY, "worst": worst}))
"""


def _run(code, without=(), **env):
    """Last stdout line of `code` in a new process, with `env` set and `without` unset."""
    e = {k: v for k, v in {**os.environ, **env}.items() if k not in without}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def _numpy_has_openblas():
    from jitgraph.runtime.cpu import blas
    return blas.numpy_openblas() is not None


@pytest.mark.parametrize("backend", ["numpy", "scipy"])
def test_gemm_against_float64_numpy(backend):
    if backend == "numpy" and not _numpy_has_openblas():
        pytest.skip("numpy has no bundled 64-bit-integer OpenBLAS here")
    out = json.loads(_run(CHECK, JITGRAPH_BLAS=backend))
    assert out["backend"] == backend
    assert ("cython_blas" in out["library"]) == (backend == "scipy")


def test_default_backend_is_numpy_openblas_when_bundled():
    out = json.loads(_run(CHECK, JITGRAPH_BLAS=""))
    assert out["backend"] == ("numpy" if _numpy_has_openblas() else "scipy")



def test_unknown_backend_is_a_clear_error(monkeypatch):
    from jitgraph.runtime.cpu import blas
    monkeypatch.setenv("JITGRAPH_BLAS", "mkl")
    with pytest.raises(ValueError, match="JITGRAPH_BLAS='mkl'.*numpy, scipy"):
        blas._choose()


def test_thread_timeout_reaches_numpy_openblas_imported_first():
    """numpy imported (and its OpenBLAS loaded) before jitgraph set OPENBLAS_THREAD_TIMEOUT:
    the setting still reaches the library jitgraph calls."""
    if not _numpy_has_openblas():
        pytest.skip("numpy has no bundled 64-bit-integer OpenBLAS here")
    code = ("import os, numpy\n"
            "os.environ['OPENBLAS_THREAD_TIMEOUT'] = '6'\n"
            "from jitgraph.runtime.cpu import blas\n"
            "print(blas.BACKEND, blas._NUMPY[1].openblas_thread_timeout())")
    assert _run(code, without=("OPENBLAS_THREAD_TIMEOUT",)).split() == ["numpy", "6"]


def test_thread_timeout_is_left_alone_with_other_threads_running():
    """Restarting numpy's OpenBLAS threads while another thread may be inside it is unsafe:
    jitgraph warns instead."""
    if not _numpy_has_openblas():
        pytest.skip("numpy has no bundled 64-bit-integer OpenBLAS here")
    code = ("import os, threading, time, warnings, numpy\n"
            "t = threading.Thread(target=time.sleep, args=(5,), daemon=True); t.start()\n"
            "os.environ['OPENBLAS_THREAD_TIMEOUT'] = '6'\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    from jitgraph.runtime.cpu import blas\n"
            "print(blas._NUMPY[1].openblas_thread_timeout(), "
            "any('OPENBLAS_THREAD_TIMEOUT=6' in str(x.message) for x in w))")
    assert _run(code, without=("OPENBLAS_THREAD_TIMEOUT",)).split() == ["0", "True"]


def test_compiled_steps_agree_under_scipy_backend():
    """Whole training programs (matmuls with transposed operands in the backward, a CNN block's
    im2col GEMMs) compiled against the fallback backend match the interpreter step for step."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            "import jitgraph as jg, test_compile as t\n"
            "from jitgraph.runtime.cpu import blas\n"
            "prog = t.train_and_compare(t.mlp(), jg.optim.AdamW(lr=1e-2))\n"
            "t.test_cnn_block_matches_interpreter()\n"
            "print(prog.stats()['gemm_library'])")
    assert _run(code, JITGRAPH_BLAS="scipy") == "scipy: scipy.linalg.cython_blas"


@pytest.mark.parametrize("bound", [0, 2 ** 12, 2 ** 26, 2 ** 40])
def test_serial_gemm_bound_keeps_results(bound):
    """GEMMs at or under blas.set_serial_max's bound run on one BLAS thread (the others as
    OpenBLAS decides): every setting gives float64 numpy's product, on sizes either side of
    the bound, and the previous bound comes back."""
    from jitgraph.runtime.cpu import blas
    rng = np.random.default_rng(3)
    auto = blas._probe["auto"]
    was = blas.set_serial_max(bound)
    try:
        for m, n, k in ((8, 8, 8), (64, 48, 40), (200, 96, 130)):
            a = rng.standard_normal((m, k)).astype(np.float32)
            b = rng.standard_normal((n, k)).astype(np.float32)
            c = np.full((m, n), 3.0, np.float32)
            blas.gemm_f32(False, True, 1.0, a, b, 0.0, c)
            want = a.astype(np.float64) @ b.astype(np.float64).T
            np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4 * k)
    finally:
        assert blas.set_serial_max(was) == bound
        blas._probe["auto"] = auto


def test_small_kernel_tiling_decisions():
    """Which one-thread GEMMs are cut for OpenBLAS's small-matrix kernels, and along what: k
    for A transposed, rows of c for neither, never with B transposed or under the bound."""
    from jitgraph.runtime.cpu.blas import tiling
    big = 1_000_000
    assert tiling(True, False, 8, 64, 2048, big) == (2, big // (8 * 64))     # a weight gradient
    assert tiling(False, False, 2048, 64, 8, big) == (0, big // (64 * 8))    # x @ w
    assert tiling(False, True, 2048, 8, 64, big) == (-1, 0)                  # B transposed
    assert tiling(True, True, 64, 64, 2048, big) == (-1, 0)
    assert tiling(False, False, 100, 100, 100, big) == (-1, 0)               # at the bound
    assert tiling(False, False, 2, 1000, 2000, big) == (-1, 0)               # no row fits
    assert tiling(False, False, 1000, 500, 784, big) == (-1, 0)              # 2-row tiles
    assert tiling(True, False, 784, 500, 1000, big) == (-1, 0)
    assert tiling(True, False, 8, 64, 2048, 0) == (-1, 0)                    # 0: never cut


@pytest.mark.parametrize("bound", [2 ** 40, 0])
@pytest.mark.parametrize("small", [0, 3000, 20000, 10 ** 6])
def test_tiled_gemm_keeps_results(small, bound):
    """Every tiling (uneven last tiles, 16-row and 16-k tiles, alpha and beta, both
    precisions), on the calling thread (bound 2^40) or in bands over the pool (bound 0: every
    GEMM; uneven bands, bands of one row), gives float64 numpy's product; the previous bounds
    come back."""
    from jitgraph.runtime.cpu import blas
    rng = np.random.default_rng(4)
    auto = blas._probe["auto"]
    serial, was = blas.set_serial_max(bound), blas.set_small_mnk(small)
    try:
        for gemm, dt, tol in ((blas.gemm_f32, np.float32, 1e-5),
                              (blas.gemm_f64, np.float64, 1e-12)):
            for m, n, k in ((13, 3, 50), (37, 5, 211), (8, 64, 2048), (2048, 8, 64), (1, 7, 9),
                            (3, 40, 700), (700, 40, 3)):
                for ta, tb in ((True, False), (False, False), (False, True)):
                    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dt)
                    b = rng.standard_normal((n, k) if tb else (k, n)).astype(dt)
                    c0 = rng.standard_normal((m, n)).astype(dt)
                    for alpha, beta in ((1.0, 0.0), (-0.5, 1.0), (2.0, 0.25)):
                        c = c0.copy()
                        gemm(ta, tb, alpha, a, b, beta, c)
                        a64, b64 = a.astype(np.float64), b.astype(np.float64)
                        want = alpha * ((a64.T if ta else a64) @ (b64.T if tb else b64)) + \
                            beta * c0
                        err = float(np.abs(c - want).max() / (np.abs(want).max() + 1))
                        assert err < tol, (dt.__name__, m, n, k, ta, tb, alpha, beta, err)
    finally:
        assert blas.set_small_mnk(was) == small
        assert blas.set_serial_max(serial) == bound
        blas._probe["auto"] = auto


def test_small_kernel_bound_env_is_checked():
    assert _run("from jitgraph.runtime.cpu import blas; print(blas.small_mnk())",
                JITGRAPH_BLAS_SMALL_MNK="1234") == "1234"
    e = {**os.environ, "JITGRAPH_BLAS_SMALL_MNK": "lots"}
    r = subprocess.run([sys.executable, "-c", "import jitgraph.runtime.cpu.blas"],
                       capture_output=True, text=True, env=e, timeout=600)
    assert r.returncode != 0 and "JITGRAPH_BLAS_SMALL_MNK='lots'" in r.stderr


def test_serial_bound_follows_the_load(monkeypatch):
    """adapt(): QUIET_BOUND until an interval is measured and while the thread running the
    steps waits for no core, BUSY_BOUND for HOLD_SECONDS after two intervals running in which
    its run delay exceeded RUN_DELAY_BUSY of the wall time (one alone is a burst); probes at
    most every PROBE_SECONDS; an interval longer than STALE_SECONDS (no steps run back to back)
    or begun on another thread is not judged; set_serial_max pins the bound; an unreadable run
    delay stops the adapting."""
    from jitgraph.runtime.cpu import blas
    d = blas.run_delay_ns()
    assert d is None or d >= 0
    monkeypatch.setattr(blas, "_probe", {"auto": True, "next": 0.0, "last": None, "hold": 0.0,
                                         "waited": False})
    monkeypatch.setattr(blas, "_SERIAL_MAX", type(blas._SERIAL_MAX)(blas.QUIET_BOUND))
    delays = []
    monkeypatch.setattr(blas, "run_delay_ns", lambda: delays.pop(0))
    B, Q = blas.BUSY_BOUND, blas.QUIET_BOUND
    ms = 1e6                                      # ns in a millisecond

    def probe(t, delay):
        delays.append(delay)
        blas.adapt(lambda: t)
        return blas._SERIAL_MAX.value

    assert probe(0.0, 0) == Q                                 # nothing measured yet
    assert probe(0.1, 1 * ms) == Q                            # 1 % of the interval waiting
    assert probe(0.11, 1 * ms) == Q and delays == [1 * ms]    # not due: no probe
    delays.clear()
    assert probe(0.2, 26 * ms) == Q                           # 25 % once: a burst
    assert probe(0.3, 27 * ms) == Q
    assert probe(0.4, 37 * ms) == Q and probe(0.5, 47 * ms) == Q   # 10 % twice: not busy
    assert probe(0.6, 72 * ms) == Q and probe(0.7, 97 * ms) == B   # 25 % twice running: busy
    hold_end = 0.7 + blas.HOLD_SECONDS
    assert probe(0.8, 97 * ms) == B                           # held
    assert probe(hold_end - 0.1, 97.1 * ms) == B              # held (a stale interval)
    assert probe(hold_end + 0.1, 97.1 * ms) == Q              # the hold is over
    # a stale interval (a compile between steps) is not judged, however long its wait
    assert probe(7.0, 900 * ms) == Q and probe(7.1, 925 * ms) == Q and probe(7.2, 950 * ms) == B
    # an interval begun on another thread is not judged (each thread has its own run delay)
    blas._probe.update(hold=0.0, waited=False)
    probe(12.6, 1000 * ms)
    assert probe(12.7, 1000 * ms) == Q
    tid = threading.get_native_id()
    monkeypatch.setattr(blas.threading, "get_native_id", lambda: tid + 1)
    assert probe(12.8, 1100 * ms) == Q and probe(12.9, 1200 * ms) == Q
    assert probe(13.0, 1300 * ms) == B                        # its own intervals count
    blas.set_serial_max(123)
    assert probe(13.0, 999 * ms) == 123 and delays == [999 * ms]   # pinned
    delays.clear()
    blas._probe.update(auto=True, next=0.0)
    assert probe(14.0, None) == 123 and blas._probe["auto"] is False


def test_import_leaves_the_omp_wait_policy_to_libgomp():
    """numba's pool is the only pool a step uses (OpenBLAS runs on one thread), so its threads
    keep libgomp's spin-then-sleep default: jitgraph sets no OMP_WAIT_POLICY (PASSIVE made
    each parallel launch wake a sleeping thread), and one the user exported stays."""
    code = ("import os, jitgraph as jg\n"
            "g = jg.Graph('g'); g.output(y=g.input('x', (4,)) * 2.0); jg.compile(g)\n"
            "print(os.environ.get('OMP_WAIT_POLICY', 'unset'))")
    assert _run(code, without=("OMP_WAIT_POLICY",)) == "unset"
    assert _run(code, OMP_WAIT_POLICY="PASSIVE") == "PASSIVE"


def test_transposed_weight_copy_decision_and_results():
    """c = a b^T with K small, B small and c tall runs as b copied into its transpose
    (runtime/cpu/lower.py transpose_pays, blas.gemm_bt); its results, as a plain matmul
    kernel and as a GEMM with an epilogue (float32 and float64), equal float64 numpy's."""
    import jitgraph as jg
    from jitgraph.runtime.cpu.lower import transpose_pays
    assert transpose_pays(False, True, 2048, 64, 8)
    assert transpose_pays(False, True, 2048, 512, 64)                  # the output layer
    assert not transpose_pays(False, True, 100, 500, 784)              # K large
    assert not transpose_pays(False, True, 1000, 500, 784)
    assert not transpose_pays(False, True, 100, 10, 500)
    assert not transpose_pays(False, True, 100, 500, 10)               # c short
    assert not transpose_pays(False, False, 2048, 64, 8)               # B not transposed
    assert not transpose_pays(True, True, 2048, 64, 8)
    assert not transpose_pays(False, True, 4096, 2048, 128)            # B too big to copy
    rng = np.random.default_rng(5)
    for dt, tol in (("f32", 1e-5), ("f64", 1e-12)):
        for m, n, k in ((300, 40, 30), (256, 7, 256), (2048, 64, 8), (2048, 64, 64)):
            assert transpose_pays(False, True, m, n, k)
            g = jg.Graph("bt")
            x, w, b = g.input("x", (m, k), dt), g.input("w", (n, k), dt), g.input("b", (n,), dt)
            g.output(y=x @ w.T, z=jg.relu(x @ w.T + b))
            np_dt = np.float32 if dt == "f32" else np.float64
            xs, ws, bs = (rng.standard_normal(s).astype(np_dt) for s in ((m, k), (n, k), (n,)))
            want = xs.astype(np.float64) @ ws.astype(np.float64).T
            scale = np.abs(want).max()
            for fuse in (True, False):        # a GEMM kernel with an epilogue; a matmul alone
                out = jg.compile(g, fuse=fuse).run(x=xs, w=ws, b=bs)
                assert np.abs(out["y"] - want).max() <= tol * scale, (dt, m, n, k, fuse)
                assert np.abs(out["z"] - np.maximum(want + bs, 0)).max() <= tol * scale, \
                    (dt, m, n, k, fuse)


def test_gemm_bt_bands_copy_their_own_transpose_and_keep_the_bits():
    """gemm_bt above the one-thread bound: each band's thread copies b^T into its own copy and
    runs its band; busy (bands on this thread), one copy and the same bands: the same bits,
    both equal to float64's product within float32 rounding."""
    from jitgraph.runtime.cpu import blas
    if blas._POOL.value < 2:
        pytest.skip("one pool thread: no bands")
    rng = np.random.default_rng(7)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((2048, 64), (172, 64)))
    bts = np.full((blas.bt_copies(), 64, 172), np.nan, np.float32)
    c1, c2 = np.empty((2048, 172), np.float32), np.empty((2048, 172), np.float32)
    was = (blas._SERIAL_MAX.value, blas._BAND_MIN.value)
    try:
        blas._SERIAL_MAX.value = blas._BAND_MIN.value = blas.QUIET_BOUND
        blas.gemm_bt(1.0, a, b, 0.0, c1, bts)
        assert not np.isnan(bts).any()                        # every thread made its copy
        blas._SERIAL_MAX.value = blas.BUSY_BOUND                # busy: bands on this thread
        blas.gemm_bt(1.0, a, b, 0.0, c2, bts)
    finally:
        blas._SERIAL_MAX.value, blas._BAND_MIN.value = was
    np.testing.assert_array_equal(c1, c2)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    assert np.abs(c1 - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("ta", [True, False], ids=["A transposed (k tiles)", "row tiles"])
def test_the_load_moves_where_bands_run_not_the_bits(ta):
    """A GEMM between the quiet and busy one-thread bounds: quiet, its bands run on the pool;
    busy (adapt() raised the bound), the same bands run one after another on this thread. Same
    sub-GEMMs, same bits (cut by the moving bound, the whole GEMM's small-kernel tiles summed
    k in another order than each band's: a resumed training run came out 1 ulp off)."""
    from jitgraph.runtime.cpu import blas
    if blas._POOL.value < 2:
        pytest.skip("one pool thread: no bands")
    was = (blas._SERIAL_MAX.value, blas._BAND_MIN.value)
    small = blas.set_small_mnk(10 ** 6)
    rng = np.random.default_rng(5)
    m, n, k = (64, 64, 2048) if ta else (2048, 64, 64)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    assert blas.QUIET_BOUND < m * n * k <= blas.BUSY_BOUND
    out = {}
    try:
        blas._BAND_MIN.value = blas.QUIET_BOUND
        for bound in (blas.QUIET_BOUND, blas.BUSY_BOUND):
            blas._SERIAL_MAX.value = bound
            c = np.zeros((m, n), np.float32)
            blas.gemm_f32(ta, False, 1.0, a, b, 0.0, c)
            out[bound] = c
    finally:
        blas._SERIAL_MAX.value, blas._BAND_MIN.value = was
        blas.set_small_mnk(small)
    want = (a.T if ta else a).astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(out[blas.QUIET_BOUND], want, rtol=1e-4, atol=1e-4 * k)
    assert np.array_equal(out[blas.QUIET_BOUND], out[blas.BUSY_BOUND])


@pytest.mark.parametrize("tb", [True, False], ids=["x W^T", "x W"])
def test_one_row_gemv_bands_keep_the_bits(tb):
    """c[1, N] (decode) runs as GEMV in column bands: on the pool (quiet) or one after another
    on this thread (busy), the same bands, the same bits; beta accumulates into c."""
    from jitgraph.runtime.cpu import blas
    rng = np.random.default_rng(7)
    n, k = 1000, 3000
    assert blas.GEMV_WEIGHT * n * k > blas.QUIET_BOUND
    a = rng.standard_normal((1, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    c0 = rng.standard_normal((1, n)).astype(np.float32)
    want = 0.5 * (a.astype(np.float64) @ (b.T if tb else b).astype(np.float64)) + 2.0 * c0
    was = (blas._SERIAL_MAX.value, blas._BAND_MIN.value)
    out = {}
    try:
        blas._BAND_MIN.value = blas.QUIET_BOUND
        for bound in (blas.QUIET_BOUND, 1 << 40):
            blas._SERIAL_MAX.value = bound
            c = c0.copy()
            blas.gemm_f32(False, tb, 0.5, a, b, 2.0, c)
            out[bound] = c
    finally:
        blas._SERIAL_MAX.value, blas._BAND_MIN.value = was
    assert np.abs(out[blas.QUIET_BOUND] - want).max() <= 1e-5 * np.abs(want).max()
    assert np.array_equal(out[blas.QUIET_BOUND], out[1 << 40])

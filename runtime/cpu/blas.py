"""BLAS GEMM callable from @njit code: sgemm/dgemm called directly, no copies, no allocation.

Row-major trick (DESIGN.md "Numba facts"): for C[M,N] = op(A) @ op(B) on row-major arrays, BLAS
(column-major) computes C^T = op(B)^T op(A)^T, so B is passed first with m=N, n=M, lda = B's row
stride, ldb = A's row stride, ldc = N. Transposes are BLAS flags; nothing is ever copied. beta=1
accumulates into C. Scalar arguments go by reference through stack slots (`_ref`), so a call
allocates nothing.

Which BLAS (`BACKEND`, override with JITGRAPH_BLAS=numpy|scipy):
  numpy  the OpenBLAS numpy's wheels bundle (scipy-openblas64, 64-bit integers), when numpy has
         one. The default: a newer OpenBLAS than scipy's, faster on every GEMM of the MNIST MLP
         step (bench/README.md: "Figures behind the code", BLAS).
  scipy  scipy's cython_blas (32-bit integers), the fallback, through a small adapter.
Generated code calls one symbol per precision, `jitgraph_sgemm64` / `jitgraph_dgemm64`, with
64-bit integers, bound to the chosen library's address when this module loads: cached machine
code names only the symbol, so it stays valid whichever library a later process picks.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
import warnings

from llvmlite import binding as llvm
from llvmlite import ir
from numba import cfunc, njit, prange, types
from numba.core import config as numba_config
from numba.core import cgutils
from numba.extending import get_cython_function_address, intrinsic, overload

from .cache import install_runtime_locator

install_runtime_locator()

BACKENDS = ("numpy", "scipy")


@intrinsic
def _ref(typingctx, val):
    """Pointer to a stack copy of `val` (Fortran passes every scalar by reference)."""
    def codegen(context, builder, sig, args):
        return cgutils.alloca_once_value(builder, args[0])
    return types.CPointer(val)(val), codegen


def _signature(real, integer):
    i8p, ip, rp = types.CPointer(types.int8), types.CPointer(integer), types.CPointer(real)
    return types.void(i8p, i8p, ip, ip, ip, rp, rp, ip, rp, ip, rp, rp, ip)


def _gemv_signature(real, integer):
    i8p, ip, rp = types.CPointer(types.int8), types.CPointer(integer), types.CPointer(real)
    return types.void(i8p, ip, ip, rp, rp, ip, rp, ip, rp, rp, ip)


def _extern(symbol, address, real, integer, signature=_signature):
    """`symbol`, bound to `address` in LLVM's symbol table (in every process: calls to it are
    cacheable), as a numba external function taking Fortran GEMM (or GEMV) arguments."""
    llvm.add_symbol(symbol, address)
    return types.ExternalFunction(symbol, signature(real, integer))


def numpy_openblas():
    """(path, ctypes library, symbol prefix) of the OpenBLAS numpy's wheels bundle with 64-bit
    integers (scipy-openblas64 in numpy 2, openblas64_ in numpy 1.2x), or None."""
    import numpy
    from threadpoolctl import threadpool_info
    root = os.path.dirname(os.path.realpath(numpy.__file__))
    for info in threadpool_info():
        path = os.path.realpath(info.get("filepath") or "")
        where = os.path.dirname(path)
        if info.get("internal_api") != "openblas" or \
                not (where == root + ".libs" or where.startswith(root + os.sep)):
            continue
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_", "_64_"), ("", "_64_")):
            if hasattr(lib, f"{prefix}sgemm{suffix}") and hasattr(lib, f"{prefix}dgemm{suffix}"):
                return path, lib, (prefix, suffix)
    return None


def _choose():
    want = os.environ.get("JITGRAPH_BLAS", "").strip().lower()
    if want not in ("",) + BACKENDS:
        raise ValueError(f"JITGRAPH_BLAS={want!r}: expected one of {', '.join(BACKENDS)}")
    found = numpy_openblas() if want in ("", "numpy") else None
    if want == "numpy" and found is None:
        raise RuntimeError("JITGRAPH_BLAS=numpy, but numpy has no bundled 64-bit-integer OpenBLAS "
                           "(numpy built against another BLAS?); use JITGRAPH_BLAS=scipy")
    return ("numpy", found) if found else ("scipy", None)


def _thread_settings(lib):
    """Apply jitgraph's OpenBLAS thread settings (runtime/cpu/threading.py) to numpy's OpenBLAS,
    which read its environment when numpy was imported, possibly before jitgraph set it: a
    thread timeout it missed (threads spinning 2**28 cycles after each GEMM slow the kernels
    that follow) is read again and takes effect when the threads restart
    (blas_thread_shutdown_, what OpenBLAS itself runs before every fork); JITGRAPH_NUM_THREADS
    sets the thread count."""
    want = os.environ.get("OPENBLAS_THREAD_TIMEOUT", "")
    if want.isdigit() and hasattr(lib, "openblas_read_env") and \
            hasattr(lib, "blas_thread_shutdown_") and lib.openblas_thread_timeout() != int(want):
        if threading.active_count() > 1:    # another thread may be inside numpy's BLAS now
            warnings.warn("jitgraph: numpy's OpenBLAS started before OPENBLAS_THREAD_TIMEOUT was "
                          "set, and other threads are running, so its threads are not restarted: "
                          "its idle threads will spin after each GEMM and slow the parallel "
                          "kernels; import jitgraph before numpy, or export "
                          f"OPENBLAS_THREAD_TIMEOUT={want}", RuntimeWarning, stacklevel=2)
        else:
            lib.openblas_read_env()
            lib.blas_thread_shutdown_()
    n = os.environ.get("JITGRAPH_NUM_THREADS", "")
    if n.isdigit() and int(n) > 0:
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_"):
            if hasattr(lib, name):
                getattr(lib, name)(ctypes.c_int(int(n)))
                break


BACKEND, _NUMPY = _choose()
LIBRARY = _NUMPY[0] if _NUMPY else "scipy.linalg.cython_blas"
if _NUMPY:
    _thread_settings(_NUMPY[1])


def _scipy_adapter(name, real):
    """A C function with the 64-bit-integer signature calling scipy's cython_blas `name`."""
    f = _extern(f"jitgraph_scipy_{name}", get_cython_function_address("scipy.linalg.cython_blas",
                                                                      name), real, types.int32)
    i32 = types.int32

    @cfunc(_signature(real, types.int64), nopython=True)
    def adapter(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        f(ta, tb, _ref(i32(m[0])), _ref(i32(n[0])), _ref(i32(k[0])), alpha, a, _ref(i32(lda[0])),
          b, _ref(i32(ldb[0])), beta, c, _ref(i32(ldc[0])))
    return adapter


def _scipy_gemv_adapter(name, real):
    """As _scipy_adapter, for GEMV's arguments."""
    f = _extern(f"jitgraph_scipy_{name}", get_cython_function_address("scipy.linalg.cython_blas",
                                                                      name), real, types.int32,
                _gemv_signature)
    i32 = types.int32

    @cfunc(_gemv_signature(real, types.int64), nopython=True)
    def adapter(t, m, n, alpha, a, lda, x, incx, beta, y, incy):
        f(t, _ref(i32(m[0])), _ref(i32(n[0])), alpha, a, _ref(i32(lda[0])), x,
          _ref(i32(incx[0])), beta, y, _ref(i32(incy[0])))
    return adapter


def _address(name, real):
    if _NUMPY:
        prefix, suffix = _NUMPY[2]
        return ctypes.cast(getattr(_NUMPY[1], f"{prefix}{name}{suffix}"), ctypes.c_void_p).value
    adapter = (_scipy_gemv_adapter if name.endswith("gemv") else _scipy_adapter)(name, real)
    _KEEP.append(adapter)     # its machine code must outlive every kernel calling it
    return adapter.address


_KEEP = []
_sgemm = _extern("jitgraph_sgemm64", _address("sgemm", types.float32), types.float32, types.int64)
_dgemm = _extern("jitgraph_dgemm64", _address("dgemm", types.float64), types.float64, types.int64)
_sgemv = _extern("jitgraph_sgemv64", _address("sgemv", types.float32), types.float32, types.int64,
                 _gemv_signature)
_dgemv = _extern("jitgraph_dgemv64", _address("dgemv", types.float64), types.float64, types.int64,
                 _gemv_signature)

_N, _T = 78, 84   # ord("N"), ord("T")


def _external_int64(module, name):
    """The module's declaration of the int64 at symbol `name` (one per module: a second
    add_global_variable of the name would be renamed name.1, a symbol nobody defines)."""
    gv = module.globals.get(name)
    if gv is None:
        gv = cgutils.add_global_variable(module, ir.IntType(64), name)
        gv.linkage = "external"
    return gv


def _setting(symbol, value):
    """An int64 at `symbol`: (its ctypes cell, an intrinsic reading it). Compiled (and cached)
    kernels read it from memory at each call, so a change reaches them at once."""
    cell = ctypes.c_int64(value)
    llvm.add_symbol(symbol, ctypes.addressof(cell))

    def read(typingctx):
        def codegen(context, builder, sig, args):
            return builder.load(_external_int64(builder.module, symbol))
        return types.int64(), codegen
    read.__name__ = read.__qualname__ = f"read_{symbol}"
    return cell, intrinsic(read)


# ---- one thread pool: OpenBLAS always on one thread, big GEMMs in bands over numba's pool --------
# Two spinning pools starve each other and sleeping threads cost a wake-up per GEMM, so there is
# one pool, numba's. OpenBLAS runs on one thread in every call jitgraph makes (its thread count
# set to 1 around the call and restored); a GEMM above the one-thread bound is cut into one band
# of c's rows per pool thread (_bands), each band in small-kernel tiles where they pay.
# The bound follows the load (adapt(), before each step, at most every PROBE_SECONDS), since on a
# busy machine a band's wait for its thread dominates the GEMM: QUIET_BOUND, or BUSY_BOUND for
# HOLD_SECONDS once the stepping thread's run delay (/proc/thread-self/schedstat; the pool's
# spinning threads would always read busy) exceeded RUN_DELAY_BUSY of the wall time in two probe
# intervals running (one is often a neighbour's burst); an interval over STALE_SECONDS spans
# other work (a compile, a pause) and is not judged. The load moves only where the bands run,
# never how a GEMM is cut (above QUIET_BOUND or the fixed bound, always the same bands), so the
# bits are the same whatever the load. JITGRAPH_BLAS_SERIAL_MAX=<m*n*k> fixes the bound (0: every
# GEMM in bands), as does set_serial_max(); compiled kernels read it from memory at each call.
# The values' measurements: bench/README.md, "Figures behind the code", BLAS.
QUIET_BOUND, BUSY_BOUND = 1 << 21, 1 << 26
PROBE_SECONDS, HOLD_SECONDS, RUN_DELAY_BUSY, STALE_SECONDS = 0.05, 2.0, 0.2, 0.5
_FIXED = os.environ.get("JITGRAPH_BLAS_SERIAL_MAX", "").strip()
SERIAL_MAX_WORK = int(_FIXED or QUIET_BOUND)
_SERIAL_MAX, _serial_max = _setting("jitgraph_blas_serial_max", SERIAL_MAX_WORK)
_BAND_MIN, _band_min = _setting("jitgraph_blas_band_min", SERIAL_MAX_WORK)   # load-independent
_probe = {"auto": not _FIXED, "next": 0.0, "last": None, "hold": 0.0, "waited": False}


def set_serial_max(work: int) -> int:
    """Run GEMMs with m*n*k <= work on one BLAS thread (0: leave every GEMM to OpenBLAS's
    own choice), from now on (the load no longer moves it); returns the previous bound."""
    was = _SERIAL_MAX.value
    _SERIAL_MAX.value = _BAND_MIN.value = int(work)
    _probe["auto"] = False
    return was


def run_delay_ns() -> int | None:
    """Nanoseconds the calling thread has spent runnable but waiting for a core (Linux:
    /proc/thread-self/schedstat), or None when that cannot be read."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def adapt(now=time.monotonic) -> None:
    """Move the one-thread bound with the machine's load (see above); cheap when called often."""
    p = _probe
    if not p["auto"]:
        return
    t = now()
    if t < p["next"]:
        return
    p["next"] = t + PROBE_SECONDS
    delay, tid = run_delay_ns(), threading.get_native_id()
    if delay is None:
        p["auto"] = False
        return
    if p["last"] is not None and t - p["last"][0] <= STALE_SECONDS and p["last"][2] == tid:
        t0, d0, _ = p["last"]
        waited = (delay - d0) * 1e-9 > RUN_DELAY_BUSY * (t - t0)
        if waited and p["waited"]:
            p["hold"] = t + HOLD_SECONDS
        p["waited"] = waited
        _SERIAL_MAX.value = BUSY_BOUND if t < p["hold"] else QUIET_BOUND
    else:
        p["waited"] = False
    p["last"] = (t, delay, tid)


def _thread_count_functions():
    """(get, set) addresses of the chosen OpenBLAS's thread count, or no-op stand-ins (scipy's
    BLAS: its threads are left to OpenBLAS)."""
    if _NUMPY:
        lib, (prefix, suffix) = _NUMPY[1], _NUMPY[2]
        names = [f"{prefix}openblas_{f}_num_threads{suffix.lstrip('_')}" for f in ("get", "set")]
        if all(hasattr(lib, nm) for nm in names):
            return [ctypes.cast(getattr(lib, nm), ctypes.c_void_p).value for nm in names]

    @cfunc(types.int32(), nopython=True)
    def get_one():
        return 1

    @cfunc(types.void(types.int32), nopython=True)
    def set_none(n):
        pass
    _KEEP.extend((get_one, set_none))
    return [get_one.address, set_none.address]


_get_addr, _set_addr = _thread_count_functions()
llvm.add_symbol("jitgraph_blas_get_threads", _get_addr)
llvm.add_symbol("jitgraph_blas_set_threads", _set_addr)
_get_threads = types.ExternalFunction("jitgraph_blas_get_threads", types.int32())
_set_threads = types.ExternalFunction("jitgraph_blas_set_threads", types.void(types.int32))


@njit(cache=True, nogil=True, inline="always")
def _dims(ta, tb, a, b, c):
    """(transa, transb, m, n, k, lda, ldb, ldc) of the column-major call computing C^T."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    return ((_T if tb else _N), (_T if ta else _N), n, m, k, max(b.shape[1], 1),
            max(a.shape[1], 1), max(n, 1))


def _xgemm(c, fb, fa, n, m, k, alpha, b, ldb, a, lda, beta, ldc):
    """sgemm or dgemm by c's dtype, every scalar by reference (callable from @njit only)."""
    raise NotImplementedError("_xgemm is callable from @njit code only")


@overload(_xgemm)
def _xgemm_typed(c, fb, fa, n, m, k, alpha, b, ldb, a, lda, beta, ldc):
    f, real = (_sgemm, types.float32) if c.dtype == types.float32 else (_dgemm, types.float64)
    i, i8 = types.int64, types.int8

    def impl(c, fb, fa, n, m, k, alpha, b, ldb, a, lda, beta, ldc):
        f(_ref(i8(fb)), _ref(i8(fa)), _ref(i(n)), _ref(i(m)), _ref(i(k)), _ref(real(alpha)),
          b.ctypes, _ref(i(ldb)), a.ctypes, _ref(i(lda)), _ref(real(beta)), c.ctypes, _ref(i(ldc)))
    return impl


def _xgemv(y, t, m, n, alpha, a, lda, x, beta):
    """sgemv or dgemv by y's dtype, unit strides (callable from @njit only)."""
    raise NotImplementedError("_xgemv is callable from @njit code only")


@overload(_xgemv)
def _xgemv_typed(y, t, m, n, alpha, a, lda, x, beta):
    f, real = (_sgemv, types.float32) if y.dtype == types.float32 else (_dgemv, types.float64)
    i, i8 = types.int64, types.int8

    def impl(y, t, m, n, alpha, a, lda, x, beta):
        f(_ref(i8(t)), _ref(i(m)), _ref(i(n)), _ref(real(alpha)), a.ctypes, _ref(i(lda)),
          x.ctypes, _ref(i(1)), _ref(real(beta)), y.ctypes, _ref(i(1)))
    return impl


@njit(cache=True, nogil=True, inline="always")
def one_thread():
    """Put OpenBLAS on one thread; returns the count to give back to restore_threads."""
    was = _get_threads()
    if was > 1:
        _set_threads(1)
    return was


@njit(cache=True, nogil=True, inline="always")
def restore_threads(was):
    if was > 1:
        _set_threads(was)


# ---- tiles for OpenBLAS's small-matrix kernels ----------------------------------------------
# OpenBLAS's SkylakeX-class builds (the AVX-512 kernels numpy's wheels pick on Intel since
# Skylake-X and on AMD Zen 4) run a GEMM with m*n*k <= 100^3 through "small matrix" kernels
# that read the operands where they lie, and pack them above that, which costs a GEMM with a
# small k or n more than its product. So a one-thread GEMM above the bound is cut into tiles
# under it where that pays: A transposed (a weight gradient, k = tokens) along k, each tile
# accumulating into c; neither transposed along the rows of c. B transposed gains nothing cut
# and stays whole, as do GEMMs on the pool (bench/README.md: "Figures behind the code", BLAS).
# Other builds (AVX2 Haswell/Zen kernels) have no such kernels: there the bound is 0 and
# nothing is cut. JITGRAPH_BLAS_SMALL_MNK=<m*n*k> overrides it (0: never cut); like the
# one-thread bound it lives at a symbol that compiled kernels read at each call.
SMALL_CORES = ("skylakex", "cooperlake", "sapphirerapids")
SMALL_MNK_DEFAULT = 1_000_000


def _small_mnk_default() -> int:
    """SMALL_MNK_DEFAULT when numpy's OpenBLAS runs SkylakeX-class kernels, else 0."""
    if not _NUMPY:
        return 0
    from threadpoolctl import threadpool_info
    for info in threadpool_info():
        if os.path.realpath(info.get("filepath") or "") == os.path.realpath(_NUMPY[0]):
            arch = str(info.get("architecture") or "").lower()
            return SMALL_MNK_DEFAULT if arch in SMALL_CORES else 0
    return 0


_SMALL_ENV = os.environ.get("JITGRAPH_BLAS_SMALL_MNK", "").strip()
if _SMALL_ENV and not _SMALL_ENV.isdigit():
    raise ValueError(f"JITGRAPH_BLAS_SMALL_MNK={_SMALL_ENV!r}: expected a non-negative integer "
                     f"(m*n*k of the largest tile; 0 never cuts a GEMM)")
_SMALL_MNK, _small_max = _setting("jitgraph_blas_small_mnk",
                                  int(_SMALL_ENV) if _SMALL_ENV else _small_mnk_default())


def small_mnk() -> int:
    """The tile bound in use (0: GEMMs are never cut)."""
    return _SMALL_MNK.value


def set_small_mnk(work: int) -> int:
    """Cut one-thread GEMMs into tiles of m*n*k <= work (0: never); returns the previous bound."""
    was = _SMALL_MNK.value
    _SMALL_MNK.value = int(work)
    return was


# The pool's size: bands per GEMM above the one-thread bound (numba's thread count, read when
# numba loaded; not cacheable in machine code, hence a symbol like the bounds).
_POOL, _pool_threads = _setting("jitgraph_pool_threads", max(1, numba_config.NUMBA_NUM_THREADS))


MIN_TILE = 16    # rows (or k) per tile, at least: thinner tiles cost more than they save


@njit(cache=True, nogil=True, inline="always")
def tiling(ta, tb, m, n, k, small):
    """(axis, step) cutting a one-thread row-major GEMM c[m, n] (inner dimension k) into tiles
    of m*n*k <= small: axis 2 = k (A transposed, B not), 0 = rows of c (neither transposed);
    (-1, 0) leaves it whole (small enough already, B transposed, or tiles of under MIN_TILE
    rows or k: OpenBLAS's packing then pays)."""
    if small <= 0 or m * n * k <= small or tb:
        return -1, 0
    step = small // (m * n) if ta else small // (n * k)
    if step < MIN_TILE:
        return -1, 0
    return (2, step) if ta else (0, step)


@njit(cache=True, nogil=True)
def _tiled(ta, tb, alpha, a, lda, b, ldb, beta, c, ldc, m, n, k, small):
    """c[m, n] = alpha op(a) op(b) + beta c on the calling thread, in tiles (tiling) where
    they pay; lda, ldb, ldc: the row strides as stored."""
    fa, fb = (_T if ta else _N), (_T if tb else _N)
    axis, step = tiling(ta, tb, m, n, k, small)
    if axis == 2:                       # k in tiles: a's rows k0.., b's rows k0.., into c
        bt = beta
        for k0 in range(0, k, step):
            _xgemm(c, fb, fa, n, m, min(step, k - k0), alpha, b[k0:], ldb, a[k0:], lda, bt, ldc)
            bt = 1.0
    elif axis == 0:                     # rows of c in tiles: a's rows i0..
        for i0 in range(0, m, step):
            _xgemm(c[i0:], fb, fa, n, min(step, m - i0), k, alpha, b, ldb, a[i0:], lda, beta,
                   ldc)
    else:
        _xgemm(c, fb, fa, n, m, k, alpha, b, ldb, a, lda, beta, ldc)


@njit(cache=True, nogil=True, inline="always")
def _band(p, parts, ta, tb, alpha, a, b, beta, c, small):
    """Band p of `parts` of c's rows, _tiled (a's rows, or with A transposed its columns: the
    same stride from a later start)."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    lda, ldb = max(a.shape[1], 1), max(b.shape[1], 1)
    h = (m + parts - 1) // parts
    i0 = p * h
    i1 = min(m, i0 + h)
    if i0 < i1:
        ab = a[:, i0:] if ta else a[i0:]
        _tiled(ta, tb, alpha, ab, lda, b, ldb, beta, c[i0:], n, i1 - i0, n, k, small)


@njit(cache=True, nogil=True, parallel=True)
def _bands(ta, tb, alpha, a, b, beta, c, parts, small):
    """c's rows in `parts` bands, one per thread of numba's pool."""
    for p in prange(parts):
        _band(p, parts, ta, tb, alpha, a, b, beta, c, small)


@njit(cache=True, nogil=True)
def _bands_here(ta, tb, alpha, a, b, beta, c, parts, small):
    """The same bands one after another on the calling thread (a busy machine)."""
    for p in range(parts):
        _band(p, parts, ta, tb, alpha, a, b, beta, c, small)


# Where gemm (and gemm_bt) run a product c[m, n] (inner dimension k) in `parts` bands: WHOLE on
# the calling thread up to the load-independent band bound, else in bands, on the pool (POOL)
# above the load-following one-thread bound, one after another on the calling thread (HERE)
# below it: the same bands, so the same bits, whatever the load.
WHOLE, HERE, POOL = 0, 1, 2


@njit(cache=True, nogil=True, inline="always")
def _where(m, n, k, parts):
    """WHOLE, HERE or POOL for c[m, n] = op(a) op(b) with inner dimension k (see above)."""
    if m * n * k <= _band_min() or parts <= 1:
        return WHOLE
    return POOL if m * n * k > _serial_max() else HERE


# ---- one row of c: GEMV ----------------------------------------------------------------------
# c[1, N] = op(a) op(b) (decode: one token's activations times a weight) runs as GEMV, which
# streams b once where sgemm at M = 1 runs several times slower (bench/README.md, "Decode").
# c's columns are cut into one band per pool thread (multiples of GEMV_ALIGN columns), the same
# bands whatever the load, run on the pool or one after another here as gemm's bands are; a
# GEMV element costs about GEMV_WEIGHT of sgemm's multiply-adds, so bounds compare that much.
GEMV_ALIGN, GEMV_WEIGHT = 64, 8


@njit(cache=True, nogil=True, inline="always")
def _gemv_band(p, parts, tb, alpha, a, b, beta, c):
    """Columns of band p of `parts` of c[1, N] = alpha a[1 or K, K or 1] op(b) + beta c."""
    n = c.shape[1]
    k = b.shape[1] if tb else b.shape[0]
    h = (n + parts - 1) // parts
    h = (h + GEMV_ALIGN - 1) // GEMV_ALIGN * GEMV_ALIGN
    j0 = p * h
    j1 = min(n, j0 + h)
    if j0 < j1:
        if tb:                          # b [N, K]: column-major [K, N], transposed
            _xgemv(c[0, j0:], _T, k, j1 - j0, alpha, b[j0:], max(k, 1), a, beta)
        else:                           # b [K, N]: column-major [N, K]
            _xgemv(c[0, j0:], _N, j1 - j0, k, alpha, b[:, j0:], max(n, 1), a, beta)


@njit(cache=True, nogil=True, parallel=True)
def _gemv_bands(tb, alpha, a, b, beta, c, parts):
    for p in prange(parts):
        _gemv_band(p, parts, tb, alpha, a, b, beta, c)


@njit(cache=True, nogil=True)
def _gemv(tb, alpha, a, b, beta, c):
    """c[1, N] = alpha a op(b) + beta c, a one row (or, transposed, one column: the same
    contiguous K elements), OpenBLAS's GEMV on one thread per band."""
    n = c.shape[1]
    k = b.shape[1] if tb else b.shape[0]
    parts = max(1, min(_pool_threads(), (n + GEMV_ALIGN - 1) // GEMV_ALIGN))
    where = _where(GEMV_WEIGHT, n, k, parts)
    if where == POOL:
        _gemv_bands(tb, alpha, a, b, beta, c, parts)
    elif where == HERE:
        for p in range(parts):
            _gemv_band(p, parts, tb, alpha, a, b, beta, c)
    else:
        _gemv_band(0, 1, tb, alpha, a, b, beta, c)


@njit(cache=True, nogil=True)
def gemm_one(ta, tb, alpha, a, b, beta, c):
    """gemm on the calling thread only (OpenBLAS's one thread, in tiles where they pay): for
    library kernels calling it from their own prange (lib_conv's images)."""
    fb, fa, n, m, k, ldb, lda, ldc = _dims(ta, tb, a, b, c)
    if m and n:
        was = one_thread()
        _tiled(ta, tb, alpha, a, lda, b, ldb, beta, c, ldc, m, n, k, _small_max())
        restore_threads(was)


@njit(cache=True, nogil=True)
def gemm(ta, tb, alpha, a, b, beta, c):
    """c[M,N] = alpha * op(a) @ op(b) + beta * c for C-contiguous 2-D float32 or float64
    arrays (sgemm / dgemm; c of one row: GEMV, _gemv), OpenBLAS on one thread throughout: up
    to the band bound whole on the calling thread, above it c's rows in one band per thread of
    numba's pool, the bands run by the pool above the (load-following) one-thread bound, else
    on the calling thread."""
    fb, fa, n, m, k, ldb, lda, ldc = _dims(ta, tb, a, b, c)
    if not (m and n):
        return
    was = one_thread()
    if m == 1 and k > 0:
        _gemv(tb, alpha, a, b, beta, c)
        restore_threads(was)
        return
    parts = min(_pool_threads(), m)
    where = _where(m, n, k, parts)
    if where == POOL:
        _bands(ta, tb, alpha, a, b, beta, c, parts, _small_max())
    elif where == HERE:
        _bands_here(ta, tb, alpha, a, b, beta, c, parts, _small_max())
    else:
        _tiled(ta, tb, alpha, a, lda, b, ldb, beta, c, ldc, m, n, k, _small_max())
    restore_threads(was)


# ---- B transposed: a small B copied into its transpose first --------------------------------------
# OpenBLAS runs c = a b^T well below c = a b where K is small (a weight [N, K] read transposed),
# so copying b into its transpose (N*K elements, once per call) and running the untransposed
# product wins where K is small and c tall, and loses where K is large, hence the bounds of
# lower.transpose_pays (bench/README.md: "Figures behind the code", BLAS): the lowering decides
# (runtime/cpu/lower.py matmul, fused.gemm) and gives the copy its scratch buffer.


@njit(cache=True, nogil=True, inline="always")
def _transpose_into(b, bt):
    """bt[K, N] = b[N, K]^T."""
    n, k = b.shape
    for kk in range(k):
        row = bt[kk]
        for j in range(n):
            row[j] = b[j, kk]


@njit(cache=True, nogil=True, parallel=True)
def _bands_bt(alpha, a, b, beta, c, bts, parts, small):
    """gemm's bands, each thread first copying b^T into its own bts[p]."""
    for p in prange(parts):
        _transpose_into(b, bts[p])
        _band(p, parts, False, False, alpha, a, bts[p], beta, c, small)


def bt_copies() -> int:
    """Copies of b^T gemm_bt's scratch holds (lower.transposed_weight): one per pool thread."""
    return _POOL.value


@njit(cache=True, nogil=True)
def gemm_bt(alpha, a, b, beta, c, bts):
    """c = alpha a b^T + beta c as gemm(a, b^T) with b^T copied into scratch (bts: [copies,
    K, N], bt_copies()): where gemm runs its bands on the pool, each thread copies b^T into a
    copy of its own and runs its band on it (one copy read by both threads ran its products
    slower: each band's reads of the other core's freshly written lines), else one copy and
    gemm's bands (the same bands: the same bits whatever the load; bench/README.md: "Figures
    behind the code", BLAS)."""
    n, k = b.shape
    m = c.shape[0]
    if not (m and n):
        return
    parts = min(_pool_threads(), m, bts.shape[0])
    if _where(m, n, k, parts) == POOL:
        was = one_thread()
        _bands_bt(alpha, a, b, beta, c, bts, parts, _small_max())
        restore_threads(was)
    else:
        _transpose_into(b, bts[0])
        gemm(False, False, alpha, a, bts[0], beta, c)


gemm_f32 = gemm_f64 = gemm      # the names generated kernels import (gemm_<dtype>)
gemm_bt_f32 = gemm_bt_f64 = gemm_bt

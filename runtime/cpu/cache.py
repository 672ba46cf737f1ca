"""The on-disk kernel cache: generated modules as real files named by a content hash.

A module's name hashes its text together with the toolchain (numba, llvmlite, numpy, Python,
host CPU, and the source of runtime/cpu/, whose kernels and helpers generated modules call and
numba compiles into them: numba's cache=True would keep a cached kernel's machine code after a
library kernel it inlined changed) and this cache's format version; decorator options are part
of the text, so a cached
`parallel=False` kernel can never be mistaken for a `parallel=True` one (numba's own cache key
ignores options). Files are compiled with numba `cache=True`, whose machine code lands in the
`__pycache__` beside them, so a second process loads instead of compiling.

Each file's first line is a checksum of the rest: a truncated or edited file is detected and
rewritten, and its numba cache files are dropped. Layout: $JITGRAPH_CACHE_DIR (default
~/.cache/jitgraph) / v<format> / k_<hash>.py (kernels) and d_<hash>.ll (drivers: LLVM IR that
llvmlite compiles in each process, quickly; runtime/cpu/backend.Driver). When that
directory cannot be created or written, one RuntimeWarning says so and the process compiles
into a private temporary cache (removed at exit) instead.

`set_progress(fn)` installs a callback `fn(done, total)` that hears of each kernel a driver
loads or compiles (a front end's progress bar).
"""
from __future__ import annotations

import hashlib
import atexit
import errno
import importlib.util
import os
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from functools import lru_cache
from pathlib import Path

FORMAT = 1
_RUNTIME_CPU = Path(__file__).parent.resolve()   # the CPU runtime's sources (this package)
_CHECK = "# jitgraph-checksum: "     # the first line of a .py module; ";" for .ll (LLVM IR)


def cache_dir() -> Path:
    root = os.environ.get("JITGRAPH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jitgraph")
    d = Path(root) / f"v{FORMAT}"
    if root in _FALLBACK:
        return _FALLBACK[root]
    try:
        d.mkdir(parents=True, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", str(d))
    except OSError as e:
        return _fallback(root, e)
    return d


_FALLBACK = {}   # unusable cache root -> the private temporary cache used instead


def _fallback(root, error) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="jitgraph-cache-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    d = tmp / f"v{FORMAT}"
    d.mkdir()
    _FALLBACK[root] = d
    why = error.strerror or str(error)
    where = f"JITGRAPH_CACHE_DIR={root}" if os.environ.get("JITGRAPH_CACHE_DIR") else root
    warnings.warn(f"kernel cache {where} is not usable ({why}: {error.filename or root}); "
                  f"compiling into a private temporary cache instead (nothing is kept for the "
                  f"next run; set JITGRAPH_CACHE_DIR to a writable directory)", RuntimeWarning,
                  stacklevel=3)
    return d


@lru_cache(maxsize=None)
def toolchain() -> str:
    import llvmlite
    import numba
    import numpy
    from llvmlite import binding
    return (f"jitgraph-cache {FORMAT}; numba {numba.__version__}; llvmlite {llvmlite.__version__}; "
            f"numpy {numpy.__version__}; python {sys.version}; cpu {binding.get_host_cpu_name()}; "
            f"runtime {runtime_source_hash()}")


@lru_cache(maxsize=None)
def runtime_source_hash() -> str:
    """Hash of the CPU runtime's Python sources (runtime/cpu/*.py), part of every module name."""
    h = hashlib.sha256()
    for f in sorted(_RUNTIME_CPU.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def install_runtime_locator() -> None:
    """Make numba's cache of the runtime's own cache=True functions (runtime/cpu/*.py) stale
    whenever any runtime/cpu source changes. numba stamps a cached function with its own file
    only, but machine code cached for lib_conv.py holds the GEMM and helpers it inlined from
    blas.py and lib_common.py: after those changed, the stale entry still loaded (and aborted
    the process once a symbol it called was renamed). Called by the runtime modules that
    define cached functions, before they define them."""
    from numba.core import caching

    class RuntimeLocator(caching._CacheLocator):
        def __init__(self, inner):
            self._inner = inner
            self._py_file = getattr(inner, "_py_file", "")   # numba's "cannot cache" warning

        def get_cache_path(self):
            return self._inner.get_cache_path()

        def get_source_stamp(self):
            return self._inner.get_source_stamp(), runtime_source_hash()

        def get_disambiguator(self):
            return self._inner.get_disambiguator()

        @classmethod
        def from_function(cls, py_func, py_file):
            if Path(py_file).resolve().parent != _RUNTIME_CPU:
                return None
            for other in caching.CacheImpl._locator_classes:
                inner = None if other is cls else other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner)
            return None

    caching.CacheImpl._locator_classes.insert(0, RuntimeLocator)


def module_name(prefix: str, text: str) -> str:
    digest = hashlib.sha256(f"{toolchain()}\n{text}".encode()).hexdigest()
    return f"{prefix}_{digest[:24]}"


def _checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _check(path: Path) -> str:
    return (";" + _CHECK[1:]) if path.suffix == ".ll" else _CHECK


def _is_valid(path: Path, text: str) -> bool:
    try:
        data = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    head, _, rest = data.partition("\n")
    return head == _check(path) + _checksum(rest) and rest == text


def purge(path: Path) -> None:
    """Drop numba's cache files (index and machine code) for module `path`."""
    for f in (path.parent / "__pycache__").glob(path.stem + ".*"):
        try:
            f.unlink()
        except OSError:
            pass


def store(name: str, text: str, suffix: str = ".py") -> tuple[Path, bool]:
    """Make sure module `name` holds `text` on disk (a Python module, or LLVM IR with suffix
    ".ll"); returns (path, True if it was (re)written). Written atomically, so concurrent
    processes never see half a file."""
    path = cache_dir() / f"{name}{suffix}"
    if _is_valid(path, text):
        return path, False
    purge(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_check(path) + _checksum(text) + "\n" + text)
        os.replace(tmp, path)
    except BaseException:       # no stray temporary file, whatever stopped the write
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path, True


def load(path: Path, fresh: bool = False):
    """Import a cached module (once per process unless `fresh`)."""
    modname = f"jitgraph_cache.{path.stem}"
    if not fresh and modname in sys.modules:
        return sys.modules[modname]
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


COUNTS = Counter()   # kernels "compiled" and "loaded" (from numba's disk cache)
_progress = None     # set_progress's callback


def set_progress(fn):
    """Install `fn(done, total)` (None: none), called while a driver's kernels load: (0, total)
    before the first kernel, then after each kernel is compiled or loaded. Returns the previous
    one."""
    global _progress
    old, _progress = _progress, fn
    return old


def _call_progress(done, total):
    if _progress is None:
        return
    try:
        _progress(done, total)
    except Exception:       # a broken progress display never stops compiling
        pass


# ---- compiling kernel modules in helper processes --------------------------------------------
# numba compiles one module at a time, on one core, so a cold compile of many modules leaves the
# other cores idle (bench/README.md: "Figures behind the code", compile). With
# JITGRAPH_COMPILE_WORKERS helper processes (default: one per core beyond the first, at most 3; 0:
# none) the modules not yet in numba's cache are a work queue: this process and each helper take
# the next module no one has claimed (a file created with O_EXCL in a private directory) and
# import it, which compiles it into numba's disk cache; then this process loads the helpers'
# modules from that cache. A helper that fails or hangs costs time only: what it left is compiled
# here.
MIN_PARALLEL_MODULES = 4
HELPER_TIMEOUT = 900.0      # seconds this process waits for the helpers once the queue is empty


def _in_numba_cache(paths) -> set:
    """The modules of `paths` whose numba cache index exists (one listing of each folder)."""
    stems = {}
    for folder in {p.parent for p in paths}:
        try:
            names = os.listdir(folder / "__pycache__")
        except OSError:
            names = []
        stems[folder] = {n.split(".", 1)[0] for n in names if n.endswith(".nbi")}
    return {p for p in paths if p.stem in stems[p.parent]}


def compile_workers() -> int:
    want = os.environ.get("JITGRAPH_COMPILE_WORKERS", "").strip()
    if want:
        if not want.isdigit():
            raise ValueError(f"JITGRAPH_COMPILE_WORKERS={want!r}: expected a count (0: none)")
        return int(want)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(0, min(cores - 1, 3))


def _claim(claims: Path, path: Path) -> bool:
    """Take module `path` from the queue; False if someone else has (or the queue is gone)."""
    try:
        os.close(os.open(claims / path.stem, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except OSError:
        return False


def _helper_count(todo) -> int:
    """Helper processes for the uncached modules `todo`: none below MIN_PARALLEL_MODULES, else
    one per two modules up to compile_workers()."""
    return 0 if len(todo) < MIN_PARALLEL_MODULES else min(compile_workers(), len(todo) // 2)


def _start_helpers(todo, claims):
    n = _helper_count(todo)
    import subprocess
    helpers = []
    for _ in range(n):
        try:
            helpers.append(subprocess.Popen(
                [sys.executable, "-c", "import sys; from jitgraph.runtime.cpu.cache import "
                 "compile_modules; compile_modules(sys.argv[1], sys.argv[2:])", str(claims),
                 *map(str, todo)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**os.environ, "JITGRAPH_COMPILE_WORKERS": "0"}))
        except OSError:
            break
    return helpers


def compile_modules(claims, paths) -> None:
    """A helper process's work: import each module of `paths` it claims (numba compiles it into
    its cache)."""
    from .threading import configure
    configure()
    from numba.np.ufunc.parallel import _launch_threads
    _launch_threads()
    for p in map(Path, paths):
        if _claim(Path(claims), p):
            load(p)


def load_kernels(paths, fresh: bool = False) -> dict:
    """Load the kernel modules at `paths` (compiling each one's cfunc, or loading it from
    numba's cache; uncached ones shared with helper processes, see above), register each
    kernel's address as the symbol `jitgraph_<name>` (what the drivers call) and return
    {name: address}."""
    from llvmlite import binding
    from numba.np.ufunc.parallel import _launch_threads
    _launch_threads()   # cached parallel kernels need the thread pool's symbols
    paths = list(paths)
    cached = set() if fresh else _in_numba_cache(paths)
    todo = [] if fresh else [p for p in paths if p not in cached]
    claims = helpers = None
    if _helper_count(todo):
        claims = Path(tempfile.mkdtemp(prefix="jitgraph-claims-"))
        helpers = _start_helpers(todo, claims)
    out = {}

    def finish(path):
        name = path.stem
        modname = f"jitgraph_cache.{name}"
        fn = getattr(load(path, fresh), name)
        if modname not in _SEEN:
            _SEEN.add(modname)
            COUNTS["compiled" if path in todo or not fn.cache_hits else "loaded"] += 1
        binding.add_symbol(f"jitgraph_{name}", fn.address)
        out[name] = fn.address
        _call_progress(len(out), len(paths))

    _call_progress(0, len(paths))
    try:
        if helpers:
            for path in todo:
                if _claim(claims, path):
                    finish(path)
            for proc in helpers:
                try:
                    proc.wait(HELPER_TIMEOUT)
                except Exception:       # a hung helper: what it left is compiled below
                    break
        for path in paths:
            if path.stem not in out:
                finish(path)
    finally:
        for proc in helpers or ():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if claims is not None:
            shutil.rmtree(claims, ignore_errors=True)
    return out


_SEEN = set()

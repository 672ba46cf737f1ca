"""Data-parallel training over MPI (mpi4py): the same compiled step on N processes, each on its
1/N slice of every global batch, the gradients averaged across processes before the update.

`world()` is None unless the process runs under a launcher with more than one rank
(`mpiexec -n N ...`: MPICH's PMI_SIZE, Open MPI's OMPI_COMM_WORLD_SIZE); then a `World`:

  threads      each rank defaults to cores / ranks on this host for numba's parallel kernels
               and BLAS (JITGRAPH_NUM_THREADS, set before numba starts; BLAS through
               threadpoolctl); a value the user exported wins
  hook         `compile(..., hook=world.hook)`: at the update boundary (passes/boundary.py)
               one in-place `Iallreduce(MPI.IN_PLACE, bucket, SUM)` per gradient bucket (one
               for an all-f32 model: the gradients are one contiguous region of the arena, no
               copy), then a scale by 1/N: every rank applies the same averaged gradient, so
               params stay equal without being broadcast (`check_params` verifies it). With
               accumulate=k the program calls the hook only on the micro-step that applies the
               update, on the accumulated sum.
  shard        this rank's slice of a global batch of sample indices (the batch must divide
               by N; a ValueError says so); the same seed gives every rank the same global
               order, so one command trains the same model whatever N
  first(fn)    rank 0 runs fn (compiling into the kernel cache, whose files are written
               atomically: runtime/cpu/cache.py, numba's index), then the others (loading what it
               compiled), each behind a barrier: every rank has compiled before the first
               collective of a step
  mean / allgather / barrier
               collectives for figures (loss, accuracy), each with a deadline
  abort_on_error()
               a rank that raises prints its error and aborts the job (MPI_Abort): the others
               would otherwise wait in their next collective for ever (mpiexec ends the job when
               a rank is killed, not when one exits normally with an error)

Every collective is non-blocking and waited for with a deadline (`timeout`, default
JITGRAPH_MPI_TIMEOUT or 300 s; the compile barriers: 3600 s): a rank that hangs or dies ends
the job with a message naming the collective, never a silent hang.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time

import numpy as np

SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")
LOCAL_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
TIMEOUT = 300.0            # seconds a step's collective may wait for the other ranks
COMPILE_TIMEOUT = 3600.0   # ... and the barriers around compiling
SPIN = 0.002               # seconds a wait polls without sleeping, then every millisecond

_WORLD = []                # the one World of this process, once made


def launched_size() -> int:
    """Ranks of the job this process was launched in, from the launcher's environment (1 when
    not launched by mpiexec); reads no MPI library."""
    for k in SIZE_VARS:
        v = os.environ.get(k, "")
        if v.isdigit():
            return int(v)
    return 1


def world(timeout: float | None = None):
    """The World of this process when it runs as one of several MPI ranks, else None. The
    first call sets the per-rank threads and initialises MPI (mpi4py); a RuntimeError says
    how to install mpi4py when the job has several ranks but it is missing."""
    if _WORLD:
        return _WORLD[0]
    n = launched_size()
    if n <= 1:
        return None
    set_threads(n)
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(f"this process is one of {n} MPI ranks (mpiexec), but mpi4py is not "
                           f"installed: pip install 'jitgraph[mpi]' (mpi4py and an MPI from "
                           f"wheels)") from None
    if MPI.COMM_WORLD.size <= 1:
        return None
    w = World(MPI.COMM_WORLD, timeout)
    _WORLD.append(w)
    return w


def local_ranks(default: int) -> int:
    """Ranks on this host, from the launcher's environment (else `default`)."""
    for k in LOCAL_VARS:
        v = os.environ.get(k, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    return default


def set_threads(ranks: int) -> int:
    """Threads for this rank: JITGRAPH_NUM_THREADS when exported, else cores / ranks on this
    host (at least 1), for numba (before its thread pool starts) and BLAS (threadpoolctl:
    OpenBLAS is loaded already). Returns the count."""
    env = os.environ
    n = env.get("JITGRAPH_NUM_THREADS", "")
    if not n.isdigit() or int(n) < 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
        n = str(max(1, cores // max(1, local_ranks(ranks))))
        env["JITGRAPH_NUM_THREADS"] = n
    for k in ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(k, n)
    if "numba" in sys.modules:
        cfg = sys.modules["numba"].config
        pool = sys.modules.get("numba.np.ufunc.parallel")
        if pool is not None and pool._is_initialized:
            sys.modules["numba"].set_num_threads(min(int(n), cfg.NUMBA_NUM_THREADS))
        else:
            cfg.NUMBA_NUM_THREADS = int(env["NUMBA_NUM_THREADS"])
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(int(n), user_api="blas")
    except ImportError:
        pass
    return int(n)


class World:
    """This process's place in an MPI job: rank, size, and the collectives training needs."""

    def __init__(self, comm, timeout=None):
        from mpi4py import MPI
        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.rank, comm.size
        env = os.environ.get("JITGRAPH_MPI_TIMEOUT", "")
        self.timeout = float(timeout if timeout is not None else env or TIMEOUT)
        self.threads = int(os.environ.get("JITGRAPH_NUM_THREADS", "1"))
        self.seconds = {"allreduce": 0.0}   # time in the gradient all-reduce (and its waits)
        self.allreduces = 0
        self.checks = 0                     # parameter checks passed (check_params)
        every = os.environ.get("JITGRAPH_MPI_CHECK", "")
        self.check_every = int(every) if every.isdigit() else 0

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def __repr__(self):
        return f"<World rank {self.rank} of {self.size}, {self.threads} thread(s)>"

    # ---- waiting with a deadline ------------------------------------------------------------
    def _wait(self, req, what, timeout=None):
        """Complete request `req`, or end the job when the other ranks do not answer in time."""
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + limit
        while not req.Test():
            now = time.monotonic()
            if now > deadline:
                self._abort(f"no answer from the other ranks for {limit:.0f} s at {what}: a rank "
                            f"died or hangs (JITGRAPH_MPI_TIMEOUT sets the limit); ending the job")
            if now - start < SPIN:
                os.sched_yield()
            else:               # a long wait (another rank compiling): leave the core to it
                time.sleep(0.001)

    def _abort(self, msg, code=1):
        """Print `msg` and end the whole job (MPI_Abort; should that return, this process)."""
        print(f"jitgraph: rank {self.rank} of {self.size}: {msg}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # mpiexec forwards a rank's output asynchronously and MPI_Abort kills the job at once:
        # wait a moment so the message is not lost (rank 0 first: when every rank fails the
        # same way, its message is the one the user reads)
        time.sleep(0.5 if self.rank == 0 else 1.5)
        try:
            self.comm.Abort(code)
        finally:
            os._exit(code)

    # ---- collectives ------------------------------------------------------------------------
    def hook(self, grads) -> None:
        """The update hook: average every gradient bucket across the ranks, in place."""
        t0 = time.perf_counter()
        for buf in grads.buckets.values():
            self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM),
                       f"the gradient all-reduce of step {grads.step}")
            buf *= buf.dtype.type(1.0 / self.size)
        self.seconds["allreduce"] += time.perf_counter() - t0
        self.allreduces += 1

    def barrier(self, what="a barrier", timeout=None) -> None:
        self._wait(self.comm.Ibarrier(), what, timeout)

    def mean(self, values, what="averaging figures"):
        """The mean over the ranks of a float array (or number), as float64."""
        a = np.array(values, np.float64)
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, a, op=self.MPI.SUM), what)
        a /= self.size
        return a if a.ndim else float(a)

    def allgather(self, obj, what="gathering figures") -> list:
        """Every rank's `obj` (picklable), in rank order; the ranks meet at a barrier with a
        deadline first, so the blocking gather cannot wait on a dead rank."""
        self.barrier(what)
        return self.comm.allgather(obj)

    def first(self, fn, what="compiling"):
        """fn() on rank 0, then on the other ranks (which load what rank 0 compiled into the
        kernel cache), each behind a barrier; returns this rank's result."""
        out = fn() if self.is_root else None
        self.barrier(f"{what} (rank 0 first)", COMPILE_TIMEOUT)
        if not self.is_root:
            out = fn()
        self.barrier(f"{what} (the other ranks)", COMPILE_TIMEOUT)
        return out

    # ---- data ---------------------------------------------------------------------------------
    def shard(self, idx):
        """This rank's slice of a global batch `idx` (a ValueError when it does not divide)."""
        n = len(idx)
        if n % self.size:
            raise ValueError(f"a batch of {n} samples does not divide by {self.size} MPI ranks; "
                             f"use a batch size that is a multiple of {self.size}")
        k = n // self.size
        return idx[self.rank * k:(self.rank + 1) * k]

    def split(self, idx):
        """This rank's part of `idx` when it need not divide (np.array_split: sizes differ by
        at most one; a part may be empty), e.g. the samples of a last, partial batch."""
        return np.array_split(np.asarray(idx), self.size)[self.rank]

    def local_batch(self, global_batch: int, flag="--batch-size") -> int:
        if global_batch % self.size:
            raise ValueError(f"{flag} {global_batch} is the global batch and must divide by the "
                             f"{self.size} MPI ranks (each takes 1/{self.size} of every batch)")
        return global_batch // self.size

    # ---- checks -------------------------------------------------------------------------------
    def check_params(self, params, step=None) -> None:
        """Raise RuntimeError unless every rank holds the same bytes in `params` (name ->
        array): a hash per rank, gathered."""
        h = hashlib.blake2b(digest_size=16)
        for k in sorted(params):
            h.update(k.encode())
            h.update(np.ascontiguousarray(params[k]).tobytes())
        hashes = self.allgather(h.hexdigest(), "the parameter check")
        if len(set(hashes)) > 1:
            bad = [r for r, x in enumerate(hashes) if x != hashes[0]]
            when = f" after step {step}" if step else ""
            raise RuntimeError(f"params differ across MPI ranks{when}: ranks {bad} disagree "
                               f"with rank 0")
        self.checks += 1

    def maybe_check(self, program) -> None:
        """check_params every JITGRAPH_MPI_CHECK=N steps of `program` (off when unset)."""
        if self.check_every and program.calls % self.check_every == 0:
            self.check_params(program.params, program.calls)

    @contextlib.contextmanager
    def abort_on_error(self, code=2):
        """A rank that raises prints the error and aborts the whole job (MPI_Abort)."""
        try:
            yield
        except SystemExit as e:
            if e.code not in (0, None):
                self._abort(f"exited with status {e.code}", e.code if isinstance(e.code, int)
                            else code)
            raise
        except BaseException as e:          # noqa: B902 (KeyboardInterrupt too)
            msg = str(e) or type(e).__name__
            self._abort(f"{type(e).__name__}: {msg}; ending the job", code)

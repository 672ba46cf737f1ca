"""Device memory as the executor sees it (runtime/executor.Program, unchanged): a `Region` is a
byte range of one device allocation (what `allocate` returns and the Program slices); a
`DeviceView` is a typed array at a slot of a region (what `view` returns: params, outputs, the
optimizer's per-step scalars), which the Program reads (`.copy()`, `[()]`) and writes
(`[...] = v`, `np.copyto(view, a)`) as it would a numpy array: each read is one device-to-host
copy, each write one host-to-device copy, and nothing else ever crosses (params and optimizer
state stay on the device between steps).

`require()` imports numba.cuda and says clearly why the target cannot run (no numba-cuda, no GPU
and no simulator)."""
from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import numpy as np

ALIGN = 256   # bytes: what cudaMalloc guarantees; the simulator's host arrays are aligned to it


def require():
    """numba.cuda, when a CUDA device (or the simulator) is usable; a RuntimeError otherwise."""
    try:
        from numba import cuda
    except ImportError as e:     # numba without numba-cuda (its own numba.cuda is gone in 0.61+)
        raise RuntimeError("target cuda: numba-cuda is not installed (pip install -e '.[cuda]')"
                           f": {e}") from None
    if not cuda.is_available():
        sim = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
        hint = ("NUMBA_ENABLE_CUDASIM=1 was set after numba.cuda was imported; set it before "
                "the process imports numba" if sim else
                "set NUMBA_ENABLE_CUDASIM=1 (before numba is imported) for the simulator")
        raise RuntimeError("target cuda: no CUDA GPU found (numba.cuda.is_available() is "
                           f"False); {hint}")
    return cuda


def select(index: int = 0):
    """Make GPU `index` the current device of this thread (what `--device N` names) and return
    numba.cuda; a RuntimeError names the cause (no numba-cuda, no GPU, no such device)."""
    cuda = require()
    index = int(index)
    if simulated():
        if index != 0:
            raise RuntimeError(f"target cuda: device {index}: the CUDA simulator has device 0 "
                               f"only")
        return cuda
    count = len(cuda.gpus)
    if not 0 <= index < count:
        raise RuntimeError(f"target cuda: no device {index}: this machine has {count} CUDA "
                           f"device(s), numbered 0..{count - 1}")
    cuda.select_device(index)
    return cuda


def simulated() -> bool:
    from numba import config
    return bool(config.ENABLE_CUDASIM)


_PATCHED = False


def fix_simulator():
    """numba-cuda's simulator (0.30) finds a block's shared array by its source line and makes
    it on first use without a lock, so two threads of a block can each make their own and the
    block computes with two (seen as wrong GEMM tiles, more often with a short GIL switch
    interval). Make that first use atomic; the simulator only."""
    global _PATCHED
    if _PATCHED:
        return
    import sys
    import threading
    import traceback
    from numba.cuda.simulator import kernelapi
    lock = threading.Lock()
    plain = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return plain(self, shape, dtype, alignment)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                if not isinstance(dtype, np.dtype) and hasattr(dtype, "name") and \
                        not isinstance(dtype, type):
                    from numba.np import numpy_support
                    dtype = numpy_support.as_dtype(dtype)
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res
    kernelapi.FakeCUDAShared.array = array
    _PATCHED = True


def device_pointer(d) -> int:
    """The address of a numba device array's first byte (the simulator's: its host array's)."""
    cai = getattr(type(d), "__cuda_array_interface__", None)
    if cai is not None:
        return d.__cuda_array_interface__["data"][0]
    return d._ary.__array_interface__["data"][0]       # simulator: FakeCUDAArray over numpy


def host_array(address: int, nbytes: int, dtype, shape) -> np.ndarray:
    """The caller's host array at `address` (an io table entry) as numpy, no copy."""
    if nbytes == 0:
        return np.zeros(shape, dtype)
    raw = (ctypes.c_ubyte * nbytes).from_address(address)
    return np.frombuffer(raw, np.uint8).view(dtype).reshape(shape)


class Region:
    """Bytes [offset, offset + nbytes) of the device allocation `dev` (a uint8 device array)."""

    def __init__(self, dev, offset: int, nbytes: int):
        self.dev, self.offset, self.nbytes = dev, offset, nbytes
        self.ptr = device_pointer(dev) + offset

    def __getitem__(self, sl):
        if not isinstance(sl, slice) or sl.step not in (None, 1):
            raise TypeError(f"device region: only contiguous byte slices, got {sl!r}")
        lo, hi, _ = sl.indices(self.nbytes)
        return Region(self.dev, self.offset + lo, max(hi - lo, 0))

    def device(self, offset, nbytes, dtype, shape):
        """A numba device array over bytes [offset, offset + nbytes) of this region."""
        dtype = np.dtype(dtype)
        lo = self.offset + offset
        if nbytes == 0:
            return None
        return self.dev[lo:lo + nbytes].view(dtype).reshape(shape)

    def view(self, dtype):
        dtype = np.dtype(dtype)
        return DeviceView(self, 0, (self.nbytes // dtype.itemsize,), dtype)

    def __repr__(self):
        return f"<device region {self.nbytes} B at {self.ptr:#x}>"


class DeviceView:
    """A typed array in device memory at byte `offset` of `region`; host reads and writes copy."""

    def __init__(self, region: Region, offset: int, shape, dtype):
        self.region, self.offset = region, offset
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self.ndim = len(self.shape)
        self.flags = SimpleNamespace(writeable=True, c_contiguous=True, aligned=True)
        self._dev = region.device(offset, self.nbytes, self.dtype, self.shape)

    @property
    def ptr(self) -> int:
        return self.region.ptr + self.offset

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) \
            else tuple(shape)
        if -1 in shape:
            known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
            shape = tuple(self.size // max(known, 1) if d == -1 else d for d in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape a device array of size {self.size} into {shape}")
        return DeviceView(self.region, self.offset, shape, self.dtype)

    def view(self, dtype):
        dtype = np.dtype(dtype)
        return DeviceView(self.region, self.offset, (self.nbytes // dtype.itemsize,), dtype)

    def copy(self) -> np.ndarray:
        """The values on the host (one device-to-host copy)."""
        if self._dev is None:
            return np.zeros(self.shape, self.dtype)
        return self._dev.copy_to_host()

    def __array__(self, dtype=None, copy=None):
        a = self.copy()
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, idx):
        return self.copy()[idx]

    def __setitem__(self, idx, value):
        if self._dev is None:
            return
        if idx is Ellipsis or idx == () and self.ndim == 0:
            host = np.empty(self.shape, self.dtype)
            host[...] = value
        else:
            host = self.copy()
            host[idx] = value
        self._dev.copy_to_device(np.ascontiguousarray(host))

    def __array_function__(self, func, types, args, kwargs):
        if func is np.copyto and args and args[0] is self:
            host = np.empty(self.shape, self.dtype)
            np.copyto(host, *[np.asarray(a) for a in args[1:]], **kwargs)
            self[...] = host
            return None
        conv = [np.asarray(a) if isinstance(a, DeviceView) else a for a in args]
        return func(*conv, **kwargs)

    def __len__(self):
        return self.shape[0]

    def __getattr__(self, name):
        """Any other numpy attribute or method (min, max, flat, ...) of the host copy."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.copy(), name)

    def __repr__(self):
        return f"DeviceView({self.copy()!r})"

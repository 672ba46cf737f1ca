"""A tensor of a file, not yet read: where its bytes lie and what type they are. A compiled
program reads it straight into the param's place in its persistent memory (Program.params[k] =
t calls t.read_into), so loading a model makes no copy of it and runs no Python over its
values; `np.asarray(t)` reads it into a new array."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..errors import ModelFormatError
from ..types import TensorType
from .mapping import map_into, pages

_CHUNK_BYTES = 1 << 24      # the buffer read_converted reads a tensor through


@dataclass(frozen=True)
class FileTensor:
    path: str
    name: str
    offset: int                 # of its first byte in the file
    type: TensorType            # f32 or a storage type (types.STORAGE); numpy dimension order
    # whether its whole pages may be mapped from the file (read_into mapped=True); False:
    # always read (the program's own anonymous pages: huge pages where the kernel gives them,
    # which stream faster than a file's 4 KB pages, for a slower load)
    mappable: bool = True

    @property
    def shape(self) -> tuple:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def nbytes(self) -> int:
        return self.type.nbytes

    @property
    def page_offset(self):
        """Where its first byte lies in a page when the tensor is large enough to be mapped
        (formats/mapping.py), else None: the memory plan puts its slot at that place in a page
        (the compiler reads this attribute, not the file format)."""
        from .mapping import MIN_BYTES, PAGE
        return self.offset % PAGE if self.nbytes >= MIN_BYTES and self.mappable else None

    def read_into(self, out: np.ndarray, mapped: bool = False) -> None:
        """Read the bytes into `out`, a C-contiguous array of exactly nbytes bytes (its
        storage array: TensorType.storage_shape, np_dtype). mapped=True (`out` lies in memory
        its caller owns and no one else sees, a program's persistent region): the whole pages
        that `out` and the file hold at the same place in a page are mapped from the file
        (formats/mapping.py: no copy, a private mapping that writes never reach), the rest read."""
        if not out.flags.c_contiguous or out.nbytes != self.nbytes:
            raise ValueError(f"tensor {self.name}: cannot read {self.nbytes} bytes into an array "
                             f"of {out.nbytes} (contiguous: {out.flags.c_contiguous})")
        view = memoryview(out.reshape(-1).view(np.uint8))
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < self.offset + self.nbytes:       # before mapping: past the end is SIGBUS
                raise ModelFormatError(f"{self.path}: tensor {self.name} is truncated: the file "
                                       f"ends at byte {size}, the tensor's {self.nbytes} bytes "
                                       f"at offset {self.offset} need {self.offset + self.nbytes}")
            whole = pages(out.ctypes.data, self.offset, self.nbytes) \
                if mapped and self.mappable else None
            if whole is not None and map_into(f.fileno(), self.offset + whole[0],
                                              out.ctypes.data + whole[0], whole[1]):
                skip, n = whole
                self._read(f, view, 0, skip)
                self._read(f, view, skip + n, self.nbytes)
            else:
                self._read(f, view, 0, self.nbytes)

    def read_converted(self, out: np.ndarray) -> None:
        """Read the tensor into `out`, a C-contiguous array of its shape in another float type:
        an f32 tensor into bf16 bits (uint16: rounded as ggml, jitgraph.half.bf16_bits), a bf16
        tensor into float32 (exact). It goes a chunk at a time through one buffer of at most
        16 MB, and the file's pages of the tensor are then dropped from the page cache
        (posix_fadvise DONTNEED; pages a mapping holds stay): converting a model's weights at
        load holds neither a second copy of them nor their file's pages."""
        from ..half import bf16_bits
        pair = (self.dtype, np.dtype(out.dtype).name)
        if pair not in (("f32", "uint16"), ("bf16", "float32")):
            raise ValueError(f"tensor {self.name}: cannot read {self.dtype} converted into "
                             f"{out.dtype} (f32 into bf16 bits, or bf16 into float32)")
        if not out.flags.c_contiguous or tuple(out.shape) != tuple(self.shape):
            raise ValueError(f"tensor {self.name}: cannot read {self.type} into an array of "
                             f"shape {list(out.shape)} (contiguous: {out.flags.c_contiguous})")
        src = np.dtype(np.float32 if self.dtype == "f32" else np.uint16)
        flat = out.reshape(-1)
        per = max(1, min(flat.size, _CHUNK_BYTES // src.itemsize))
        buf = np.empty(per, src)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < self.offset + self.nbytes:
                raise ModelFormatError(f"{self.path}: tensor {self.name} is truncated: the file "
                                       f"ends at byte {size}, the tensor's {self.nbytes} bytes "
                                       f"at offset {self.offset} need {self.offset + self.nbytes}")
            for lo in range(0, flat.size, per):
                n = min(per, flat.size - lo)
                chunk = buf[:n]
                self._read(f, memoryview(chunk.view(np.uint8)), 0, n * src.itemsize,
                           at=lo * src.itemsize)
                if src == np.float32:
                    bf16_bits(chunk, out=flat[lo:lo + n])
                else:
                    wide = chunk.astype(np.uint32)
                    wide <<= 16
                    flat[lo:lo + n] = wide.view(np.float32)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), self.offset, self.nbytes, os.POSIX_FADV_DONTNEED)

    def _read(self, f, view, lo, hi, at=0):
        """Bytes at+lo..at+hi of the tensor into view[lo:hi]."""
        f.seek(self.offset + at + lo)
        done = lo
        while done < hi:
            n = f.readinto(view[done:hi])
            if not n:
                raise ModelFormatError(f"{self.path}: tensor {self.name} is truncated: "
                                       f"{at + done} of {self.nbytes} bytes at offset "
                                       f"{self.offset}")
            done += n

    def __array__(self, dtype=None, copy=None):
        a = np.empty(self.type.storage_shape, self.type.np_dtype)
        self.read_into(a)
        return a if dtype is None else a.astype(dtype)

    def f32(self) -> np.ndarray:
        """Its values as f32 (dequantized as ggml does: jitgraph/quant.py)."""
        from ..quant import dequantize
        a = np.asarray(self)
        return a if not self.type.is_storage else dequantize(a, self.type)


def materialize(params: dict) -> dict:
    """`params` with every FileTensor read and turned into f32."""
    return {k: v.f32() if isinstance(v, FileTensor) else v for k, v in params.items()}

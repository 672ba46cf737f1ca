"""A file's pages mapped into memory a program owns: the whole pages of a tensor's bytes replace
the pages of its place in the program's region (mmap MAP_FIXED | MAP_PRIVATE over them), so a
weight whose file is in the page cache costs no copy and no fresh memory, and its pages are read
from disk only when first used. The mapping is private: the program may write into its pages
(each page written becomes its own copy), the file never changes. Linux only; elsewhere, or
where the kernel refuses, the caller reads the bytes instead.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

PAGE = mmap.PAGESIZE
MIN_BYTES = 4 * PAGE        # smaller tensors are read: a mapping per few pages does not pay

_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10
_MADV_WILLNEED = 3
_libc = None


def _c():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc = libc
    return _libc


def pages(address: int, offset: int, nbytes: int):
    """(skip, n): the bytes skip..skip+n of a tensor at file `offset`, to lie at memory `address`,
    that are whole pages in both (their place in a page must agree); None when none are."""
    if sys.platform != "linux" or nbytes < MIN_BYTES or (address - offset) % PAGE:
        return None
    skip = -address % PAGE
    n = (nbytes - skip) // PAGE * PAGE
    return (skip, n) if n > 0 else None


def map_into(fd: int, offset: int, address: int, nbytes: int) -> bool:
    """Map the file's bytes offset..offset+nbytes (whole pages, as `pages` gave them) at memory
    `address` (inside an array the caller owns, which it replaces); asks the kernel to start
    reading them (MADV_WILLNEED). False when the kernel refuses (the caller then reads them)."""
    libc = _c()
    got = libc.mmap(address, nbytes, _PROT_RW, mmap.MAP_PRIVATE | _MAP_FIXED, fd, offset)
    if got != address:
        # a failed MAP_FIXED may have dropped the pages there: put fresh ones back to read into
        libc.mmap(address, nbytes, _PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED,
                  -1, 0)
        return False
    libc.madvise(address, nbytes, _MADV_WILLNEED)
    return True


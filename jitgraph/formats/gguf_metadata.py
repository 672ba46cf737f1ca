"""A GGUF file's metadata (the key/value section), read fast: a vocabulary's hundreds of thousands
of token and merge strings in well under a second (gguf.GGUFReader builds a numpy array per
string). Every length is checked against the file's size; a malformed file raises
jitgraph.ModelFormatError naming it.
"""
from __future__ import annotations

import mmap
import os
import struct

from ..errors import ModelFormatError

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


def read_metadata(path, prefix: str | tuple = "") -> dict:
    """{key: value} of the GGUF file at `path` whose keys start with `prefix`: ints, floats,
    bools, str, and lists of them for arrays (the others are skipped, not decoded)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ModelFormatError(f"{path}: not a GGUF file ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as buf:
            return _parse(buf, size, path, prefix)


def _parse(buf, size, path, prefix):
    if bytes(buf[:4]) != b"GGUF":
        raise ModelFormatError(f"{path}: not a GGUF file (starts with {bytes(buf[:4])!r})")
    order = "<" if int.from_bytes(buf[4:8], "little") in (2, 3) else ">"
    version = int.from_bytes(buf[4:8], "little" if order == "<" else "big")
    if version not in (2, 3):
        raise ModelFormatError(f"{path}: unsupported GGUF version {version}")
    u64 = struct.Struct(order + "Q")
    pos = 24
    _, n_kv = struct.unpack_from(order + "QQ", buf, 8)

    def fail(what):
        raise ModelFormatError(f"{path}: truncated or corrupt metadata: {what} at offset {pos} "
                               f"runs past the end of the file ({size} bytes)")

    def text(what):
        nonlocal pos
        if pos + 8 > size:
            fail(what)
        (n,) = u64.unpack_from(buf, pos)
        if pos + 8 + n > size:
            fail(what)
        s = bytes(buf[pos + 8:pos + 8 + n])
        pos += 8 + n
        try:
            return s.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFormatError(f"{path}: {what} is not valid UTF-8: {s[:40]!r}") from None

    out = {}
    for _ in range(n_kv):
        key = text("a metadata key")
        if pos + 4 > size:
            fail(f"the type of {key!r}")
        (vtype,) = struct.unpack_from(order + "I", buf, pos)
        pos += 4
        keep = key.startswith(prefix)
        if vtype in _SCALARS:
            st = struct.Struct(order + _SCALARS[vtype])
            if pos + st.size > size:
                fail(repr(key))
            if keep:
                out[key] = st.unpack_from(buf, pos)[0]
            pos += st.size
        elif vtype == _STRING:
            v = text(repr(key))
            if keep:
                out[key] = v
        elif vtype == _ARRAY:
            if pos + 12 > size:
                fail(f"the array header of {key!r}")
            itype, count = struct.unpack_from(order + "IQ", buf, pos)
            pos += 12
            if itype in _SCALARS:
                if count * struct.calcsize(_SCALARS[itype]) > size - pos:
                    fail(f"{key!r} ({count} elements)")
                st = struct.Struct(f"{order}{count}{_SCALARS[itype]}")
                if keep:
                    out[key] = list(st.unpack_from(buf, pos))
                pos += st.size
            elif itype == _STRING:
                if count * 8 > size - pos:
                    fail(f"{key!r} ({count} strings)")
                if keep:        # text() inline: a vocabulary has 10^5 strings
                    vals, unpack = [], u64.unpack_from
                    for _ in range(count):
                        end = pos + 8 + (unpack(buf, pos)[0] if pos + 8 <= size else size)
                        if end > size:
                            fail(f"a string of {key!r}")
                        try:
                            vals.append(str(buf[pos + 8:end], "utf-8"))
                        except UnicodeDecodeError:
                            text(f"a string of {key!r}")        # raises, naming it
                        pos = end
                    out[key] = vals
                else:
                    for _ in range(count):
                        if pos + 8 > size:
                            fail(f"a string of {key!r}")
                        pos += 8 + u64.unpack_from(buf, pos)[0]
            else:
                raise ModelFormatError(f"{path}: metadata {key!r} is an array of type {itype}, "
                                       f"which this reader does not read")
        else:
            raise ModelFormatError(f"{path}: metadata {key!r} has unknown value type {vtype}")
    return out


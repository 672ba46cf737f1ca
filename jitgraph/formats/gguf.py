"""GGUF files in ggml's MNIST layout (examples/mnist): models that ggml's mnist-eval can evaluate,
and training checkpoints.

A model file has `general.architecture` (a key of jitgraph.models.MODELS) and one F32 tensor per
param under ggml's name and dimension order (the model's GGMLTensor table converts). A checkpoint is
a model file plus the optimizer state as tensors `state.<name>` (jitgraph layout, any dtype gguf
stores) and a JSON object under `jitgraph.checkpoint` (step counter, RNG state, ...), so
load_model (and ggml) can read a checkpoint too. A checkpoint keeps every value in the type the
program stores it in: bf16 values (bf16 master weights, bf16 moments: uint16 bits) are BF16
tensors holding those bits, which load_checkpoint gives back as uint16 bits and load_model as
their f32 values (exact). Writes are atomic, and stream: the header and every tensor's info
are written first, then each tensor's data in turn (add_tensor_later: made, written, dropped).
Loading checks every count and size in the header against the file's length before it
allocates anything; a malformed, truncated or mismatched file raises jitgraph.ModelFormatError
(a ValueError) naming the file.
"""
from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct

import gguf
import numpy as np

from ..errors import ModelFormatError
from ..types import ShapeError, TensorType
from .paths import temp_path

ARCH_KEY = "general.architecture"
CHECKPOINT_KEY = "jitgraph.checkpoint"
DATA_KEY = "jitgraph.data"          # what a model was trained on: "mnist", "synthetic"
STATE_PREFIX = "state."
_STATE_DTYPES = (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64)


def _spec(arch, path):
    from ..models import MODELS
    if arch not in MODELS:
        raise ValueError(f"{path}: unknown architecture {arch!r} (expected one of {sorted(MODELS)})")
    return MODELS[arch]


def save_model(path, arch: str, params: dict, data: str | None = None) -> None:
    """Write `params` (jitgraph layout, by param name) as ggml's `arch` model, F32 tensors;
    `data` (e.g. "mnist" or "synthetic") records what it was trained on, under DATA_KEY."""
    _write(path, arch, _spec(arch, path).to_ggml(params), _data_strings(data))


def load_model(path, arch: str | None = None) -> tuple[str, dict]:
    """(arch, f32 params in jitgraph layout) from a model or checkpoint file (a checkpoint's
    bf16 weights as their f32 values); `arch`, if given, must match the file's."""
    arch, params, _, _ = _load(path, arch)
    return arch, {k: bf16_values(v) for k, v in params.items()}


def save_checkpoint(path, arch: str, params: dict, state: dict, meta: dict,
                    data: str | None = None) -> None:
    """Params (as save_model, but bf16 ones, uint16 bits, as BF16 tensors of those bits),
    optimizer `state` arrays (stored as they are; bf16 state, uint16 bits, as BF16 tensors) and
    a JSON-able `meta` dict (e.g. {"step": 12, "rng": generator.bit_generator.state}); `data`
    as in save_model."""
    tensors = _spec(arch, path).to_ggml(params, keep_bf16=True)
    for k, v in state.items():
        v = np.asarray(v)
        if v.dtype.type not in _STATE_DTYPES and v.dtype != np.uint16:
            raise ValueError(f"{path}: state {k} has dtype {v.dtype}; GGUF stores "
                             f"{', '.join(np.dtype(t).name for t in _STATE_DTYPES)} and "
                             f"uint16 (bf16 bits)")
        tensors[STATE_PREFIX + k] = v
    _write(path, arch, tensors, {**_data_strings(data),
                                 CHECKPOINT_KEY: json.dumps(meta, default=_numpy_scalar)})


def load_checkpoint(path, arch: str | None = None) -> tuple[str, dict, dict, dict]:
    """(arch, params, state, meta) as given to save_checkpoint: BF16 tensors as uint16 bits,
    which a program's bf16 slots take bit for bit (I16 state, as older checkpoints stored bf16
    moments, the program's state takes back as bits too)."""
    arch, params, state, meta = _load(path, arch)
    if meta is None:
        raise ModelFormatError(f"{path}: a model file, not a training checkpoint (no "
                               f"{CHECKPOINT_KEY})")
    return arch, params, state, meta


def _numpy_scalar(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"checkpoint meta: {type(o).__name__} is not JSON-serialisable (store arrays "
                    f"in `state`)")


def bf16_values(a):
    """Array `a` as f32 values when it holds bf16 bits (uint16, as checkpoints give bf16 values
    back), else `a`."""
    from ..half import to_f32
    return to_f32(a, "bf16") if a.dtype == np.uint16 else a


def add_stored(writer, name, a) -> None:
    """Add array `a` to a GGUFWriter as the type it holds: bf16 bits (uint16) as a BF16 tensor
    of those bits, anything else as gguf stores its dtype."""
    a = np.asarray(a, order="C")
    if a.dtype == np.uint16:
        writer.add_tensor(name, a.reshape(a.shape or (1,)).view(np.uint8),
                          raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        writer.add_tensor(name, a)


# ---- files -------------------------------------------------------------------------------------
def _data_strings(data):
    return {} if data is None else {DATA_KEY: str(data)}


def trained_on(path) -> str | None:
    """The DATA_KEY string of a model or checkpoint file: what it was trained on ("mnist",
    "synthetic"); None when the file records nothing (e.g. a model written by ggml)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        kv, _, _ = _header(f, path)
    return _string(kv, DATA_KEY, path)


@contextlib.contextmanager
def gguf_writer(path, arch):
    """`with gguf_writer(path, arch) as w:` add metadata and tensors to the gguf.GGUFWriter `w`;
    on leaving the block it is written to a temporary file next to `path`, fsynced and renamed
    over `path`: readers see the old file or the new one, never a partial one. The temporary
    file is removed on every exit, exceptions included (KeyboardInterrupt, and SIGTERM where
    the program turns it into an exception, as the CLI does); errors name `path`, never the
    temporary file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = temp_path(path)
    w = None
    try:
        w = gguf.GGUFWriter(tmp, arch)
        yield w
        w.write_header_to_file()
        w.write_kv_data_to_file()
        _write_tensors(w, path)
        w.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:                    # name the user's path, not the temporary file
        if os.path.isdir(path):
            raise IsADirectoryError(e.errno, "is a directory, not a file name", path) from None
        if e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror, path) from None
    finally:
        if tmp is not None:                 # failed or interrupted: no partial file is left
            for f in (getattr(w, "fout", None) or ()):
                try:
                    f.close()
                except Exception:
                    pass
            try:
                os.unlink(tmp)
            except OSError:
                pass
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Later:
    """A tensor's data that add_tensor_later's `make` gives when the file's data is written."""

    def __init__(self, make):
        self.make = make


_PIECE_BYTES = 1 << 24      # add_weight_later converts a weight this many f32 bytes at a time


def add_tensor_later(writer, name, shape, ttype, make) -> None:
    """Add to a gguf_writer's writer a tensor of numpy `shape` and ggml type `ttype` whose data
    is made when the file is written: `make()` gives its bytes as arrays (any dtype, native
    byte order) that are written one after another and dropped once written, together exactly
    the type's bytes for that shape. A model converted as it is written (--ftype, bf16 master
    weights as f32 values) holds one converted piece of one tensor at a time."""
    block, size = gguf.GGML_QUANT_SIZES[ttype]
    shape = tuple(int(d) for d in shape)
    if shape and shape[-1] % block:
        raise ShapeError(f"tensor {name}: shape {list(shape)} does not fit {ttype.name}'s blocks "
                         f"of {block}")
    writer.add_tensor_info(name, shape, np.dtype(np.float32), math.prod(shape) // block * size,
                           raw_dtype=ttype)
    writer.tensors[-1][name].tensor = _Later(make)


def _write_tensors(w, path):
    """The tensor infos, then each tensor's data in turn, laid out as
    GGUFWriter.write_tensors_to_file lays them out (the data section aligned, each tensor
    padded to the alignment): an add_tensor_later tensor's pieces are made and written one at a
    time, and the writer lets go of each tensor once written."""
    from gguf.gguf_writer import WriterState
    w.write_ti_data_to_file()
    for fout in w.fout:
        w.write_padding(fout, fout.tell())
    for fout, tensors in zip(w.fout, w.tensors):
        for name, ti in list(tensors.items()):
            data, ti.tensor = ti.tensor, None
            if not isinstance(data, _Later):        # add_tensor swapped its bytes already
                data = np.asarray(data)
                _check_bytes(path, name, ti, data.nbytes)
                w.write_tensor_data(data, tensor_endianess=w.endianess)
                continue
            del tensors[name]                       # as write_tensor_data pops it
            w.write_padding(fout, fout.tell())
            done = 0
            for piece in data.make():
                piece = np.ascontiguousarray(piece)
                done += piece.nbytes
                if done > ti.nbytes:
                    break
                piece.tofile(fout)
                del piece
            _check_bytes(path, name, ti, done)
            w.write_padding(fout, ti.nbytes)
            w.state = WriterState.WEIGHTS


def _check_bytes(path, name, ti, nbytes):
    if nbytes != ti.nbytes:
        raise ValueError(f"{path}: tensor {name}: {nbytes} bytes of data (or more) for its "
                         f"{ti.nbytes} bytes ({ti.dtype.name} {list(ti.shape)})")


def _write(path, arch, tensors, strings):
    """GGUF with `strings` metadata and `tensors`, written atomically (gguf_writer)."""
    with gguf_writer(path, arch) as w:
        for k, v in strings.items():
            w.add_string(k, v)
        for name, a in tensors.items():
            add_stored(w, name, a)


# ---- reading -----------------------------------------------------------------------------------
# The header is parsed here, not by gguf.GGUFReader: that reader trusts the counts it reads (an
# array declaring 2**62 elements in a 200-byte file makes it loop forever, growing lists). Every
# count, length and tensor extent is checked against the bytes left in the file before anything is
# read or allocated, so what a file can make this code allocate is bounded by the file's size.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}                                   # GGUFValueType -> struct format
_STRING, _ARRAY = int(gguf.GGUFValueType.STRING), int(gguf.GGUFValueType.ARRAY)
_MAX_DIMS = 4                                          # GGML_MAX_DIMS: ggml reads no more
_MIN_KV, _MIN_TENSOR_INFO = 8 + 4 + 1, 8 + 4 + 4 + 8    # bytes: empty key + type + u8; empty name
_NUMPY = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
          gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
          gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
          gguf.GGMLQuantizationType.I64: np.int64}
# types read as their bits (no numpy float type): BF16 as uint16, the array of a bf16 value
_BITS = {gguf.GGMLQuantizationType.BF16: np.uint16}


class _Cursor:
    """Bounds-checked reads from a file's bytes (`buf`, the file memory-mapped) of known size;
    errors name the file."""

    def __init__(self, buf, size, path):
        self.buf, self.size, self.path, self.pos, self.order = buf, size, path, 0, "<"

    def fail(self, msg):
        raise ModelFormatError(f"{self.path}: {msg}")

    def need(self, n, what):
        if n > self.size - self.pos:
            self.fail(f"truncated or corrupt: {what} needs {n} bytes at offset {self.pos}, but the "
                      f"file ({self.size} bytes) has {self.size - self.pos} left")

    def take(self, n, what):
        self.need(n, what)
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def skip(self, n, what):
        self.need(n, what)
        self.pos += n

    def skip_strings(self, count, what):
        """Past `count` strings (a length, then its bytes, each), every length checked."""
        buf, size, pos = self.buf, self.size, self.pos
        u64 = struct.Struct(self.order + "Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"a string length in {what}")
            n = u64(buf, pos)[0]
            if n > size - pos - 8:
                self.pos = pos + 8
                self.need(n, f"a string in {what} (declared {n} bytes long)")
            pos += 8 + n
        self.pos = pos

    def unpack(self, fmt, what):
        fmt = self.order + fmt
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def text(self, what):
        (n,) = self.unpack("Q", f"the length of {what}")
        raw = self.take(n, f"{what} (declared {n} bytes long)")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8: {raw[:40]!r}")


def _value(cur, vtype, key):
    """One metadata value: a scalar, bytes (strings, decoded on use) or ("array", type, count)
    (arrays are skipped: no jitgraph key holds one)."""
    what = f"metadata {key!r}"
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype], what)[0]
    if vtype == _STRING:
        (n,) = cur.unpack("Q", f"the length of {what}")
        return cur.take(n, f"{what} (a string declared {n} bytes long)")
    if vtype != _ARRAY:
        cur.fail(f"{what} has unknown value type {vtype}")
    itype, count = cur.unpack("IQ", f"the array header of {what}")
    if itype in _SCALARS:
        cur.skip(count * struct.calcsize(_SCALARS[itype]), f"{what} (an array declared to hold "
                                                           f"{count} elements of type {itype})")
    elif itype == _STRING:
        cur.need(count * 8, f"{what} (an array declared to hold {count} strings)")
        cur.skip_strings(count, what)
    else:
        inner = "arrays" if itype == _ARRAY else f"unknown type {itype}"
        cur.fail(f"{what} is an array of {inner}")
    return ("array", itype, count)


def _header(f, path):
    """(metadata {key: (type, value)}, tensor infos [(name, type, dims, start, nbytes)], byte
    order), every tensor's data checked to lie inside the file, no two overlapping, and none
    followed by more than padding (_check_extent)."""
    size = os.fstat(f.fileno()).st_size
    if size < 24:
        raise ModelFormatError(f"{path}: not a GGUF file: {size} bytes, shorter than a GGUF "
                               f"header (24)")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return _parse_header(_Cursor(m, size, path), size)


def _parse_header(cur, size):
    magic = cur.take(4, "the magic")
    if magic != b"GGUF":
        cur.fail(f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    raw = cur.take(4, "the version")
    version = int.from_bytes(raw, "little")
    if version & 0xFFFF == 0 and version:            # written on a big-endian machine
        cur.order, version = ">", int.from_bytes(raw, "big")
    if version not in (2, 3):
        cur.fail(f"unsupported GGUF version {version} (this reader reads 2 and 3)")
    n_tensors, n_kv = cur.unpack("QQ", "the tensor and metadata counts")
    left = size - cur.pos
    if n_kv > left // _MIN_KV:
        cur.fail(f"corrupt header: it declares {n_kv} metadata entries, but the {left} bytes "
                 f"after it hold at most {left // _MIN_KV}")
    if n_tensors > (left - n_kv * _MIN_KV) // _MIN_TENSOR_INFO:
        cur.fail(f"corrupt header: it declares {n_tensors} tensors, but the {left} bytes after "
                 f"it hold at most {(left - n_kv * _MIN_KV) // _MIN_TENSOR_INFO} tensor infos")
    kv = {}
    for i in range(n_kv):
        key = cur.text(f"metadata key {i}")
        if key in kv:
            cur.fail(f"metadata key {key!r} appears twice")
        (vtype,) = cur.unpack("I", f"the type of metadata {key!r}")
        kv[key] = (vtype, _value(cur, vtype, key))
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in kv:
        vtype, alignment = kv["general.alignment"]
        if vtype != int(gguf.GGUFValueType.UINT32) or not alignment or alignment & (alignment - 1):
            cur.fail(f"general.alignment must be a power of two stored as UINT32, got "
                     f"{alignment!r}")
    infos, names = [], set()
    for i in range(n_tensors):
        name = cur.text(f"the name of tensor {i}")
        if name in names:
            cur.fail(f"tensor {name!r} appears twice")
        names.add(name)
        (ndim,) = cur.unpack("I", f"the rank of tensor {name!r}")
        if ndim > _MAX_DIMS:
            cur.fail(f"tensor {name!r} declares {ndim} dimensions (GGUF allows {_MAX_DIMS})")
        dims = cur.unpack(f"{ndim}Q", f"the shape of tensor {name!r}")
        if math.prod(d for d in dims if d) >= 2 ** 59:    # ggml and numpy reject these too
            cur.fail(f"tensor {name!r}: impossible shape {list(dims)}")
        (ttype,) = cur.unpack("I", f"the type of tensor {name!r}")
        try:
            ttype = gguf.GGMLQuantizationType(ttype)
            block, type_size = gguf.GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            cur.fail(f"tensor {name!r} has unknown type {ttype}")
        if dims and dims[0] % block:
            cur.fail(f"tensor {name!r}: shape {list(dims)} does not fit {ttype.name}'s blocks of "
                     f"{block}")
        (offset,) = cur.unpack("Q", f"the data offset of tensor {name!r}")
        if offset % alignment:
            cur.fail(f"tensor {name!r}: data offset {offset} is not a multiple of the alignment "
                     f"{alignment}")
        infos.append((name, ttype, dims, offset, math.prod(dims) // block * type_size))
    data = cur.pos + (-cur.pos) % alignment
    infos = [(name, t, dims, data + off, nbytes) for name, t, dims, off, nbytes in infos]
    placed = sorted(infos, key=lambda i: (i[3], i[4]))
    end = data
    for name, _, dims, start, nbytes in placed:
        if start + nbytes > size:
            cur.fail(f"truncated or corrupt: tensor {name!r} ({list(dims)}, {nbytes} bytes at "
                     f"offset {start}) runs past the end of the file ({size} bytes)")
        if start < end:
            cur.fail(f"corrupt: tensor {name!r} overlaps the data of another tensor")
        end = start + nbytes
    for info, after in zip(placed, [i[3] for i in placed[1:]] + [size]):
        _check_extent(cur, info, after - info[3] - info[4], alignment)
    return kv, infos, cur.order


def _check_extent(cur, info, gap, alignment):
    """ggml lays the tensors' data out back to back, each padded to the alignment: more than
    padding after a tensor means its data is larger than its declared type and shape say (an F32
    tensor labelled Q4_0), which reading would silently misinterpret."""
    if gap < alignment:
        return
    name, ttype, dims, _, nbytes = info
    cur.fail(f"tensor {name!r}: {ttype.name} {list(dims)} is {nbytes} bytes, but {nbytes + gap} "
             f"bytes lie before the next tensor's data (or the file's end); its declared type or "
             f"shape is wrong")


def _string(kv, key, path):
    vtype, value = kv.get(key, (None, None))
    if vtype != _STRING:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise ModelFormatError(f"{path}: {key} is not valid UTF-8: {value[:40]!r}") from None


def _tensor(f, path, order, name, ttype, dims, start, nbytes):
    """A tensor's data as a native-order numpy array, shape = reversed ne (numpy order); BF16
    as uint16 bits."""
    kinds = {**_NUMPY, **_BITS}
    if ttype not in kinds:
        raise ModelFormatError(f"{path}: tensor {name!r} is {ttype.name}; jitgraph reads "
                               f"{', '.join(t.name for t in kinds)}")
    dtype = np.dtype(kinds[ttype]).newbyteorder(order)
    a = np.empty(nbytes // dtype.itemsize, dtype)
    f.seek(start)
    if f.readinto(memoryview(a).cast("B")) != nbytes:
        raise ModelFormatError(f"{path}: the file shrank while tensor {name!r} was read")
    return a.reshape(tuple(reversed(dims))).astype(a.dtype.newbyteorder("="), copy=False)


def type_as(shape, ftype: str) -> str:
    """The type add_tensor_as stores a tensor of numpy `shape` in for `ftype` (WRITE_TYPES): a
    matrix in `ftype`, F16 where its rows are not whole blocks of the type (as llama.cpp's
    converters fall back), anything else F32."""
    from ..quant import WRITE_TYPES
    from ..types import STORAGE
    if ftype not in WRITE_TYPES:
        raise ValueError(f"cannot write tensors as {ftype!r}; expected one of "
                         f"{', '.join(WRITE_TYPES)}")
    dt = ftype if len(shape) == 2 else "f32"
    if dt != "f32" and shape[1] % STORAGE[dt][1]:
        dt = "f16"
    return dt


def add_tensor_as(writer, name, a, ftype: str) -> None:
    """Add f32 array `a` to a GGUFWriter in the type type_as gives (as ggml's reference
    quantizers round: jitgraph/quant.py)."""
    dt = type_as(a.shape, ftype)
    if dt == "f32":
        writer.add_tensor(name, np.ascontiguousarray(a, np.float32))
        return
    from ..quant import ggml_type
    writer.add_tensor(name, _converted(name, a, dt).view(np.uint8), raw_dtype=ggml_type(dt))


def add_weight_later(writer, name, a, ftype: str) -> None:
    """Add a weight to a gguf_writer's writer in the type type_as gives, converted only when
    the file's data is written (add_tensor_later: a block of rows at a time). `a`: an
    f32 array, bf16 bits (uint16: bf16 master weights; BF16 is written as those bits, any
    other type from their f32 values, exact) or a formats.tensors.FileTensor (read then; a
    BF16 one written as BF16 as its bits)."""
    from ..quant import ggml_type
    dt = type_as(np.shape(a), ftype)
    ttype = gguf.GGMLQuantizationType.F32 if dt == "f32" else ggml_type(dt)
    add_tensor_later(writer, name, np.shape(a), ttype, lambda: _weight_pieces(name, a, dt))


def _weight_pieces(name, a, dt):
    """The data of weight `a` (as add_weight_later takes it) in storage type or f32 `dt`, as
    arrays to write one after another: a weight whose values must be converted goes a block of
    rows at a time (_PIECE_BYTES of f32; each type stores rows independently, so the bytes are
    those of the whole converted at once)."""
    from ..half import to_f32
    from .tensors import FileTensor
    if isinstance(a, FileTensor):
        if a.dtype == dt == "bf16" or a.dtype == dt == "f32":
            yield np.asarray(a)
            return
        a = a.f32()
    a = np.asarray(a)
    bits = a.dtype == np.uint16                     # bf16 bits
    if (bits and dt == "bf16") or (not bits and dt == "f32" and a.dtype == np.float32):
        yield a                                     # as they are: no copy
        return
    if a.ndim != 2:
        yield to_f32(a, "bf16") if bits else np.asarray(a, np.float32)
        return
    rows = max(1, _PIECE_BYTES // max(1, 4 * a.shape[1]))
    for lo in range(0, a.shape[0], rows):
        x = a[lo:lo + rows]
        x = to_f32(x, "bf16") if bits else np.ascontiguousarray(x, np.float32)
        yield x if dt == "f32" else _converted(name, x, dt, lo)
        del x


def _converted(name, a, dt, row=0):
    """f32 array `a` in storage type `dt` (f16, bf16, q8_0), its bytes' array; `a` holds the
    weight's rows from `row` on (named in errors)."""
    from ..quant import quantize
    try:        # the CPU backend's quantizers: the same bits, compiled (a 1B model in seconds)
        from ..runtime.cpu.lib_quant import KINDS, quantize_rows
    except ImportError:
        KINDS, quantize_rows = None, None
    try:
        with np.errstate(over="ignore"):            # f16: beyond its range is inf, as ggml
            q = quantize_rows(KINDS[dt], a) if quantize_rows else quantize(a, dt)
    except ValueError as e:
        where = f" (in its rows {row}..{row + len(a) - 1})" if row else ""
        raise ValueError(f"tensor {name}: cannot store it as {dt}{where}: {e}") from None
    return q


def tensor_f32(f, path, order, name, ttype, dims, start, nbytes):
    """A tensor's values as f32 (numpy order): a numeric type converted, a block type
    dequantized as ggml does (jitgraph/quant.py for the storage types, gguf.quants for the
    others it knows)."""
    from ..quant import dequantize, storage_name
    if ttype in _NUMPY:
        return np.asarray(_tensor(f, path, order, name, ttype, dims, start, nbytes), np.float32)
    shape = tuple(reversed(dims))
    raw = np.empty(nbytes, np.uint8)
    f.seek(start)
    if f.readinto(memoryview(raw)) != nbytes:
        raise ModelFormatError(f"{path}: the file shrank while tensor {name!r} was read")
    kind = storage_name(ttype)
    if kind is not None:
        return dequantize(raw, TensorType(kind, shape))
    try:
        return gguf.quants.dequantize(raw.reshape(shape[:-1] + (-1,)), ttype).astype(
            np.float32).reshape(shape)
    except (NotImplementedError, gguf.quants.QuantError, KeyError, ValueError) as e:
        raise ModelFormatError(f"{path}: tensor {name!r}: cannot read type {ttype.name} "
                               f"({e})") from None


def _read(path, want_arch=None):
    """(arch, {name: (ggml type, array)}, checkpoint meta text or None). Missing or unreadable
    files raise OSError; anything wrong inside one, ModelFormatError naming the file. The
    architecture is checked before any tensor data is read."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        try:
            kv, infos, order = _header(f, path)
        except OSError as e:          # e.g. a directory or device that reads fail on
            raise ModelFormatError(f"{path}: cannot read it as a GGUF file ({e})") from None
        arch, meta = _string(kv, ARCH_KEY, path), _string(kv, CHECKPOINT_KEY, path)
        if arch is None:
            raise ModelFormatError(f"{path}: no {ARCH_KEY} string; not a jitgraph/ggml model file")
        if want_arch is not None and arch != want_arch:
            raise ModelFormatError(f"{path}: architecture is {arch!r}, expected {want_arch!r}")
        try:
            _spec(arch, path)
        except ValueError as e:
            raise ModelFormatError(str(e)) from None
        tensors = {i[0]: (i[1], _tensor(f, path, order, *i)) for i in infos}
    return arch, tensors, meta


def _load(path, want_arch):
    arch, tensors, meta = _read(path, want_arch)
    spec = _spec(arch, path)
    state = {k[len(STATE_PREFIX):]: a for k, (_, a) in tensors.items() if k.startswith(STATE_PREFIX)}
    weights = {k: a for k, (_, a) in tensors.items() if not k.startswith(STATE_PREFIX)}
    bad = [k for k in weights if tensors[k][0] not in (gguf.GGMLQuantizationType.F32,
                                                        gguf.GGMLQuantizationType.BF16)]
    if bad:
        raise ModelFormatError(f"{path}: tensors {bad} are neither F32 nor BF16 (a checkpoint's "
                               f"bf16 weights)")
    try:
        params = spec.from_ggml(weights)
    except ValueError as e:
        raise ModelFormatError(f"{path}: {e}") from None
    if meta is not None:
        try:
            meta = json.loads(meta)
        except (ValueError, RecursionError) as e:
            raise ModelFormatError(f"{path}: {CHECKPOINT_KEY} is not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise ModelFormatError(f"{path}: {CHECKPOINT_KEY} is not a JSON object")
    return arch, params, state, meta

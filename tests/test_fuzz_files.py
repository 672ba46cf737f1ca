"""Hostile and careless files into every loader: GGUF models and checkpoints (jitgraph/formats/gguf.py), MNIST IDX
files (data.read_idx, data.load_mnist; raw and .gz) and graph JSON (Graph.from_json).

The contract: a loader either loads the file or raises its own error class -- ModelFormatError
(GGUF), DataFormatError (IDX), GraphFormatError (JSON), all ValueErrors, the file named in the
message -- and never anything else (IndexError, struct.error, UnicodeDecodeError, OverflowError,
MemoryError, numpy errors), never hangs, and never allocates more than a small multiple of the
input: a header's declared counts and sizes are checked against the file's length first. Every
case runs under a time limit and with tracemalloc watching its peak allocation.

The fuzz cases are hypothesis-generated mutations -- bit flips, byte and header-field overwrites
with boundary values (0, 2**31, 2**63, 2**64 - 1, ...), truncations, insertions, deletions and
splices, several at once -- of real files (stories260K.gguf and the MNIST headers from
tests/data) and of small files jitgraph writes itself (models, checkpoints, IDX,
the JSON of a few graphs), plus structural JSON mutations (any value in the document replaced by
hostile JSON). CI runs a fixed, derandomized set (`derandomize=True`, the count given to `fuzz()`
per test: about 2400 loads in 10-15 s; the module prints the number of cases run). A longer,
freshly random run for manual use:

    JITGRAPH_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz_files.py

(examples per fuzz test; with the variable set, the cases are random rather than derandomized;
a failure prints the example and hypothesis's reproduce blob).
"""
import contextlib
import copy
import gzip
import io
import json
import os
import re
import signal
import struct
import threading
import tracemalloc
from collections import Counter
from unittest import mock

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jitgraph as jg
from jitgraph.formats import gguf as gguf_io
from jitgraph.formats.data import load_mnist, read_idx
from jitgraph.models import MODELS

_LONG = os.environ.get("JITGRAPH_FUZZ_EXAMPLES")


def fuzz(examples):
    """Hypothesis settings of a fuzz test: `examples` cases in CI, derandomized; with
    JITGRAPH_FUZZ_EXAMPLES set, that many, random, for long runs."""
    return settings(max_examples=int(_LONG) if _LONG else examples, derandomize=not _LONG,
                    deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


CASES = Counter()


@pytest.fixture(scope="module", autouse=True)
def report_cases(request):
    yield
    total = sum(CASES.values())
    if total:
        line = f"fuzz_files: {total} cases (" + ", ".join(f"{k} {v}" for k, v in
                                                          sorted(CASES.items())) + ")"
        plugins = request.config.pluginmanager
        tr, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            (tr.write_line if tr else print)(line)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


# ---- limits on a single load -------------------------------------------------------------------
class Hang(BaseException):
    """Raised by the alarm: a BaseException so that no loader's `except` can swallow it."""


@contextlib.contextmanager
def limits(seconds=10.0, peak_bytes=None):
    """Fail if the body runs longer than `seconds` or its traced allocations peak above
    `peak_bytes` (numpy's buffers included: numpy reports them to tracemalloc)."""
    def alarm(*_):
        raise Hang(f"still running after {seconds} s")
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    timed = threading.current_thread() is threading.main_thread()   # signals: main thread only
    if timed:
        old = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        peak = tracemalloc.get_traced_memory()[1] - base
        if started:
            tracemalloc.stop()
    if peak_bytes is not None:
        assert peak <= peak_bytes, f"allocated {peak} bytes (limit {peak_bytes})"


def outcome(load, error, *args, path=None, size=0):
    """Run one load: it succeeds or raises `error` (naming `path`); anything else fails the test.
    Allocation is bounded by 8x the input plus 16 MiB."""
    with limits(peak_bytes=8 * size + (16 << 20)):
        try:
            load(*args)
            return "ok"
        except error as e:
            if path is not None:
                assert path in str(e), f"{type(e).__name__} does not name the file: {e}"
            return type(e).__name__


# ---- byte mutations ----------------------------------------------------------------------------
BOUNDARY = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 27, 28, 29, 32, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF,
            0x8000, 0xFFFF, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 40, 2 ** 62,
            2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]


@st.composite
def mutated(draw, base, fields=(), hot=None, donors=()):
    """`base` with 1-4 mutations. `fields`: (offset, width, endian) of the header's integer
    fields, overwritten with boundary or random values; `hot`: the header's length, where most
    byte-level mutations land; `donors`: other files to splice chunks from."""
    data = bytearray(base)
    kinds = ["flip", "byte", "truncate", "insert", "delete", "splice", "duplicate"]
    kinds += ["field"] * 3 if fields else []
    for _ in range(draw(st.integers(1, 4))):
        n = len(data)
        top = max(1, min(hot or n, n))
        pos = draw(st.one_of(st.integers(0, top - 1), st.integers(0, max(0, n - 1))))
        kind = draw(st.sampled_from(kinds))
        if kind == "field":
            off, width, endian = draw(st.sampled_from(fields))
            value = draw(st.one_of(st.sampled_from(BOUNDARY), st.integers(0, 2 ** (8 * width) - 1)))
            if off + width <= n:
                data[off:off + width] = (value % 2 ** (8 * width)).to_bytes(width, endian)
        elif not data:
            data += draw(st.binary(min_size=1, max_size=32))
        elif kind == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte":
            data[pos] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]) | st.integers(0, 255))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        else:                                  # a chunk of this file or a donor, over or into pos
            src = draw(st.sampled_from([bytes(data), *donors]))
            a = draw(st.integers(0, len(src) - 1))
            chunk = src[a:a + draw(st.integers(1, 256))]
            if kind == "splice":
                data[pos:pos + len(chunk)] = chunk
            else:
                data[pos:pos] = chunk
    return bytes(data)


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


# ---- GGUF --------------------------------------------------------------------------------------
def gguf_fields(path):
    """(offset, width, endian) of every integer the reader parses in the file's header, and the
    header's length: recorded from a clean parse."""
    rec, orig = [], gguf_io._Cursor.unpack

    def unpack(self, fmt, what):
        pos, endian = self.pos, "little" if self.order == "<" else "big"
        for count, code in re.findall(r"(\d*)(\D)", fmt):
            w = struct.calcsize(code)
            for _ in range(int(count or 1)):
                rec.append((pos, w, endian))
                pos += w
        return orig(self, fmt, what)
    with mock.patch.object(gguf_io._Cursor, "unpack", unpack), open(path, "rb") as f:
        _, infos, _ = gguf_io._header(f, path)
    hot = min((start for _, _, _, start, _ in infos), default=os.path.getsize(path))
    return sorted(set(rec)), hot


def cnn_params(seed=0):
    return MODELS["mnist-cnn"](1).init_params(seed)


def rich_gguf(path, endian=gguf.GGUFEndian.LITTLE):
    """An mnist-cnn model with metadata of every value type, written by gguf's own writer."""
    w = gguf.GGUFWriter(path, "mnist-cnn", endianess=endian)
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -3), w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -2), w.add_uint32("t.u32", 7), w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.5), w.add_uint64("t.u64", 2 ** 40), w.add_int64("t.i64", -1)
    w.add_float64("t.f64", 1e300), w.add_bool("t.bool", True), w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3]), w.add_array("t.strs", ["a", "", "ccc"])
    w.add_array("t.bools", [True, False]), w.add_array("t.floats", [0.5, 1.5])
    for k, a in MODELS["mnist-cnn"].to_ggml(cnn_params(2)).items():
        w.add_tensor(k, a)
    w.add_tensor("state.h", np.arange(5, dtype=np.float16))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.fixture(scope="module")
def gguf_bases(work, testdata):
    """name -> (bytes, header fields, header length)."""
    paths = {"model": str(work / "model.gguf"), "ckpt": str(work / "ckpt.gguf"),
             "rich": rich_gguf(str(work / "rich.gguf")),
             "big-endian": rich_gguf(str(work / "be.gguf"), gguf.GGUFEndian.BIG)}
    gguf_io.save_model(paths["model"], "mnist-cnn", cnn_params(1))
    gguf_io.save_checkpoint(paths["ckpt"], "mnist-cnn", cnn_params(3),
                            {"m/dense.bias": np.ones(10, np.float32), "step": np.array(5),
                             "flags": np.arange(6, dtype=np.int8).reshape(2, 3)},
                            {"step": 5, "rng": {"state": [1, 2]}, "lr": 1e-3})
    out = {}
    for name, p in paths.items():
        with open(p, "rb") as f:
            out[name] = (f.read(), *gguf_fields(p))
    stories = str(testdata.stories)
    out["stories"] = (open(stories, "rb").read(), *gguf_fields(stories))
    return out


def read_all(path):
    """Everything the GGUF parser can read from a file, whatever its architecture: the header,
    then every tensor."""
    with open(path, "rb") as f:
        kv, infos, order = gguf_io._header(f, path)
        for key in kv:
            gguf_io._string(kv, key, path)
        return [gguf_io._tensor(f, path, order, *i) for i in infos]


def gguf_case(work, data, load, kind):
    path = write(work / "case.gguf", data)
    CASES[f"gguf-{kind}"] += 1
    return outcome(load, jg.ModelFormatError, path, path=path, size=len(data))


@pytest.mark.parametrize("base", ["model", "ckpt", "rich", "big-endian"])
@given(data=st.data())
@fuzz(100)
def test_fuzz_gguf_jitgraph_files(work, gguf_bases, base, data):
    raw, fields, hot = gguf_bases[base]
    donors = [gguf_bases[k][0][:gguf_bases[k][2]] for k in gguf_bases if k != base]
    case = data.draw(mutated(raw, fields, hot, donors))
    load = gguf_io.load_checkpoint if base == "ckpt" else gguf_io.load_model
    gguf_case(work, case, load, base)
    gguf_case(work, case, read_all, base + "-parse")


@given(data=st.data())
@fuzz(80)
def test_fuzz_gguf_stories260k(work, gguf_bases, data):
    raw, fields, hot = gguf_bases["stories"]
    case = data.draw(mutated(raw, fields, hot))
    gguf_case(work, case, gguf_io.load_model, "stories")
    gguf_case(work, case, read_all, "stories-parse")


@given(version=st.sampled_from([2, 3, 2 << 24, 3 << 24]),
       counts=st.tuples(st.integers(0, 4), st.integers(0, 4)), blob=st.binary(max_size=512))
@fuzz(100)
def test_fuzz_gguf_random_bytes(work, version, counts, blob):
    """A valid start (magic, version, small counts), then random bytes."""
    data = b"GGUF" + struct.pack("<IQQ", version, *counts) + blob
    gguf_case(work, data, gguf_io.load_model, "random")
    gguf_case(work, data, read_all, "random-parse")


# ---- IDX ---------------------------------------------------------------------------------------
def idx(magic, dims, payload):
    return struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in dims) + payload


IDX_FIELDS = {"images": [(o, 4, "big") for o in (0, 4, 8, 12)] + [(o, 1, "big") for o in range(16)],
              "labels": [(o, 4, "big") for o in (0, 4)] + [(o, 1, "big") for o in range(8)]}


def real_mnist_heads(mnist_dir):
    """The real t10k files' headers with the first few samples (declaring all 2000 of tests/data's
    subset: truncated as they stand), and the same with the count patched to what the slice holds
    (valid)."""
    out = {}
    for kind, tag, ndim, item in (("images", "idx3", 3, 784), ("labels", "idx1", 1, 1)):
        with gzip.open(mnist_dir / f"t10k-{kind}-{tag}-ubyte.gz", "rb") as f:
            head = f.read(4 + 4 * ndim + 4 * item)
        out[kind] = [head, head[:4] + struct.pack(">I", 4) + head[8:]]
    return out


@pytest.fixture(scope="module")
def idx_bases(testdata):
    rng = np.random.default_rng(0)
    bases = {"images": [idx(2051, (3, 28, 28), rng.integers(0, 256, 3 * 784, np.uint8).tobytes()),
                        idx(2051, (0, 28, 28), b"")],
             "labels": [idx(2049, (6,), bytes([0, 1, 2, 9, 5, 3])), idx(2049, (0,), b"")]}
    for kind, heads in real_mnist_heads(testdata.mnist).items():
        bases[kind] += heads
    return bases


def idx_case(work, data, kind, gz, tag):
    path = str(work / f"case-{kind}-idx-ubyte{'.gz' if gz else ''}")
    write(path, data)
    CASES[f"idx-{tag}"] += 1
    return outcome(read_idx, jg.DataFormatError, path, kind, path=path,
                   size=len(data) if not gz else 1032 * len(data))


@pytest.mark.parametrize("kind", ["images", "labels"])
@given(data=st.data())
@fuzz(120)
def test_fuzz_idx(work, idx_bases, kind, data):
    base = data.draw(st.sampled_from(idx_bases[kind]))
    case = data.draw(mutated(base, IDX_FIELDS[kind], hot=16, donors=idx_bases[kind]))
    idx_case(work, case, kind, False, "raw")
    idx_case(work, gzip.compress(case, mtime=0), kind, True, "gz-content")


@pytest.mark.parametrize("kind", ["images", "labels"])
@given(data=st.data())
@fuzz(80)
def test_fuzz_idx_gzip_stream(work, idx_bases, kind, data):
    base = gzip.compress(data.draw(st.sampled_from(idx_bases[kind])), mtime=0)
    fields = [(o, 1, "big") for o in range(10)] + [(len(base) - 8, 4, "little"),
                                                   (len(base) - 4, 4, "little")]  # CRC, ISIZE
    idx_case(work, data.draw(mutated(base, fields, hot=32)), kind, True, "gz-stream")


@given(data=st.data())
@fuzz(60)
def test_fuzz_load_mnist(work, idx_bases, data):
    d = work / "mnist"
    d.mkdir(exist_ok=True)
    kind = data.draw(st.sampled_from(["images", "labels"]))
    other = "labels" if kind == "images" else "images"
    ip, lp = str(d / "train-images-idx3-ubyte"), str(d / "train-labels-idx1-ubyte")
    write(lp if kind == "images" else ip, idx_bases[other][0])
    base = data.draw(st.sampled_from(idx_bases[kind]))
    write(ip if kind == "images" else lp, data.draw(mutated(base, IDX_FIELDS[kind], hot=16)))
    CASES["idx-load_mnist"] += 1
    outcome(load_mnist, jg.DataFormatError, str(d), "train", size=8000)


# ---- graph JSON --------------------------------------------------------------------------------
HOSTILE_NAMES = ['x"); import os; os.system("true"); ("', "a\nb\r\x00c", "'''", "\\", "ünï ☃ 𝔘",
                 "{x}", "%1", "__import__('os')", "-", " ", "a" * 300]


def json_graphs():
    g = jg.Graph("mlp")
    x, y = g.input("x", (4, 6)), g.input("y", (4,), "i32")
    w = g.param("w", (6, 3), init=jg.init.he_normal())
    b = g.param("b", (3,))
    logits = jg.relu(x @ w + b)
    g.output(loss=jg.cross_entropy(logits, y), logits=logits)
    train = jg.training_graph(g, "loss", jg.optim.AdamW(lr=1e-3))
    h = jg.Graph(HOSTILE_NAMES[0])
    ins = [h.input(n, (2, 3)) for n in HOSTILE_NAMES]
    p = h.param(HOSTILE_NAMES[1] + "p", (2, 3), init=jg.init.uniform(-1, 1))
    acc = p
    for t in ins:
        acc = acc + t
    h.output(**{n: acc * 2.0 for n in HOSTILE_NAMES[2:5]})
    h.update(**{HOSTILE_NAMES[1] + "p": acc})
    return [g, train, MODELS["mnist-cnn"](2), h]


@pytest.fixture(scope="module")
def json_bases():
    return [g.to_json() for g in json_graphs()]


def json_value(leaves=None):
    leaf = st.one_of(st.none(), st.booleans(), st.sampled_from(BOUNDARY + [-1, -2 ** 63, 10 ** 30]),
                     st.integers(), st.floats(), st.text(max_size=8),
                     st.sampled_from(HOSTILE_NAMES),
                     st.sampled_from(["f32", "i32", "f64", "add", "input", "param", "matmul"]))
    if leaves:
        leaf = leaf | st.sampled_from(leaves)
    return st.recursive(leaf, lambda c: st.lists(c, max_size=4) |
                        st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)


def paths(doc, at=()):
    yield at
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths(v, at + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths(v, at + (i,))


def get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


@st.composite
def json_mutated(draw, text):
    doc = json.loads(text)
    for _ in range(draw(st.integers(1, 3))):
        every = list(paths(doc))
        if len(every) == 1:
            break
        where = draw(st.sampled_from(every[1:]))
        parent, key = get(doc, where[:-1]), where[-1]
        how = draw(st.sampled_from(["replace", "replace", "delete", "copy", "add"]))
        if how == "delete":
            del parent[key]
        elif how == "copy":                          # another part of the same document
            parent[key] = copy.deepcopy(get(doc, draw(st.sampled_from(every))))
        elif how == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(json_value())
        elif how == "add":
            parent.insert(key, draw(json_value()))
        else:
            nodes = doc.get("nodes")
            n = len(nodes) if isinstance(nodes, list) else 0
            parent[key] = draw(json_value(leaves=[-1, n, n - 1]))
    return json.dumps(doc)


def json_case(text, tag):
    CASES[f"json-{tag}"] += 1
    return outcome(json_load_and_round_trip, jg.GraphFormatError, text, size=8 * len(text))


def json_load_and_round_trip(text):
    g = jg.Graph.from_json(text)
    again = g.to_json()                              # what loads must serialise and load back
    assert jg.Graph.from_json(again).to_json() == again


@given(data=st.data())
@fuzz(300)
def test_fuzz_json_structure(json_bases, data):
    json_case(data.draw(json_mutated(data.draw(st.sampled_from(json_bases)))), "structure")


@given(data=st.data())
@fuzz(150)
def test_fuzz_json_bytes(json_bases, data):
    text = data.draw(st.sampled_from(json_bases)).encode()
    json_case(data.draw(mutated(text, hot=len(text), donors=[b.encode() for b in json_bases])),
              "bytes")


@given(names=st.lists(st.text(min_size=1, max_size=12), min_size=3, max_size=3, unique=True),
       gname=st.text(min_size=1, max_size=12))
@fuzz(60)
def test_fuzz_hostile_names_load_as_data(names, gname):
    g = jg.Graph(gname)
    x = g.input(names[0], (2,))
    w = g.param(names[1], (2,))
    g.output(**{names[2]: x * w})
    g.update(**{names[1]: w + x})
    CASES["json-names"] += 1
    with limits():
        g2 = jg.Graph.from_json(g.to_json())
    assert g2.name == gname and list(g2.inputs) == names[:1] and list(g2.params) == names[1:2]
    assert list(g2.outputs) == names[2:] and g2.fingerprint() == g.fingerprint()


# ---- targeted: header checks before allocation (GGUF) ------------------------------------------
def model_bytes(work, arch="mnist-cnn"):
    path = str(work / "m.gguf")
    gguf_io.save_model(path, arch, cnn_params(4) if arch == "mnist-cnn" else
                       MODELS[arch](1).init_params(0))
    with open(path, "rb") as f:
        return path, bytearray(f.read())


def rejects_fast(path, data, *words, loader=None):
    """The load fails with ModelFormatError naming the file and `words`, in well under a second,
    allocating under 1 MiB beyond the file (a 35 kB model)."""
    write(path, bytes(data))
    with limits(seconds=5, peak_bytes=len(data) + (1 << 20)):
        with pytest.raises(jg.ModelFormatError) as e:
            (loader or gguf_io.load_model)(path)
    for w in (path,) + words:
        assert w in str(e.value), str(e.value)
    return str(e.value)


def kv_offset(data, key):
    """Offset of the value type that follows metadata key `key`."""
    at = data.find(struct.pack("<Q", len(key)) + key.encode())
    assert at >= 0
    return at + 8 + len(key)


def test_gguf_giant_counts(tmp_path):
    path, data = model_bytes(tmp_path)
    bad = bytearray(data)
    struct.pack_into("<Q", bad, 8, 2 ** 40)
    rejects_fast(path, bad, "declares 1099511627776 tensors")
    bad = bytearray(data)
    struct.pack_into("<Q", bad, 16, 2 ** 63)
    rejects_fast(path, bad, f"declares {2 ** 63} metadata entries")


def test_gguf_giant_string_lengths(tmp_path):
    path, data = model_bytes(tmp_path)
    bad = bytearray(data)
    struct.pack_into("<Q", bad, 24, 2 ** 64 - 1)                     # the first key's length
    rejects_fast(path, bad, "metadata key 0", str(2 ** 64 - 1))
    at = kv_offset(data, "general.architecture")
    bad = bytearray(data)
    struct.pack_into("<Q", bad, at + 4, 2 ** 62)                     # the architecture's length
    rejects_fast(path, bad, "general.architecture", str(2 ** 62))


def test_gguf_giant_array_does_not_hang(tmp_path):
    """gguf.GGUFReader loops forever on this file (an array of 2**62 bools in a 500-byte file,
    one element a pass, past the end of the file); the loader must reject it at once."""
    path = str(tmp_path / "a.gguf")
    w = gguf.GGUFWriter(path, "mnist-cnn")
    w.add_array("x.flags", [True, False])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    data = bytearray(open(path, "rb").read())
    at = kv_offset(data, "x.flags")
    assert struct.unpack_from("<IIQ", data, at) == (9, 7, 2)
    struct.pack_into("<Q", data, at + 8, 2 ** 62)
    rejects_fast(path, data, "x.flags", f"{2 ** 62} elements")
    struct.pack_into("<IIQ", data, at, 9, 8, 2 ** 40)                # 2**40 strings
    rejects_fast(path, data, "x.flags", f"{2 ** 40} strings")
    struct.pack_into("<IIQ", data, at, 9, 9, 1)                      # an array of arrays
    rejects_fast(path, data, "x.flags", "array of arrays")


def tensor_info(data, name):
    """Offset of tensor `name`'s n_dims field."""
    at = data.find(struct.pack("<Q", len(name)) + name.encode())
    assert at >= 0
    return at + 8 + len(name)


def test_gguf_giant_tensor_shapes_and_offsets(tmp_path):
    path, data = model_bytes(tmp_path)
    at = tensor_info(data, "dense.weight")
    assert struct.unpack_from("<IQQIQ", data, at)[:4] == (2, 784, 10, 0)
    for dims, words in (((2 ** 32, 2 ** 20), ["dense.weight", "runs past the end"]),
                        ((2 ** 63, 2 ** 63), ["dense.weight", "impossible shape"])):
        bad = bytearray(data)
        struct.pack_into("<QQ", bad, at + 4, *dims)
        rejects_fast(path, bad, *words)
    bad = bytearray(data)
    struct.pack_into("<I", bad, at, 2 ** 31)                         # n_dims
    rejects_fast(path, bad, "dense.weight", "2147483648 dimensions")
    bad = bytearray(data)
    struct.pack_into("<Q", bad, at + 24, 2 ** 64 - 32)               # data offset
    rejects_fast(path, bad, "dense.weight", "runs past the end")
    bad = bytearray(data)
    struct.pack_into("<Q", bad, at + 24, 36)                         # not aligned
    rejects_fast(path, bad, "dense.weight", "alignment")
    bad = bytearray(data)
    struct.pack_into("<I", bad, at + 20, 9999)                       # type
    rejects_fast(path, bad, "dense.weight", "unknown type 9999")
    other = tensor_info(data, "dense.bias")
    off = other + 4 + 8 * struct.unpack_from("<I", data, other)[0] + 4
    bad = bytearray(data)                                            # two tensors, one place
    bad[off:off + 8] = data[at + 24:at + 32]
    rejects_fast(path, bad, "overlaps")


def test_gguf_bad_text_and_json(tmp_path):
    path, data = model_bytes(tmp_path)
    bad = bytearray(data)
    at = kv_offset(data, "general.architecture")
    bad[at + 12] = 0xFF                                         # "mnist-cnn" -> b"\xffnist-cnn"
    rejects_fast(path, bad, "general.architecture", "UTF-8")
    bad = bytearray(data)
    bad[data.find(b"dense.weight")] = 0xC3
    rejects_fast(path, bad, "tensor", "UTF-8")
    ck = str(tmp_path / "c.gguf")
    for meta, words in (("[" * 100000, "jitgraph.checkpoint"), ("[1, 2]", "not a JSON object")):
        gguf_io._write(ck, "mnist-cnn", MODELS["mnist-cnn"].to_ggml(cnn_params()),
                       {gguf_io.CHECKPOINT_KEY: meta})
        rejects_fast(ck, open(ck, "rb").read(), words, loader=gguf_io.load_checkpoint)


def test_gguf_reader_agrees_with_gguf_package(tmp_path, gguf_bases):
    """The bounds-checked parser reads what gguf.GGUFReader reads, both byte orders included."""
    for name, (raw, _, _) in gguf_bases.items():
        path = write(tmp_path / f"{name}.gguf", raw)
        r = gguf.GGUFReader(path)
        with open(path, "rb") as f:
            kv, infos, order = gguf_io._header(f, path)
            assert set(kv) == set(r.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
            assert len(infos) == len(r.tensors)
            for (tname, t, dims, start, nbytes), rt in zip(infos, r.tensors):
                want = (rt.name, rt.tensor_type, [int(d) for d in rt.shape], rt.data_offset,
                        rt.n_bytes)
                assert (tname, t, list(dims), start, nbytes) == want
                a = gguf_io._tensor(f, path, order, tname, t, dims, start, nbytes)
                assert a.dtype.isnative and np.array_equal(a, np.array(rt.data)), tname
        for key in ("t.str", "general.architecture"):
            if key in kv:
                assert gguf_io._string(kv, key, path) == r.fields[key].contents()


def test_gguf_big_endian_model_loads(tmp_path, gguf_bases):
    path = write(tmp_path / "be.gguf", gguf_bases["big-endian"][0])
    arch, params = gguf_io.load_model(path)
    want = cnn_params(2)
    assert arch == "mnist-cnn" and all(np.array_equal(params[k], want[k]) for k in want)


def test_gguf_foreign_model_rejected_before_its_tensors_are_read(testdata):
    stories = str(testdata.stories)
    with limits(peak_bytes=256 << 10):               # the file is 1.2 MB: no tensor was read
        with pytest.raises(jg.ModelFormatError, match="unknown architecture 'llama'"):
            gguf_io.load_model(stories)
    with pytest.raises(jg.ModelFormatError, match="architecture is 'llama', expected 'mnist-fc'"):
        gguf_io.load_model(stories, arch="mnist-fc")


def test_gguf_os_errors_stay_os_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        gguf_io.load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(IsADirectoryError):
        gguf_io.load_model(str(tmp_path))


# ---- targeted: header checks before allocation (IDX) -------------------------------------------
def test_idx_giant_count_in_small_file(tmp_path):
    for gz in (False, True):
        path = str(tmp_path / f"train-images-idx3-ubyte{'.gz' if gz else ''}")
        data = idx(2051, (2 ** 31, 28, 28), bytes(84))                # 100 bytes
        write(path, gzip.compress(data) if gz else data)
        with limits(seconds=5, peak_bytes=1 << 20):
            with pytest.raises(jg.DataFormatError) as e:
                read_idx(path, "images")
        assert path in str(e.value) and "2147483648 images" in str(e.value), str(e.value)
        path = str(tmp_path / f"labels{'.gz' if gz else ''}")
        data = idx(2049, (2 ** 32 - 1,), bytes(92))
        write(path, gzip.compress(data) if gz else data)
        with limits(seconds=5, peak_bytes=1 << 20):
            with pytest.raises(jg.DataFormatError, match="4294967295 labels"):
                read_idx(path, "labels")


def test_idx_gzip_decompresses_no_more_than_declared(tmp_path):
    """A 60 kB .gz that inflates to 60 MB behind a header declaring 10 images: rejected as
    trailing data after reading about the declared 7.8 kB, never inflating the rest."""
    path = str(tmp_path / "train-images-idx3-ubyte.gz")
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        f.write(idx(2051, (10, 28, 28), bytes(10 * 784)))
        for _ in range(60):
            f.write(bytes(1 << 20))
    write(path, buf.getvalue())
    assert os.path.getsize(path) < 100_000
    with limits(seconds=5, peak_bytes=8 << 20):
        with pytest.raises(jg.DataFormatError, match="trailing data") as e:
            read_idx(path, "images")
    assert path in str(e.value)


def test_idx_errors_are_data_format_errors(tmp_path):
    path = str(tmp_path / "x.gz")
    for data, words in ((b"\x1f\x8b" + bytes(30), "cannot read"), (b"not gzip" * 9, "cannot read"),
                        (gzip.compress(idx(2049, (3,), bytes(3)))[:-3], "cannot read"),
                        (gzip.compress(idx(2049, (3,), bytes(2))), "truncated"),
                        (gzip.compress(idx(2051, (3,), bytes(3))), "magic")):
        write(path, data)
        with pytest.raises(jg.DataFormatError, match=words):
            read_idx(path, "labels")
    with pytest.raises(IsADirectoryError):
        read_idx(str(tmp_path), "labels")
    ok = read_idx(write(path, gzip.compress(idx(2049, (3,), bytes([1, 2, 3])))), "labels")
    assert ok.tolist() == [1, 2, 3]


# ---- targeted: graph JSON ----------------------------------------------------------------------
def test_json_rejects_non_utf8_and_non_text():
    text = json_graphs()[0].to_json().encode()
    with pytest.raises(jg.GraphFormatError, match="not UTF-8"):
        jg.Graph.from_json(text.replace(b'"mlp"', b'"\xffmlp"'))
    with pytest.raises(jg.GraphFormatError, match="expected JSON text"):
        jg.Graph.from_json(12)
    assert jg.Graph.from_json(bytearray(text)).to_json() == text.decode()


def test_json_structure_checks():
    doc = json.loads(json_graphs()[0].to_json())

    def bad(path, value, words):
        d = copy.deepcopy(doc)
        parent = get(d, path[:-1])
        parent[path[-1]] = value
        with pytest.raises(jg.GraphFormatError, match=words):
            jg.Graph.from_json(json.dumps(d))
    bad(["nodes", 0, "type", "shape"], [1] * 65, "65 dimensions")
    bad(["nodes", 0, "type", "extra"], 1, "'type' must be")
    bad(["nodes", 0, "type", "dtype"], ["f32"], "'type' must be")
    bad(["nodes", 0, "attrs", "name"], "\ud800", "not valid Unicode")
    bad(["nodes", 0, "attrs", "name"], "", "non-empty string")
    bad(["name"], "", "graph name")
    bad(["outputs", "\udfff"], 0, "not valid Unicode")
    bad(["updates"], [], "'updates' must be")
    bad(["updates", "w"], "3", "node id")


def test_json_hostile_names_round_trip():
    h = json_graphs()[-1]
    g = jg.Graph.from_json(h.to_json())
    assert g.name == HOSTILE_NAMES[0] and list(g.inputs) == HOSTILE_NAMES
    assert g.to_json() == h.to_json() and str(g) == str(h)

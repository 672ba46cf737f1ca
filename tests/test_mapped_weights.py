"""Weights mapped from their file into a program (jitgraph/formats/mapping.py, FileTensor's
read_into(mapped=True), the memory plan's page offsets): the same bytes as reading them, a
private mapping the program's writes never reach, a truncated file named; and library kernels
compiled once for every shape (runtime/cpu/codegen.py)."""
import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import jitgraph as jg
from jitgraph import ops
from jitgraph.errors import ModelFormatError
from jitgraph.formats.mapping import PAGE
from jitgraph.formats.tensors import FileTensor
from jitgraph.types import TensorType

DATA = Path(__file__).parent / "data"
MODELS = [DATA / "stories260K.gguf", DATA / "types" / "stories260K-q8_0.gguf",
          DATA / "types" / "stories260K-f16.gguf"]


def _mapped_regions(path) -> int:
    """How many of this process's mappings are of the file at `path` (/proc/self/maps)."""
    ino = os.stat(path).st_ino
    with open("/proc/self/maps") as f:
        return sum(1 for ln in f if len(ln.split()) >= 6 and int(ln.split()[4]) == ino)


def _sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.name)
def test_mapped_weights_equal_the_bytes_read(model, tmp_path):
    """Every weight of the program (decode program of generate, weights kept in their file's
    type) holds exactly the bytes a plain read gives, and the file's pages are mapped (the
    memory plan put the large weights at their file's page offsets)."""
    from jitgraph.models.generate import llama_decoder
    from jitgraph.models.llama import read_llama
    path = tmp_path / model.name          # a file of its own: its mappings are countable
    shutil.copy(model, path)
    cfg, params, _ = read_llama(path, keep_types=True)
    files = {k: v for k, v in params.items() if isinstance(v, FileTensor)}
    assert files
    before = _mapped_regions(path)
    prog = jg.compile(llama_decoder(cfg, 1, 8), copy_outputs=False, check_indices=False,
                      params=params)
    slots = prog._products.memory.params
    big = [k for k, v in files.items() if v.nbytes >= 4 * PAGE and v.offset % 32 == 0]
    assert big
    for k in big:
        assert slots[k].offset % PAGE == files[k].offset % PAGE, k
    assert _mapped_regions(path) > before
    for k, v in params.items():
        want = np.asarray(v)      # read with plain file reads (FileTensor.__array__)
        got = prog.params.view(k)
        assert got.dtype == want.dtype and got.shape == want.shape, k
        assert got.tobytes() == want.tobytes(), k


def test_generator_without_mmap_reads_the_same_bytes(tmp_path):
    """Generator(mmap=False) (`generate --no-mmap`): no page of the file is mapped, the
    weights hold the same bytes, and greedy generation is the same as with the mapping."""
    from jitgraph.models.generate import Generator, Sampler
    path = tmp_path / "stories-q8_0.gguf"
    shutil.copy(MODELS[1], path)
    runs = []
    for mmap in (False, True):
        before = _mapped_regions(path)
        gen = Generator(str(path), ctx=32, chunk=4, mmap=mmap)
        mapped = _mapped_regions(path) - before
        assert (mapped > 0) == mmap, mapped
        ids = gen.tokenizer.encode("Once upon a time", bos=True)
        runs.append((gen.generate(ids, 8, Sampler(temperature=0.0)).ids,
                     {k: gen.decode.params.view(k).tobytes() for k in gen.decode.params}))
        del gen
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 8
    assert runs[0][1] == runs[1][1]


def test_writing_a_mapped_weight_never_reaches_the_file(tmp_path):
    """The mapping is private: assigning a weight (or a kernel writing it) changes the
    program's copy of those pages, never the file, which later reads still see unchanged."""
    from jitgraph.models.generate import llama_decoder
    from jitgraph.models.llama import read_llama
    path = tmp_path / "m.gguf"
    shutil.copy(DATA / "stories260K.gguf", path)
    digest = _sha(path)
    cfg, params, _ = read_llama(path, keep_types=True)
    prog = jg.compile(llama_decoder(cfg, 1, 8), copy_outputs=False, check_indices=False,
                      params=params)
    k = "token_embd.weight"
    prog.params[k] = np.full(prog.params.view(k).shape, 0.5, np.float32)
    assert np.all(prog.params.view(k) == 0.5)
    assert _sha(path) == digest
    np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(read_llama(path)[1][k]))


def test_a_file_truncated_after_reading_its_header_is_named(tmp_path):
    """A file cut short between read_llama and the program's load raises ModelFormatError
    naming the file and the tensor (never a SIGBUS from a mapping past its end)."""
    from jitgraph.models.generate import llama_decoder
    from jitgraph.models.llama import read_llama
    path = tmp_path / "cut.gguf"
    shutil.copy(DATA / "stories260K.gguf", path)
    cfg, params, _ = read_llama(path, keep_types=True)
    last = max((v for v in params.values() if isinstance(v, FileTensor)),
               key=lambda v: v.offset)
    os.truncate(path, last.offset + last.nbytes // 2)
    with pytest.raises(ModelFormatError, match=rf"cut\.gguf: tensor {last.name} is truncated"):
        jg.compile(llama_decoder(cfg, 1, 8), copy_outputs=False, check_indices=False,
                   params=params)


@pytest.mark.parametrize("lead,nbytes", [(0, 5 * PAGE), (100 * 64, 5 * PAGE + 192),
                                         (PAGE - 64, 5 * PAGE + 64)])
def test_read_into_mapped_reads_the_partial_pages(tmp_path, lead, nbytes):
    """A tensor starting inside a page: its whole pages mapped, the head and tail (inside pages
    it shares with its neighbours) read; the neighbours' bytes stay untouched."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 8 * PAGE, dtype=np.uint8)
    path = tmp_path / "t.bin"
    path.write_bytes(data.tobytes())
    t = FileTensor(str(path), "t", PAGE + lead, TensorType("f32", (nbytes // 4,)))
    region = np.full(16 * PAGE, 7, np.uint8)
    base = (-region.ctypes.data) % PAGE + 2 * PAGE + lead        # same place in a page
    out = region[base:base + nbytes].view(np.float32)
    t.read_into(out, mapped=True)
    assert out.tobytes() == data[PAGE + lead:PAGE + lead + nbytes].tobytes()
    assert np.all(region[:base] == 7) and np.all(region[base + nbytes:] == 7)
    assert _mapped_regions(path) >= 1
    out[:] = 0                                            # private: the file is unchanged
    assert path.read_bytes() == data.tobytes()


def test_library_kernels_are_one_module_for_every_shape():
    """A lone GEMM (a BLAS call) of two shapes runs one compiled module (its dimensions are
    parameters), and both programs compute their products."""
    mods, rng = [], np.random.default_rng(1)
    for m, n, k in ((3, 5, 7), (6, 4, 9)):
        g = jg.Graph("mm")
        a, b = g.input("a", (m, k)), g.input("b", (k, n))
        g.output(c=ops.matmul(a, b))
        prog = jg.compile(g, fuse=False)
        x, y = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        np.testing.assert_allclose(prog.step(a=x, b=y)["c"], x @ y, rtol=1e-5, atol=1e-6)
        gemm = [name for _, name, _, dims in prog._products.module.calls if dims]
        assert len(gemm) == 1
        mods.append(gemm[0])
    assert mods[0] == mods[1]

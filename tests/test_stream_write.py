"""Model files written tensor by tensor (write_llama through formats/gguf.py's gguf_writer: the
tensor infos first, then each tensor converted and written in turn) and weights converted
into a program's slots a chunk at a time (FileTensor.read_converted: f32 files into bf16
master weights, bf16 files into f32 weights). The oracles: gguf's own GGUFWriter, writing
every tensor at once, with gguf.quants' numpy quantizers, and gguf.GGUFReader reading back."""
import os
import tracemalloc

import gguf
import numpy as np
import pytest

import jitgraph as jg
from jitgraph.formats import gguf as gguf_io
from jitgraph.formats import tensors as tensors_mod
from jitgraph.formats.tensors import FileTensor
from jitgraph.models.llama import LlamaConfig, read_llama, write_llama
from jitgraph.models.text import byte_vocab

Q = gguf.GGMLQuantizationType
LLAMA_FTYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}     # llama.cpp's llama_ftype
TYPE = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
BLOCK = {"f32": 1, "f16": 1, "bf16": 1, "q8_0": 32}


def _bits_of(x):
    """bf16 bits (uint16) of f32 x by truncation: any bf16 values will do as master weights."""
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _values(a):
    """The f32 values of a weight as write_llama takes it (bf16 bits: uint16)."""
    if isinstance(a, FileTensor):
        return a.f32()
    a = np.asarray(a)
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a


def _model(seed=0):
    """A small llama (ff 80: ffn_down's rows are not whole Q8_0 blocks, so F16) with bf16-bit
    matrices (as bf16 master weights are stored) beside f32 ones, the tokenizer included."""
    cfg = LlamaConfig(vocab=354, dim=64, layers=2, heads=2, ff=80, ctx=32)
    rng = np.random.default_rng(seed)
    params = {}
    for i, (k, shape) in enumerate(cfg.param_shapes().items()):
        x = np.ones(shape, np.float32) if k.endswith("norm.weight") else \
            rng.standard_normal(shape).astype(np.float32) * np.float32(0.05)
        params[k] = _bits_of(x) if len(shape) == 2 and i % 2 else x
    return cfg, params, byte_vocab()


def _reference(path, cfg, params, tok, ftype, name):
    """The file as gguf's GGUFWriter writes it with every tensor added at once, converted by
    gguf.quants (a matrix in `ftype`, F16 where its rows are not whole blocks, the rest F32)."""
    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_name(name)
    w.add_file_type(LLAMA_FTYPE[ftype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    cfg.to_gguf(w)
    tok.write_gguf(w)
    for k, shape in cfg.param_shapes().items():
        x = _values(params[k])
        dt = ftype if len(shape) == 2 else "f32"
        if shape[-1] % BLOCK[dt]:
            dt = "f16"
        if dt == "f32":
            w.add_tensor(k, x)
        else:
            w.add_tensor(k, gguf.quants.quantize(x, TYPE[dt]).view(np.uint8), raw_dtype=TYPE[dt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _read_back(path):
    r = gguf.GGUFReader(str(path))
    fields = {k: (f.types, f.contents()) for k, f in r.fields.items()
              if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type, [int(n) for n in t.shape], np.array(t.data).tobytes())
               for t in r.tensors}
    return fields, tensors, [t.name for t in r.tensors]


@pytest.mark.parametrize("ftype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("piece", [None, 1000])
def test_streamed_file_equals_gguf_writers(tmp_path, monkeypatch, ftype, piece):
    """write_llama's file (each weight converted when written; piece=1000: a few rows at a
    time, the last block of rows partial) is gguf's eager writer's, byte for byte."""
    if piece:
        monkeypatch.setattr(gguf_io, "_PIECE_BYTES", piece)
    cfg, params, tok = _model()
    ours, ref = tmp_path / "ours.gguf", tmp_path / "ref.gguf"
    write_llama(ours, cfg, params, tok, ftype=ftype, name="m")
    _reference(ref, cfg, params, tok, ftype, "m")
    fo, to, order_o = _read_back(ours)
    fr, tr, order_r = _read_back(ref)
    assert fo == fr
    assert order_o == order_r == list(cfg.param_shapes())
    assert to.keys() == tr.keys()
    for k in tr:
        assert to[k][:2] == tr[k][:2], k
        assert to[k][2] == tr[k][2], k
    assert {t for t, _, _ in to.values()} >= {TYPE[ftype]}
    assert ours.read_bytes() == ref.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["ours.gguf", "ref.gguf"]


def test_bf16_bits_written_as_they_are(tmp_path):
    """bf16 master weights written with ftype bf16 are their bits, a NaN's payload included
    (an f32 round trip would make a signalling NaN quiet)."""
    cfg, params, tok = _model(1)
    k = "blk.0.attn_k.weight"
    bits = params[k] if params[k].dtype == np.uint16 else _bits_of(params[k])
    bits = bits.copy()
    bits[0, :3] = (0x7F81, 0xFF81, 0x7FC0)          # NaNs: two signalling, one quiet
    params[k] = bits
    write_llama(tmp_path / "m.gguf", cfg, params, tok, ftype="bf16")
    _, t, _ = _read_back(tmp_path / "m.gguf")
    assert t[k][0] == Q.BF16
    assert np.array_equal(np.frombuffer(t[k][2], np.uint16).reshape(bits.shape), bits)


@pytest.mark.parametrize("fail", ["error", "interrupt", "q8_0"])
def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch, fail):
    """An exception while the tensors are written (the 5th tensor's conversion; Ctrl-C there;
    a Q8_0 of a non-finite weight in the middle of the model): the old file stays as it was,
    no partial file and no temporary file are left."""
    cfg, params, tok = _model(2)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"the old model")
    ftype = "f32"
    if fail == "q8_0":
        ftype = "q8_0"
        params["blk.1.attn_q.weight"] = np.full((64, 64), np.inf, np.float32)
    else:
        real, fifth = gguf_io._weight_pieces, list(cfg.param_shapes())[4]

        def flaky(name, a, dt):
            if name == fifth:
                raise KeyboardInterrupt if fail == "interrupt" else OSError(28, "No space left")
            return real(name, a, dt)
        monkeypatch.setattr(gguf_io, "_weight_pieces", flaky)
    err = {"error": OSError, "interrupt": KeyboardInterrupt, "q8_0": ValueError}[fail]
    with pytest.raises(err) as e:
        write_llama(path, cfg, params, tok, ftype=ftype)
    if fail == "q8_0":
        assert "blk.1.attn_q.weight" in str(e.value) and "q8_0" in str(e.value)
    if fail == "error":
        assert str(path) in str(e.value)                # the user's path, not the temp file
    assert path.read_bytes() == b"the old model"
    assert os.listdir(tmp_path) == ["m.gguf"]
    (tmp_path / "m.gguf").unlink()
    with pytest.raises(err):
        write_llama(path, cfg, params, tok, ftype=ftype)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("ftype", ["f32", "bf16", "q8_0"])
def test_writer_holds_one_tensor_at_a_time(tmp_path, ftype):
    """bf16 master weights (uint16 bits) of 30 equal 256 x 256 matrices written as f32, bf16 or
    q8_0: the most memory the write allocates at once (tracemalloc: numpy's buffers) is below
    two tensors' f32 bytes, where converting them all first held 30."""
    cfg = LlamaConfig(vocab=256, dim=256, layers=4, heads=4, ff=256, ctx=32)
    rng = np.random.default_rng(3)
    params = {k: _bits_of(rng.standard_normal(s).astype(np.float32)) if len(s) == 2 else
              np.ones(s, np.float32) for k, s in cfg.param_shapes().items()}
    mats = [k for k, s in cfg.param_shapes().items() if len(s) == 2]
    one = 256 * 256 * 4
    assert len(mats) == 30
    write_llama(tmp_path / "warm.gguf", cfg, params, ftype=ftype)    # imports, compiles
    tracemalloc.start()
    try:
        write_llama(tmp_path / "m.gguf", cfg, params, ftype=ftype)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * one, (peak, one)
    _, t, _ = _read_back(tmp_path / "m.gguf")
    for k in mats:      # and what was written is each weight's values in the type
        want = _values(params[k])
        if ftype == "f32":
            assert np.array_equal(np.frombuffer(t[k][2], np.float32).reshape(want.shape), want)
        else:
            assert t[k][2] == gguf.quants.quantize(want, TYPE[ftype]).tobytes(), k


def test_bf16_bits_rounds_as_gguf_across_chunks(monkeypatch):
    """half.bf16_bits (a chunk at a time: small chunks here, the last partial) gives
    gguf.quants' BF16 bits: ties to even, infinities, NaNs quiet, overflow to inf; 0-d too."""
    from jitgraph import half
    monkeypatch.setattr(half, "_CHUNK", 1000)
    rng = np.random.default_rng(6)
    x = rng.standard_normal(12345).astype(np.float32)
    x.view(np.uint32)[:2000] = rng.integers(0, 2 ** 32, 2000, dtype=np.uint64).astype(np.uint32)
    x.view(np.uint32)[2000:2006] = (0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF800000, 0x7F800001,
                                    0xFFC00000)
    want = gguf.quants.quantize(x, Q.BF16).view(np.uint16)
    np.testing.assert_array_equal(half.bf16_bits(x.reshape(3, 4115)).reshape(-1), want)
    out = np.empty(12345, np.uint16)
    assert half.bf16_bits(x, out=out) is out and np.array_equal(out, want)
    assert half.bf16_bits(np.float32(1.0)).shape == ()
    with pytest.raises(ValueError, match="uint16"):
        half.bf16_bits(x, out=np.empty(12345, np.float16))


# ---- loading: f32 and bf16 files into bf16 master weights and f32 weights ----------------------
def _program(shape, master, params):
    g = jg.Graph("lin")
    gin = g.input("g", shape)
    w = g.param("token_embd.weight", shape)
    g.output(loss=jg.sum(w * gin))
    return jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=0.01, master=master),
                      params=params)


def _f32_model_with_ties(tmp_path):
    """An f32 llama file whose token_embd holds bf16 ties (both ways), infinities, NaNs and the
    largest finite f32 (rounds to inf), the rest random."""
    cfg, params, tok = _model(4)
    x = np.random.default_rng(5).standard_normal((354, 64)).astype(np.float32)
    u = x.view(np.uint32)
    u[0, :8] = (0x3F808000, 0x3F818000, 0xBF808000, 0x7F800000, 0xFF800000, 0x7FC00001,
                0xFFA00000, 0x7F7FFFFF)
    params["token_embd.weight"] = x
    write_llama(tmp_path / "f32.gguf", cfg, params, tok, ftype="f32")
    write_llama(tmp_path / "bf16.gguf", cfg, params, tok, ftype="bf16")
    return x


def _file_tensor(path, name):
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == name:
            return t
    raise KeyError(name)


def test_load_master_bf16_from_f32_and_bf16_files(tmp_path, monkeypatch):
    """read_llama(f32_in_file=True) gives F32 and BF16 matrices as FileTensors (no type kept);
    a program with bf16 master weights takes an f32 file's values rounded as gguf.quants rounds
    them and a bf16 file's bits as they are, and f32 weights a bf16 file's exact values; each
    converted in chunks (a small chunk here: many, the last one partial), the file's pages of
    each tensor released after."""
    _f32_model_with_ties(tmp_path)
    monkeypatch.setattr(tensors_mod, "_CHUNK_BYTES", 1000)
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise",
                        lambda fd, off, n, how: (advised.append((off, n, how)),
                                                 real(fd, off, n, how))[1])
    k = "token_embd.weight"
    want = {}
    for kind in ("f32", "bf16"):
        t = _file_tensor(tmp_path / f"{kind}.gguf", k)
        data = np.array(t.data)
        want[kind] = gguf.quants.quantize(data, Q.BF16).view(np.uint16).reshape(354, 64) \
            if kind == "f32" else data.view(np.uint16).reshape(354, 64)
        cfg, base, _ = read_llama(tmp_path / f"{kind}.gguf", f32_in_file=True)
        assert cfg.types == ()
        assert all(isinstance(v, FileTensor) == (len(v.shape) == 2) for v in base.values())
        assert isinstance(base[k], FileTensor) and base[k].dtype == kind
        advised.clear()
        prog = _program((354, 64), "bf16", {k: base[k]})
        got = prog.params.view(k)
        assert got.dtype == np.uint16
        np.testing.assert_array_equal(got, want[kind], err_msg=kind)
        if hasattr(os, "posix_fadvise") and kind == "f32":
            assert (base[k].offset, base[k].nbytes, os.POSIX_FADV_DONTNEED) in advised
        if kind == "bf16":      # f32 weights from a bf16 file: its exact values
            prog = _program((354, 64), "f32", {k: base[k]})
            np.testing.assert_array_equal(prog.params.view(k).view(np.uint32),
                                          want["bf16"].astype(np.uint32) << 16)
    # the f32 file's values rounded are the bf16 file's bits (write_llama rounded them alike)
    np.testing.assert_array_equal(want["f32"], want["bf16"])


def test_read_converted_checks_its_arguments(tmp_path):
    _f32_model_with_ties(tmp_path)
    _, base, _ = read_llama(tmp_path / "f32.gguf", f32_in_file=True)
    t = base["token_embd.weight"]
    with pytest.raises(ValueError, match="token_embd.weight.*f32 into bf16 bits"):
        t.read_converted(np.empty((354, 64), np.float16))
    with pytest.raises(ValueError, match="token_embd.weight.*shape"):
        t.read_converted(np.empty((64, 354), np.uint16))
    short = tmp_path / "short.gguf"
    short.write_bytes((tmp_path / "f32.gguf").read_bytes()[:t.offset + 100])
    cut = FileTensor(str(short), t.name, t.offset, t.type)
    with pytest.raises(jg.ModelFormatError, match="truncated"):
        cut.read_converted(np.empty((354, 64), np.uint16))


@pytest.mark.slow
def test_full_finetune_from_a_bf16_file_equals_one_from_its_f32_values(tmp_path, capsys,
                                                                      stories, corpus_file):
    """A full finetune from a BF16 file (its matrices mapped into bf16 master slots as they
    are, or converted into f32 ones) equals the same finetune from an F32 file of the same
    values (rounded into bf16 slots: exact): the same losses, checkpoints and models bit for
    bit; with --ftype bf16 the model's BF16 matrices are the checkpoint's master bits."""
    import json

    from jitgraph import cli
    cfg, params, tok = read_llama(stories)
    bf, f32 = tmp_path / "base-bf16.gguf", tmp_path / "base-f32.gguf"
    write_llama(bf, cfg, params, tok, ftype="bf16")
    write_llama(f32, *read_llama(bf))                 # the bf16 file's values, as F32
    runs = {}
    for master in ("bf16", "f32"):
        for base in (bf, f32):
            tag = f"{master}-{base.stem}"
            assert cli.main(["finetune", str(base), "--full", "--text", corpus_file(40_000),
                             "--lr", "1e-2", "--steps", "2", "--ctx", "32", "--batch-size", "2",
                             "--no-ppl", "--quiet", "--json", "--master", master,
                             "--ftype", "bf16", "--out", str(tmp_path / f"{tag}.gguf"),
                             "--checkpoint", str(tmp_path / f"{tag}.ckpt")]) == 0
            res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            runs[tag] = ([c["train"] for c in res["curve"]],
                         _read_back(tmp_path / f"{tag}.gguf")[1],
                         _read_back(tmp_path / f"{tag}.ckpt")[1])
        a, b = runs[f"{master}-base-bf16"], runs[f"{master}-base-f32"]
        assert a[0] == b[0], master
        assert a[1] == b[1] and a[2] == b[2], master
    model, ckpt = runs["bf16-base-bf16"][1], runs["bf16-base-bf16"][2]
    mats = [k for k, (t, _, _) in model.items() if t == Q.BF16]
    assert mats and all(ckpt[k][0] == Q.BF16 and ckpt[k][2] == model[k][2] for k in mats)

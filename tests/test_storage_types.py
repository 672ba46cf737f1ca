"""Storage types (jitgraph/types.py STORAGE): frozen weights kept in their file's type, read by
matmul (second operand) and get_rows. The oracle is the interpreter, which dequantizes as ggml
does (gguf.quants) and then computes in f32; compiled programs must agree within f32 rounding.
Also: the build-time refusals, LoRA and gradients through such a weight, the llama model read
in its file's type against the same file read as f32, and the writers' round trips."""
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp, optim
from jitgraph.errors import ModelFormatError
from jitgraph.quant import dequantize, quantize
from jitgraph.testing.storage import random_storage
from jitgraph.types import STORAGE, ShapeError, TensorType

KINDS = tuple(STORAGE)


def _close(got, want):
    scale = max(float(np.abs(want).max()), 1.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * scale)


def _block(dtype):
    return max(STORAGE[dtype][1], 32)


@pytest.mark.parametrize("dtype", KINDS)
@pytest.mark.parametrize("m", [1, 37])
def test_compiled_matmul_and_get_rows_match_the_interpreter(dtype, m):
    """Both layouts (x W^T and x W), a fused epilogue, get_rows; M = 1 (a decode row) and M = 37
    (the tiled path)."""
    k, n = 2 * _block(dtype), 48
    rng = np.random.default_rng(hash(dtype) % 1000 + m)
    g = jg.Graph("stored")
    x = g.input("x", (m, k))
    idx = g.input("idx", (5,), "i32")
    w = g.param("w", (n, k), dtype, trainable=False)        # [out, in]: x W^T
    v = g.param("v", (n, k), dtype, trainable=False)        # [in, out]: y V
    b = g.param("b", (n,))
    y = jg.relu(jg.ops.matmul(x, w, tb=True) + b)           # the epilogue fuses into the GEMM
    g.output(y=y, z=jg.ops.matmul(y, v), rows=jg.ops.get_rows(w, idx))
    params = {"w": random_storage(dtype, (n, k), rng), "v": random_storage(dtype, (n, k), rng),
              "b": rng.standard_normal(n).astype(np.float32)}
    feed = {"x": rng.standard_normal((m, k)).astype(np.float32),
            "idx": np.array([0, n - 1, 3, 3, 17], np.int32)}
    want = interp.run(g, feed, params)
    prog = jg.compile(g)
    for key, val in params.items():
        prog.params[key] = val
    got = prog.step(**feed)
    for key in want:
        _close(got[key], want[key])
    assert np.array_equal(got["rows"], dequantize(params["w"], TensorType(dtype, (n, k)))[
        feed["idx"]])
    assert np.array_equal(prog.params["w"], params["w"])    # the bytes as given, untouched


def test_build_time_refusals_name_the_op_and_the_type():
    g = jg.Graph("bad")
    x = g.input("x", (2, 32))
    w = g.param("w", (4, 32), "q8_0", trainable=False)
    with pytest.raises(ShapeError, match=r"add: operand 1 \(.*q8_0\[4,32\]\) is of storage type "
                                         r"q8_0.*matmul \(second operand\) and get_rows"):
        w + 1.0
    with pytest.raises(ShapeError, match=r"matmul: operand 1 .* only as operand 2"):
        jg.ops.matmul(w, x, tb=True)
    with pytest.raises(ShapeError, match="2-D second operand of an f32 matmul without ta"):
        jg.ops.matmul(x, w, ta=True)
    x64 = g.input("x64", (2, 32), "f64")
    with pytest.raises(ShapeError, match="f32 matmul"):
        jg.ops.matmul(x64, w, tb=True)
    with pytest.raises(ShapeError, match="input q: q4_k is a storage type"):
        g.input("q", (2, 256), "q4_k")
    with pytest.raises(ShapeError, match="trainable params must be f32, f64, f16 or bf16"):
        g.param("t", (2, 256), "q4_k")
    with pytest.raises(ShapeError, match="multiple of its block, 256"):
        g.param("u", (2, 32), "q6_k", trainable=False)
    # a wrong value is refused when it is set, naming the param and both types
    g.output(y=jg.ops.matmul(x, w, tb=True))
    prog = jg.compile(g)
    with pytest.raises(ShapeError, match=r"param w: expected uint8\[4,34\]"):
        prog.params["w"] = np.zeros((4, 32), np.float32)


def _two_layer(dtype):
    """y = (x W1^T) W2s^T, W1 trainable f32, W2s frozen in `dtype`: the gradient reaches W1
    through the stored weight (matmul with tb=False on it)."""
    g = jg.Graph("through")
    x, t = g.input("x", (6, 32)), g.input("t", (6,), "i32")
    w1 = g.param("w1", (64, 32), init=jg.init.normal(0.0, 0.2))
    w2 = g.param("w2", (10, 64), dtype, trainable=False)
    h = jg.tanh(jg.ops.matmul(x, w1, tb=True))
    g.output(loss=jg.cross_entropy(jg.ops.matmul(h, w2, tb=True), t))
    return g


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_training_through_a_stored_weight_matches_the_interpreter(dtype):
    rng = np.random.default_rng(4)
    g = _two_layer(dtype)
    opt = optim.AdamW(lr=1e-2)
    prog = jg.compile(g, loss="loss", optimizer=opt, seed=1)
    w2 = random_storage(dtype, (10, 64), rng, scale=0.5)
    prog.params["w2"] = w2
    tg = jg.training_graph(g, optimizer=opt)
    ref = {k: np.array(v) for k, v in tg.init_params(0).items()}
    ref.update({k: np.array(prog.params[k]) for k in g.params})
    start = np.array(prog.params["w1"])
    for step in range(3):
        f = {"x": rng.standard_normal((6, 32)).astype(np.float32),
             "t": rng.integers(0, 10, 6).astype(np.int32)}
        prog.step(**f)
        interp.run(tg, {**f, **opt.runtime_inputs(step)}, ref)
    assert not np.array_equal(prog.params["w1"], start)
    np.testing.assert_allclose(prog.params["w1"], ref["w1"], rtol=1e-5, atol=1e-6)
    assert np.array_equal(prog.params["w2"], w2) and sorted(prog.state) == \
        ["opt/m/w1", "opt/v/w1"]


def test_lora_on_a_stored_base_matches_the_interpreter():
    rng = np.random.default_rng(5)
    g = jg.Graph("base")
    x = g.input("x", (8, 64))
    w = g.param("w", (32, 64), "q4_0", trainable=False)
    g.output(y=jg.ops.matmul(x, w, tb=True))
    lg = jg.lora(g, targets=["w"], rank=4, alpha=8.0)
    assert lg.nodes[lg.params["w.lora_a"]].type.dtype == "f32"
    params = {"w": random_storage("q4_0", (32, 64), rng),
              "w.lora_a": rng.standard_normal((4, 64)).astype(np.float32),
              "w.lora_b": rng.standard_normal((32, 4)).astype(np.float32)}
    feed = {"x": rng.standard_normal((8, 64)).astype(np.float32)}
    prog = jg.compile(lg)
    for k, v in params.items():
        prog.params[k] = v
    _close(prog.step(**feed)["y"], interp.run(lg, feed, params)["y"])


# ---- the llama model in its file's type ----------------------------------------------------------
@pytest.fixture(scope="module")
def stories(tmp_path_factory, testdata):
    from jitgraph.models.llama import read_llama, write_llama
    model = read_llama(testdata.stories)
    d = tmp_path_factory.mktemp("types")
    files = {}
    for ftype in ("f16", "bf16", "q8_0"):
        files[ftype] = d / f"stories260K-{ftype}.gguf"
        write_llama(files[ftype], *model, ftype=ftype)
    return model, files


@pytest.mark.parametrize("ftype", ["f16", "bf16", "q8_0"])
def test_llama_in_its_file_type_scores_as_the_file_read_as_f32(stories, ftype, testdata):
    """perplexity of the file kept in its type (FileTensors read into the program, dequantized
    in the kernels) equals that of the same file dequantized at load (the values are the same:
    only the GEMMs' rounding differs); the writer stored exactly quantize(f32 weights)."""
    from jitgraph.formats.tensors import FileTensor
    from jitgraph.models.llama import read_llama
    from jitgraph.models.perplexity import perplexity
    (cfg, params, tok), files = stories
    kept = read_llama(files[ftype], keep_types=True)
    assert isinstance(kept[1]["blk.0.attn_q.weight"], FileTensor)
    types = dict(kept[0].types)
    assert types["blk.0.attn_q.weight"] == ftype
    # ffn_down's rows are ff = 172 long: not whole q8_0 blocks, so written as F16
    assert types["blk.0.ffn_down.weight"] == ("f16" if ftype == "q8_0" else ftype)
    assert isinstance(kept[1]["blk.0.attn_norm.weight"], np.ndarray)      # 1-D: read as f32
    f32 = read_llama(files[ftype])
    w = params["blk.1.ffn_up.weight"]
    assert np.array_equal(f32[1]["blk.1.ffn_up.weight"],
                          dequantize(quantize(w, ftype), TensorType(ftype, w.shape)))
    text = testdata.shakespeare_tail.read_text()[:3000]
    a = perplexity(kept, text, n_ctx=64, batch=4)
    b = perplexity(f32, text, n_ctx=64, batch=4)
    assert a.chunks == b.chunks > 2
    assert abs(a.ppl / b.ppl - 1) < 1e-5


def test_generation_in_its_file_type_is_greedy_identical(stories):
    from jitgraph.models.generate import Generator, Sampler
    from jitgraph.models.llama import read_llama
    _, files = stories
    outs = []
    for keep in (True, False):
        gen = Generator(read_llama(files["q8_0"], keep_types=keep), ctx=48, chunk=8)
        ids = gen.tokenizer.encode("Once upon a time", bos=True)
        outs.append(gen.generate(ids, 16, Sampler(temperature=0.0)).ids)
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_file_tensor_of_a_truncated_file_is_an_error(stories, tmp_path):
    from jitgraph.models.llama import read_llama
    _, files = stories
    data = files["q8_0"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data)
    cfg, params, _ = read_llama(cut, keep_types=True)
    last = max((t for t in params.values() if hasattr(t, "read_into")), key=lambda t: t.offset)
    with open(cut, "r+b") as f:                 # the file shrinks after its header was read
        f.truncate(last.offset + 10)
    with pytest.raises(ModelFormatError, match=f"tensor {last.name} is truncated"):
        np.asarray(last)


@pytest.mark.parametrize("ftype", ["f16", "bf16", "q8_0"])
def test_adapter_writer_round_trip(stories, ftype, tmp_path):
    """write_adapter --ftype stores A and B as convert_lora_to_gguf.py --outtype would (Q8_0
    where rows are whole blocks, else F16); read_adapter reads every type back."""
    from jitgraph.models.lora import read_adapter, write_adapter
    (cfg, _, _), _ = stories
    rng = np.random.default_rng(6)
    a = rng.standard_normal((4, cfg.dim)).astype(np.float32)
    b = rng.standard_normal((cfg.dim, 4)).astype(np.float32)
    path = tmp_path / "ad.gguf"
    write_adapter(path, cfg, {"blk.0.attn_q.weight.lora_a": a,
                              "blk.0.attn_q.weight.lora_b": b}, 4.0, ftype=ftype)
    params, alpha = read_adapter(path, cfg)
    assert alpha == 4.0
    b_type = "f16" if ftype == "q8_0" else ftype          # rows of 4: not a q8_0 block
    for x, got, dt in ((a, params["blk.0.attn_q.weight.lora_a"], ftype),
                       (b, params["blk.0.attn_q.weight.lora_b"], b_type)):
        assert np.array_equal(got, dequantize(quantize(x, dt), TensorType(dt, x.shape)))


@pytest.mark.slow
def test_lora_finetune_on_a_q8_0_base_trains_as_on_its_f32_values(stories, tmp_path, capsys):
    """`finetune --lora-rank` keeps a Q8_0 base in its type: the same run on the same values
    stored as F32 (the file dequantized) gives the same losses and adapter, within f32 rounding;
    --ftype f16 writes the adapter as F16; the checkpoint holds the adapter alone."""
    import json

    from jitgraph import cli
    from jitgraph.formats.llama_checkpoint import load_llama_checkpoint
    from jitgraph.models.llama import read_llama, write_llama
    from jitgraph.models.lora import read_adapter
    from jitgraph.models.text import read_corpus
    _, files = stories
    text = tmp_path / "t.txt"
    text.write_bytes(read_corpus()[:20_000])
    as_f32 = tmp_path / "q8_0-as-f32.gguf"
    write_llama(as_f32, *read_llama(files["q8_0"]))
    out = {}
    for name, base in (("kept", files["q8_0"]), ("f32", as_f32)):
        ad, ck = tmp_path / f"{name}.gguf", tmp_path / f"{name}.ckpt"
        assert cli.main(["finetune", str(base), "--text", str(text), "--lora-rank", "2",
                         "--steps", "3", "--ctx", "32", "--batch-size", "2", "--no-ppl",
                         "--ftype", "f16", "--out", str(ad), "--checkpoint", str(ck),
                         "--json", "--quiet"]) == 0
        out[name] = (json.loads(capsys.readouterr().out.strip().splitlines()[-1]), ad, ck)
    (ra, ada, cka), (rb, adb, _) = out["kept"], out["f32"]
    for x, y in zip(ra["curve"], rb["curve"]):
        assert x["train"] == pytest.approx(y["train"], rel=1e-5)
    cfg = read_llama(files["q8_0"])[0]
    pa, _ = read_adapter(ada, cfg)
    pb, _ = read_adapter(adb, cfg)
    assert set(pa) == set(pb) and pa
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-3, atol=1e-4, err_msg=k)
        assert np.array_equal(pa[k], pa[k].astype(np.float16).astype(np.float32))   # F16
    _, _, params, _, _ = load_llama_checkpoint(cka)
    assert params and all(k.endswith((".lora_a", ".lora_b")) for k in params)


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["f16", "bf16", "q8_0"])
def test_llama_quantize_files_score_as_llama_perplexity(ftype, testdata):
    """stories260K converted by llama.cpp's llama-quantize (tests/data/types), read in its type:
    perplexity over the whole held-out tail within 0.5 % of llama-perplexity's on the same
    file (llama.cpp rounds activations to the weights' dot type: more than f32 rounding)."""
    import json

    from jitgraph.models.llama import read_llama
    from jitgraph.models.perplexity import perplexity, split_text
    folder = testdata.stories.parent / "types"
    ref = json.loads((folder / "llamacpp-perplexity.json").read_text())
    model = read_llama(folder / f"stories260K-{ftype}.gguf", keep_types=True)
    assert ftype in dict(model[0].types).values()
    res = perplexity(model, split_text(testdata.shakespeare_tail, "all"), n_ctx=ref["ctx"],
                     batch=16, kv_f16=True)
    assert res.chunks == ref["chunks"]
    assert abs(res.ppl / ref["perplexity"][ftype] - 1) < 0.005, (res.ppl, ref["perplexity"])


def test_f32_in_file_defers_the_f32_matrices_alone(stories):
    """read_llama(f32_in_file=True), a full finetune's base: each F32 or BF16 weight matrix is
    a FileTensor (read straight into a program, converted where the slot's type differs: not
    held twice) with the values read_llama reads; another storage-typed one is read as f32 (a
    full finetune trains f32 or bf16 master weights) and cfg names no types."""
    from jitgraph.formats.tensors import FileTensor
    from jitgraph.models.llama import read_llama, write_llama
    _, files = stories
    f32_path = files["f16"].parent / "stories260K-f32.gguf"
    write_llama(f32_path, *stories[0])
    for path, deferred in ((f32_path, True), (files["bf16"], True), (files["f16"], False)):
        cfg2, got, _ = read_llama(path, f32_in_file=True)
        assert cfg2.types == ()
        w = got["blk.0.attn_q.weight"]
        assert isinstance(w, FileTensor) == deferred
        assert isinstance(got["blk.0.attn_norm.weight"], np.ndarray)
        eager = read_llama(path)[1]
        for k in ("blk.0.attn_q.weight", "token_embd.weight"):
            v = got[k].f32() if isinstance(got[k], FileTensor) else got[k]
            np.testing.assert_array_equal(v, eager[k], err_msg=k)

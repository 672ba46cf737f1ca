"""The architectures of jitgraph/models/arch.py (llama with LLaMA 3.x rope_freqs, qwen2, phi3)
against llama.cpp: the test models of tests/data/arch (random weights, real vocabularies cut
short; bench/make_arch_fixtures.py made them and llama.cpp's outputs through llama-cpp-python
0.3.36). Logits within 1e-4 of the row's scale, greedy continuations identical, perplexity within
0.5 %; the rope op's frequency factors; the descriptions' errors; LoRA on fused weights; finetune
(full and LoRA) and export for each architecture."""
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import cli
from jitgraph.errors import ModelFormatError
from jitgraph.interp import run
from jitgraph.ir import Graph
from jitgraph.models.arch import ARCHS
from jitgraph.models.generate import Generator, Sampler
from jitgraph.models.llama import llama_forward, llama_inputs, read_llama, tokenizer_fields
from jitgraph.models.lora import merge, read_adapter, write_adapter
from jitgraph.models.perplexity import perplexity
from jitgraph.testing import check_grad

DATA = Path(__file__).resolve().with_name("data")   # as conftest.py; ../shared is never read
NAMES = ("llama3", "qwen2", "phi3")
ARCH_OF = {"llama3": "llama", "qwen2": "qwen2", "phi3": "phi3"}


def _path(name):
    return DATA / "arch" / f"{name}.gguf"


@pytest.fixture(scope="module", params=NAMES)
def arch_model(request):
    """(name, read_llama's tuple, llama.cpp's reference, llama.cpp's logits)."""
    name = request.param
    with open(DATA / "arch" / f"{name}-reference.json") as f:
        ref = json.load(f)
    return name, read_llama(_path(name)), ref, np.load(DATA / "arch" / f"{name}-logits.npy")


def _logits(cfg, params, ids, kv_f16=True):
    prog = jg.compile(llama_forward(cfg, 1, len(ids), kv_f16=kv_f16))
    for k, v in params.items():
        prog.params[k] = v
    return prog.step(**llama_inputs(ids))["logits"][0]


def _row_errs(got, want):
    """Each row's largest error relative to that row's scale (its largest |logit|)."""
    return np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)


def _rel_err(got, want):
    """The largest of _row_errs."""
    return float(_row_errs(got, want).max())


# ---- the models read as llama.cpp reads them ---------------------------------------------------
def test_configs_follow_the_files(arch_model):
    name, (cfg, params, tok), ref, _ = arch_model
    assert cfg.arch == ARCH_OF[name] == ref["architecture"]
    assert (cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ff) == \
        (512, 64, 2, 4, 2, 128)
    assert cfg.tied == (name != "phi3") and cfg.rope_freqs == (name == "llama3")
    assert set(params) == set(cfg.param_shapes())
    assert ("blk.0.attn_qkv.weight" in params) == (name == "phi3")
    assert ("blk.1.attn_v.bias" in params) == (name == "qwen2")
    if name == "phi3":
        assert params["blk.0.ffn_up.weight"].shape == (2 * cfg.ff, cfg.dim)
    assert tok is not None and len(tok) == cfg.vocab     # SPM (phi3) or BPE (llama3, qwen2)


def test_logits_match_llama_cpp(arch_model):
    name, (cfg, params, _), ref, want = arch_model
    got = _logits(cfg, params, ref["prompt_ids"])
    # Both sides round K and V to f16 (the KV cache); a value that lands near a tie between two
    # f16 numbers can round the other way when the f32 sums that made it are ordered
    # differently (the host's SIMD width, BLAS's kernel), which moves the rows after it by
    # ~1e-4 of their scale (seen: qwen2's last three rows on an AVX2 host). Most rows agree to
    # ~1e-6; a KV cache kept in f32 instead misses by 1e-3 or more.
    err = _row_errs(got, want)
    assert err.max() < 3e-4 and np.median(err) < 1e-5, err
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))


def test_greedy_continuations_match_llama_cpp(arch_model):
    name, model, ref, _ = arch_model
    gen = Generator(model, ctx=64)
    for g in ref["greedy"]:
        gen.reset()
        res = gen.generate(g["prompt_ids"], len(g["ids"]), Sampler(0.0), stop_at_eos=False)
        assert list(res.ids) == g["ids"], name


def test_perplexity_matches_llama_cpp(arch_model):
    name, model, ref, _ = arch_model
    p = ref["perplexity"]
    ids = ref["text_ids"][:p["n_ctx"] * p["chunks"]]
    res = perplexity(model, ids, n_ctx=p["n_ctx"], batch=4,
                     bos=p["bos"] if p["bos"] is not None else False)
    assert res.chunks == p["chunks"]
    assert abs(res.ppl / p["ppl"] - 1) < 5e-3


def test_each_variant_matters(arch_model):
    """The checks above can fail: llama3's frequency factors, qwen2's biases and the order of
    phi3's fused halves each change the logits far beyond the tolerance."""
    name, (cfg, params, _), ref, want = arch_model
    ids = ref["prompt_ids"]
    if name == "llama3":
        other = (cfg, {**params, "rope_freqs.weight": np.ones(cfg.rope_half, np.float32)})
    elif name == "qwen2":
        other = (cfg, {k: (v * 0 if k.endswith(".bias") else v) for k, v in params.items()})
    else:
        up = {k: np.concatenate([v[cfg.ff:], v[:cfg.ff]]) for k, v in params.items()
              if k.endswith("ffn_up.weight")}
        other = (cfg, {**params, **up})
    assert _rel_err(_logits(*other, ids), want) > 1e-2


# ---- rope's frequency factors ------------------------------------------------------------------
def _rope_loop(x, pos, theta, mode, factors):
    out = x.astype(np.float64).copy()
    d = x.shape[-1]
    for idx in np.ndindex(x.shape[:-1]):
        for i in range(d // 2):
            a, b = (2 * i, 2 * i + 1) if mode == "normal" else (i, i + d // 2)
            ang = pos[idx[-2]] * theta ** (-2 * i / d) / factors[i]
            out[idx + (a,)] = x[idx + (a,)] * math.cos(ang) - x[idx + (b,)] * math.sin(ang)
            out[idx + (b,)] = x[idx + (a,)] * math.sin(ang) + x[idx + (b,)] * math.cos(ang)
    return out


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_rope_factors(mode):
    rng = np.random.default_rng(1)
    g = Graph("rope_factors")
    x, pos = g.input("x", (2, 5, 3, 8), "f32"), g.input("pos", (5,), "i32")
    f = g.input("f", (4,), "f32")
    g.output(y=jg.rope(x, pos, theta=500.0, mode=mode, factors=f))
    feed = {"x": rng.standard_normal((2, 5, 3, 8)).astype(np.float32),
            "pos": np.array([0, 3, 9, 40, 7], np.int32), "f": np.array([1, 2.5, 8, 32], np.float32)}
    want = _rope_loop(feed["x"], feed["pos"], 500.0, mode, feed["f"])
    np.testing.assert_allclose(run(g, feed)["y"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jg.compile(g).step(**feed)["y"], want, rtol=1e-5, atol=1e-5)
    # the backward: the inverse rotation with the same factors, checked by finite differences
    gp = Graph("rope_factors_grad")
    w = gp.param("w", (1, 4, 2, 8), "f32")
    gp.output(y=jg.rope(w, gp.input("pos", (4,), "i32"), mode=mode,
                        factors=gp.input("f", (4,), "f32")))
    check_grad(gp, {"pos": np.array([1, 2, 5, 11], np.int32), "f": feed["f"]},
               {"w": rng.standard_normal((1, 4, 2, 8))})


def test_rope_factors_shape_error():
    g = Graph("bad")
    x, pos = g.input("x", (1, 2, 1, 8), "f32"), g.input("pos", (2,), "i32")
    with pytest.raises(jg.ShapeError, match=r"frequency factors .*\(expected f32\[4\]"):
        jg.rope(x, pos, factors=g.input("f", (8,), "f32"))


# ---- what is refused ---------------------------------------------------------------------------
def _rewrite(src, dst, arch=None, extra=None):
    """A copy of the GGUF file src with general.architecture (and its key prefix) changed and
    tensors {name: array} added."""
    r = gguf.GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    arch = arch or old
    w = gguf.GGUFWriter(str(dst), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        sub = f.types[1] if len(f.types) > 1 else None
        w.add_key_value(k.replace(f"{old}.", f"{arch}.", 1), f.contents(), f.types[0], sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape([int(n) for n in reversed(t.shape)]))
    for k, v in (extra or {}).items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_architecture_is_one_line_naming_it(tmp_path):
    p = tmp_path / "gemma.gguf"
    _rewrite(_path("qwen2"), p, arch="gemma")
    with pytest.raises(ModelFormatError) as e:
        read_llama(p)
    msg = str(e.value)
    assert "\n" not in msg and "architecture 'gemma' is not supported" in msg and str(p) in msg


def test_unsupported_tensors_are_named(tmp_path):
    p = tmp_path / "longrope.gguf"          # phi3's long-context rope factors
    _rewrite(_path("phi3"), p, extra={"rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(ModelFormatError, match=r"rope_factors_long.weight.*not supported by "
                                               r"jitgraph's phi3 graph"):
        read_llama(p)


# ---- LoRA, finetune and export -----------------------------------------------------------------
def test_lora_roles_on_fused_weights(capsys):
    from jitgraph.cli.llama_train import lora_weights
    notes = []
    assert lora_weights(ARCHS["phi3"], "q,v,up", notes.append) == ("attn_qkv.weight",
                                                                    "ffn_up.weight")
    assert len(notes) == 2 and "fused attn_qkv (roles q,k,v)" in notes[0] and \
        "covers the whole fused weight" in notes[0] and "roles gate,up" in notes[1]
    assert lora_weights(ARCHS["phi3"], "gate", notes.append) == ("ffn_up.weight",)
    assert "on phi3, gate is part of the fused ffn_up" in notes[-1]
    notes.clear()
    assert lora_weights(ARCHS["qwen2"], "q,k,v,o,gate,up,down", notes.append) == tuple(
        f"{p}.weight" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                "ffn_up", "ffn_down"))
    assert not notes


def test_lora_shorthands_skip_biases():
    """jg.lora's shorthands name weights: on qwen2, q and v adapt attn_q/attn_v.weight, never the
    biases beside them (which no matmul reads)."""
    cfg, _, _ = read_llama(_path("qwen2"))
    g = jg.lora(llama_forward(cfg, 1, 4, labels=True), targets="q,v", rank=2)
    assert sorted(k for k in g.params if "lora" in k) == sorted(
        f"blk.{i}.attn_{r}.weight.lora_{x}" for i in range(2) for r in "qv" for x in "ab")


def _train_steps(cfg, params, ids, targets=None, steps=6):
    """Losses of `steps` AdamW steps on one row of ids (LoRA on `targets` when given)."""
    from jitgraph.lora import lora
    seq = len(ids) - 1
    g = llama_forward(cfg, 1, seq, labels=True)
    if targets:
        g = lora(g, targets=targets, rank=2)
    prog = jg.compile(g, loss="loss", optimizer=jg.optim.AdamW(lr=3e-3))
    for k, v in params.items():
        prog.params[k] = v
    feed = {**llama_inputs(ids[:-1]), "labels": np.asarray([ids[1:]], np.int32)}
    losses = [float(prog.step(**feed)["loss"]) for _ in range(steps)]
    return losses, prog


@pytest.mark.parametrize("lora_on", [False, True])
def test_training_steps_lower_the_loss(arch_model, lora_on):
    """finetune's program (full and LoRA) for each architecture: the loss falls; LoRA leaves
    the base weights as they are; rope_freqs is never trained."""
    from jitgraph.cli.llama_train import lora_weights
    name, (cfg, params, _), ref, _ = arch_model
    targets = lora_weights(cfg.description, "q,v,gate", lambda m: None) if lora_on else None
    losses, prog = _train_steps(cfg, params, ref["text_ids"][:33], targets)
    assert losses[-1] < losses[0] - 0.1, losses
    for k, v in params.items():
        moved = not np.array_equal(np.asarray(prog.params[k]), v)
        assert moved == (not lora_on and k != "rope_freqs.weight"), k


def test_phi3_lora_finetune_and_export(tmp_path, capsys):
    """`finetune --lora-targets q` on phi3 says the adapter covers the fused attn_qkv, writes
    an adapter of attn_qkv; `export` merges it into a model that reads back with the merge."""
    text = tmp_path / "t.txt"
    text.write_text(json.load(open(DATA / "arch" / "phi3-reference.json"))["text"] * 8)
    ad, out = tmp_path / "ad.gguf", tmp_path / "merged.gguf"
    argv = ["finetune", str(_path("phi3")), "--text", str(text), "--lora-rank", "2",
            "--lora-targets", "q", "--steps", "2", "--ctx", "32", "--batch-size", "2",
            "--no-ppl", "--out", str(ad)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "note: on phi3, q is part of the fused attn_qkv (roles q,k,v): the adapter covers " \
           "the whole fused weight" in said
    cfg, params, tok = read_llama(_path("phi3"))
    adapter, alpha = read_adapter(ad, cfg)
    assert sorted(adapter) == [f"blk.{i}.attn_qkv.weight.lora_{x}" for i in range(2)
                               for x in "ab"]
    assert cli.main(["export", str(_path("phi3")), "--lora", str(ad), "--out", str(out)]) == 0
    cfg2, p2, tok2 = read_llama(out)
    assert cfg2 == cfg and tok2.tokens == tok.tokens
    for k, v in merge(params, adapter, alpha).items():
        np.testing.assert_allclose(p2[k], v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_export_keeps_a_bpe_vocabulary(tmp_path, name):
    """export of a model whose vocabulary jitgraph has no tokenizer for (BPE) copies its
    tokenizer.* metadata as it is, and every weight (rope_freqs and biases included)."""
    cfg, params, _ = read_llama(_path(name))
    rng = np.random.default_rng(0)
    w = "blk.1.attn_v.weight"
    ad = tmp_path / "ad.gguf"
    write_adapter(ad, cfg, {w + ".lora_a": rng.standard_normal((2, cfg.dim)) * 0.1,
                            w + ".lora_b": rng.standard_normal((cfg.kv_dim, 2)) * 0.1}, 2.0)
    out = tmp_path / "out.gguf"
    assert cli.main(["export", str(_path(name)), "--lora", str(ad), "--out", str(out),
                     "--quiet"]) == 0
    cfg2, p2, _ = read_llama(out)
    assert cfg2 == cfg
    adapter, alpha = read_adapter(ad, cfg)
    merged = merge(params, adapter, alpha)
    assert set(p2) == set(merged)
    for k in merged:
        np.testing.assert_allclose(p2[k], merged[k], rtol=1e-6, atol=1e-7)
    a, b = tokenizer_fields(_path(name)), tokenizer_fields(out)
    assert a.keys() == b.keys() and all(a[k][0] == b[k][0] for k in a)


@pytest.mark.parametrize("name", ["llama3", "qwen2", "phi3"])
def test_from_text_as_llama_cpp(tmp_path, capsys, name):
    """Each test model's vocabulary (llama-bpe and qwen2: BPE; phi-3: SPM) tokenizes the passage
    as llama.cpp did, and `jitgraph generate` from the prompt's text continues as llama.cpp's
    greedy decoding."""
    ref = json.load(open(DATA / "arch" / f"{name}-reference.json"))
    _, _, tok = read_llama(_path(name))
    assert tok.encode(ref["text"], bos=tok.add_bos) == ref["text_ids"]
    g = ref["greedy"][0]
    prompt = tok.decode(g["prompt_ids"][1:] if ref["add_bos"] else g["prompt_ids"])
    assert tok.encode(prompt, bos=tok.add_bos) == g["prompt_ids"]
    assert cli.main(["generate", str(_path(name)), "--prompt", prompt, "-n", str(len(g["ids"])),
                     "--temp", "0", "--ignore-eos", "--ctx", "64", "--quiet", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["tokens"] == len(g["ids"]) and out["text"] == tok.decode(g["ids"])

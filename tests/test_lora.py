"""LoRA (jitgraph/lora.py, jitgraph/models/lora.py): the graph transform against a numpy oracle
and finite differences, identity at step 0 on stories260K, llama.cpp adapter files (layout read
back with the gguf library, round trip, errors), merge == unmerged, and the --lora / export
commands."""
import json
import math

import gguf
import numpy as np
import pytest

import jitgraph as jg
from jitgraph import interp
from jitgraph.errors import ModelFormatError
from jitgraph.formats.gguf import gguf_writer
from jitgraph.models.llama import LlamaConfig, llama_forward, llama_inputs, write_llama
from jitgraph.models.lora import adapter_scale, merge, read_adapter, write_adapter
from jitgraph.printer import param_roles
from jitgraph.testing import check_grad
from jitgraph.types import ShapeError

TINY = LlamaConfig(vocab=40, dim=32, layers=2, heads=4, kv_heads=2, ff=48, ctx=64)


# ---- the transform -----------------------------------------------------------------------------
def three_ways(dtype="f32"):
    """x [4, 6] through a weight read each way: x @ Wq^T (tb), x @ Wp, Wl @ x^T (W on the left)."""
    g = jg.Graph("three")
    x = g.input("x", (4, 6), dtype)
    wq = g.param("wq", (5, 6), dtype, init=jg.init.normal(0, 0.5))
    wp = g.param("wp", (6, 7), dtype, init=jg.init.normal(0, 0.5))
    wl = g.param("wl", (3, 6), dtype, init=jg.init.normal(0, 0.5))
    yq = jg.matmul(x, wq, tb=True)
    yp = jg.tanh(x @ wp)
    yl = jg.matmul(wl, x, tb=True)                                # [3, 4]
    g.output(out=jg.sum(yq) * 0.5 + jg.sum(jg.sqr(yp)) + jg.sum(jg.tanh(yl)), yq=yq, yp=yp,
             yl=yl)
    return g


def random_adapters(g, rng, scale=0.5):
    return {k: (rng.standard_normal(g.nodes[i].type.shape) * scale).astype(
        g.nodes[i].type.np_dtype) for k, i in g.params.items()
        if k.endswith((".lora_a", ".lora_b"))}


def test_lora_forward_matches_numpy_oracle_each_way_a_weight_is_read():
    g = three_ways()
    lg = jg.lora(g, targets=("wq", "wp", "wl"), rank=2, alpha=3.0)
    shapes = {k: lg.nodes[i].type.shape for k, i in lg.params.items()}
    assert shapes["wq.lora_a"] == (2, 6) and shapes["wq.lora_b"] == (5, 2)
    assert shapes["wp.lora_a"] == (2, 6) and shapes["wp.lora_b"] == (7, 2)
    assert shapes["wl.lora_a"] == (2, 6) and shapes["wl.lora_b"] == (3, 2)
    roles = param_roles(lg)
    assert [k for k, r in roles.items() if r == "frozen"] == ["wq", "wp", "wl"]
    rng = np.random.default_rng(0)
    params = {**g.init_params(1), **random_adapters(lg, rng)}
    x = rng.standard_normal((4, 6)).astype(np.float32)
    s = 3.0 / 2
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    x64 = x.astype(np.float64)
    want = {"yq": x64 @ p64["wq"].T + s * (x64 @ p64["wq.lora_a"].T) @ p64["wq.lora_b"].T,
            "yp": np.tanh(x64 @ p64["wp"] + s * x64 @ p64["wp.lora_a"].T @ p64["wp.lora_b"].T),
            "yl": p64["wl"] @ x64.T + s * p64["wl.lora_b"] @ (p64["wl.lora_a"] @ x64.T)}
    got = interp.run(lg, {"x": x}, dict(params))
    prog = jg.compile(lg)
    for k, v in params.items():
        prog.params[k] = v
    out = prog.step(x=x)
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[k], w, rtol=1e-5, atol=1e-5)
    # B = 0 (the initial adapters): exactly the base graph
    fresh = lg.init_params(0)
    assert not np.any(fresh["wq.lora_b"]) and np.any(fresh["wq.lora_a"])
    base = interp.run(g, {"x": x}, g.init_params(0))
    ada = interp.run(lg, {"x": x}, fresh)
    assert all(np.array_equal(base[k], ada[k]) for k in want)


def test_lora_gradients_match_finite_differences_in_float64():
    lg = jg.lora(three_ways("f64"), targets=("wq", "wp", "wl"), rank=2, alpha=3.0)
    rng = np.random.default_rng(1)
    params = {**lg.init_params(2), **random_adapters(lg, rng)}
    x = rng.standard_normal((4, 6))
    res = check_grad(lg, {"x": x}, params, loss="out", max_elements=20)
    assert set(res.errors) == {f"{w}.lora_{ab}" for w in ("wq", "wp", "wl") for ab in "ab"}
    assert res.ok


def test_lora_init_is_pefts_and_seeded():
    g = llama_forward(TINY, 1, 4)
    lg = jg.lora(g, rank=8, seed=0)           # default targets: attn_q, attn_v
    adapted = sorted({k.rsplit(".", 1)[0] for k in lg.params if ".lora_" in k})
    assert adapted == [f"blk.{i}.attn_{n}.weight" for i in range(2) for n in "qv"]
    assert lg.trainable_params() == [k for k in lg.params if ".lora_" in k]
    big = jg.lora(llama_forward(LlamaConfig(vocab=8, dim=512, layers=1, heads=4), 1, 2),
                  targets="q", rank=16).init_params(0)
    a = big["blk.0.attn_q.weight.lora_a"]
    bound = 1 / math.sqrt(512)              # kaiming_uniform_(a=sqrt(5)) over fan_in 512
    assert a.shape == (16, 512) and np.abs(a).max() <= bound
    assert abs(a.std() - bound / math.sqrt(3)) < 0.03 * bound          # U(-b, b): std b/sqrt(3)
    assert not np.any(big["blk.0.attn_q.weight.lora_b"])
    same = jg.lora(g, rank=8, seed=0).init_params(0)
    other = jg.lora(g, rank=8, seed=1).init_params(0)
    k = "blk.1.attn_v.weight.lora_a"
    assert np.array_equal(lg.init_params(0)[k], same[k]) and not np.array_equal(same[k], other[k])
    # shorthands and exact names: "output.weight" is not attn_output.weight
    lo = jg.lora(g, targets=["o", "output.weight", "down"], rank=2)
    assert sorted({k.rsplit(".", 1)[0] for k in lo.params if ".lora_" in k}) == sorted(
        ["output.weight"] + [f"blk.{i}.{n}.weight" for i in range(2)
                             for n in ("attn_output", "ffn_down")])


def test_lora_errors_name_what_is_wrong():
    g = llama_forward(TINY, 1, 4)
    with pytest.raises(ShapeError, match="rank must be an integer >= 1"):
        jg.lora(g, rank=0)
    with pytest.raises(ShapeError, match="rank must be an integer >= 1"):
        jg.lora(g, rank=2.5)
    with pytest.raises(ShapeError, match="exceeds min"):
        jg.lora(g, targets="k", rank=17)                   # attn_k is [16, 32]
    with pytest.raises(ShapeError, match="alpha must be a finite number"):
        jg.lora(g, alpha=float("nan"))
    with pytest.raises(ShapeError, match="'attn_z' matches no matmul weight.*blk.0.attn_k"):
        jg.lora(g, targets=("attn_q", "attn_z"))
    with pytest.raises(ShapeError, match="which no matmul reads"):
        jg.lora(g, targets="attn_norm")
    with pytest.raises(ShapeError, match="targets must be non-empty"):
        jg.lora(g, targets=())
    with pytest.raises(ShapeError, match="read by get_rows"):
        jg.lora(llama_forward(LlamaConfig(vocab=40, dim=32, layers=1, heads=4, tied=True), 1, 4),
                targets="token_embd")
    with pytest.raises(ShapeError, match="lora applied twice"):
        jg.lora(jg.lora(g, targets="q"), targets="q")
    with pytest.raises(ShapeError, match="no rank for"):
        jg.lora(g, targets="q", rank={"blk.0.attn_q.weight": 2})
    with pytest.raises(ShapeError, match="is updated by graph"):
        jg.lora(_updated(g), targets="blk.0.attn_q.weight")
    # a second call on other weights composes: earlier adapters stay trainable
    two = jg.lora(jg.lora(g, targets="q", rank=2), targets="v", rank=4)
    assert len(two.trainable_params()) == 8


def _updated(g):
    g = g.copy()
    w = g.tensor(g.params["blk.0.attn_q.weight"])
    g.update(**{"blk.0.attn_q.weight": w * 0.5})
    return g


# ---- the adapter file --------------------------------------------------------------------------
def tiny_adapter(cfg=TINY, rank=3, seed=0, names=("attn_q", "attn_v", "ffn_down")):
    rng = np.random.default_rng(seed)
    shapes = cfg.param_shapes()
    out = {}
    for i in range(cfg.layers):
        for n in names:
            w = f"blk.{i}.{n}.weight"
            o, inn = shapes[w]
            out[w + ".lora_a"] = rng.standard_normal((rank, inn)).astype(np.float32)
            out[w + ".lora_b"] = rng.standard_normal((o, rank)).astype(np.float32)
    return out


def test_adapter_gguf_layout_is_llama_cpps_and_round_trips(tmp_path):
    path = tmp_path / "a.gguf"
    ad = tiny_adapter()
    write_adapter(path, TINY, ad, alpha=6.0)
    r = gguf.GGUFReader(path)                     # the peer reader
    md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert md["general.architecture"] == "llama" and md["general.type"] == "adapter"
    assert md["adapter.type"] == "lora" and md["adapter.lora.alpha"] == 6.0
    assert r.fields["adapter.lora.alpha"].types == [gguf.GGUFValueType.FLOAT32]
    ne = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert set(ne) == set(ad)
    shapes = TINY.param_shapes()
    for name in ad:
        if not name.endswith(".lora_a"):
            continue
        base = name[:-len(".lora_a")]
        w = list(reversed(shapes[base]))              # the base tensor's ggml ne
        a, b = ne[base + ".lora_a"], ne[base + ".lora_b"]
        # llama_adapter_lora_init_impl's checks
        assert w[0] == a[0] and w[1] == b[1] and a[1] == b[0] == 3
    for t in r.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(np.asarray(t.data).reshape(ad[t.name].shape), ad[t.name])
    back, alpha = read_adapter(path, TINY)
    assert alpha == 6.0 and set(back) == set(ad)
    assert all(np.array_equal(back[k], ad[k]) and back[k].dtype == np.float32 for k in ad)


def test_read_adapter_errors(tmp_path):
    good = tmp_path / "good.gguf"
    write_adapter(good, TINY, tiny_adapter(), alpha=3.0)
    # another base model: the tensor shapes do not fit
    wide = LlamaConfig(vocab=40, dim=64, layers=2, heads=4, kv_heads=2, ff=48, ctx=64)
    with pytest.raises(ModelFormatError, match=r"blk.0.attn_q.weight: lora_a has shape \[3, 32\]"
                                               r".*wrong base model"):
        read_adapter(good, wide)
    deeper = LlamaConfig(vocab=40, dim=32, layers=1, heads=4, kv_heads=2, ff=48, ctx=64)
    with pytest.raises(ModelFormatError, match="blk.1.* is not a weight of the base model"):
        read_adapter(good, deeper)
    # truncated
    raw = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:len(raw) - 100])
    with pytest.raises(ModelFormatError, match="truncated or corrupt"):
        read_adapter(cut, TINY)
    # another architecture
    other = tmp_path / "gpt2.gguf"
    with gguf_writer(other, "gpt2") as w:
        w.add_type("adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", 1.0)
    with pytest.raises(ModelFormatError, match="architecture 'gpt2', the base model is 'llama'"):
        read_adapter(other, TINY)
    # a model, not an adapter
    model = tmp_path / "model.gguf"
    write_llama(model, TINY, {k: np.zeros(s, np.float32) for k, s in TINY.param_shapes().items()})
    with pytest.raises(ModelFormatError, match="not a LoRA adapter"):
        read_adapter(model, TINY)
    # half a pair
    half = tmp_path / "half.gguf"
    a = tiny_adapter()["blk.0.attn_q.weight.lora_a"]
    with gguf_writer(half, "llama") as w:
        w.add_type("adapter")
        w.add_string("adapter.type", "lora")
        w.add_tensor("blk.0.attn_q.weight.lora_a", a)
    with pytest.raises(ModelFormatError, match="no partner blk.0.attn_q.weight.lora_b"):
        read_adapter(half, TINY)
    # the writer refuses what llama.cpp would refuse
    bad = tiny_adapter()
    bad["blk.0.attn_q.weight.lora_b"] = bad["blk.0.attn_q.weight.lora_b"].T.copy()
    with pytest.raises(ValueError, match="lora_b"):
        write_adapter(tmp_path / "bad.gguf", TINY, bad, 1.0)
    with pytest.raises(ValueError, match="token_embd"):
        write_adapter(tmp_path / "bad.gguf", TINY,
                      {"token_embd.weight.lora_a": np.zeros((2, 32), np.float32),
                       "token_embd.weight.lora_b": np.zeros((40, 2), np.float32)}, 1.0)
    assert not (tmp_path / "bad.gguf").exists()


def test_merge_is_export_loras_formula():
    rng = np.random.default_rng(3)
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in TINY.param_shapes().items()}
    ad = tiny_adapter(rank=3)
    for alpha, scale in ((6.0, 1.0), (6.0, 0.5), (0.0, 0.25)):
        m = merge(base, ad, alpha, scale)
        s = scale * alpha / 3 if alpha else scale     # llama.cpp: alpha 0 -> the scale alone
        assert adapter_scale(alpha, 3, scale) == s
        w = "blk.1.ffn_down.weight"
        want = base[w].astype(np.float64) + s * (ad[w + ".lora_b"].astype(np.float64)
                                                 @ ad[w + ".lora_a"].astype(np.float64))
        np.testing.assert_allclose(m[w], want, rtol=1e-6, atol=1e-6)
        assert m["blk.0.attn_k.weight"] is base["blk.0.attn_k.weight"]


# ---- stories260K: identity at step 0, merged == unmerged ---------------------------------------
@pytest.mark.slow
def test_lora_identity_at_step_0_and_merge_equals_unmerged_on_stories260k(model):
    cfg, params, _ = model
    rows = [[1, 403, 407, 261, 378, 433, 418, 259, 268, 261, 263, 269, 316, 341, 427, 263, 270],
            [1, 80, 308, 263, 283, 345, 400, 411, 300, 272, 260, 356, 343, 363, 352, 319, 380]]
    feed = llama_inputs([r[:16] for r in rows])
    feed["labels"] = np.array([r[1:] for r in rows], np.int32)
    g = llama_forward(cfg, 2, 16, labels=True)
    base = jg.compile(g)
    for k, v in params.items():
        base.params[k] = v
    want = base.step(**feed)
    lg = jg.lora(g, targets="q,k,v,o", rank=8, alpha=8)
    prog = jg.compile(lg, seed=5)
    for k, v in params.items():
        prog.params[k] = v
    got = prog.step(**feed)                         # A random, B zero: the base model
    assert np.any(prog.params["blk.0.attn_q.weight.lora_a"])
    assert abs(float(got["loss"]) - float(want["loss"])) <= 1e-6
    assert np.max(np.abs(got["logits"] - want["logits"])) <= 1e-6
    # nonzero B: the unmerged program against the merged weights in the base program
    rng = np.random.default_rng(7)
    ad = {k: (rng.standard_normal(prog.params[k].shape) * 0.05).astype(np.float32)
          for k in lg.params if ".lora_" in k}
    for k, v in ad.items():
        prog.params[k] = v
    unmerged = prog.step(**feed)
    for k, v in merge(params, ad, alpha=8.0).items():
        base.params[k] = v
    merged = base.step(**feed)
    assert np.max(np.abs(unmerged["logits"] - want["logits"])) > 0.1      # the adapter acts
    np.testing.assert_allclose(unmerged["logits"], merged["logits"], rtol=1e-4, atol=1e-4)
    assert abs(float(unmerged["loss"]) - float(merged["loss"])) < 1e-5


# ---- the commands ------------------------------------------------------------------------------
@pytest.mark.slow
def test_lora_commands_generate_perplexity_export(model, testdata, tmp_path, capsys):
    from jitgraph import cli
    from jitgraph.models.text import read_corpus
    cfg, stories = model[0], str(testdata.stories)
    adapter = tmp_path / "ad.gguf"
    ad = tiny_adapter(cfg, rank=4, seed=1, names=("attn_q", "attn_v"))
    ad = {k: v * 0.1 for k, v in ad.items()}
    write_adapter(adapter, cfg, ad, alpha=4.0)
    text = tmp_path / "t.txt"
    text.write_bytes(read_corpus()[:1500])                # the first lines of tiny shakespeare
    ppl = ["perplexity", stories, "--text", str(text), "--split", "all", "--ctx", "16",
           "--batch-size", "2", "--json", "--quiet"]

    def run(argv):
        assert cli.main(argv) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    base = run(ppl)["perplexity"]
    assert run(ppl + ["--lora", str(adapter), "--lora-scale", "0"])["perplexity"] == base
    unmerged = run(ppl + ["--lora", str(adapter)])["perplexity"]
    merged_path = tmp_path / "merged.gguf"
    assert cli.main(["export", stories, "--lora", str(adapter), "--out",
                     str(merged_path), "--quiet"]) == 0
    merged = run(["perplexity", str(merged_path)] + ppl[2:])["perplexity"]
    assert abs(unmerged / base - 1) > 1e-3                  # the adapter changes the model
    assert merged == pytest.approx(unmerged, rel=1e-5)
    gen = ["generate", stories, "--prompt", "Once upon a time", "-n", "12", "--temp", "0",
           "--chunk", "1", "--json", "--quiet"]
    assert run(gen + ["--lora", str(adapter), "--lora-scale", "0"])["text"] == run(gen)["text"]
    # the decode program (V projection W x^T: the weight on the left) with the adapter, unmerged,
    # against the merged weights, over a prompt and steps through the KV cache (in f32: with
    # llama.cpp's F16 cache rounding, 1e-7 apart K and V round 1e-3 apart now and then)
    from jitgraph.models.generate import Generator
    _, params, tok = model
    unm = Generator(model, ctx=512, chunk=1, lora=(ad, 4.0), warmup=False, kv_f16=False)
    mer = Generator((cfg, merge(params, ad, 4.0), tok), ctx=512, chunk=1, warmup=False,
                    kv_f16=False)
    ids = tok.encode("Once upon a time")
    a, b = unm.feed(ids).copy(), mer.feed(ids).copy()
    # atol relative to the row's largest logit (~15): a logit near 0 carries the rounding of
    # the sums that make the large ones (merged and unmerged 1.2e-5 apart at 0.02 on a Zen 3)
    for t in (300, 301, 302):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
        a, b = unm.step(t).copy(), mer.step(t).copy()
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    unm.reset()
    base_logits = Generator(model, ctx=512, chunk=1, warmup=False, kv_f16=False).feed(ids)
    assert np.max(np.abs(unm.feed(ids) - base_logits)) > 1e-2      # the adapter acts
    # errors: an adapter for another base model, --lora-scale alone, --out = the adapter
    wrong = tmp_path / "wrong.gguf"
    write_adapter(wrong, TINY, tiny_adapter(), 1.0)
    assert cli.main(ppl + ["--lora", str(wrong)]) == 2
    assert "wrong base model" in capsys.readouterr().err
    assert cli.main(ppl + ["--lora-scale", "2"]) == 2
    assert "--lora-scale needs --lora" in capsys.readouterr().err
    assert cli.main(["export", stories, "--lora", str(adapter), "--out", str(adapter)]) == 2
    assert "is the input --lora" in capsys.readouterr().err

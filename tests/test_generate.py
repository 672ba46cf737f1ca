"""Generation (jitgraph/models/generate.py): the KV-cache ops set_rows and kv_attention, the
decode and prefill programs sharing one persistent region (jg.compile(share=...)), greedy
continuations against llama.cpp's, logits against the full-sequence forward, sampling, and the
`jitgraph generate` command."""
import contextlib
import io
import json

import numpy as np
import pytest

import jitgraph as jg
import jitgraph.compiler
from jitgraph import ops
from jitgraph.models.generate import (ContextFull, Generator, Sampler,
                                      llama_decoder)
from jitgraph.models.llama import LlamaConfig, llama_forward, llama_inputs
from jitgraph.passes.memory_check import check_plan


@pytest.fixture(scope="module")
def gen(model):
    """ctx 96, prompts in chunks of 8: the 5- and 12-token prompts take a padded chunk, a
    9-token one a chunk and a decode step."""
    return Generator(model, ctx=96, chunk=8)


def f16(x):
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(x.dtype)


# ---- the ops ---------------------------------------------------------------------------------
def test_set_rows_updates_a_param_in_place():
    g = jg.Graph("cache")
    t = g.param("t", (6, 2, 3), init=jg.init.zeros(), trainable=False)
    pos = g.input("pos", (2,), "i32")
    new = ops.set_rows(t, pos, g.input("rows", (2, 2, 3)))
    g.update(t=new)
    g.output(y=ops.sum(new, axis=(1, 2)))
    prog = jg.compile(g)
    plan = prog._products.memory
    assert plan.summary()["updates_in_place"] == 1 and plan.copies == []
    check_plan(prog._products.kernels, plan)
    rng = np.random.default_rng(0)
    want = np.zeros((6, 2, 3), np.float32)
    for p in ([0, 3], [5, 5], [1, 2]):                 # a repeated index keeps the last row
        rows = rng.standard_normal((2, 2, 3)).astype(np.float32)
        ref = {"t": want.copy()}
        expect = jg.interp.run(g, {"pos": np.array(p, np.int32), "rows": rows}, ref)["y"]
        got = prog.step(pos=np.array(p, np.int32), rows=rows)["y"]
        want[p[0]], want[p[1]] = rows[0], rows[1]
        np.testing.assert_array_equal(prog.params["t"], want)
        np.testing.assert_array_equal(ref["t"], want)
        np.testing.assert_allclose(got, expect, rtol=1e-6)
    with pytest.raises(IndexError, match="out of range"):            # checked before the step
        prog.step(pos=np.array([0, 6], np.int32), rows=rows)
    np.testing.assert_array_equal(prog.params["t"], want)


def test_set_rows_not_in_place_and_other_axes():
    """The old table is still read after set_rows (an output): the update is copied, the
    kernel copies the table first. axis=2 with f16 rounding; a forward-only use."""
    g = jg.Graph("copy")
    t = g.param("t", (2, 3, 5), init=jg.init.zeros(), trainable=False)
    new = ops.set_rows(t, g.input("pos", (2,), "i32"), g.input("rows", (2, 3, 2)), axis=2,
                       f16=True)
    g.update(t=new)
    g.output(old=t * 2.0, new=new)
    prog = jg.compile(g)
    assert prog._products.memory.summary()["updates_in_place"] == 0
    rows = np.random.default_rng(1).standard_normal((2, 3, 2)).astype(np.float32)
    for _ in range(2):
        params = {"t": prog.params["t"]}
        want = jg.interp.run(g, {"pos": np.array([4, 1], np.int32), "rows": rows}, params)
        got = prog.step(pos=np.array([4, 1], np.int32), rows=rows)
        for k in ("old", "new"):
            np.testing.assert_array_equal(got[k], want[k])
        np.testing.assert_array_equal(prog.params["t"], params["t"])
    assert np.array_equal(prog.params["t"][:, :, 4], f16(rows[:, :, 0]))
    with pytest.raises(jg.ShapeError, match="no vjp"):               # an inference op
        h = jg.Graph("grad")
        w = h.param("w", (4, 2))
        h.output(loss=ops.sum(ops.set_rows(w, h.input("i", (1,), "i32"), h.input("r", (1, 2)))))
        jg.compile(h, loss="loss")
    with pytest.raises(jg.ShapeError, match="do not fit"):
        ops.set_rows(t, g.input("p3", (3,), "i32"), g.input("r3", (2, 3, 2)), axis=2)


def test_f16_rounding_matches_numpy():
    """set_rows(f16=True)'s rounding (runtime/cpu/lib_kv.half) on 2^20 random float32 bit
    patterns, the rounding boundaries and the specials: numpy's astype(float16) exactly."""
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    half = np.arange(0, 1 << 15, dtype=np.uint16).view(np.float16).astype(np.float32)
    half = half[np.isfinite(half)]
    nxt = np.nextafter(half, np.float32(np.inf))
    mid = (half[:-1].astype(np.float64) + half[1:]) / 2          # ties (exact in float32)
    edge = np.array([65504, 65519.996, 65520, 65536, 1e30, 2.0 ** -24, 2.0 ** -25,
                     3 * 2.0 ** -26, 2.0 ** -14, 2.0 ** -14 - 2.0 ** -25, 1e-30, 0, np.inf,
                     np.nan], np.float32)
    x = np.concatenate([x, half, nxt, np.nextafter(half, np.float32(-np.inf)),
                        mid.astype(np.float32), edge])
    x = np.concatenate([x, -x])
    g = jg.Graph("f16")
    t = g.param("t", (1, x.size), init=jg.init.zeros(), trainable=False)
    g.update(t=ops.set_rows(t, g.input("i", (1,), "i32"), g.input("x", (1, x.size)), f16=True))
    prog = jg.compile(g)
    prog.step(i=np.zeros(1, np.int32), x=x[None])
    np.testing.assert_array_equal(prog.params["t"][0], f16(x))


@pytest.mark.parametrize("f16_", [False, True])
def test_kv_attention_matches_reference(f16_):
    """GQA (6 heads over 2), a chunk of 3 queries at scattered positions, against the numpy
    reference and against plain causal attention over the filled rows."""
    rng = np.random.default_rng(3)
    S, H, Hkv, hd, R = 3, 6, 2, 8, 11
    q = rng.standard_normal((S, H, hd)).astype(np.float32)
    kt = rng.standard_normal((Hkv, hd, R)).astype(np.float32)
    vt = rng.standard_normal((Hkv, hd, R)).astype(np.float32)
    pos = np.array([0, 6, 10], np.int32)
    g = jg.Graph("att")
    g.output(y=ops.kv_attention(g.input("q", q.shape), g.input("kt", kt.shape),
                                g.input("vt", vt.shape), g.input("pos", (S,), "i32"), f16=f16_))
    feed = {"q": q, "kt": kt, "vt": vt, "pos": pos}
    want = jg.interp.run(g, feed, {})["y"]
    np.testing.assert_allclose(jg.compile(g).step(**feed)["y"], want, atol=2e-6)
    qq = f16(q) if f16_ else q
    for s, p in enumerate(pos):
        for h in range(H):
            sc = qq[s, h] @ kt[h // 3, :, :p + 1] / np.sqrt(hd)
            w = np.exp(sc - sc.max())
            w /= w.sum()
            w = f16(w) if f16_ else w
            np.testing.assert_allclose(want[s, h], vt[h // 3, :, :p + 1] @ w, atol=1e-5)
    with pytest.raises(IndexError):
        jg.compile(g).step(**{**feed, "pos": np.array([0, 1, 11], np.int32)})


# ---- the programs ----------------------------------------------------------------------------
def test_share_params_between_programs():
    cfg = LlamaConfig(vocab=20, dim=16, layers=1, heads=4, kv_heads=2, ff=24)
    a = jg.compile(llama_decoder(cfg, 1, 8))
    b = jg.compile(llama_decoder(cfg, 4, 8), share=a)
    a.params["blk.0.ffn_up.weight"] = np.ones((24, 16), np.float32)
    assert (b.params["blk.0.ffn_up.weight"] == 1).all()
    assert b.stats()["persistent_bytes"] <= a.stats()["persistent_bytes"]
    with pytest.raises(ValueError, match="cache/k/0"):
        jg.compile(llama_decoder(cfg, 1, 9), share=a)              # another cache size
    with pytest.raises(ValueError, match="not a param"):
        jg.compile(llama_forward(LlamaConfig(vocab=20, dim=16, layers=2, heads=4, kv_heads=2,
                                                 ff=24), 1, 2),
                   share=a)


def test_decoder_matches_forward_gqa_partial_rope_tied():
    """A random tied GQA model with partial rope, f32 cache: decode steps and a prefill chunk
    give llama_forward's logits at every position (the interpreter and compiled)."""
    cfg = LlamaConfig(vocab=40, dim=32, layers=2, heads=4, kv_heads=2, ff=40, rope_base=100.0,
                      rope_dims=4, tied=True)
    rng = np.random.default_rng(4)
    params = {k: (v + rng.normal(0, 0.3, v.shape)).astype(np.float32)
              for k, v in llama_forward(cfg, 1, 1).init_params(0).items()}
    ids = [1, 5, 7, 3, 9, 2, 30, 11]
    want = jg.interp.run(llama_forward(cfg, 1, len(ids)), llama_inputs(ids), params)["logits"][0]
    gen = Generator((cfg, params), ctx=10, chunk=4, kv_f16=False)
    got = [gen.feed(ids[:5]).copy()]                      # a chunk, then a decode step
    got += [gen.step(t).copy() for t in ids[5:]]
    np.testing.assert_allclose(np.array(got), want[4:], atol=2e-5)
    gen.reset()
    np.testing.assert_allclose(gen.feed(ids), want[-1], atol=2e-5)    # 4 + 4
    assert gen.n_past == len(ids)
    gen.reset()                                   # 4 + 4 + 2, the last chunk padded past ctx
    np.testing.assert_allclose(gen.feed(ids + [4, 4])[None], jg.interp.run(
        llama_forward(cfg, 1, 10), llama_inputs(ids + [4, 4]), params)["logits"][0, -1:],
        atol=2e-5)


@pytest.mark.parametrize("case", [0, 1])
def test_greedy_matches_llama_cpp(gen, ref, case):
    """Token for token, llama.cpp's greedy continuation (48 tokens), through the prefill and
    decode programs and the KV cache."""
    c = ref["greedy"][case]
    res = gen.generate(c["prompt"], len(c["ids"]))
    assert res.prompt_ids == c["prompt_ids"]
    assert res.ids == c["ids"] and res.text == c["text"]
    assert res.decode_steps == len(c["ids"]) - 1 and res.prompt_chunks == 2 - (case == 0)


def test_logits_match_llama_cpp(gen, ref):
    """Decode steps from position 0, and a prefill chunk: llama.cpp's logits."""
    ids = ref["logits"]["prompt_ids"]
    want = np.array(ref["logits"]["first5_of_each_position"])
    gen.reset()
    got = np.array([gen.step(t)[:5].copy() for t in ids])
    # 5e-4: an F16 cache value at a rounding boundary rounds either way with the host's BLAS
    # (tests/test_llama.py F16_CACHE_TOL); most positions agree to ~2e-6
    assert np.abs(got - want).max() < 5e-4
    assert np.median(np.abs(got - want)) < 1e-5
    gen.reset()
    assert np.abs(gen.feed(ids)[:5] - want[-1]).max() < 5e-4


def test_decode_logits_equal_full_forward(gen, model, ref):
    """The logits of every decode step equal the full-sequence forward's at that position;
    the prompt through prefill chunks (9 = 8 + a decode step). With the float16 rounding a
    probability on a rounding boundary may round the other way after another summation order
    (the compiled llama_forward differs from the interpreter's by up to 2.3e-3 here); in float32
    the two agree to 2e-5 (test_decoder_matches_forward_gqa_partial_rope_tied)."""
    cfg, params, _ = model
    c = ref["greedy"][1]
    ids = c["prompt_ids"] + c["ids"][:28]                 # 40 tokens
    want = jg.interp.run(llama_forward(cfg, 1, len(ids), kv_f16=True), llama_inputs(ids),
                         params)["logits"][0]
    gen.reset()
    got = np.array([gen.feed(ids[:9]).copy()] + [gen.step(t).copy() for t in ids[9:]])
    err = np.abs(got - want[8:]).max(-1)
    assert err.max() < 2e-2 and np.median(err) < 1e-2, err
    assert (got.argmax(-1) == want[8:].argmax(-1)).all()


def test_no_recompile_per_token(gen, monkeypatch):
    builds = []
    real = jitgraph.compiler.build
    monkeypatch.setattr(jitgraph.compiler, "build",
                        lambda *a, **k: builds.append(1) or real(*a, **k))
    calls = gen.decode.calls, gen.prefill.calls
    res = gen.generate("Once upon a time", 40, stop_at_eos=False)
    assert builds == [] and len(res.ids) == 40
    assert (gen.decode.calls - calls[0], gen.prefill.calls - calls[1]) == (39, 1)
    assert gen.decode.stats()["memory"]["updates_in_place"] == 2 * gen.config.layers
    assert gen.decode.stats()["memory"]["updates_copied"] == 0
    check_plan(gen.decode._products.kernels, gen.decode._products.memory)
    check_plan(gen.prefill._products.kernels, gen.prefill._products.memory)


def test_context_capacity(gen):
    prompt = list(range(1, 81))                           # 80 tokens of ctx 96
    calls = gen.decode.calls
    with pytest.raises(ContextFull, match=r"80 tokens\) \+ 17 .* context of 96"):
        gen.generate(prompt, 17)
    assert gen.decode.calls == calls                      # refused before computing anything
    res = gen.generate(prompt, 16, stop_at_eos=False)     # exactly full
    assert len(res.ids) == 16 and gen.n_past == 95        # the last token is not fed back
    with pytest.raises(ContextFull):
        gen.step(5), gen.step(5)
    with pytest.raises(ValueError, match="out of range"):
        gen.feed([1, 512])


def test_sampling(gen):
    a = gen.generate("Once upon a time", 30, Sampler(0.9, 40, 0.95, seed=7))
    b = gen.generate("Once upon a time", 30, Sampler(0.9, 40, 0.95, seed=7))
    c = gen.generate("Once upon a time", 30, Sampler(0.9, 40, 0.95, seed=8))
    assert a.ids == b.ids and a.ids != c.ids
    greedy = gen.generate("Once upon a time", 30).ids
    assert gen.generate("Once upon a time", 30, Sampler(1.0, top_k=1, seed=1)).ids == greedy
    assert gen.generate("Once upon a time", 30, Sampler(1.0, 0, 1e-6, seed=2)).ids == greedy
    # the distribution: top-k keeps the k largest, top-p the fewest reaching p, then temp
    logits = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))
    s = Sampler(1.0, top_k=3, top_p=1.0, seed=3)
    counts = np.bincount([s(logits) for _ in range(20000)], minlength=5) / 20000
    np.testing.assert_allclose(counts, [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85], atol=0.015)
    s = Sampler(2.0, top_k=0, top_p=0.75, seed=4)        # keeps 0.4 + 0.3 + 0.15 (>= 0.75)
    counts = np.bincount([s(logits) for _ in range(20000)], minlength=5) / 20000
    w = np.sqrt([0, 0.4, 0, 0.3, 0.15])
    np.testing.assert_allclose(counts, w / w.sum(), atol=0.015)
    assert Sampler(0.0)(np.array([1.0, 3.0, 3.0])) == 1   # greedy: the first maximum


# ---- the command -----------------------------------------------------------------------------
def run_cli(*argv):
    from jitgraph.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_cli_generate(testdata, ref):
    c, model = ref["greedy"][0], str(testdata.stories)
    rc, out, err = run_cli("generate", model, "--prompt", c["prompt"], "-n", "48",
                           "--temp", "0", "--ctx", "96", "--chunk", "8", "--json")
    assert rc == 0, err
    text, last = out.rsplit("\n", 2)[0], json.loads(out.splitlines()[-1])
    assert text == c["prompt"] + c["text"]                    # streamed as generated
    assert last["tokens"] == 48 and last["text"] == c["text"] and last["tokens_per_second"] > 0
    assert "tokens/s" in err
    rc, out, err = run_cli("generate", model, "--prompt", c["prompt"], "-n", "600")
    assert rc == 2 and out == ""
    assert "exceed the context of 512 tokens (the KV cache's capacity)" in err
    rc, out, err = run_cli("generate", model, "-n", "8", "--ctx", "4096")
    assert rc == 2 and "context length 2048" in err

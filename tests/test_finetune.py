"""`jitgraph finetune` (jitgraph/cli/llama_train.py) on llama.cpp's stories260K: --full writes a
model that loads, --lora-rank an adapter that read_adapter reads back; the LoRA program's loss
at step 0 equals the base model's; the memory report; resume bit-exact; option errors."""
import contextlib
import io
import json

import numpy as np
import pytest

from jitgraph import cli
from jitgraph.cli import llama_train
from jitgraph.models.llama import read_llama
from jitgraph.models.lora import merge, read_adapter

# a short text of the shipped corpus keeps tokenizing and perplexity quick
SMALL = ["--ctx", "32", "--batch-size", "2", "--eval-every", "1", "--ppl-chunks", "2",
         "--quiet", "--json"]


@pytest.fixture(scope="module")
def text(corpus_file):
    return corpus_file(40_000)


def _json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


LORA = ["--lora-rank", "2", "--lora-targets", "q,k,v,o", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def runs(stories, text, tmp_path_factory):
    """A --full and a LoRA finetune of 4 steps (their files and --json results)."""
    d = tmp_path_factory.mktemp("finetune")
    full, ad, ck = d / "full.gguf", d / "ad.gguf", d / "ad.ckpt"
    res = []
    for how, out, extra in ((["--full"], full, []), (LORA, ad, ["--checkpoint", str(ck)])):
        with contextlib.redirect_stdout(io.StringIO()) as got:
            assert cli.main(["finetune", stories, "--text", text, *how, "--steps", "4", *SMALL,
                             "--out", str(out), *extra]) == 0
        res.append(json.loads(got.getvalue().strip().splitlines()[-1]))
    return {"full": full, "adapter": ad, "checkpoint": ck, "rf": res[0], "rl": res[1]}


@pytest.mark.slow
def test_full_and_lora_finetunes_write_files_that_load(model, runs):
    cfg, params, tok = model
    full, ad, ck, rf, rl = (runs[k] for k in ("full", "adapter", "checkpoint", "rf", "rl"))

    # --full: a complete model with the base's tokenizer, every weight moved
    cfg2, p2, tok2 = read_llama(full)
    assert cfg2 == cfg and tok2.tokens == tok.tokens
    assert all(not np.array_equal(p2[k], params[k]) for k in params)
    n = sum(v.size for v in params.values())
    assert rf["trainable_params"] == rf["params"] == n
    assert rf["optimizer_state_bytes"] == 2 * 4 * n          # AdamW's m and v, f32
    # the memory plan, printed before the first step: weights, optimizer state, arena, scratch
    assert rf["weights_bytes"] == 4 * n
    assert rf["persistent_bytes"] >= rf["weights_bytes"] + rf["optimizer_state_bytes"]
    line = llama_train._memory_line(rf)          # what a run without --quiet prints
    assert rf["workspace_bytes"] >= 0 and rf["output_bytes"] > 0
    assert f"weights {llama_train._bytes(4 * n)}, optimizer state " \
        f"{llama_train._bytes(8 * n)}, activations and gradients (arena) " \
        f"{llama_train._bytes(rf['arena_bytes'])}, workspace " \
        f"{llama_train._bytes(rf['workspace_bytes'])}" in line
    total = sum(rf[k] for k in ("persistent_bytes", "arena_bytes", "workspace_bytes",
                                "output_bytes"))
    assert line.endswith(f": {llama_train._bytes(total)} in all")
    assert rf["ppl_after"] < rf["ppl_before"] and rf["ppl_chunks"] == 2

    # --lora-rank: the adapter reads back as the program's adapter params, alpha = rank
    adapter, alpha = read_adapter(ad, cfg)
    assert alpha == 2.0
    names = {f"blk.{i}.{t}.weight.lora_{x}" for i in range(cfg.layers)
             for t in ("attn_q", "attn_k", "attn_v", "attn_output") for x in "ab"}
    assert set(adapter) == names
    # the checkpoint keeps the trainable params alone: the frozen base comes from BASE.gguf
    # (its hash recorded), so a checkpoint costs the adapter's size, not the model's
    ckpt = llama_train.load_llama_checkpoint(ck)[2]
    assert set(ckpt) == names
    for k in names:
        np.testing.assert_array_equal(adapter[k], ckpt[k], err_msg=k)
    assert any(np.abs(adapter[k]).max() > 0 for k in names if k.endswith("lora_b"))
    trainable = sum(v.size for v in adapter.values())
    assert rl["trainable_params"] == trainable and rl["params"] == n + trainable
    assert rl["optimizer_state_bytes"] == 2 * 4 * trainable
    assert rl["optimizer_state_bytes"] < 0.1 * rf["optimizer_state_bytes"]
    assert rl["ppl_before"] == rf["ppl_before"]
    assert rl["ppl_after"] < rl["ppl_before"]
    merged = merge(params, adapter, alpha)
    assert any(not np.array_equal(merged[k], params[k]) for k in params)

    # step 1's loss is computed before any update: the LoRA program (B = 0) computes the base
    # model's loss on the same windows (same seed) as the full finetune's first step
    assert rl["curve"][0]["step"] == rf["curve"][0]["step"] == 1
    assert rl["curve"][0]["train"] == pytest.approx(rf["curve"][0]["train"], abs=1e-6)
    assert rl["curve"][-1]["val"] < rl["curve"][0]["val"]


@pytest.mark.slow
def test_lora_resume_is_bit_exact(model, stories, text, runs, tmp_path, capsys):
    """2 steps, checkpoint, resume, 2 more == the 4 steps of the LoRA run (its options, so its
    compiled kernels are reused; the perplexity does not touch the training)."""
    cfg = model[0]
    args = ["finetune", stories, "--text", text, *LORA, "--no-ppl", *SMALL]
    a, b, ck = runs["adapter"], tmp_path / "b.gguf", tmp_path / "b.ckpt"
    assert cli.main([*args, "--steps", "2", "--out", str(b), "--checkpoint", str(ck)]) == 0
    capsys.readouterr()
    assert cli.main([*args, "--steps", "4", "--out", str(b), "--resume", str(ck),
                     "--checkpoint", str(ck)]) == 0
    assert _json(capsys)["steps"] == 4
    pa, alpha_a = read_adapter(a, cfg)
    pb, alpha_b = read_adapter(b, cfg)
    assert alpha_a == alpha_b == 2.0 and set(pa) == set(pb)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    # a resume against another base model is refused
    other = tmp_path / "other.gguf"
    from jitgraph.models.llama import write_llama
    write_llama(other, *model[:2], model[2], name="other")
    assert cli.main(["finetune", str(other), "--text", text, "--lora-rank", "2", "--steps", "5",
                     "--out", str(b), "--resume", str(ck), "--quiet"]) == 2
    assert "another base model" in capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["--steps", "2"], ["one of the arguments --lora-rank --full is required"]),
    (["--full", "--lora-rank", "2"], ["not allowed with argument"]),
    (["--lora-rank", "2", "--lora-targets", "q,x"], ["argument --lora-targets", "'q,x'"]),
    (["--lora-rank", "0"], ["argument --lora-rank", ">= 1"]),
])
def test_usage_errors(stories, capsys, argv, words, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["finetune", stories, "--out", str(tmp_path / "o.gguf"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_input_errors(stories, capsys, tmp_path):
    out = str(tmp_path / "o.gguf")
    assert cli.main(["finetune", stories, "--full", "--ctx", "4096", "--out", out]) == 2
    assert "--ctx 4096 exceeds the model's context length 2048" in capsys.readouterr().err
    assert cli.main(["finetune", str(tmp_path / "none.gguf"), "--full", "--out", out]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["finetune", stories, "--full", "--lora-alpha", "4", "--out", out]) == 2
    assert "--lora-alpha" in capsys.readouterr().err
    assert cli.main(["finetune", stories, "--full", "--out", str(tmp_path / "no" / "o.gguf")]) == 2
    assert "--out" in capsys.readouterr().err

"""Files `jitgraph finetune` wrote, scored by llama.cpp (issue 40): the full finetune of
stories260K in each --ftype and a LoRA adapter, with what llama.cpp's llama-perplexity computed on
them (tests/data/finetuned/llamacpp-perplexity.json; tests/data/finetuned/README.md says how they
were made). jitgraph's perplexity of the same file on the same tokens must be within 0.5 % of
llama.cpp's, and llama-perplexity having run on them at all shows llama.cpp loads them."""
import json

import pytest

from jitgraph.models.llama import read_llama
from jitgraph.models.perplexity import perplexity, split_text


@pytest.fixture(scope="module")
def finetuned(testdata):
    folder = testdata.stories.parent / "finetuned"
    ref = json.loads((folder / "llamacpp-perplexity.json").read_text())
    return folder, ref


def _row(ref, model, lora=None):
    rows = [r for r in ref["rows"] if r["model"] == model and r["lora"] == lora]
    assert len(rows) == 1, (model, lora, [(r["model"], r["lora"]) for r in ref["rows"]])
    return rows[0]


def _score(testdata, ref, model, lora=None):
    text = split_text(testdata.shakespeare_tail, "all")
    return perplexity(model, text, n_ctx=ref["ctx"], batch=16, kv_f16=True, lora=lora,
                      chunks=ref["chunks"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ft-full-f32.gguf", "ft-full-q8_0.gguf"])
def test_full_finetune_scores_as_llama_perplexity(name, finetuned, testdata):
    """The model `jitgraph finetune --full` wrote, read back in its type."""
    folder, ref = finetuned
    row = _row(ref, name)
    model = read_llama(folder / name, keep_types=True)
    res = _score(testdata, ref, model)
    assert res.chunks == row["chunks"]
    assert abs(res.ppl / row["llamacpp"] - 1) < 0.005, (name, res.ppl, row["llamacpp"])
    # the file is the finetuned model, not the base: llama.cpp scores the base far higher
    assert row["llamacpp"] < 0.5 * _row(ref, "stories260K.gguf")["llamacpp"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ft-lora-f32.gguf", "ft-lora-q8_0.gguf"])
def test_lora_adapter_scores_as_llama_perplexity_with_lora(name, finetuned, testdata):
    """The adapter `jitgraph finetune --lora-rank` wrote, on the base stories260K: llama.cpp
    applies it with `llama-perplexity --lora ADAPTER`, jitgraph with perplexity(lora=ADAPTER)."""
    folder, ref = finetuned
    row = _row(ref, "stories260K.gguf", name)
    res = _score(testdata, ref, str(testdata.stories), lora=str(folder / name))
    assert res.chunks == row["chunks"]
    assert abs(res.ppl / row["llamacpp"] - 1) < 0.005, (name, res.ppl, row["llamacpp"])
    assert row["llamacpp"] < 0.5 * _row(ref, "stories260K.gguf")["llamacpp"]


@pytest.mark.slow
def test_the_base_row_is_stories260k_as_scored_here(finetuned, testdata):
    """The fixture's base figure (what the 'not the base model' checks above compare with) is
    llama.cpp's for tests/data/stories260K.gguf on these 100 chunks: jitgraph agrees."""
    _, ref = finetuned
    row = _row(ref, "stories260K.gguf")
    res = _score(testdata, ref, str(testdata.stories))
    assert abs(res.ppl / row["llamacpp"] - 1) < 0.005, (res.ppl, row["llamacpp"])

"""The context check counts a prompt with the model's own tokenizer when its directory has one (a small word-level
tokenizer the test builds), and names the character estimate as an estimate otherwise."""

from __future__ import annotations

import json
import os

import pytest

from autotune.config.context import misfit_reason
from autotune.errors import WorkloadError
from autotune.prompts import PromptSample
from autotune.prompts.tokens import TokenCounter

CONTEXT = 1000
MAX_TOKENS = 64


@pytest.fixture
def tokenizers():
    if os.environ.get("AUTOTUNE_REQUIRE_ALL") == "1":
        import tokenizers  # the test extra installs it: CI must run this test

        return tokenizers
    return pytest.importorskip("tokenizers")


def model_dir(tmp_path, tokenizers):
    """A model directory with a 1,000-token context and a tokenizer that makes every word one token."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": CONTEXT}))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "word": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def sample(tmp_path, words: int) -> PromptSample:
    path = tmp_path / f"prompts-{words}.jsonl"
    path.write_text(json.dumps({"prompt": "word " * words}) + "\n")
    return PromptSample.load(path, 1)


def test_a_prompt_the_tokenizer_counts_under_the_context_is_accepted(tmp_path, tokenizers):
    model = model_dir(tmp_path, tokenizers)
    fits = sample(tmp_path, 900)  # 900 words: 4,500 chars, ~1,128 tokens by the estimate, 904 by the tokenizer
    assert TokenCounter.for_model(model).count(fits.rows[0]) == 904  # 900 words + the "[pass 9999]" marker's 4
    assert misfit_reason(str(model), {}, fits, MAX_TOKENS) is None
    with pytest.raises(WorkloadError) as info:  # the estimate alone would have refused it
        fits.check_fit(CONTEXT, MAX_TOKENS)
    assert "an estimate" in str(info.value) and "no tokenizer at hand" in str(info.value)


def test_a_prompt_the_tokenizer_counts_over_the_context_is_refused_with_its_count(tmp_path, tokenizers):
    model = model_dir(tmp_path, tokenizers)
    with pytest.raises(WorkloadError) as info:
        misfit_reason(str(model), {}, sample(tmp_path, 960), MAX_TOKENS)
    text = str(info.value)
    assert "prompt is 964 tokens (by the model's tokenizer" in text and "tokenizer.json" in text
    assert "over model's context length (1,000 tokens)" in text and "~" not in text.split("tokens")[0]


def test_without_a_tokenizer_the_estimate_says_it_is_one(tmp_path):
    model = tmp_path / "bare"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": CONTEXT}))
    counter = TokenCounter.for_model(model)
    assert not counter.exact and counter.source is None
    with pytest.raises(WorkloadError) as info:
        misfit_reason(str(model), {}, sample(tmp_path, 900), MAX_TOKENS)
    assert "prompt is ~1,128 tokens (4,500 chars at 4 per token, an estimate: no tokenizer at hand)" in str(info.value)

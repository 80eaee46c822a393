"""The tiny models' tokenizers (disagg/tools/tinymodel.py)."""

from __future__ import annotations

import json

from disagg.tools.tinymodel import BOS, EOS, UNK, build_tokenizer


def test_a_large_vocabulary_is_filled_with_vocabulary_entries_that_decode():
    """The benchmark shapes' vocabularies (49,152, 128,256) outgrow the local text's merges: the rest are
    placeholder entries of the BPE vocabulary, as a real tokenizer's tokens are. As added tokens (the
    first recipe) 127k of them made llguidance's tokenizer take 152 s to build here, a worker's start."""
    tokenizer = build_tokenizer(128256)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    assert len(tokenizer) == 128256 and len(spec["model"]["vocab"]) == 128256
    assert sorted(token["content"] for token in spec["added_tokens"]) == sorted([BOS, EOS, UNK])
    assert tokenizer.decode([128255]) == "<extra_127257>"
    ids = tokenizer("Every spring the school holds a fair.")["input_ids"]
    assert max(ids) < 1000 and tokenizer.decode(ids, skip_special_tokens=True) == "Every spring the school holds a fair."


def test_a_small_vocabulary_is_the_merges_alone():
    tokenizer = build_tokenizer(512)
    assert len(tokenizer) == 512 and not any("<extra_" in token for token in tokenizer.get_vocab())


def test_a_recital_row_is_consecutive_paragraphs_then_the_same_document():
    """The reciting model's rows (training_text="recital"): after the first copy, every token is in the context."""
    import random

    from disagg.tools.tinymodel import paragraphs, recital_row

    tokenizer, texts = build_tokenizer(512), paragraphs()
    rng = random.Random(0)
    counts = set()
    for _ in range(40):
        row = recital_row(rng, list(range(len(texts))), texts, tokenizer)
        assert row[0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in row
        text = tokenizer.decode(row, skip_special_tokens=True)
        first, second = text[: len(text) // 2], text[len(text) // 2 + 1 :]
        assert first == second and text[len(text) // 2] == " ", text
        start = next(i for i, t in enumerate(texts) if first.startswith(t))
        count = next(n for n in range(1, 5) if " ".join(texts[(start + j) % len(texts)] for j in range(n)) == first)
        counts.add(count)
    assert counts == {1, 2, 3, 4}


def test_a_training_text_it_does_not_know_is_refused():
    import pytest

    from disagg.tools.tinymodel import TinyModelSpec

    with pytest.raises(ValueError, match="training_text 'recitals'"):
        TinyModelSpec(training_text="recitals")

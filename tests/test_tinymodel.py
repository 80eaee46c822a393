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

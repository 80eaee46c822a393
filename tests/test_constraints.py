"""The constraints room alone: the sampler's bitmask, a constraint's checks, the compiler's
cache and refusals, and a row matcher started from earlier tokens (no processes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from disagg.engine.constraints import Constraint, ConstraintKind
from disagg.engine.constraints.compiler import ConstraintCompiler
from disagg.engine.constraints.rows import bitmask_words, step_bitmask
from disagg.engine.constraints.spec import choice, json_schema
from disagg.engine.requests import InvalidField
from disagg.engine.sampler import apply_bitmask, sample

VOCAB = 70  # not a multiple of 32: the last word is partial


def bitmask_of(allowed_rows: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    bits = np.zeros((len(allowed_rows), bitmask_words(vocab) * 32), dtype=np.uint8)
    for row, allowed in enumerate(allowed_rows):
        bits[row, allowed] = 1
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())


def test_the_bitmask_leaves_only_the_allowed_tokens_in_every_row():
    logits = torch.randn(3, VOCAB)
    allowed = [[0, 33, 69], list(range(VOCAB)), [5]]
    masked = apply_bitmask(logits.clone(), bitmask_of(allowed))
    for row, ids in enumerate(allowed):
        finite = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert finite == ids
        assert torch.equal(masked[row, ids], logits[row, ids])


def test_greedy_and_seeded_draws_take_only_allowed_tokens_and_logprobs_are_over_them():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    allowed = [[3, 40], [7], [1, 2, 64, 69], list(range(VOCAB))]
    bitmask = bitmask_of(allowed)
    greedy = torch.tensor([[0.0, 1.0, 0.0, 0, 0, 0, 1.0]] * 4)
    out = sample(logits, greedy, torch.arange(4), torch.zeros(4, dtype=torch.long), top_logprobs=2, bitmask=bitmask)
    for row, ids in enumerate(allowed):
        assert out.token_ids[row].item() == ids[int(logits[row, ids].argmax())]
        constrained = logits[row, ids].log_softmax(-1)
        assert out.logprobs[row].item() == pytest.approx(constrained.max().item(), abs=1e-5)
    hot = torch.tensor([[0.0, 1.0, 1.5, 0, 0, 0, 1.0]] * 4)
    for step in range(20):
        drawn = sample(logits, hot, torch.arange(4), torch.full((4,), step), bitmask=bitmask).token_ids.tolist()
        assert all(token in ids for token, ids in zip(drawn, allowed))


@pytest.mark.parametrize(
    "constraint, field",
    [
        (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), "constraint.json_schema"),
        (Constraint(ConstraintKind.JSON_SCHEMA, "[1, 2]"), "constraint.json_schema"),
        (Constraint(ConstraintKind.CHOICE, "[]"), "constraint.choice"),
        (Constraint(ConstraintKind.CHOICE, '["a", ""]'), "constraint.choice"),
        (Constraint(ConstraintKind.REGEX, ""), "constraint.regex"),
        (Constraint(ConstraintKind.GRAMMAR, "x" * 101), "constraint.grammar"),
    ],
)
def test_a_malformed_or_oversized_constraint_is_refused_before_compiling(constraint, field):
    with pytest.raises(InvalidField) as refused:
        constraint.check(max_chars=100)
    assert refused.value.field == field


@pytest.fixture(scope="module")
def compiler(llama_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    made = ConstraintCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield made, tokenizer
    made.close()


@pytest.mark.parametrize(
    "constraint, field",
    [
        (Constraint(ConstraintKind.REGEX, "[0-9"), "constraint.regex"),
        (json_schema({"type": "nonsense"}), "constraint.json_schema"),
        (Constraint(ConstraintKind.GRAMMAR, "start: undefined_rule"), "constraint.grammar"),
        (Constraint(ConstraintKind.GRAMMAR, 'root ::= "a" ( other'), "constraint.grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(compiler, constraint, field):
    made, _ = compiler
    with pytest.raises(InvalidField) as refused:
        made.compiled(constraint)
    assert refused.value.field == field and "does not compile" in refused.value.rule


def test_compiled_once_per_text_and_a_row_resumes_from_earlier_tokens(compiler):
    made, tokenizer = compiler
    words = choice(["yes please", "no thanks"])
    before = made.compiles
    made.compiled(words)
    made.compiled(choice(["yes please", "no thanks"]))
    assert made.compiles == before + 1
    ids = tokenizer("no thanks", add_special_tokens=False)["input_ids"]
    row = made.start_row(words, ids[:1])  # a resumed request: its first token was generated elsewhere
    bitmask = step_bitmask([row, None], [ids[1], 0], made.vocab_size)
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : made.vocab_size]
    assert allowed[1].all()  # the unconstrained row
    expected_next = ids[2] if len(ids) > 2 else tokenizer.eos_token_id
    assert allowed[0, expected_next] and allowed[0].sum() >= 1
    with pytest.raises(InvalidField):
        made.start_row(words, tokenizer("maybe", add_special_tokens=False)["input_ids"])


def test_json_object_allows_any_object(compiler):
    made, tokenizer = compiler
    row = made.start_row(Constraint(ConstraintKind.JSON_OBJECT), tokenizer(json.dumps({"a": [1, {"b": None}]}), add_special_tokens=False)["input_ids"])
    assert row.matcher.is_accepting()


def test_a_compile_over_its_time_bound_is_refused_and_the_next_one_compiles(llama_path):
    import threading

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    made = ConstraintCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id], compile_seconds=0.05)
    busy = threading.Event()
    made._threads.submit(busy.wait)  # the compile thread held: the constraint cannot compile in time
    try:
        with pytest.raises(InvalidField) as refused:
            made.compiled(Constraint(ConstraintKind.REGEX, "[a-z]+"))
        assert refused.value.field == "constraint.regex" and "did not compile within 0.05 s" in refused.value.rule
    finally:
        busy.set()
    assert made.compiled(Constraint(ConstraintKind.REGEX, "[0-9]+"), timeout=30) is not None
    made.close()

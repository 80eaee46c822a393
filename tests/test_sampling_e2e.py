"""Logprobs, penalties, n choices and chat messages through the whole gRPC path
(router, prefill and decode workers as real processes), against transformers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from conftest import PresenceFrequencyPenalty, assert_nothing_held
from transformers import LogitsProcessorList

from disagg.clients.grpc_client import AsyncClient, Client

PROMPT = "The market is busy on Saturdays. People buy apples, cheese, fish,"
NEW = 24


def reference_run(ref, prompt_ids: list[int], repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0, max_new_tokens: int = NEW):
    """transformers' greedy generate() with the same processing: (token ids, the processed scores per step)."""
    processors = LogitsProcessorList([PresenceFrequencyPenalty(len(prompt_ids), presence, frequency)]) if presence or frequency else None
    with torch.no_grad():
        out = ref.model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            repetition_penalty=repetition,
            logits_processor=processors,
            eos_token_id=None,
            pad_token_id=ref.eos,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt_ids) :].tolist(), [s[0] for s in out.scores]


def assert_logprobs_match(result, scores, top: int) -> None:
    assert len(result.logprobs) == len(result.token_ids) == len(scores)
    for token, got, step_scores in zip(result.token_ids, result.logprobs, scores):
        expected = step_scores.float().log_softmax(-1)
        assert got.token_id == token
        assert got.logprob == pytest.approx(expected[token].item(), abs=1e-4)
        values, ids = expected.topk(top)
        assert [t for t, _, _ in got.top] == ids.tolist()  # in order, best first
        assert [v for _, _, v in got.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert got.top[0][0] == token  # greedy: the sampled token is the top-1


# The tiny model is sure of itself: presence and frequency penalties at OpenAI's
# maximum move its logprobs, not its greedy tokens; the other two change the tokens.
PENALTIES = [dict(), dict(repetition=2.0), dict(repetition=0.5), dict(presence=2.0, frequency=2.0), dict(repetition=1.5, presence=-0.5, frequency=2.0)]


@pytest.mark.parametrize("penalty", PENALTIES, ids=["none", "repetition", "repetition-below-1", "presence+frequency", "all-three"])
def test_greedy_tokens_and_logprobs_equal_transformers_with_the_same_processing(llama_cluster, llama_ref, penalty):
    prompt = "The cat slept"
    ids = llama_ref.ids(prompt)
    expected, scores = reference_run(llama_ref, ids, **penalty)
    params = dict(repetition_penalty=penalty.get("repetition"), presence_penalty=penalty.get("presence", 0.0), frequency_penalty=penalty.get("frequency", 0.0))
    with Client(llama_cluster.router_address, timeout=60) as client:
        result = client.complete(prompt, max_new_tokens=NEW, ignore_eos=True, logprobs=True, top_logprobs=5, **params)
    assert result.token_ids == expected
    assert_logprobs_match(result, scores, 5)
    assert result.logprobs[0].text == llama_ref.tokenizer.decode([result.token_ids[0]])
    if penalty:  # the processing shows: the checks above are not the unprocessed ones again
        plain_tokens, plain_scores = reference_run(llama_ref, ids)
        moved = [abs(a.log_softmax(-1) - b.log_softmax(-1)).max().item() for a, b in zip(scores, plain_scores)]
        assert max(moved) > 0.1 and (expected != plain_tokens or "repetition" not in penalty)
    assert_nothing_held(llama_cluster)


def test_seeded_penalized_sampling_is_the_same_alone_and_in_a_batch(llama_cluster):
    params = dict(
        max_new_tokens=30, temperature=1.2, top_p=0.95, min_p=0.02, seed=4321, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=True
    )
    with Client(llama_cluster.router_address, timeout=60) as client:
        alone = client.complete(PROMPT, **params)

    async def crowd():
        async with AsyncClient(llama_cluster.router_address, timeout=120) as client:
            others = [client.complete(f"The cat slept {i}", max_new_tokens=30, temperature=1.0, seed=i, presence_penalty=0.5 * (i % 3)) for i in range(7)]
            return await asyncio.gather(client.complete(PROMPT, **params), *others)

    in_batch = asyncio.run(crowd())[0]
    assert in_batch.token_ids == alone.token_ids
    assert [x.logprob for x in in_batch.logprobs] == pytest.approx([x.logprob for x in alone.logprobs], abs=1e-4)
    assert_nothing_held(llama_cluster)


def test_n_choices_are_the_one_choice_requests_with_seed_plus_i_on_every_call(llama_cluster):
    params = dict(max_new_tokens=16, temperature=2.0, seed=77, ignore_eos=True, n=3)
    with Client(llama_cluster.router_address, timeout=60) as client:
        first = client.choices("The cat slept", **params)
        second = client.choices("The cat slept", **params)
        singles = [client.complete("The cat slept", **{**params, "n": 1, "seed": 77 + i}) for i in range(3)]
    single = singles[0]
    assert [c.index for c in first] == [0, 1, 2]
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    # Choice i samples with seed + i: what the seeds guarantee on any host (three samples
    # differing is likely, not guaranteed, and another CPU's rounding can change it).
    assert [c.token_ids for c in first] == [s.token_ids for s in singles]
    assert all(c.finish_reason == "length" and c.completion_tokens == 16 and c.prompt_tokens == single.prompt_tokens for c in first)
    assert_nothing_held(llama_cluster)


def test_cancelling_an_n_choice_call_frees_every_choice_on_every_worker(llama_cluster):
    async def run():
        async with AsyncClient(llama_cluster.router_address, timeout=60) as client:
            stream = client.generate("The lighthouse keeper", max_new_tokens=300, ignore_eos=True, temperature=1.0, n=4)
            seen = set()
            async for chunk in stream:
                seen.add(chunk.index)
                if len(seen) == 4:
                    break
            await stream.aclose()
            return seen

    assert asyncio.run(run()) == {0, 1, 2, 3}
    assert_nothing_held(llama_cluster)


def test_messages_render_with_the_chat_template_as_apply_chat_template(llama_cluster, llama_ref):
    conversation = [("system", "You answer briefly."), ("user", "The lighthouse keeper climbed")]
    ids = llama_ref.tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in conversation], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with Client(llama_cluster.router_address, timeout=60) as client:
        result = client.complete(messages=conversation, max_new_tokens=NEW)
    assert result.prompt_tokens == len(ids)
    assert result.token_ids == llama_ref.greedy(list(ids), NEW)


BAD = [
    (dict(prompt="x", min_p=1.5), "sampling.min_p"),
    (dict(prompt="x", presence_penalty=3.0), "sampling.presence_penalty"),
    (dict(prompt="x", frequency_penalty=-2.5), "sampling.frequency_penalty"),
    (dict(prompt="x", repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(prompt="x", logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(prompt="x", top_logprobs=2), "top_logprobs"),
    (dict(prompt="x", n=17), "n"),
    (dict(prompt="x", n=-1), "n"),
    (dict(messages=[("", "hi")]), "messages"),
    (dict(prompt="x", messages=[("user", "hi")]), "exactly one of prompt, prompt_token_ids or messages"),
]


@pytest.mark.parametrize("params,field", BAD, ids=[f for _, f in BAD])
def test_each_new_bad_parameter_is_invalid_argument_naming_it(llama_cluster, params, field):
    params = dict(params)
    with Client(llama_cluster.router_address, timeout=30) as client, pytest.raises(grpc.RpcError) as error:
        client.generate(params.pop("prompt", None), **params).__next__()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()

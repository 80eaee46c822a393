"""The shared request validation, in process: every refusal names its field (the gRPC name)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from disagg.rpc.server import RequestError
from router.config import Limits
from router.params import GenerateParams
from router.prompts import prompt_ids, render_chat
from router.validation import ModelFacts, build_request, check_params

FACTS = ModelFacts(name="tiny", vocab_size=512, max_seq_len=512, eos_token_ids=(2,), backend="torch", dtype="float32")
LIMITS = Limits()

BAD = [
    (dict(), "prompt"),
    (dict(prompt="x", prompt_token_ids=(1,)), "prompt"),
    (dict(prompt="x", messages=(("user", "hi"),)), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt_token_ids=()), "prompt_token_ids"),
    (dict(prompt_token_ids=(1, 512)), "prompt_token_ids"),
    (dict(messages=()), "messages"),
    (dict(messages=(("", "hi"),)), "messages"),
    (dict(prompt="x", request_id="r" * 129), "request_id"),
    (dict(prompt="x", temperature=-0.5), "sampling.temperature"),
    (dict(prompt="x", temperature=float("nan")), "sampling.temperature"),
    (dict(prompt="x", top_p=0.0), "sampling.top_p"),
    (dict(prompt="x", top_p=float("nan")), "sampling.top_p"),
    (dict(prompt="x", top_k=-1), "sampling.top_k"),
    (dict(prompt="x", min_p=1.5), "sampling.min_p"),
    (dict(prompt="x", min_p=-0.1), "sampling.min_p"),
    (dict(prompt="x", seed=2**63), "sampling.seed"),
    (dict(prompt="x", presence_penalty=2.5), "sampling.presence_penalty"),
    (dict(prompt="x", frequency_penalty=-3.0), "sampling.frequency_penalty"),
    (dict(prompt="x", frequency_penalty=float("inf")), "sampling.frequency_penalty"),
    (dict(prompt="x", repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(prompt="x", repetition_penalty=-1.0), "sampling.repetition_penalty"),
    (dict(prompt="x", max_new_tokens=0), "stopping.max_new_tokens"),
    (dict(prompt="x", max_new_tokens=5000), "stopping.max_new_tokens"),
    (dict(prompt="x", stop=("",)), "stopping.stop"),
    (dict(prompt="x", stop=("a",) * 17), "stopping.stop"),
    (dict(prompt="x", stop_token_ids=(9999,)), "stopping.stop_token_ids"),
    (dict(prompt="x", top_logprobs=21, logprobs=True), "top_logprobs"),
    (dict(prompt="x", top_logprobs=-1, logprobs=True), "top_logprobs"),
    (dict(prompt="x", top_logprobs=3), "top_logprobs"),
    (dict(prompt="x", n=0), "n"),
    (dict(prompt="x", n=17), "n"),
]


@pytest.mark.parametrize("fields,name", BAD, ids=[f"{name}-{i}" for i, (_, name) in enumerate(BAD)])
def test_every_refusal_names_its_field(fields, name):
    with pytest.raises(RequestError) as error:
        check_params(GenerateParams(**fields), LIMITS, FACTS)
    assert error.value.field == name
    assert name in str(error.value)


def test_max_new_tokens_past_the_sequence_length_names_it_with_both_numbers():
    with pytest.raises(RequestError) as error:
        build_request(GenerateParams(prompt="x", max_new_tokens=500), list(range(20)), LIMITS, FACTS)
    assert error.value.field == "stopping.max_new_tokens"
    assert "prompt has 20 tokens" in str(error.value) and "over the maximum sequence length 512" in str(error.value)


def test_a_good_request_builds_with_the_defaults():
    params = GenerateParams(prompt="x", top_p=0.5, seed=7, stop_token_ids=(5,))
    check_params(params, LIMITS, FACTS)
    request = build_request(params, [1, 2, 3], LIMITS, FACTS)
    assert request.sampling.top_p == 0.5 and request.sampling.seed == 7
    assert request.stopping.stop_token_ids == frozenset({2, 5})
    assert request.max_new_tokens == LIMITS.default_max_new_tokens


def test_messages_without_a_chat_template_are_refused_naming_messages(llama_path):
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    tokenizer.chat_template = None
    with pytest.raises(RequestError) as error:
        render_chat(tokenizer, (("user", "hi"),))
    assert error.value.field == "messages" and "no chat template" in str(error.value)


def test_messages_render_as_apply_chat_template_does(llama_path):
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    conversation = (("system", "Be brief."), ("user", "The cat sat"))
    expected = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in conversation], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt_ids(tokenizer, GenerateParams(messages=conversation)) == list(expected)


NEURON = ModelFacts(name="tiny", vocab_size=512, max_seq_len=512, eos_token_ids=(2,), backend="neuron", dtype="bfloat16")
NEURON_REFUSED = [
    (dict(min_p=0.1), "sampling.min_p"),
    (dict(presence_penalty=0.5), "sampling.presence_penalty"),
    (dict(frequency_penalty=0.5), "sampling.frequency_penalty"),
    (dict(repetition_penalty=1.2), "sampling.repetition_penalty"),
    (dict(logprobs=True), "logprobs"),
]


@pytest.mark.parametrize("fields,name", NEURON_REFUSED, ids=[name for _, name in NEURON_REFUSED])
def test_the_neuron_backend_refuses_what_nxdi_cannot_sample_naming_the_field(fields, name):
    with pytest.raises(RequestError) as error:
        check_params(GenerateParams(prompt="x", **fields), LIMITS, NEURON)
    assert error.value.field == name and "neuron backend" in str(error.value)
    check_params(GenerateParams(prompt="x", **fields), LIMITS, FACTS)  # the torch backend serves it
    check_params(GenerateParams(prompt="x", n=3, repetition_penalty=1.0), LIMITS, NEURON)  # neutral values and n pass


def test_choice_seeds_are_seed_plus_index_wrapped_to_int64():
    from router.choices import choice_requests

    request = build_request(GenerateParams(prompt="x", seed=2**63 - 2, n=3, temperature=1.0), [1, 2], LIMITS, FACTS)
    seeds = [choice.sampling.seed for choice in choice_requests(request)]
    assert seeds == [2**63 - 2, 2**63 - 1, -(2**63)]

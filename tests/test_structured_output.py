"""Structured output through the whole service (router, prefill and decode workers as real
processes): constraints over gRPC, exact against transformers' generate() with the same
mask, valid when sampled, the same in a mixed batch as alone over both KV transports,
resumed on another decode worker when one dies, and refused before any prefill when bad.

The reference mask is computed here, independently of the engine's code: a transformers
logits processor over llguidance's own matcher and its packed bitmask."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import pathlib
import re
import signal

import grpc
import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from conftest import DEFAULT_TRANSPORT, assert_nothing_held, start_cluster
from polling import wait_for
from transformers import LogitsProcessorList

from disagg.clients.grpc_client import AsyncClient, Client
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # the engine's JSON layout
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "pet", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,6}"
CHOICES = ["the red lighthouse", "a green boat", "the harbour"]
LARK = 'start: greeting " " name "!"\ngreeting: "hello" | "goodbye"\nname: /[a-z]{3,8}/'
PROMPT = "The cat slept"

# What each constraint is as a Client keyword argument, as llguidance's grammar, and how its output is checked.
CASES = {
    "json_schema": (dict(json_schema=PERSON), lambda: llguidance.LLMatcher.grammar_from_json_schema(PERSON, JSON_LAYOUT),
                    lambda text: jsonschema.validate(json.loads(text), PERSON)),
    "json_object": (dict(json_object=True), lambda: llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_LAYOUT),
                    lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
    "regex": (dict(regex=REGEX), lambda: llguidance.LLMatcher.grammar_from_regex(REGEX),
              lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    "choice": (dict(choice=CHOICES), lambda: llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in CHOICES)),
               lambda text: text in CHOICES or pytest.fail(text)),
    "grammar": (dict(grammar=LARK), lambda: llguidance.LLMatcher.grammar_from_lark(LARK),
                lambda text: re.fullmatch(r"(hello|goodbye) [a-z]{3,8}!", text) or pytest.fail(text)),
}


class GrammarMask:
    """A transformers logits processor: llguidance's matcher fed the generated tokens, its
    bitmask unpacked with numpy, the refused tokens' scores -inf."""

    def __init__(self, ref, grammar: str, prompt_len: int):
        vocab = ref.model.config.vocab_size
        tokenizer = llguidance.hf.from_tokenizer(ref.tokenizer, n_vocab=vocab, eos_token=[ref.eos])
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self.prompt_len, self.vocab, self.fed = prompt_len, vocab, 0

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.prompt_len :].tolist()
        assert self.matcher.consume_tokens(generated[self.fed :]), self.matcher.get_error()
        self.fed = len(generated)
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[: self.vocab]
        return scores.masked_fill(torch.from_numpy(bits == 0)[None, :], float("-inf"))


def constrained_reference(ref, prompt: str, grammar: str, max_new_tokens: int):
    """(token ids, processed scores per step) of transformers' greedy generate() under the mask."""
    ids = ref.ids(prompt)
    with torch.no_grad():
        out = ref.model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=ref.eos,
            logits_processor=LogitsProcessorList([GrammarMask(ref, grammar, len(ids))]), output_scores=True, return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids) :].tolist(), [s[0] for s in out.scores]


@pytest.fixture(scope="module")
def cluster(cluster_logs):
    """One prefill and two decode workers (a request can move), on the default KV transport, with the HTTP API."""
    cluster = start_cluster(cluster_logs / "structured", "llama", prefill=1, decode=2, http_port=0, router_args=["--max-constraint-chars", "8192"])
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("kind", list(CASES))
def test_greedy_constrained_output_equals_transformers_with_the_same_mask(cluster, llama_ref, kind):
    constraint, grammar, valid = CASES[kind]
    expected, scores = constrained_reference(llama_ref, PROMPT, grammar(), 130)
    with Client(cluster.router_address, timeout=60) as client:
        result = client.complete(PROMPT, max_new_tokens=130, logprobs=True, top_logprobs=2, **constraint)
    assert result.token_ids == expected
    if kind != "json_object":  # greedy, the tiny model writes one endless key into an open object
        assert result.finish_reason == "stop"  # the grammar ended it: EOS was the only token left
        valid(result.text)
    # Logprobs are over the constrained distribution: the masked scores' log-softmax.
    for got, step in zip(result.logprobs, scores):
        assert got.logprob == pytest.approx(step.log_softmax(-1)[got.token_id].item(), abs=1e-4)
        assert all(np.isfinite(value) for _, _, value in got.top)  # the alternatives are allowed tokens (finite logprobs), or none
    assert_nothing_held(cluster)


# The constraints whose outputs end within a bound (any JSON object may hold one endless string).
BOUNDED = [kind for kind in CASES if kind != "json_object"]


def test_sampled_constrained_outputs_are_always_valid(cluster):
    """At temperature 1 the tiny model rarely writes JSON by itself; every constrained output parses and validates."""
    async def run():
        async with AsyncClient(cluster.router_address, timeout=120) as client:
            jobs = [client.complete(PROMPT, max_new_tokens=160, temperature=1.0, seed=seed, **CASES[kind][0]) for seed in range(6) for kind in BOUNDED]
            return await asyncio.gather(*jobs)

    kinds = [kind for _ in range(6) for kind in BOUNDED]
    results = asyncio.run(run())
    for kind, result in zip(kinds, results):
        assert result.finish_reason == "stop", (kind, result.text)
        CASES[kind][2](result.text)
    with Client(cluster.router_address, timeout=60) as client:
        free = [client.complete(PROMPT, max_new_tokens=40, temperature=1.0, seed=seed).text for seed in range(4)]
    assert not any(text.lstrip().startswith("{") for text in free)  # unconstrained it does not write JSON


MIXED = [dict(), CASES["json_schema"][0], CASES["regex"][0], CASES["choice"][0]]


async def _mixed_batch(address: str) -> list[list[int]]:
    async with AsyncClient(address, timeout=180) as client:
        jobs = [client.complete(f"{PROMPT} {i % 5}", max_new_tokens=60, **MIXED[i % 4]) for i in range(32)]
        return [r.token_ids for r in await asyncio.gather(*jobs)]


def _alone(address: str) -> list[list[int]]:
    with Client(address, timeout=60) as client:
        return [client.complete(f"{PROMPT} {i % 5}", max_new_tokens=60, **MIXED[i % 4]).token_ids for i in range(20)]


@pytest.fixture(scope="module")
def alone(cluster) -> list[list[int]]:
    """The greedy tokens of the 20 distinct (prompt, constraint) pairs of the mixed batch, each asked alone."""
    return _alone(cluster.router_address)


def test_a_mixed_batch_of_32_gives_each_request_what_it_gets_alone(cluster, cluster_logs, alone):
    """Rows with and without constraints share steps: each gets exactly its own greedy output, over both KV transports."""
    assert asyncio.run(_mixed_batch(cluster.router_address)) == [alone[i % 20] for i in range(32)]
    other = "grpc" if DEFAULT_TRANSPORT != "grpc" else "nixl"
    if other == "nixl":
        pytest.skip("NIXL is not installed: the default transport (grpc) ran")
    second = start_cluster(cluster_logs / "structured-other", "llama", transport=other)
    try:
        assert asyncio.run(_mixed_batch(second.router_address)) == [alone[i % 20] for i in range(32)]
    finally:
        second.stop()


def test_the_colocated_path_masks_its_prefills_too(cluster, cluster_logs):
    """A decode worker that prefills itself (--colocated) gives what the split gives."""
    asks = [MIXED[i % 4] for i in range(1, 4)]
    with Client(cluster.router_address, timeout=60) as client:
        split = [client.complete(PROMPT, max_new_tokens=60, **ask).token_ids for ask in asks]
    colocated = start_cluster(cluster_logs / "structured-colocated", "llama", colocated=True)
    try:
        with Client(colocated.router_address, timeout=60) as client:
            assert [client.complete(PROMPT, max_new_tokens=60, **ask).token_ids for ask in asks] == split
    finally:
        colocated.stop()


def _active_decode_worker(cluster) -> str | None:
    for name in ("decode-0", "decode-1"):
        with grpc.insecure_channel(cluster.process(name).address) as channel:
            if wgrpc.DecodeServiceStub(channel).GetLoad(wpb.LoadRequest(), timeout=5).active:
                return name
    return None


def test_a_constrained_stream_moves_to_another_decode_worker_and_stays_valid(cluster, llama_ref, alone):
    """The matcher is rebuilt from the tokens streamed before: the same tokens as an unbroken run; a mixed
    batch of 32 sent as the worker dies gets what each of its requests gets alone."""
    words = r"((the|a|cat|dog|sat|on|mat) ){150,250}"
    expected, _ = constrained_reference(llama_ref, PROMPT, llguidance.LLMatcher.grammar_from_regex(words), 440)
    with Client(cluster.router_address, timeout=120) as client:
        stream = client.generate(PROMPT, max_new_tokens=440, regex=words)
        received = [t for _, chunk in zip(range(4), stream) for t in chunk.token_ids]
        victim = _active_decode_worker(cluster)
        assert victim is not None
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            batch = pool.submit(asyncio.run, _mixed_batch(cluster.router_address))
            cluster.signal(victim, signal.SIGKILL)
            rest = list(stream)
            assert batch.result(timeout=300) == [alone[i % 20] for i in range(32)]
        assert received + [t for chunk in rest for t in chunk.token_ids] == expected
        # Cut by max_new_tokens before the grammar's end: still a prefix it accepts.
        assert GrammarMask(llama_ref, llguidance.LLMatcher.grammar_from_regex(words), 0).matcher.consume_tokens(expected)
        cluster.process(victim).popen.wait()
        cluster.restart(victim)
        wait_for(lambda: client.model_info().decode_workers == 2, 120, "the restarted decode worker back in the router's pool")


BAD = [
    (dict(json_schema='{"type": "object", "properties": 7}'), "constraint.json_schema"),
    (dict(json_schema="{not json"), "constraint.json_schema"),
    (dict(regex="[0-9"), "constraint.regex"),
    (dict(choice=[]), "constraint.choice"),
    (dict(grammar="start: missing_rule"), "constraint.grammar"),
    (dict(grammar='start: "' + "x" * 9000 + '"'), "constraint.grammar"),  # over --max-constraint-chars
]


@pytest.mark.parametrize("constraint, field", BAD, ids=["schema", "schema-json", "regex", "choice", "grammar", "grammar-size"])
def test_a_bad_constraint_is_invalid_argument_naming_the_field_before_any_prefill(cluster, constraint, field):
    with Client(cluster.router_address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.complete(PROMPT, max_new_tokens=8, **constraint)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(field), refused.value.details()
        assert client.complete(PROMPT, max_new_tokens=3).completion_tokens == 3  # still serving
    assert_nothing_held(cluster)


# -- OpenAI's API, through the official `openai` package -------------------------------------------------------------

import openai  # noqa: E402

# Small: the chat template shows the tools to the model, and the tiny model's context is 512 tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client, client.models.list().data[0].id


def test_response_format_json_schema_validates_100_of_100_at_temperature_1(oai):
    client, model = oai
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    outputs = []
    for seed in range(10):
        reply = client.chat.completions.create(
            model=model, messages=ASK, response_format=schema_format, temperature=1.0, seed=seed * 10, n=10, max_tokens=200,
        )
        outputs += [(c.message.content, c.finish_reason) for c in reply.choices]
    assert len(outputs) == 100
    for content, finish in outputs:
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), PERSON)
    free = client.chat.completions.create(model=model, messages=ASK, temperature=1.0, seed=1, n=10, max_tokens=60)
    assert sum(_parses_as_object(c.message.content) for c in free.choices) == 0  # unconstrained, it writes no JSON


def _parses_as_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_structured_outputs_on_completions(oai):
    client, model = oai
    for kind in ("json", "regex", "choice", "grammar"):
        value = {"json": PERSON, "regex": REGEX, "choice": CHOICES, "grammar": LARK}[kind]
        check = CASES[{"json": "json_schema"}.get(kind, kind)][2]
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=200, temperature=0.8, seed=3,
                                          extra_body={"structured_outputs": {kind: value}})
        assert reply.choices[0].finish_reason == "stop"
        check(reply.choices[0].text)


def _arguments_valid(calls) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_and_named_give_calls_valid_against_the_tools_schemas(oai):
    client, model = oai
    one = dict(model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=5, n=4, max_tokens=120)
    required = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **one)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _arguments_valid(choice.message.tool_calls)
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "time"}}, **one)
    for choice in named.choices:
        assert choice.finish_reason == "stop"  # OpenAI's, for a named tool_choice
        assert [c.function.name for c in choice.message.tool_calls] == ["time"]
        _arguments_valid(choice.message.tool_calls)
    parallel = client.chat.completions.create(tool_choice="required", **one)  # one call or more; a call cut by max_tokens is no call
    for choice in parallel.choices:
        assert choice.message.tool_calls and choice.finish_reason in ("tool_calls", "length")
        _arguments_valid(choice.message.tool_calls if choice.finish_reason == "tool_calls" else choice.message.tool_calls[:-1] or [])


def test_a_streamed_tool_call_reassembles_to_the_same_call(oai):
    client, model = oai
    params = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**params).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**params, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] = (delta.function.name if delta.function else None) or call["name"]
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_lets_the_model_answer_in_text_and_a_tool_result_continues_the_chat(oai, llama_ref):
    client, model = oai
    auto = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=20)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content  # the tiny model never calls by itself
    history = ASK + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
    ]
    reply = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=12)
    rendered = llama_ref.tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>sunny, 21 degrees</tool_response>" in rendered and '"name": "weather"' in rendered
    assert reply.usage.prompt_tokens == len(llama_ref.tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")


HTTP_BAD = [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}}), "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "[0-9"}}), "structured_outputs.regex"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rocket"}}), "tool_choice"),
    (dict(extra_body={"structured_outputs": {"grammar": 'start: "' + "x" * 9000 + '"'}}), "structured_outputs.grammar"),
    (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}), "response_format"),
]


@pytest.mark.parametrize("params, param", HTTP_BAD, ids=["schema", "regex", "unknown-tool", "grammar-size", "two-constraints"])
def test_bad_structured_output_is_400_naming_the_parameter(oai, cluster, params, param):
    client, model = oai
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=8, **params)
    assert bad.value.status_code == 400 and bad.value.body["param"] == param, bad.value.body
    # Still serving: ignore_eos (vLLM's extension), since an unseeded sampled reply may draw EOS first (seen in CI: 1 token).
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=2, extra_body={"ignore_eos": True}).usage.completion_tokens == 2
    assert_nothing_held(cluster)


def test_each_worker_has_its_constraint_tokenizer_before_it_serves(cluster):
    """llguidance builds its tokenizer holding the GIL (seconds for a large vocabulary): a worker that served
    first would answer no health check or load poll meanwhile, so each waits for it before it serves."""
    for process in cluster.processes:
        if process.name == "router":
            continue
        lines = pathlib.Path(cluster.log_path(process.name)).read_text().splitlines()
        ready = next(i for i, line in enumerate(lines) if "constraint tokenizer ready" in line)
        serving = next(i for i, line in enumerate(lines) if "worker serving on port" in line)
        assert ready < serving, process.name

"""The OpenAI-compatible HTTP API through the official `openai` package (sync
and async, streamed and not) against a real cluster (the session's llama
cluster, which serves HTTP beside gRPC): exact greedy text against
transformers, usage, refusals in OpenAI's error shape naming the parameter,
and a client that leaves mid-stream freeing everything on every worker."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from conftest import assert_nothing_held

from disagg.cli.main import main
from disagg.clients.grpc_client import Client, by_choice

PROMPT = "The lighthouse keeper"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the harbour."}]


@pytest.fixture(scope="module")
def url(llama_cluster) -> str:
    return llama_cluster.http_url


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat_ids(ref, messages) -> list[int]:
    """The prompt as transformers' apply_chat_template renders and tokenizes it."""
    return list(ref.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def text_of(ref, ids: list[int]) -> str:
    return ref.tokenizer.decode(ids, skip_special_tokens=True)


def test_models_and_health(client, url, llama_cluster, model):
    assert model.startswith("tiny-llama-")
    assert httpx.get(f"{url}/health").status_code == 200
    assert client.models.list().data[0].owned_by == "disagg"


def test_completion_greedy_equals_generate_with_usage_and_token_ids(client, model, llama_ref):
    expected = llama_ref.greedy(PROMPT, 12, ignore_eos=True)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == model
    assert choice.text == text_of(llama_ref, expected) and choice.index == 0 and choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == expected
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (len(llama_ref.ids(PROMPT)), 12, len(llama_ref.ids(PROMPT)) + 12)


def test_a_batch_of_prompts_text_and_token_ids_streamed_with_the_final_usage_chunk(client, model, llama_ref):
    ids = llama_ref.ids("The baker")
    stream = client.completions.create(model=model, prompt=[ids, llama_ref.ids(PROMPT)], max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {0: text_of(llama_ref, llama_ref.greedy(ids, 6, True)), 1: text_of(llama_ref, llama_ref.greedy(PROMPT, 6, True))}
    last = chunks[-1]
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids) + len(llama_ref.ids(PROMPT)), 12)
    finals = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finals == ["length", "length"]


def test_chat_greedy_equals_generate_on_the_chat_template_sync_and_async_streamed(client, url, model, llama_ref):
    prompt_ids = chat_ids(llama_ref, CHAT)
    expected = llama_ref.greedy(prompt_ids, 10)
    out = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text_of(llama_ref, expected)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), len(expected))
    assert out.choices[0].finish_reason == ("stop" if expected[-1] == llama_ref.eos else "length")

    async def streamed():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as aclient:
            stream = await aclient.chat.completions.create(
                model=model, messages=CHAT, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text_of(llama_ref, expected)
    assert chunks[-1].usage.completion_tokens == len(expected) and chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_async_completion_not_streamed_and_stop_strings(url, model, llama_ref):
    expected = text_of(llama_ref, llama_ref.greedy(PROMPT, 30, True))
    stop = expected[8:11]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as aclient:
            return await aclient.completions.create(model=model, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop], extra_body={"ignore_eos": True})

    out = asyncio.run(run())
    assert out.choices[0].text == expected[: expected.index(stop)] and out.choices[0].finish_reason == "stop"


def test_echo_prefixes_the_prompt(client, model, llama_ref):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert out.choices[0].text == PROMPT + text_of(llama_ref, llama_ref.greedy(PROMPT, 4, True))


def test_n_choices_are_the_one_choice_requests_with_seed_plus_i_every_call_and_equal_the_grpc_api(client, url, model, llama_cluster, llama_ref):
    params = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "n": 3, "seed": 11, "extra_body": {"ignore_eos": True}}
    first, again = client.completions.create(**params), client.completions.create(**params)
    texts = [c.text for c in first.choices]
    # What the seeds guarantee (not that three samples differ, which a host's rounding can change):
    # choice i samples with seed + i, so it is the one-choice request with that seed.
    singles = [client.completions.create(**{**params, "n": 1, "seed": 11 + i}).choices[0].text for i in range(3)]
    assert [c.index for c in first.choices] == [0, 1, 2] and texts == singles
    assert [c.text for c in again.choices] == texts
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(llama_ref.ids(PROMPT)), 30)  # the prompt counts once
    with Client(llama_cluster.router_address, timeout=60) as grpc_client:
        grpc_choices = by_choice(grpc_client.generate(PROMPT, max_new_tokens=10, temperature=1.0, n=3, seed=11, ignore_eos=True))
    assert [g.text for g in grpc_choices] == texts
    # Streamed chat: each choice's deltas, joined by index, equal the same request not streamed.
    chat = {"model": model, "messages": CHAT, "max_tokens": 8, "n": 3, "seed": 5, "temperature": 1.0}
    whole = [c.message.content for c in client.chat.completions.create(**chat).choices]
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.chat.completions.create(**chat, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert [streamed[i] for i in range(3)] == whole
    assert whole == [client.chat.completions.create(**{**chat, "n": 1, "seed": 5 + i}).choices[0].message.content for i in range(3)]


def test_logprobs_in_openais_shapes_equal_the_grpc_api(client, model, llama_cluster):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and top[token] == logprob == max(top.values())  # greedy: the sampled token is top-1
    with Client(llama_cluster.router_address, timeout=60) as grpc_client:
        reference = grpc_client.complete(PROMPT, max_new_tokens=6, logprobs=True, top_logprobs=3, ignore_eos=True).logprobs
    assert logprobs.token_logprobs == pytest.approx([x.logprob for x in reference], abs=1e-6)

    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    # The tokens' bytes join into the text, even where a character spans two tokens.
    assert len(content) == chat.usage.completion_tokens and b"".join(bytes(c.bytes) for c in content).decode() == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].bytes == entry.bytes and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_penalties_and_min_p_reach_the_sampler_as_through_grpc(client, model, llama_cluster):
    knobs = {"presence_penalty": 0.5, "frequency_penalty": 0.4, "repetition_penalty": 1.5, "min_p": 0.05}
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    penalized = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, presence_penalty=0.5, frequency_penalty=0.4,
                                          extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.5, "min_p": 0.05})
    with Client(llama_cluster.router_address, timeout=60) as grpc_client:
        reference = grpc_client.complete(PROMPT, max_new_tokens=40, ignore_eos=True, **knobs).token_ids
    assert penalized.choices[0].model_extra["token_ids"] == reference != plain.choices[0].model_extra["token_ids"]


BAD = [
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"min_p": 2}, "min_p"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 100000}, "max_tokens"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"stop_token_ids": [10**6]}, "stop_token_ids"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"logprobs": 99}, "logprobs"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"seed": 2**64}, "seed"),
    ("completions", {"prompt": [1, 10**6]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": {"a": 1}}, "prompt"),
    ("completions", {"prompt": ["a"] * 257}, "prompt"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"tools": []}, "tools"),
]


def test_every_bad_parameter_is_400_naming_it_in_openais_shape(url, llama_cluster):
    with httpx.Client(base_url=f"{url}/v1", timeout=30) as http:
        for endpoint, fields, param in BAD:
            body = {"prompt": PROMPT} if endpoint == "completions" else {"messages": CHAT}
            response = http.post(f"/{endpoint}", json={**body, "max_tokens": 4, **fields})
            assert response.status_code == 400, (fields, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert error["param"] == param, (fields, error)
            assert param.split("[")[0] in error["message"], error
        unknown = http.post("/completions", json={"model": "gpt-4", "prompt": PROMPT})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        not_json = http.post("/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert not_json.status_code == 400 and "error" in not_json.json()
    assert_nothing_held(llama_cluster)


def test_the_openai_package_raises_its_own_errors(client, model):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt=PROMPT, top_p=1.5)
    assert bad.value.param == "top_p" and bad.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_client_gone_mid_stream_frees_everything_on_every_worker(url, llama_cluster, endpoint):
    body = {"prompt": PROMPT} if endpoint == "completions" else {"messages": CHAT}
    body |= {"max_tokens": 450, "ignore_eos": True, "stream": True, "temperature": 0}  # near the 512-token context
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/{endpoint}", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():  # until the decode worker holds the stream's slot
            assert line != "data: [DONE]", "the stream finished before its slot was seen in use"
            held = llama_cluster.held()
            if held["decode-0"][0] == 1:
                break
    # The connection is closed here, hundreds of tokens early.
    assert_nothing_held(llama_cluster, within=5.0)


def test_a_client_gone_before_a_response_that_is_not_streamed_frees_everything(url, llama_cluster):
    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            request = asyncio.ensure_future(http.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}))
            for _ in range(500):
                await asyncio.sleep(0.02)
                if llama_cluster.held()["decode-0"][0] == 1:
                    break
            assert llama_cluster.held()["decode-0"][0] == 1
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(run())
    assert_nothing_held(llama_cluster, within=5.0)


def test_disagg_bench_drives_our_own_http_api(url, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--api", "openai", "--url", url, "--concurrency", "2", "--requests", "4", "--warmup", "1",
                 "--prompt-len", "8", "--output-len", "5", "--json", str(out), "--no-progress"]) == 0
    run = json.loads(out.read_text())[0]
    assert run["requests"] == run["ok"] == 4 and run["errors"] == {}
    assert run["output_tokens_per_second"] * run["seconds"] == pytest.approx(4 * 5)

"""Bad input on the public API: a clear status naming the field, nothing held, and the server keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conftest import assert_nothing_held

from disagg.clients.grpc_client import AsyncClient, Client
from disagg.v1 import generation_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT

CASES = [
    (dict(), "exactly one of prompt, prompt_token_ids or messages"),
    (dict(prompt="x", prompt_token_ids=[1]), "exactly one of prompt, prompt_token_ids or messages"),
    (dict(prompt_token_ids=[1, 10**6]), "prompt_token_ids contains 1000000"),
    (dict(prompt_token_ids=[1, -3]), "prompt_token_ids contains -3"),
    (dict(prompt="x", temperature=-1.0), "sampling.temperature"),
    (dict(prompt="x", temperature=float("nan")), "sampling.temperature"),
    (dict(prompt="x", temperature=float("inf")), "sampling.temperature"),
    (dict(prompt="x", top_p=1.5), "sampling.top_p"),
    (dict(prompt="x", top_p=0.0), "sampling.top_p"),
    (dict(prompt="x", top_k=-2), "sampling.top_k"),
    (dict(prompt="x", max_new_tokens=-1), "stopping.max_new_tokens"),
    (dict(prompt="x", max_new_tokens=10**6), "stopping.max_new_tokens"),
    (dict(prompt="x", stop=["a"] * 17), "stopping.stop has 17 strings"),
    (dict(prompt="x", stop=["a" * 257]), "stopping.stop has a string of 257 characters"),
    (dict(prompt="x", stop=[""]), "stopping.stop contains an empty string"),
    (dict(prompt="x", stop_token_ids=list(range(65))), "stopping.stop_token_ids has 65 ids"),
    (dict(prompt="x", stop_token_ids=[10**6]), "stopping.stop_token_ids contains 1000000"),
    (dict(prompt="x", request_id="r" * 129), "request_id has 129 characters"),
    (dict(messages=[("", "hi")]), "messages [0] has no role"),
    (dict(prompt="x", top_p=float("nan")), "sampling.top_p must be in (0, 1], got nan"),
    (dict(prompt="x", min_p=1.5), "sampling.min_p must be in [0, 1]"),
    (dict(prompt="x", min_p=-0.1), "sampling.min_p must be in [0, 1]"),
    (dict(prompt="x", presence_penalty=2.5), "sampling.presence_penalty must be in [-2, 2]"),
    (dict(prompt="x", frequency_penalty=-3.0), "sampling.frequency_penalty must be in [-2, 2]"),
    (dict(prompt="x", frequency_penalty=float("inf")), "sampling.frequency_penalty must be in [-2, 2]"),
    (dict(prompt="x", repetition_penalty=0.0), "sampling.repetition_penalty must be a finite number > 0"),
    (dict(prompt="x", repetition_penalty=-1.0), "sampling.repetition_penalty must be a finite number > 0"),
    (dict(prompt="x", logprobs=True, top_logprobs=21), "top_logprobs must be in [0, 20], got 21"),
    (dict(prompt="x", logprobs=True, top_logprobs=-1), "top_logprobs must be in [0, 20], got -1"),
    (dict(prompt="x", top_logprobs=3), "top_logprobs needs logprobs set to true"),
    (dict(prompt="x", n=17), "n must be in [1, 16], got 17"),
    (dict(prompt="x", stop_token_ids=[-1]), "stopping.stop_token_ids contains -1"),
]


@pytest.mark.parametrize("params,message", CASES, ids=[m for _, m in CASES])
def test_each_bad_field_is_invalid_argument_naming_it(llama_cluster, params, message):
    params = dict(params)
    with Client(llama_cluster.router_address, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as error:
            client.choices(params.pop("prompt", None), **params)
    assert error.value.code() == INVALID, error.value.details()
    assert message in error.value.details()


def test_prompt_plus_max_new_tokens_over_the_limit_gives_both_numbers(llama_cluster, llama_ref):
    prompt = "x " * 300
    n_prompt = len(llama_ref.ids(prompt))
    with Client(llama_cluster.router_address, timeout=30) as client, pytest.raises(grpc.RpcError) as error:
        client.complete(prompt, max_new_tokens=400)
    assert error.value.code() == INVALID
    assert f"prompt has {n_prompt} tokens" in error.value.details() and "stopping.max_new_tokens is 400" in error.value.details()
    assert "maximum sequence length 512" in error.value.details()


def test_request_id_already_in_flight(llama_cluster):
    async def run():
        async with AsyncClient(llama_cluster.router_address, timeout=60) as client:
            first = client.generate("The ship's captain", request_id="same-id", max_new_tokens=200, ignore_eos=True)
            await first.__anext__()  # the first request is now in flight
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await client.complete("The cat", request_id="same-id", max_new_tokens=3)
            await first.aclose()
            return error.value

    error = asyncio.run(run())
    assert error.code() == INVALID and "request_id 'same-id' is already in flight" in error.details()
    assert_nothing_held(llama_cluster)


def raw_generate(address: str, payload: bytes):
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream("/disagg.v1.GenerationService/Generate", request_serializer=None, response_deserializer=pb.GenerateResponse.FromString)
        return list(call(payload, timeout=30))


@pytest.mark.parametrize(
    "payload,message",
    [
        (b"\xff\xff\xff", "does not parse as disagg.v1.GenerateRequest"),
        (b"\x12\x02\xff\xfe", "field prompt is not valid UTF-8"),
        (b"\x2a\x04\x12\x02\xff\xfe", "field stopping.stop is not valid UTF-8"),
    ],
    ids=["garbage", "utf8-prompt", "utf8-stop"],
)
def test_unparsable_messages_are_invalid_argument_not_internal(llama_cluster, payload, message):
    with pytest.raises(grpc.RpcError) as error:
        raw_generate(llama_cluster.router_address, payload)
    assert error.value.code() == INVALID and message in error.value.details()


def test_tokenize_text_that_is_not_utf8_is_invalid_argument_naming_the_field(llama_cluster, llama_ref):
    with grpc.insecure_channel(llama_cluster.router_address) as channel:
        call = channel.unary_unary("/disagg.v1.GenerationService/Tokenize", request_serializer=None, response_deserializer=pb.TokenizeResponse.FromString)
        with pytest.raises(grpc.RpcError) as error:
            call(b"\x0a\x02\xff\xfe", timeout=30)  # field 1 (text): two bytes that are not UTF-8
        assert error.value.code() == INVALID and "field text is not valid UTF-8" in error.value.details()
        assert list(call(pb.TokenizeRequest(text="The cat", add_special_tokens=True).SerializeToString(), timeout=30).token_ids) == llama_ref.ids("The cat")


def test_a_message_over_the_size_limit_is_resource_exhausted_and_the_next_call_works(llama_cluster, llama_ref):
    with Client(llama_cluster.router_address, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as error:
            client.complete("word " * 1_200_000, max_new_tokens=2)  # 6 MB, over the 4 MiB limit
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.complete("The cat", max_new_tokens=4).token_ids == llama_ref.greedy("The cat", 4)
    assert_nothing_held(llama_cluster)

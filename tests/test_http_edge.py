"""The HTTP edge's pure parts, no cluster: parameter naming, the error event of
a stream that breaks off, and the exact bytes of tokens."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from disagg.engine.requests import FinishReason
from disagg.rpc.server import RequestError
from router.http.app import completion_events
from router.http.convert import openai_param
from router.http.errors import pydantic_param
from router.http.responses import Envelope
from router.http.schema import ChatCompletionRequest, CompletionRequest
from router.http.streams import Tagged
from router.http.token_bytes import TokenBytes
from router.lifecycle import Chunk

COMPLETION = CompletionRequest(prompt="x")
CHAT = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=3)


@pytest.mark.parametrize("field,request_,param", [
    ("sampling.temperature", COMPLETION, "temperature"),
    ("stopping.max_new_tokens", COMPLETION, "max_tokens"),
    ("stopping.max_new_tokens", CHAT, "max_completion_tokens"),
    ("prompt_token_ids", COMPLETION, "prompt"),
    ("prompt", CHAT, "messages"),
    ("top_logprobs", COMPLETION, "logprobs"),
    ("top_logprobs", CHAT, "top_logprobs"),
    (None, COMPLETION, None),
])
def test_a_refused_grpc_field_is_named_as_the_openai_parameter(field, request_, param):
    assert openai_param(field, request_) == param


def test_pydantic_locations_read_as_openai_parameters():
    assert pydantic_param(("body", "messages", 0, "content")) == "messages[0].content"
    assert pydantic_param(("body", "stream_options", "include_usage")) == "stream_options.include_usage"
    assert pydantic_param(("body",)) is None


def test_a_stream_that_breaks_off_ends_with_an_error_event_and_done():
    async def chunks():
        yield Tagged(0, Chunk([5], " a"))
        raise RequestError("no decode worker is available", grpc.StatusCode.UNAVAILABLE)

    async def events():
        return [e async for e in completion_events(chunks(), Envelope("cmpl-1", "m", chat=False), COMPLETION, str, [""], include_usage=False)]

    out = asyncio.run(events())
    assert json.loads(out[0].removeprefix("data: "))["choices"][0]["text"] == " a"
    assert json.loads(out[1].removeprefix("data: ")) == {
        "error": {"message": "no decode worker is available", "type": "service_unavailable_error", "param": None, "code": "unavailable"}
    }
    assert out[2] == "data: [DONE]\n\n" and len(out) == 3


def test_token_bytes_rejoin_characters_split_across_tokens(llama_ref):
    text = "Zão, naïve café ☕"
    ids = llama_ref.tokenizer(text, add_special_tokens=False)["input_ids"]
    bytes_of = TokenBytes(llama_ref.tokenizer)
    assert any("\ufffd" in llama_ref.tokenizer.decode([t]) for t in ids)  # some token is half a character
    assert b"".join(bytes(bytes_of(t)) for t in ids) == text.encode()


def test_finish_reasons_are_openais():
    from router.http.responses import finish_reason

    assert [finish_reason(f) for f in FinishReason] == [None, "length", "stop", "stop"]


def test_the_front_answers_503_until_ready_and_its_connections_have_nagle_off():
    import socket

    from router.http.app import FrontState
    from router.http.server import HttpFront

    async def run():
        front = HttpFront(FrontState(router=lambda: None, draining=lambda: False, auth_token=None, model_path="m"), "127.0.0.1", 0)
        await front.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = (await reader.readuntil(b"}}")).decode()
        (connection,) = front._server.server_state.connections
        # Without TCP_NODELAY every SSE event after the first waits for the client's delayed ACK.
        nodelay = connection.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        await front.stop()
        return response, nodelay

    response, nodelay = asyncio.run(run())
    assert response.startswith("HTTP/1.1 503") and '"message":"the router is waiting for its workers"' in response
    assert nodelay

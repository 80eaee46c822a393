"""Python client for the public API: iterate over streamed chunks, sync or asyncio.

    from disagg.clients.grpc_client import Client
    with Client("127.0.0.1:50050") as client:
        for chunk in client.generate("The lighthouse keeper", max_new_tokens=32):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc

from disagg.v1 import generation_pb2 as pb
from disagg.v1 import generation_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]]  # (token_id, text, logprob), best first


@dataclass(frozen=True)
class GenerationChunk:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "length", "stop", "stop_sequence" on the last chunk
    prompt_tokens: int = 0
    completion_tokens: int = 0
    matched_stop: str = ""
    ttft_seconds: float = 0.0
    index: int = 0  # which of the n choices
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, with logprobs=True


@dataclass
class Generation:
    """A whole generation, joined from its chunks."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    matched_stop: str = ""
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, chunk: GenerationChunk) -> None:
        self.request_id, self.index = chunk.request_id, chunk.index
        self.token_ids += chunk.token_ids
        self.text += chunk.text
        self.logprobs += chunk.logprobs
        if chunk.finish_reason:
            self.finish_reason, self.matched_stop = chunk.finish_reason, chunk.matched_stop
            self.prompt_tokens, self.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] = (),
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    messages: Sequence[tuple[str, str]] = (),
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    n: int = 0,
    json_schema: dict | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
) -> pb.GenerateRequest:
    """messages: (role, content) pairs, a chat the server renders with the model's chat template.
    json_schema (a dict or its JSON text), json_object, regex, choice, grammar: at most one, the output's constraint."""
    sampling = pb.SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    return pb.GenerateRequest(
        request_id=request_id,
        prompt=prompt or "",
        prompt_token_ids=list(prompt_token_ids),
        messages=[pb.ChatMessage(role=role, content=content) for role, content in messages],
        sampling=sampling,
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=n,
        **_constraint(json_schema, json_object, regex, choice, grammar),
    )


def _constraint(json_schema, json_object: bool, regex, choice, grammar) -> dict:
    given = {name: value for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice), ("grammar", grammar)) if value is not None}
    if json_object:
        given["json_object"] = True
    if len(given) > 1:
        raise ValueError(f"at most one constraint, not {sorted(given)}")
    if "json_schema" in given and not isinstance(json_schema, str):
        given["json_schema"] = json.dumps(json_schema)
    if "choice" in given:
        given["choice"] = pb.ChoiceConstraint(choices=list(choice))
    return given


def chunk_from_pb(msg: pb.GenerateResponse) -> GenerationChunk:
    finish = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower() if msg.finish_reason else None
    return GenerationChunk(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        finish_reason=finish,
        prompt_tokens=msg.usage.prompt_tokens,
        completion_tokens=msg.usage.completion_tokens,
        matched_stop=msg.matched_stop,
        ttft_seconds=msg.timings.time_to_first_token_seconds,
        index=msg.index,
        logprobs=[TokenLogprob(x.token_id, x.text, x.logprob, [(t.token_id, t.text, t.logprob) for t in x.top_logprobs]) for x in msg.logprobs],
    )


def by_choice(chunks) -> list[Generation]:
    """The chunks of an n-choice generation, joined per choice, in index order."""
    choices: dict[int, Generation] = {}
    for chunk in chunks:
        choices.setdefault(chunk.index, Generation()).add(chunk)
    return [choices[i] for i in sorted(choices)]


def _credentials(tls_ca: str | bytes | None) -> grpc.ChannelCredentials | None:
    if tls_ca is None:
        return None
    root = tls_ca if isinstance(tls_ca, bytes) else open(tls_ca, "rb").read()
    return grpc.ssl_channel_credentials(root_certificates=root)


def _metadata(token: str | None) -> tuple | None:
    return (("authorization", f"Bearer {token}"),) if token else None


class Client:
    """tls_ca: the CA (path or PEM bytes) of a router serving TLS; token: its bearer token."""

    def __init__(self, address: str = "127.0.0.1:50050", timeout: float | None = None, tls_ca: str | bytes | None = None, token: str | None = None):
        credentials = _credentials(tls_ca)
        self._channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._metadata = _metadata(token)
        self.timeout = timeout

    def generate(self, prompt: str | None = None, **params) -> Iterator[GenerationChunk]:
        """Streams the generation; leaving the loop early cancels the request."""
        call = self._stub.Generate(build_request(prompt, **params), timeout=self.timeout, metadata=self._metadata)
        try:
            for message in call:
                yield chunk_from_pb(message)
        finally:
            call.cancel()

    def complete(self, prompt: str | None = None, **params) -> Generation:
        if params.get("n", 1) > 1:
            raise ValueError("complete() returns one choice: use choices() with n > 1")
        (result,) = self.choices(prompt, **params)
        return result

    def choices(self, prompt: str | None = None, **params) -> list[Generation]:
        """Every choice of the generation (n of them), in index order."""
        return by_choice(self.generate(prompt, **params))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._stub.Tokenize(request, timeout=self.timeout, metadata=self._metadata).token_ids)

    def model_info(self) -> pb.GetModelInfoResponse:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    def __init__(self, address: str = "127.0.0.1:50050", timeout: float | None = None, tls_ca: str | bytes | None = None, token: str | None = None):
        credentials = _credentials(tls_ca)
        self._channel = grpc.aio.secure_channel(address, credentials) if credentials else grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._metadata = _metadata(token)
        self.timeout = timeout

    async def generate(self, prompt: str | None = None, **params) -> AsyncIterator[GenerationChunk]:
        call = self._stub.Generate(build_request(prompt, **params), timeout=self.timeout, metadata=self._metadata)
        try:
            async for message in call:
                yield chunk_from_pb(message)
        finally:
            call.cancel()

    async def complete(self, prompt: str | None = None, **params) -> Generation:
        if params.get("n", 1) > 1:
            raise ValueError("complete() returns one choice: use choices() with n > 1")
        (result,) = await self.choices(prompt, **params)
        return result

    async def choices(self, prompt: str | None = None, **params) -> list[Generation]:
        """Every choice of the generation (n of them), in index order."""
        return by_choice([chunk async for chunk in self.generate(prompt, **params)])

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        response = await self._stub.Tokenize(request, timeout=self.timeout, metadata=self._metadata)
        return list(response.token_ids)

    async def model_info(self) -> pb.GetModelInfoResponse:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

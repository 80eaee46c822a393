"""A small client for the OpenAI HTTP API, so `disagg bench --api openai` drives
any OpenAI-compatible server (our router's --http-port, vLLM, SGLang, ...) with
the same load generator and report as our gRPC API.

It offers the two calls the load generator makes on `disagg.clients.grpc_client.AsyncClient`:
`generate` streams `/v1/completions` (server-sent events) and yields chunks with
`token_ids`, and `tokenize` asks the server's `/tokenize` (a vLLM and SGLang
extension, not OpenAI's). The prompt goes as token ids (a list of ints as
`prompt`), greedy by default, with vLLM's `ignore_eos` so output lengths are
exact, and `return_token_ids` (vLLM) so each chunk names its tokens. A server
that does not return token ids is counted one token per chunk that carries
text, as OpenAI's own streams do; those tokens read as -1.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


class OpenAIError(Exception):
    """A request the server refused or broke off; `code` names it for the report (HTTP_503, UNAVAILABLE, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class CompletionChunk:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


def parse_chunk(payload: dict) -> CompletionChunk:
    """One `data:` event of a streaming completion (choice 0; the final usage-only event has none)."""
    if "error" in payload:
        error = payload["error"]
        raise OpenAIError("STREAM_ERROR", error.get("message", str(error)) if isinstance(error, dict) else str(error))
    if not payload.get("choices"):
        return CompletionChunk()
    choice = payload["choices"][0]
    text = choice.get("text") or ""
    ids = choice.get("token_ids")
    if ids is None:
        ids = [-1] if text else []
    return CompletionChunk(list(ids), text, choice.get("finish_reason"))


class OpenAIClient:
    """`async with OpenAIClient("http://127.0.0.1:8000") as client:` ... like AsyncClient."""

    def __init__(self, url: str, timeout: float | None = None, model: str | None = None, api_key: str | None = None):
        import httpx  # an extra (bench, test), not a core dependency: the load generator imports this module

        self._transport_error = httpx.HTTPError
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No cap on connections: the load generator sets the concurrency.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout, limits=limits, headers=headers)
        self.model = model

    async def served_model(self) -> str:
        """The `model` to name in requests: the one given, else the first the server lists."""
        if self.model is None:
            response = await self._request("GET", "/v1/models")
            self.model = response.json()["data"][0]["id"]
        return self.model

    async def generate(
        self, prompt_token_ids: list[int], max_new_tokens: int, ignore_eos: bool = True, temperature: float = 0.0
    ) -> AsyncIterator[CompletionChunk]:
        body = {
            "model": await self.served_model(),
            "prompt": list(prompt_token_ids),
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
            "stream": True,
        }
        try:
            async with self._http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise OpenAIError(f"HTTP_{response.status_code}", response.text[:500])
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event names
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    chunk = parse_chunk(json.loads(data))
                    if chunk.token_ids or chunk.finish_reason:
                        yield chunk
        except self._transport_error as exc:
            raise OpenAIError("UNAVAILABLE", repr(exc)) from exc

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = {"model": await self.served_model(), "prompt": text, "add_special_tokens": add_special_tokens}
        tokens = list((await self._request("POST", "/tokenize", json=body)).json()["tokens"])
        if not tokens and text:  # llama.cpp's server reads "content" (and "add_special"), and answers [] to the above
            body = {"content": text, "add_special": add_special_tokens}
            tokens = list((await self._request("POST", "/tokenize", json=body)).json()["tokens"])
        return tokens

    async def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except self._transport_error as exc:
            raise OpenAIError("UNAVAILABLE", repr(exc)) from exc
        if response.status_code != 200:
            raise OpenAIError(f"HTTP_{response.status_code}", response.text[:500])
        return response

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

"""The OpenAI-compatible routes: a thin edge like the gRPC servicer.

Each request converts to GenerateParams (convert.py), goes through the same
Router.prepare (validation, tokenization, chat template) and Router.generate
as a gRPC call, and converts back to OpenAI's shapes (responses.py). Nothing
is generated here and nothing blocks the event loop the gRPC server shares.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from disagg.rpc.server import RequestError

from . import errors
from .bodies import OffLoopJsonRoute
from .convert import chat_params, completion_params, echo_text, openai_param, split_prompts
from .responses import Choice, Envelope, TokenText, chat_logprobs, completion_logprobs, finish_reason, gather, total_usage, usage
from .schema import ChatCompletionRequest, CommonRequest, CompletionRequest, NamedToolChoice, TokenizeRequest
from .streams import MergedGenerations, RequestDeadline
from .token_bytes import TokenBytes
from .tools import ToolCallParser


@dataclass
class FrontState:
    """What the routes need from the router process."""

    router: Callable[[], object]  # the Router, or None while it waits for its workers
    draining: Callable[[], bool]  # true once SIGTERM started the drain
    auth_token: str | None
    model_path: str  # the --model the router was given: accepted as a name too (as vLLM serves it)
    max_body_bytes: int = 4 * 1024 * 1024  # larger bodies get 413 before they are read (limits.py)
    timeout_seconds: float = 600.0  # every request's deadline: nothing waits forever
    started: int = 0
    _token_bytes: TokenBytes | None = None

    def token_bytes(self, router) -> TokenBytes:
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(router.tokenizer)
        return self._token_bytes


class ClientGone(Exception):
    """The client closed its connection before the response was ready."""


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs on_close once the response ends, however
    it ends: Starlette cancels the sending task when the client disconnects and
    leaves the body iterator as it was, not closed."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._on_close()


async def _disconnected(request: Request) -> None:
    # The body has been read: the next message the server gives is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable):
    """awaitable's result; cancelled (and ClientGone raised) if the client leaves first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this wait is cancelled itself: the work never outlives it
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientGone()
    return work.result()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def create_app(state: FrontState) -> FastAPI:
    app = FastAPI(title="disagg OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = OffLoopJsonRoute  # before any route: large bodies are parsed on a thread (bodies.py)
    state.started = state.started or int(time.time())
    _add_error_handlers(app)
    auth = [Depends(_authorizer(state))]
    _add_info_routes(app, state, auth)
    _add_completion_routes(app, state, auth)
    _add_chat_routes(app, state, auth)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.HttpError)
    async def _http_error(_, exc: errors.HttpError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_, exc: RequestValidationError):
        return errors.validation_error(list(exc.errors())).response()

    @app.exception_handler(ClientGone)
    async def _client_gone(_, exc: ClientGone):
        return JSONResponse({}, status_code=499)  # no one reads it: the generation was cancelled

    @app.exception_handler(HTTPException)
    async def _starlette_error(_, exc: HTTPException):
        return errors.HttpError(exc.status_code, str(exc.detail), "invalid_request_error").response()


def _authorizer(state: FrontState):
    """The dependency every route but /health takes: the bearer token, when the router has one."""

    async def authorized(request: Request) -> None:  # async: FastAPI runs a sync dependency in a thread
        if state.auth_token is None:
            return
        given = request.headers.get("authorization")
        if given is None:
            raise errors.unauthorized("missing authorization header: send 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.auth_token}".encode()):
            raise errors.unauthorized("the API key (bearer token) is not valid")

    return authorized


def _serving(state: FrontState):
    router = state.router()
    if router is None:
        raise errors.unavailable("the router is waiting for its workers")
    if state.draining():
        raise errors.unavailable("server is shutting down")
    return router


def _check_model(state: FrontState, router, body) -> None:
    if body.model is not None and body.model not in {router.facts.name, state.model_path}:
        raise errors.model_not_found(body.model)


async def _prepare(router, make_params, body: CommonRequest, deadline: RequestDeadline):
    """make_params() -> the GenerateParams list, validated and tokenized; a refusal is a 400 naming its parameter."""
    try:
        params = make_params()
        _check_queue_room(router, len(params), body)
        return [await deadline.bound(router.prepare(p)) for p in params]
    except RequestError as exc:
        raise errors.HttpError.from_status(exc.code, str(exc), openai_param(exc.field, body), exc.field) from exc


def _check_queue_room(router, prompts: int, body: CommonRequest) -> None:
    """A batch of prompts times n choices is that many generations at once: more than
    the router may queue could never be admitted whole (400, naming n, or prompt when n is 1)."""
    generations, room = prompts * body.n, router.config.max_queue
    if generations > room:
        field = "n" if body.n > 1 else "prompt"
        message = (
            f"{field} makes {generations} generations ({prompts} prompts times n={body.n}); "
            f"the router queues at most {room} (--max-queue)"
        )
        raise RequestError(message, field=field)


async def _started(request: Request, router, prepared, n: int, deadline: RequestDeadline) -> MergedGenerations:
    merged = MergedGenerations(router, [(r, i * n) for i, r in enumerate(prepared)], deadline)
    try:
        await unless_disconnected(request, merged.start())
    except RequestError as exc:
        await merged.aclose()
        raise errors.HttpError.from_status(exc.code, str(exc)) from exc
    except BaseException:
        await merged.aclose()
        raise
    return merged


async def _collected(request: Request, merged: MergedGenerations) -> dict[int, Choice]:
    async def collect():
        choices: dict[int, Choice] = {}
        async for tagged in merged:
            gather(choices, tagged)
        return choices

    try:
        return await unless_disconnected(request, collect())
    except RequestError as exc:
        raise errors.HttpError.from_status(exc.code, str(exc)) from exc
    finally:
        await merged.aclose()


def _check_stream_options(body: CommonRequest) -> bool:
    if body.stream_options is not None and not body.stream:
        raise errors.bad_request("stream_options is only allowed when stream is true", "stream_options")
    return bool(body.stream_options and body.stream_options.include_usage)


def _add_info_routes(app: FastAPI, state: FrontState, auth: list) -> None:
    """/health, /v1/models and /tokenize: what a client asks before it generates."""

    @app.get("/health")
    async def health():
        _serving(state)
        return JSONResponse({})

    @app.get("/v1/models", dependencies=auth)
    async def models():
        router = _serving(state)
        card = {"id": router.facts.name, "object": "model", "created": state.started, "owned_by": "disagg", "max_model_len": router.facts.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest):
        router = _serving(state)
        _check_model(state, router, body)
        try:
            ids = await RequestDeadline(state.timeout_seconds).bound(router.tokenize(body.prompt, body.add_special_tokens))
        except RequestError as exc:
            raise errors.HttpError.from_status(exc.code, str(exc)) from exc
        return {"tokens": ids, "count": len(ids), "max_model_len": router.facts.max_seq_len}


def _add_completion_routes(app: FastAPI, state: FrontState, auth: list) -> None:
    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        router = _serving(state)
        _check_model(state, router, body)
        include_usage = _check_stream_options(body)
        if body.echo and body.logprobs is not None:
            raise errors.bad_request("echo with logprobs is not supported (it needs the prompt's logprobs)", "echo")
        deadline = RequestDeadline(state.timeout_seconds)
        envelope = Envelope(f"cmpl-{uuid.uuid4().hex}", router.facts.name, chat=False)
        prepared = await _prepare(router, lambda: completion_params(body, envelope.id), body, deadline)
        echoes = [echo_text(router.tokenizer, p) if body.echo else "" for p in split_prompts(body.prompt)]
        merged = await _started(request, router, prepared, body.n, deadline)
        if body.stream:
            events = completion_events(merged, envelope, body, router.token_text, echoes, include_usage)
            return ClosingStreamingResponse(events, merged.aclose, media_type="text/event-stream")
        choices = await _collected(request, merged)
        out = _completion_choices(choices, body, router.token_text, echoes)
        return {**envelope.head(streamed=False), "choices": out, "usage": total_usage(choices, body.n)}


def _completion_choices(choices: dict[int, Choice], body: CompletionRequest, text_of: TokenText, echoes: list[str]) -> list[dict]:
    out = []
    for index, choice in sorted(choices.items()):
        echo = echoes[index // body.n]
        item = {"index": index, "text": echo + choice.text, "logprobs": None, "finish_reason": finish_reason(choice.finish)}
        if body.logprobs is not None:
            item["logprobs"] = completion_logprobs(choice.logprobs, text_of, 0)
        if body.return_token_ids:
            item["token_ids"] = choice.token_ids
        out.append(item)
    return out


def _add_chat_routes(app: FastAPI, state: FrontState, auth: list) -> None:
    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        router = _serving(state)
        _check_model(state, router, body)
        include_usage = _check_stream_options(body)
        deadline = RequestDeadline(state.timeout_seconds)
        envelope = Envelope(f"chatcmpl-{uuid.uuid4().hex}", router.facts.name, chat=True)
        prepared = await _prepare(router, lambda: [chat_params(body, envelope.id)], body, deadline)
        merged = await _started(request, router, prepared, body.n, deadline)
        if body.stream:
            events = chat_events(merged, envelope, body, router.token_text, state.token_bytes(router), include_usage)
            return ClosingStreamingResponse(events, merged.aclose, media_type="text/event-stream")
        choices = await _collected(request, merged)
        out = _chat_choices(choices, body, router.token_text, state.token_bytes(router))
        return {**envelope.head(streamed=False), "choices": out, "usage": total_usage(choices, body.n)}


def tool_parser(body: ChatCompletionRequest) -> ToolCallParser | None:
    """A parser of the model's tool calls where the request lets it call tools (router/http/tools.py)."""
    if not body.tools or body.tool_choice == "none":
        return None
    return ToolCallParser(frozenset(t.function.name for t in body.tools), llama3_json=body.tool_choice in (None, "auto"))


def tool_finish(body: ChatCompletionRequest, parser: ToolCallParser | None, finish) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model called (a named tool_choice ends with "stop", as OpenAI's)."""
    reason = finish_reason(finish)
    if reason == "stop" and parser is not None and parser.calls and not isinstance(body.tool_choice, NamedToolChoice):
        return "tool_calls"
    return reason


def _chat_choices(choices: dict[int, Choice], body: ChatCompletionRequest, text_of: TokenText, bytes_of: TokenBytes) -> list[dict]:
    out = []
    for index, choice in sorted(choices.items()):
        message = {"role": "assistant", "content": choice.text}
        parser = tool_parser(body)
        if parser is not None:
            content = "".join(delta.get("content", "") for delta in parser.feed(choice.text, final=True))
            message = {"role": "assistant", "content": content or None, "tool_calls": parser.tool_calls()} if parser.calls else message
        item = {"index": index, "message": message, "logprobs": None, "finish_reason": tool_finish(body, parser, choice.finish)}
        if body.logprobs:
            item["logprobs"] = chat_logprobs(choice.logprobs, text_of, bytes_of)
        out.append(item)
    return out


class StreamUsage:
    """Counts for the final usage chunk of a stream."""

    def __init__(self, n: int):
        self.n, self.prompt, self.completion = n, 0, 0

    def add(self, index: int, chunk) -> None:
        if chunk.finish:
            self.prompt += chunk.prompt_tokens if index % self.n == 0 else 0
            self.completion += chunk.completion_tokens


def _error_event(exc: RequestError) -> str:
    return sse(errors.HttpError.from_status(exc.code, str(exc)).body())


async def completion_events(merged, envelope: Envelope, body: CompletionRequest, text_of: TokenText, echoes: list[str], include_usage: bool):
    counts, offsets = StreamUsage(body.n), {}
    try:
        async for tagged in merged:
            chunk, index = tagged.chunk, tagged.index
            text = chunk.text
            if index not in offsets:  # the choice's first chunk
                text = echoes[index // body.n] + text
                offsets[index] = 0
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason(chunk.finish)}
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(chunk.logprobs or [], text_of, offsets[index])
            if body.return_token_ids:
                choice["token_ids"] = chunk.token_ids
            offsets[index] += len(text)
            counts.add(index, chunk)
            yield sse({**envelope.head(streamed=True), "choices": [choice], **({"usage": None} if include_usage else {})})
        if include_usage:
            yield sse({**envelope.head(streamed=True), "choices": [], "usage": usage(counts.prompt, counts.completion)})
    except RequestError as exc:
        yield _error_event(exc)
    yield SSE_DONE


async def chat_events(merged, envelope: Envelope, body: ChatCompletionRequest, text_of: TokenText, bytes_of: TokenBytes, include_usage: bool):
    counts = StreamUsage(body.n)
    extra = {"usage": None} if include_usage else {}
    head = envelope.head(streamed=True)
    parsers = [tool_parser(body) for _ in range(body.n)]
    for index in range(body.n):  # OpenAI opens each choice with its role
        yield sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], **extra})
    try:
        async for tagged in merged:
            chunk, index = tagged.chunk, tagged.index
            parser = parsers[index]
            if parser is None:
                deltas = [{"content": chunk.text}] if chunk.text or not chunk.finish else []
            else:  # the tool calls' deltas, and the content around them (router/http/tools.py)
                deltas = parser.feed(chunk.text, final=bool(chunk.finish))
            counts.add(index, chunk)
            for delta in deltas[:-1]:
                yield sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}], **extra})
            last = deltas[-1] if deltas else {}
            if last or chunk.finish or body.logprobs:
                choice = {"index": index, "delta": last, "logprobs": None, "finish_reason": tool_finish(body, parser, chunk.finish)}
                if body.logprobs:
                    choice["logprobs"] = chat_logprobs(chunk.logprobs or [], text_of, bytes_of)
                yield sse({**head, "choices": [choice], **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(counts.prompt, counts.completion)})
    except RequestError as exc:
        yield _error_event(exc)
    yield SSE_DONE

"""The router's public gRPC edge: the GenerationService servicer, and its messages <-> the router's edge-neutral types.

Protobuf stops here: GenerateRequest -> GenerateParams on the way in (proto3
defaults read as "not given" where the API says so), Chunk -> GenerateResponse
on the way out.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from disagg.engine.constraints import Constraint, ConstraintKind
from disagg.engine.constraints.spec import choice
from disagg.engine.requests import TokenLogprobs
from disagg.rpc.server import RequestError, check_parsed
from disagg.v1 import generation_pb2 as pb

from .coalesce import coalesced
from .core import Router
from .lifecycle import Chunk
from .params import GenerateParams

SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"]


def params_from_pb(message: pb.GenerateRequest) -> GenerateParams:
    """Raises RequestError for a message that did not parse."""
    check_parsed(message)
    s, t = message.sampling, message.stopping
    return GenerateParams(
        request_id=message.request_id,
        prompt=message.prompt or None,
        prompt_token_ids=tuple(message.prompt_token_ids) or None,
        messages=tuple((m.role, m.content) for m in message.messages) or None,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else None,
        min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        max_new_tokens=t.max_new_tokens or None,
        stop=tuple(t.stop),
        stop_token_ids=tuple(t.stop_token_ids),
        ignore_eos=t.ignore_eos,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        n=message.n or 1,
        constraint=constraint_from_pb(message),
    )


def constraint_from_pb(message: pb.GenerateRequest) -> Constraint | None:
    which = message.WhichOneof("constraint")
    if which is None:
        return None
    if which == "json_object":
        if not message.json_object:
            raise RequestError("constraint.json_object must be true when set", field="constraint.json_object")
        return Constraint(ConstraintKind.JSON_OBJECT)
    if which == "choice":
        return choice(list(message.choice.choices))
    kind = {"json_schema": ConstraintKind.JSON_SCHEMA, "regex": ConstraintKind.REGEX, "grammar": ConstraintKind.GRAMMAR}[which]
    return Constraint(kind, getattr(message, which))


def logprob_to_pb(logprobs: TokenLogprobs, token_text: Callable[[int], str]) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=t, text=token_text(t), logprob=v) for t, v in logprobs.top]
    return pb.TokenLogprob(token_id=logprobs.token_id, text=token_text(logprobs.token_id), logprob=logprobs.logprob, top_logprobs=top)


def chunk_to_pb(chunk: Chunk, request_id: str, token_text: Callable[[int], str]) -> pb.GenerateResponse:
    """token_text: a token id decoded alone, to name the tokens of logprobs."""
    response = pb.GenerateResponse(request_id=request_id, token_ids=chunk.token_ids, text=chunk.text, finish_reason=int(chunk.finish), index=chunk.index)
    if chunk.logprobs:
        response.logprobs.extend(logprob_to_pb(x, token_text) for x in chunk.logprobs)
    if chunk.finish:
        response.usage.prompt_tokens = chunk.prompt_tokens
        response.usage.completion_tokens = chunk.completion_tokens
        response.matched_stop = chunk.matched_stop
        response.timings.queue_seconds = chunk.queue_seconds
        response.timings.time_to_first_token_seconds = chunk.ttft_seconds
        response.timings.total_seconds = chunk.total_seconds
    return response


class GenerationServicer:
    def __init__(self):
        self.router: Router | None = None  # set once the workers are ready

    async def _ready(self, context) -> Router:
        if self.router is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router is waiting for its workers")
        return self.router

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        router = await self._ready(context)
        try:
            generation = await router.prepare(params_from_pb(request))
            async for chunk in coalesced(router.generate(generation, context.time_remaining())):
                yield chunk_to_pb(chunk, generation.request_id, router.token_text)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        router = await self._ready(context)
        try:
            check_parsed(request)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
        ids = await router.tokenize(request.text, request.add_special_tokens)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        router = await self._ready(context)
        facts, limits = router.facts, router.config.limits
        return pb.GetModelInfoResponse(
            model_name=facts.name,
            max_seq_len=facts.max_seq_len,
            vocab_size=facts.vocab_size,
            eos_token_ids=facts.eos_token_ids,
            default_max_new_tokens=limits.default_max_new_tokens,
            max_new_tokens_cap=limits.max_new_tokens_cap,
            backend=facts.backend,
            dtype=facts.dtype,
            prefill_workers=sum(w.healthy for w in router.pool.prefill),
            decode_workers=sum(w.healthy for w in router.pool.decode),
        )

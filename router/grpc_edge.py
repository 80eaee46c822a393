"""The public gRPC API's messages <-> the router's edge-neutral types.

Protobuf stops here: GenerateRequest -> GenerateParams on the way in (proto3
defaults read as "not given" where the API says so), Chunk -> GenerateResponse
on the way out.
"""

from __future__ import annotations

from collections.abc import Callable

from disagg.engine.requests import TokenLogprobs
from disagg.rpc import check_parsed
from disagg.v1 import generation_pb2 as pb

from .lifecycle import Chunk
from .params import GenerateParams


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
    )


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

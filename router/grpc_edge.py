"""The public gRPC API's messages <-> the router's edge-neutral types.

Protobuf stops here: GenerateRequest -> GenerateParams on the way in (proto3
defaults read as "not given" where the API says so), Chunk -> GenerateResponse
on the way out.
"""

from __future__ import annotations

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
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else None,
        seed=s.seed if s.HasField("seed") else None,
        max_new_tokens=t.max_new_tokens or None,
        stop=tuple(t.stop),
        stop_token_ids=tuple(t.stop_token_ids),
        ignore_eos=t.ignore_eos,
    )


def chunk_to_pb(chunk: Chunk, request_id: str) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=request_id, token_ids=chunk.token_ids, text=chunk.text, finish_reason=int(chunk.finish))
    if chunk.finish:
        response.usage.prompt_tokens = chunk.prompt_tokens
        response.usage.completion_tokens = chunk.completion_tokens
        response.matched_stop = chunk.matched_stop
        response.timings.queue_seconds = chunk.queue_seconds
        response.timings.time_to_first_token_seconds = chunk.ttft_seconds
        response.timings.total_seconds = chunk.total_seconds
    return response

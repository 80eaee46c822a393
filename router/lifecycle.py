"""One request's path through the workers: decode slot, prefill, first token, decode stream.

Every worker call is opened inside an AsyncExitStack, so whatever ends the
request (a stop, an error, a client cancel or deadline) cancels every call
still open, and each worker frees what it held for the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from disagg import wire
from disagg.engine.requests import FinishReason, token_finish
from disagg.rpc import RequestError
from disagg.v1 import worker_pb2 as wpb

from .detokenizer import IncrementalDetokenizer, StopSequenceMatcher
from .validation import GenerationRequest, ModelFacts
from .workers import Worker, WorkerPool

# How long to wait before asking again when a decode worker refuses a slot that
# the router counted as free (it is still retiring the previous request's slot).
SLOT_RETRY_SECONDS = 0.005


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish: FinishReason = FinishReason.NONE
    matched_stop: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0


class TextAssembler:
    """Tokens -> text deltas for one request, with stop sequences and counts."""

    def __init__(self, tokenizer, request: GenerationRequest):
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_ids)
        self._stops = StopSequenceMatcher(list(request.stop_sequences))
        self.completion_tokens = 0

    def add(self, token_ids: list[int], finish: FinishReason) -> Chunk:
        self.completion_tokens += len(token_ids)
        text = self._detokenizer.add(token_ids)
        if finish is not FinishReason.NONE:
            text += self._detokenizer.flush()
        text, matched = self._stops.feed(text)
        if matched is not None:
            return Chunk(token_ids, text, FinishReason.STOP_SEQUENCE, matched)
        if finish is not FinishReason.NONE:
            text += self._stops.flush()
        return Chunk(token_ids, text, finish)


def worker_failure(worker: Worker, exc: grpc.aio.AioRpcError) -> RequestError:
    code = exc.code()
    if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return RequestError(f"{worker.role} worker {worker.address}: {exc.details()}", code)
    return RequestError(f"{worker.role} worker {worker.address} failed: {code.name}: {exc.details()}", grpc.StatusCode.UNAVAILABLE)


class DecodeLease:
    """An open Decode stream: it holds the reserved slot until closed."""

    def __init__(self, pool: WorkerPool, worker: Worker, call, reservation_id: str):
        self.pool, self.worker, self.call, self.reservation_id = pool, worker, call, reservation_id

    async def tokens(self) -> AsyncIterator[tuple[list[int], FinishReason]]:
        # read() throughout: grpc.aio forbids mixing read() and iteration on one call.
        while True:
            try:
                event = await self.call.read()
            except grpc.aio.AioRpcError as exc:
                raise worker_failure(self.worker, exc) from exc
            if event is grpc.aio.EOF:
                raise RequestError(f"decode worker {self.worker.address} ended the stream without finishing", grpc.StatusCode.UNAVAILABLE)
            yield list(event.tokens.token_ids), wire.finish_from_pb(event.tokens.finish)

    async def close(self) -> None:
        self.call.cancel()
        self.pool.release_decode(self.worker)


class Lifecycle:
    def __init__(self, pool: WorkerPool, tokenizer, facts: ModelFacts):
        self.pool = pool
        self.tokenizer = tokenizer
        self.facts = facts

    async def run(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        text = TextAssembler(self.tokenizer, request)
        async with contextlib.AsyncExitStack() as calls:
            lease = None
            if request.max_new_tokens > 1:  # a single token needs no decode worker
                lease = await self._reserve_decode(request)
                calls.push_async_callback(lease.close)
            queued = time.perf_counter() - started
            prefill = self._start_prefill(request, lease)
            calls.callback(prefill.cancel)
            first = await self._first_token(prefill)
            ttft = time.perf_counter() - started
            finish = token_finish(first, 1, len(request.prompt_ids) + 1, request.stopping, self.facts.max_seq_len)
            chunk = text.add([first], finish)
            if chunk.finish is FinishReason.NONE:
                yield chunk
                async for token_ids, finish in lease.tokens():
                    chunk = text.add(token_ids, finish)
                    if chunk.finish is not FinishReason.NONE:
                        break
                    if chunk.token_ids or chunk.text:
                        yield chunk
            chunk.prompt_tokens = len(request.prompt_ids)
            chunk.completion_tokens = text.completion_tokens
            chunk.queue_seconds, chunk.ttft_seconds, chunk.total_seconds = queued, ttft, time.perf_counter() - started
            yield chunk

    async def _reserve_decode(self, request: GenerationRequest) -> DecodeLease:
        decode_request = wpb.DecodeRequest(
            request_id=request.request_id,
            prompt_len=len(request.prompt_ids),
            sampling=wire.sampling_to_pb(request.sampling),
            stopping=wire.stopping_to_pb(request.stopping),
        )
        while True:
            worker = await self.pool.acquire_decode()
            call = worker.stub.Decode(decode_request)
            try:
                event = await call.read()
                return DecodeLease(self.pool, worker, call, event.reserved.reservation_id)
            except grpc.aio.AioRpcError as exc:
                self.pool.release_decode(worker)
                if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise worker_failure(worker, exc) from exc
            except BaseException:
                call.cancel()
                self.pool.release_decode(worker)
                raise
            await asyncio.sleep(SLOT_RETRY_SECONDS)

    def _start_prefill(self, request: GenerationRequest, lease: DecodeLease | None) -> "PrefillCall":
        worker = self.pool.pick_prefill()
        target = wpb.KvTarget(address=lease.worker.address, reservation_id=lease.reservation_id) if lease else None
        message = wpb.PrefillRequest(request_id=request.request_id, token_ids=request.prompt_ids, sampling=wire.sampling_to_pb(request.sampling), kv_target=target)
        worker.outstanding += 1
        return PrefillCall(worker, worker.stub.Prefill(message))

    async def _first_token(self, prefill: "PrefillCall") -> int:
        try:
            event = await prefill.call.read()
        except grpc.aio.AioRpcError as exc:
            raise worker_failure(prefill.worker, exc) from exc
        finally:
            prefill.worker.outstanding -= 1
        if event is grpc.aio.EOF or not event.HasField("first_token"):
            raise RequestError(f"prefill worker {prefill.worker.address} ended without a first token", grpc.StatusCode.UNAVAILABLE)
        return event.first_token.token_id


@dataclass
class PrefillCall:
    worker: Worker
    call: object  # the Prefill stream; its kv_sent event is not awaited: the decode stream shows a failed transfer

    def cancel(self) -> None:
        self.call.cancel()

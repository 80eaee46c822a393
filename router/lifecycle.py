"""One request's path through the workers: decode slot, prefill, first token, decode stream.

    attempt: reserve a decode slot -> prefill (retried on another prefill worker
             if one dies) -> first token -> KV delivery watched in the background
             -> tokens from the decode stream
    run:     attempts until the request finishes; when a decode worker fails,
             the next attempt prefills the prompt plus the tokens generated so
             far on another decode worker, so the stream goes on with no token
             lost or repeated (sampling counters carry over too); a decode step
             that failed the stream (INTERNAL) is resumed the same way on a
             decode worker that has not failed it, or ends the request when
             there is none

Every worker call is opened inside an AsyncExitStack, so whatever ends an
attempt (a stop, an error, a client cancel or deadline) cancels every call
still open, and each worker frees what it held for the request. Each call
carries what is left of the client's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

import grpc

from disagg.engine.requests import FinishReason, Stopping, TokenLogprobs, token_finish
from disagg.rpc import worker_messages
from disagg.rpc.metrics import RouterMetrics
from disagg.rpc.server import RequestError
from disagg.v1 import worker_pb2 as wpb

from .detokenizer import IncrementalDetokenizer, StopSequenceMatcher
from .prefix_index import RoutedPrompt
from .validation import GenerationRequest, ModelFacts
from .workers import NoWorkerAvailable, Worker, WorkerPool

log = logging.getLogger(__name__)

# How long to wait before asking again when a decode worker refuses a slot that
# the router counted as free (it is still retiring the previous request's slot).
SLOT_RETRY_SECONDS = 0.005
# Worker codes that mean "this worker, not the request": try elsewhere.
# A worker's call ending so means the worker went away, not the request: it moves to another worker.
# CANCELLED too: no worker cancels a call itself; a worker's server cancels the calls it still holds
# when it stops (a worker that lost its device drains and exits), and the router's own cancel of a
# call surfaces as asyncio's CancelledError, never as this status.
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED)
# What a worker stream yields: new token ids, the finish they bring, their logprobs when asked.
Tokens = tuple[list[int], FinishReason, list[TokenLogprobs] | None]


@dataclass
class Chunk:
    """New output of one choice: its tokens and text since the previous chunk; the last
    chunk of a choice carries its finish, usage and timings."""

    token_ids: list[int]
    text: str
    finish: FinishReason = FinishReason.NONE
    matched_stop: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    index: int = 0  # which of the request's n choices
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids entry, when asked


class TextAssembler:
    """Tokens -> text deltas for one request, with stop sequences and counts."""

    def __init__(self, tokenizer, request: GenerationRequest):
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_ids)
        self._stops = StopSequenceMatcher(list(request.stop_sequences))
        self.completion_tokens = 0

    def add(self, token_ids: list[int], finish: FinishReason, logprobs: list[TokenLogprobs] | None = None) -> Chunk:
        chunk = self._add(token_ids, finish)
        if logprobs is not None:
            chunk.logprobs = logprobs[: len(chunk.token_ids)]  # a stop sequence may have cut the tokens
        return chunk

    def _add(self, token_ids: list[int], finish: FinishReason) -> Chunk:
        if not self._stops.active:
            return self._add_run(token_ids, finish)
        # A stop sequence may end inside a run of several tokens: the tokens after
        # the one that completes it are neither returned nor counted.
        text = ""
        for i, token in enumerate(token_ids):
            last = i == len(token_ids) - 1
            chunk = self._add_run([token], finish if last else FinishReason.NONE)
            text += chunk.text
            if chunk.finish is FinishReason.STOP_SEQUENCE or last:
                return Chunk(token_ids[: i + 1], text, chunk.finish, chunk.matched_stop)
        return self._add_run([], finish)

    def _add_run(self, token_ids: list[int], finish: FinishReason) -> Chunk:
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


class WorkerLost(Exception):
    """A worker failed this request in a way another worker can make good."""

    def __init__(self, worker: Worker, detail: str, unreachable: bool = False):
        super().__init__(f"{worker.role} worker {worker.address}: {detail}")
        self.worker = worker
        self.unreachable = unreachable  # gone, rather than refusing this one request


class DecodeStepFailed(WorkerLost):
    """A decode worker's step failed this stream (INTERNAL): another decode worker may finish it."""

    def __init__(self, worker: Worker, error: RequestError):
        super().__init__(worker, str(error))
        self.error = error  # what the client gets where no other decode worker is left


def worker_failure(worker: Worker, exc: grpc.aio.AioRpcError) -> Exception:
    code = exc.code()
    if code in LOST:
        return WorkerLost(worker, f"{code.name}: {exc.details()}", unreachable=code is grpc.StatusCode.UNAVAILABLE)
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return RequestError(f"{worker.role} worker {worker.address}: {exc.details()}", code)
    return RequestError(f"{worker.role} worker {worker.address} failed: {code.name}: {exc.details()}", grpc.StatusCode.INTERNAL)


@dataclass
class Plan:
    """What one attempt asks of the workers: the request resumed after `done` tokens."""

    request: GenerationRequest
    done: list[int]  # tokens already streamed to the client

    @property
    def context_ids(self) -> list[int]:
        return self.request.prompt_ids + self.done

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.done)

    @property
    def stopping(self) -> Stopping:
        return replace(self.request.stopping, max_new_tokens=self.remaining)

    @property
    def routed(self) -> RoutedPrompt:
        """The prompt for cache-aware routing. A resumed attempt is routed by the prompt alone: the
        tokens generated since were never sent to a worker as a prompt, so no index holds them."""
        return RoutedPrompt(self.request.prompt_hashes, len(self.request.prompt_ids))


class Deadline:
    def __init__(self, seconds: float | None):
        self._at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        return None if self._at is None else max(0.001, self._at - time.monotonic())


class DecodeLease:
    """An open Decode stream: it holds the reserved slot until closed."""

    def __init__(self, pool: WorkerPool, worker: Worker, call, reservation_id: str, cached_tokens: int = 0):
        self.pool, self.worker, self.call, self.reservation_id = pool, worker, call, reservation_id
        self.cached_tokens = cached_tokens  # the prompt's leading tokens the decode worker holds already: no KV is sent for them
        self.error: Exception | None = None  # set when the KV delivery failed for good

    def fail(self, error: Exception) -> None:
        self.error = error
        self.call.cancel()

    async def tokens(self) -> AsyncIterator[Tokens]:
        # read() throughout: grpc.aio forbids mixing read() and iteration on one call.
        while True:
            try:
                event = await self.call.read()
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
                if self.error is not None:
                    raise self.error from None
                if isinstance(exc, asyncio.CancelledError):
                    raise
                failure = worker_failure(self.worker, exc)
                if exc.code() is grpc.StatusCode.INTERNAL:
                    failure = DecodeStepFailed(self.worker, failure)
                raise failure from exc
            if event is grpc.aio.EOF:
                raise self.error or WorkerLost(self.worker, "the stream ended without finishing")
            ids = list(event.tokens.token_ids)
            logprobs = [worker_messages.logprobs_from_pb(t, x) for t, x in zip(ids, event.tokens.logprobs)] if event.tokens.logprobs else None
            yield ids, worker_messages.finish_from_pb(event.tokens.finish), logprobs

    async def close(self) -> None:
        self.call.cancel()
        self.pool.release_decode(self.worker)


@dataclass
class PrefillCall:
    worker: Worker
    call: object  # the Prefill stream

    def cancel(self) -> None:
        self.call.cancel()


class Lifecycle:
    def __init__(self, pool: WorkerPool, tokenizer, facts: ModelFacts, metrics: RouterMetrics):
        self.pool = pool
        self.tokenizer = tokenizer
        self.facts = facts
        self.metrics = metrics

    async def run(self, request: GenerationRequest, timeout: float | None = None) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        deadline = Deadline(timeout)
        text = TextAssembler(self.tokenizer, request)
        done: list[int] = []
        timings = {"queue": 0.0, "ttft": 0.0}
        attempts_left = 2 * len(self.pool.decode) + 1
        last_token_at = None
        step_failed_on: set[str] = set()  # decode workers whose step failed this request: not asked again
        while True:
            try:
                async with contextlib.aclosing(self._attempt(Plan(request, list(done)), deadline, timings, started, frozenset(step_failed_on))) as tokens:
                    async for token_ids, finish, logprobs in tokens:
                        last_token_at = self._observe_tokens(len(token_ids), last_token_at, timings)
                        done += token_ids
                        chunk = text.add(token_ids, finish, logprobs)
                        if chunk.finish is not FinishReason.NONE:
                            chunk.prompt_tokens, chunk.completion_tokens = len(request.prompt_ids), text.completion_tokens
                            chunk.queue_seconds, chunk.ttft_seconds = timings["queue"], timings["ttft"]
                            chunk.total_seconds = time.perf_counter() - started
                            self.metrics.e2e.observe(chunk.total_seconds)
                            yield chunk
                            return
                        if chunk.token_ids or chunk.text:
                            yield chunk
            except WorkerLost as lost:
                if isinstance(lost, DecodeStepFailed):
                    step_failed_on.add(lost.worker.address)
                    if not self.pool.has_decode(avoid=step_failed_on):
                        raise lost.error from lost
                self.metrics.failovers.labels(lost.worker.role).inc()
                attempts_left -= 1
                if lost.unreachable:
                    self.pool.mark_unavailable(lost.worker)
                if attempts_left <= 0:
                    raise RequestError(f"gave up after repeated worker failures; last: {lost}", grpc.StatusCode.UNAVAILABLE) from lost
                log.warning("request %s: %s; resuming after %d tokens", request.request_id, lost, len(done))

    def _observe_tokens(self, count: int, last_token_at: float | None, timings: dict) -> float:
        now = time.perf_counter()
        self.metrics.tokens.inc(count)
        if last_token_at is None:
            self.metrics.queue.observe(timings["queue"])
            self.metrics.ttft.observe(timings["ttft"])
        elif count:
            gap = (now - last_token_at) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        return now

    async def _attempt(self, plan: Plan, deadline: Deadline, timings: dict, started: float, avoid: frozenset[str] = frozenset()) -> AsyncIterator[Tokens]:
        """Tokens of one attempt: the prefill's first token, then the decode stream's (on a decode worker not in avoid)."""
        async with contextlib.AsyncExitStack() as calls:
            lease = None
            if plan.remaining > 1:  # a single token needs no decode worker
                lease = await self._reserve_decode(plan, deadline, avoid)
                calls.push_async_callback(lease.close)
            if not plan.done:
                timings["queue"] = time.perf_counter() - started
            first, first_logprobs, prefill = await self._prefill(plan, lease, deadline, calls)
            if not plan.done:
                timings["ttft"] = time.perf_counter() - started
            seq_len = len(plan.context_ids) + 1
            finish = token_finish(first, 1, seq_len, plan.stopping, self.facts.max_seq_len)
            yield [first], finish, None if first_logprobs is None else [first_logprobs]
            if finish is not FinishReason.NONE:
                return
            delivery = asyncio.create_task(self._watch_delivery(prefill, plan, lease, deadline, calls))
            delivery.add_done_callback(lambda task: task.cancelled() or task.exception() is None or lease.fail(task.exception()))
            calls.callback(delivery.cancel)
            async for tokens in lease.tokens():
                yield tokens

    async def _reserve_decode(self, plan: Plan, deadline: Deadline, avoid: frozenset[str] = frozenset()) -> DecodeLease:
        message = wpb.DecodeRequest(
            request_id=plan.request.request_id,
            prompt_len=len(plan.context_ids),
            sampling=worker_messages.sampling_to_pb(plan.request.sampling),
            stopping=worker_messages.stopping_to_pb(plan.stopping),
            first_step=len(plan.done),
            # Penalties count the prompt and the tokens before this worker, and the prefix cache
            # names the prompt's blocks by them: the decode worker needs their ids.
            context_token_ids=plan.context_ids,
        )
        while True:
            worker = await self.pool.acquire_decode(avoid, plan.routed)
            call = worker.stub.Decode(message, timeout=deadline.remaining())
            try:
                event = await call.read()
                if event is grpc.aio.EOF:
                    raise WorkerLost(worker, "the stream ended before reserving a slot")
                return DecodeLease(self.pool, worker, call, event.reserved.reservation_id, event.reserved.cached_tokens)
            except grpc.aio.AioRpcError as exc:
                self.pool.release_decode(worker)
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    self.pool.mark_unavailable(worker)
                elif exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise worker_failure(worker, exc) from exc
            except BaseException:
                call.cancel()
                self.pool.release_decode(worker)
                raise
            await asyncio.sleep(SLOT_RETRY_SECONDS)

    def _start_prefill(self, plan: Plan, lease: DecodeLease | None, deadline: Deadline, exclude: set[str]) -> PrefillCall:
        worker = self.pool.pick_prefill(exclude, plan.routed)
        target = wpb.KvTarget(address=lease.worker.address, reservation_id=lease.reservation_id, token_start=lease.cached_tokens) if lease else None
        message = wpb.PrefillRequest(
            request_id=plan.request.request_id,
            token_ids=plan.context_ids,
            sampling=worker_messages.sampling_to_pb(plan.request.sampling),
            kv_target=target,
            first_step=len(plan.done),
        )
        return PrefillCall(worker, worker.stub.Prefill(message, timeout=deadline.remaining()))

    async def _prefill(
        self, plan: Plan, lease: DecodeLease | None, deadline: Deadline, calls, exclude: set[str] | None = None
    ) -> tuple[int, TokenLogprobs | None, PrefillCall]:
        """The first token, from the first prefill worker that lives to give it."""
        exclude = set() if exclude is None else exclude
        waited = False
        while True:
            try:
                prefill = self._start_prefill(plan, lease, deadline, exclude)
            except NoWorkerAvailable:
                # None up, or none left that has not failed this request: wait once for one to come
                # back (a restarted worker, which is worth another try even if it failed this request).
                if waited or not await self.pool.wait_for_worker("prefill"):
                    raise
                waited = True
                exclude.clear()
                continue
            calls.callback(prefill.cancel)
            prefill.worker.outstanding += 1
            try:
                event = await prefill.call.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise worker_failure(prefill.worker, exc) from exc
                self.pool.mark_unavailable(prefill.worker)
                exclude.add(prefill.worker.address)
                continue
            finally:
                prefill.worker.outstanding -= 1
            if event is grpc.aio.EOF or not event.HasField("first_token"):
                raise WorkerLost(prefill.worker, "ended without a first token")
            first = event.first_token
            logprobs = worker_messages.logprobs_from_pb(first.token_id, first.logprobs) if first.HasField("logprobs") else None
            return first.token_id, logprobs, prefill

    async def _watch_delivery(self, prefill: PrefillCall, plan: Plan, lease: DecodeLease, deadline: Deadline, calls) -> None:
        """Until the decode worker has the KV; a prefill worker that dies mid-transfer is replaced."""
        exclude: set[str] = set()
        while True:
            try:
                event = await prefill.call.read()
                if event is not grpc.aio.EOF and event.HasField("kv_sent"):
                    return
                raise WorkerLost(prefill.worker, "ended without confirming the KV transfer")
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.ABORTED:
                    raise WorkerLost(lease.worker, f"KV hand-off failed: {exc.details()}") from exc
                if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise worker_failure(prefill.worker, exc) from exc
            # The prefill worker went away mid-transfer: the reservation waits for
            # KV again, so another prefill worker sends it (its first token is the same).
            self.pool.mark_unavailable(prefill.worker)
            exclude.add(prefill.worker.address)
            _, _, prefill = await self._prefill(plan, lease, deadline, calls, exclude)

"""The prefill worker's request logic on the asyncio side; the model runs on one device thread.

A prefill that raises fails its request with INTERNAL naming the cause (the
router then cancels the decode reservation) and the next prefill runs. Failures
that repeat, or DeviceLost, drain the worker and end it non-zero
(disagg/engine/faults.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from disagg.engine.backends import Backend, PrefillResult
from disagg.engine.constraints.compiler import model_compiler
from disagg.engine.faults import TEST_FAIL_PREFILL_STEP, TEST_HOLD_KV_SEND, FailureStreak, describe, injected_hold, with_injected_faults
from disagg.engine.kv_blocks import BlockStats
from disagg.engine.requests import Sampling, TokenLogprobs, check_prompt_len, check_token_ids
from disagg.engine.threads import start_compute_thread
from disagg.kv_transport import open_fallible
from disagg.kv_transport.chunk_codec import KvCommit
from disagg.kv_transport.grpc_push import GrpcPushSender
from disagg.kv_transport.nixl_control import NixlPullSender, PeerHasNoNixl
from disagg.kv_transport.spans import KvSpan
from disagg.rpc import worker_messages
from disagg.rpc.metrics import PrefillMetrics, outcome_label
from disagg.rpc.security import open_channel
from disagg.rpc.server import RequestError

from .channels import MAX_KV_CHANNELS, ChannelCache
from .config import PrefillWorkerConfig
from .peers import DecodePeers
from .prefix_cache import PrefixCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvTarget:
    address: str
    reservation_id: str
    # The decode worker holds the prompt's tokens before this one (its prefix cache's
    # Reserved.cached_tokens): only the KV of [token_start, prompt_len) is sent.
    token_start: int = 0


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    prefill_seconds: float
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class KvSent:
    bytes: int
    seconds: float


@dataclass
class Prefilled:
    """A prefill's outcome on the device thread."""

    result: PrefillResult  # its layers: the computed tokens' K/V, from cached_tokens on
    spans: list[KvSpan]  # per layer, what the decode worker gets: tokens [token_start, prompt_len)
    cached_tokens: int  # the prompt's first tokens, taken from the prefix cache


class PrefillWorker:
    def __init__(self, backend: Backend, config: PrefillWorkerConfig, metrics: PrefillMetrics):
        self.backend = backend
        self.metrics = metrics
        self.config = config
        self.info = backend.info
        bind = config.bind_compute_threads and config.device == "cpu"
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device", initializer=start_compute_thread, initargs=(config.device_cpus, bind))
        self._prefill_step = with_injected_faults(backend.prefill, TEST_FAIL_PREFILL_STEP)  # read once, here; unset: the backend's own
        self._streak = FailureStreak()
        self.failure: str | None = None  # why the device stopped being trusted; the process then exits non-zero
        # KV goes only to the decode pool (--decode), over at most MAX_KV_CHANNELS idle channels.
        self._channels = ChannelCache(lambda address: open_channel(address, config.tls))
        self.peers = DecodePeers(config.decode_peers)
        self.peers.on_change = self._pool_changed
        self._refresher: asyncio.Task | None = None
        self.pending = 0  # prefills submitted and not finished (running one included)
        self.pending_tokens = 0  # their prompt tokens
        self.inflight_transfers = 0
        # How KV moves (disagg.kv_transport): pushed as a gRPC stream, or staged for the decode worker to pull through NIXL.
        self.push = GrpcPushSender(self._channel, metrics, config.kv_send_timeout, injected_hold(TEST_HOLD_KV_SEND))
        self.pull = None
        if config.kv_transport == "nixl":
            self.pull = open_fallible(lambda: NixlPullSender.open(
                backend.info, config.kv_staging_buffers, self._channel, metrics, config.kv_send_timeout, config.nixl_backend, config.device_cpus
            ), config)
        metrics.queued.set_function(lambda: self.pending)
        metrics.queued_tokens.set_function(lambda: self.pending_tokens)
        # Prompts' KV in blocks, so a prompt that starts with cached blocks computes only the rest.
        # Only the device thread touches it (and the metrics read its counts).
        self.prefix_cache = self._open_prefix_cache()
        # Constraints compile on threads of their own (the tokenizer's token table is built there now).
        self.constraints = model_compiler(config.model, self.info.vocab_size, self.info.eos_token_ids)
        self._cache_counted = BlockStats()  # the pool's counts already added to the metrics
        if self.prefix_cache is not None:
            pool = self.prefix_cache.pool
            metrics.cache_blocks.labels("used").set_function(lambda: pool.used_blocks)
            metrics.cache_blocks.labels("cached").set_function(lambda: pool.cached_blocks)
            metrics.cache_blocks.labels("free").set_function(lambda: pool.free_blocks)

    def _open_prefix_cache(self) -> PrefixCache | None:
        config, info = self.config, self.info
        if not config.prefix_caching or not config.prefix_cache_gib:
            log.info("prefix caching off (%s)", "--no-prefix-caching" if not config.prefix_caching else "--prefix-cache-gib 0")
            return None
        if info.backend == "neuron":
            log.info("prefix caching off: the neuron backend prefills whole prompts (NxDI's context encoding takes no cached prefix)")
            return None
        return PrefixCache.sized(info, getattr(self.backend, "device", "cpu"), config.prefix_cache_gib, config.block_size)

    async def start(self) -> None:
        """Resolves the decode pool, and keeps following it where DNS can change it; waits for the constraint
        tokenizer, whose build stops every thread of the process (compiler.wait_ready), before serving."""
        await asyncio.get_running_loop().run_in_executor(None, self.constraints.wait_ready)
        await self.peers.refresh()
        if self.peers.dynamic:
            self._refresher = asyncio.create_task(self.peers.refresh_forever())

    def _pool_changed(self, allowed: frozenset[str]) -> None:
        self._channels.capacity = max(MAX_KV_CHANNELS, len(allowed))
        self._channels.retain(allowed)

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        await self._channels.close()
        self._device.shutdown(wait=True)
        self.constraints.close()
        if self.pull is not None:
            self.pull.close()
        if self.failure is not None:  # non-zero, so the supervisor starts a fresh process on a fresh device
            raise SystemExit(f"prefill_worker: stopped serving: {self.failure}")

    def validate(self, token_ids: list[int], sampling: Sampling, target: KvTarget | None = None) -> None:
        if self.failure is not None:
            raise RequestError(f"prefill worker is stopping: {self.failure}", grpc.StatusCode.UNAVAILABLE)
        worker_messages.check_sampling(self.backend, sampling)
        # The server checked the order already (worker_messages.prefill_order_from_pb); in-process callers get the same rules.
        with worker_messages.worker_names():
            check_prompt_len("token_ids", len(token_ids), self.info.max_seq_len)
            check_token_ids("token_ids", token_ids, self.info.vocab_size)
        if target is not None:
            worker_messages.check_token_start(target.token_start, len(token_ids))

    async def prefill(self, token_ids: list[int], sampling: Sampling, target: KvTarget | None, first_step: int = 0,
                      timeout: float | None = None) -> AsyncIterator[FirstToken | KvSent]:
        """Yields the first token, then (with a target) the acknowledged transfer.

        timeout is what is left of the caller's deadline; the KV send inherits it.
        """
        self.validate(token_ids, sampling, target)
        bitmask = await self.first_bitmask(token_ids, sampling, first_step)
        if target is not None:  # before any device work: nothing is held by a refused target
            target = KvTarget(await self.peers.admit(target.address), target.reservation_id, target.token_start)
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue = asyncio.Queue()

        def on_span(layer: int, span: KvSpan) -> None:
            # Device thread: cut this layer while the next one computes.
            loop.call_soon_threadsafe(outbox.put_nowait, span.pieces(layer, self.config.kv_piece_bytes))

        pull = target is not None and self.pull is not None and self.pull.serves(target.address)
        sender = None
        if target is not None and not pull and self.config.streams_kv_during_prefill:
            sender = asyncio.create_task(self._push(target, outbox, timeout))
        started = time.perf_counter()
        self.pending += 1
        self.pending_tokens += len(token_ids)
        outcome = "cancelled"
        try:
            token_start = target.token_start if target is not None else len(token_ids)
            prefilled = await self._run_prefill(token_ids, sampling, on_span if target and not pull else None, first_step, token_start, bitmask)
            result = prefilled.result
            self.metrics.prefill.observe(time.perf_counter() - started)
            # Each path counts "ok" before its last event: the caller may close the call on
            # receiving it, which ends this generator at that yield.
            if target is None:
                outcome = "ok"
            yield FirstToken(result.first_token, time.perf_counter() - started, result.logprobs)
            if pull:
                sent_at = time.perf_counter()
                try:
                    sent = KvSent(await self._pull(target, prefilled, len(token_ids), timeout), time.perf_counter() - sent_at)
                    outcome = "ok"
                    yield sent
                    return
                except PeerHasNoNixl:
                    for layer, span in enumerate(prefilled.spans):
                        outbox.put_nowait(span.pieces(layer, self.config.kv_piece_bytes))
            if target is not None and sender is None:
                sender = asyncio.create_task(self._push(target, outbox, timeout))
            if sender is not None:
                outbox.put_nowait(KvCommit(result.first_token, len(token_ids), self.info.num_layers))
                sent_at = time.perf_counter()
                sent = KvSent(await sender, time.perf_counter() - sent_at)
                outcome = "ok"
                yield sent
        except RequestError as exc:
            outcome = outcome_label(exc.code)
            raise
        finally:
            self.metrics.requests.labels(outcome).inc()
            self.pending -= 1
            self.pending_tokens -= len(token_ids)
            if sender is not None and not sender.done():
                sender.cancel()  # the decode worker sees the broken transfer and frees the slot

    async def first_bitmask(self, token_ids: list[int], sampling: Sampling, first_step: int):
        """A constrained request's first-token mask, compiled off the event loop and the device thread
        (INVALID_ARGUMENT when it does not compile); None without a constraint."""
        if sampling.constraint is None:
            return None
        with worker_messages.worker_names():
            return await self.constraints.first_bitmask(sampling.constraint, token_ids[len(token_ids) - first_step :])

    async def _run_prefill(self, token_ids: list[int], sampling: Sampling, on_span, first_step: int, token_start: int, bitmask=None) -> Prefilled:
        """The prefill on the device thread; one that raises becomes INTERNAL naming the cause."""
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._device, self._prefill_on_device, token_ids, sampling, on_span, first_step, token_start, bitmask)
        except Exception as raised:
            exc = self.backend.device_error(raised)
            log.error("prefill of %d tokens failed: %s", len(token_ids), describe(exc), exc_info=raised)
            if self.failure is None and self._streak.failed(exc):
                self._stop_serving(self._streak.cause(exc, "prefills"))
            raise RequestError(f"prefill failed: {describe(exc)}", grpc.StatusCode.INTERNAL) from exc
        self._streak.succeeded()
        return result

    def _stop_serving(self, cause: str) -> None:
        """The device can no longer be trusted: drain as on SIGTERM (NOT_SERVING, new calls
        refused, the calls in flight end), then stop() exits non-zero."""
        self.failure = cause
        log.error("prefill worker failing: %s; draining, then exiting non-zero", cause)
        os.kill(os.getpid(), signal.SIGTERM)  # the one drain path: rpc.serve_until_signal

    def _prefill_on_device(self, token_ids: list[int], sampling: Sampling, on_span, first_step: int, token_start: int, bitmask=None) -> Prefilled:
        """Device thread: the prompt's cached prefix taken from the prefix cache, the rest
        prefilled, its new full blocks stored and published. on_span(layer, span) gets each
        layer's KV of tokens [token_start, prompt_len) as soon as it is computed: from the
        cached prefix where token_start is before its end, then the computed tokens."""
        cache = self.prefix_cache
        plan = cache.begin(token_ids) if cache is not None else None  # None: no cache, or no room for this prompt
        try:
            prefix_kv = cache.gather(plan) if plan is not None else None
            spans: list[KvSpan | None] = [None] * self.info.num_layers

            def on_layer(layer: int, keys, values) -> None:
                spans[layer] = KvSpan.of(token_start, None if prefix_kv is None else prefix_kv[layer], keys, values)
                if on_span is not None:
                    on_span(layer, spans[layer])

            with_prefix = {} if prefix_kv is None else {"prefix_kv": prefix_kv}
            if bitmask is not None:  # only a constrained request's: a backend without constraints refused it
                with_prefix["bitmask"] = bitmask
            result = self._prefill_step(token_ids, sampling, on_layer, first_step, **with_prefix)
            if plan is not None:  # only once the whole prompt ran: a failed prefill publishes nothing
                cache.store(plan, result.layers)
                cache.publish(plan)
        finally:
            if plan is not None:
                cache.release(plan)  # the blocks stay cached for the next prompt that starts alike
                self._count_cache()
        cached = 0 if prefix_kv is None else plan.prefix_len
        self.metrics.computed_tokens.inc(len(token_ids) - cached)
        for layer, span in enumerate(spans):  # a backend that did not hand every layer on
            if span is None:
                spans[layer] = KvSpan.of(token_start, None if prefix_kv is None else prefix_kv[layer], *result.layers[layer])
        return Prefilled(result, spans, cached)

    def _count_cache(self) -> None:
        stats, counted = self.prefix_cache.pool.stats, self._cache_counted
        self.metrics.cache_queried_tokens.inc(stats.queried_tokens - counted.queried_tokens)
        self.metrics.cache_hit_tokens.inc(stats.hit_tokens - counted.hit_tokens)
        self.metrics.cache_evictions.inc(stats.evictions - counted.evictions)
        self._cache_counted = dataclasses.replace(stats)

    async def _push(self, target: KvTarget, outbox: asyncio.Queue, timeout: float | None) -> int:
        self.inflight_transfers += 1
        self._channels.hold(target.address)
        try:
            return await self.push.send(target.address, target.reservation_id, outbox, timeout)
        finally:
            self._channels.release(target.address)
            self.inflight_transfers -= 1  # the pieces not sent are dropped with the outbox

    async def _pull(self, target: KvTarget, prefilled: Prefilled, prompt_len: int, timeout: float | None) -> int:
        self.inflight_transfers += 1
        self._channels.hold(target.address)
        try:
            return await self.pull.send(target.address, target.reservation_id, prefilled.spans, prefilled.result.first_token, timeout, prompt_len)
        finally:
            self._channels.release(target.address)
            self.inflight_transfers -= 1

    def _channel(self, address: str) -> grpc.aio.Channel:
        """The transports' channel_for: only a channel a send holds, to an admitted address."""
        return self._channels.get(address)

    def busy(self) -> bool:
        return self.pending > 0 or self.inflight_transfers > 0

    def load(self) -> dict:
        return {"capacity": 1, "queued": self.pending, "inflight_transfers": self.inflight_transfers}

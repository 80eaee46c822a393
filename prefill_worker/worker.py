"""The prefill worker's request logic on the asyncio side; the model runs on one device thread."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from disagg import wire
from disagg.engine.backends import Backend
from disagg.engine.kv_wire import KvCommit, KvKind, encode
from disagg.engine.requests import Sampling, TokenLogprobs
from disagg.flags import pin_this_thread
from disagg.metrics import PrefillMetrics, outcome_label
from disagg.rpc import RequestError
from disagg.security import open_channel
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

from .config import PrefillWorkerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvTarget:
    address: str
    reservation_id: str


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    prefill_seconds: float
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class KvSent:
    bytes: int
    seconds: float


class PrefillWorker:
    def __init__(self, backend: Backend, config: PrefillWorkerConfig, metrics: PrefillMetrics):
        self.backend = backend
        self.metrics = metrics
        self.config = config
        self.info = backend.info
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device", initializer=pin_this_thread, initargs=(config.device_cpus,))
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.pending = 0  # prefills submitted and not finished (running one included)
        self.inflight_transfers = 0
        self.nixl = open_nixl_source(backend.info, config.kv_staging_buffers) if config.kv_transport == "nixl" else None
        self._push_only: set[str] = set()  # decode workers that answered they have no NIXL transport
        # Free staging buffers; taken and given back on the event loop, so a cancelled request cannot lose one.
        self._staging: asyncio.Queue = asyncio.Queue()
        for buffer in self.nixl.buffers if self.nixl else ():
            self._staging.put_nowait(buffer)
        metrics.queued.set_function(lambda: self.pending)

    async def stop(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._device.shutdown(wait=True)

    def validate(self, token_ids: list[int], sampling: Sampling) -> None:
        wire.check_sampling(self.backend, sampling)
        if not token_ids:
            raise RequestError("token_ids is empty")
        if len(token_ids) >= self.info.max_seq_len:
            raise RequestError(f"token_ids has {len(token_ids)} tokens; the limit is {self.info.max_seq_len - 1}")
        bad = next((t for t in token_ids if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token_ids contains {bad}, outside the vocabulary [0, {self.info.vocab_size})")

    async def prefill(self, token_ids: list[int], sampling: Sampling, target: KvTarget | None, first_step: int = 0, timeout: float | None = None) -> AsyncIterator[FirstToken | KvSent]:
        """Yields the first token, then (with a target) the acknowledged transfer.

        timeout is what is left of the caller's deadline; the KV send inherits it.
        """
        self.validate(token_ids, sampling)
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue = asyncio.Queue()

        def on_layer(layer: int, keys, values) -> None:
            # Device thread: cut this layer while the next one computes.
            loop.call_soon_threadsafe(outbox.put_nowait, self._pieces(layer, keys, values))

        pull = target is not None and self.nixl is not None and target.address not in self._push_only
        sender = None
        if target is not None and not pull and self.config.streams_kv_during_prefill:
            sender = asyncio.create_task(self._send_kv(target, outbox, timeout))
        started = time.perf_counter()
        self.pending += 1
        outcome = "cancelled"
        try:
            result = await loop.run_in_executor(self._device, self.backend.prefill, token_ids, sampling, on_layer if target and not pull else None, first_step)
            self.metrics.prefill.observe(time.perf_counter() - started)
            yield FirstToken(result.first_token, time.perf_counter() - started, result.logprobs)
            if pull:
                sent_at = time.perf_counter()
                try:
                    yield KvSent(await self._pull_kv(target, result, len(token_ids), timeout), time.perf_counter() - sent_at)
                    outcome = "ok"
                    return
                except _PushInstead:
                    for layer, (keys, values) in enumerate(result.layers):
                        outbox.put_nowait(self._pieces(layer, keys, values))
            if target is not None and sender is None:
                sender = asyncio.create_task(self._send_kv(target, outbox, timeout))
            if sender is not None:
                outbox.put_nowait(KvCommit(result.first_token, len(token_ids), self.info.num_layers))
                sent_at = time.perf_counter()
                yield KvSent(await sender, time.perf_counter() - sent_at)
            outcome = "ok"
        except RequestError as exc:
            outcome = outcome_label(exc.code)
            raise
        finally:
            self.metrics.requests.labels(outcome).inc()
            self.pending -= 1
            if sender is not None and not sender.done():
                sender.cancel()  # the decode worker sees the broken transfer and frees the slot

    def _pieces(self, layer: int, keys, values) -> list:
        return encode(layer, KvKind.KEY, keys, self.config.kv_piece_bytes) + encode(layer, KvKind.VALUE, values, self.config.kv_piece_bytes)

    async def _send_kv(self, target: KvTarget, outbox: asyncio.Queue, timeout: float | None) -> int:
        push_kv = wire.push_kv_call(self._channel(target.address))

        async def chunks():
            first = True
            while True:
                item = await outbox.get()
                if isinstance(item, KvCommit):
                    yield wire.commit_bytes(item, target.reservation_id)
                    return
                for piece in item:
                    yield wire.piece_bytes(piece, target.reservation_id if first else "")
                    first = False

        self.inflight_transfers += 1
        try:
            limit = self.config.kv_send_timeout if timeout is None else min(timeout, self.config.kv_send_timeout)
            started = time.perf_counter()
            ack = await push_kv(chunks(), timeout=limit)
            self.metrics.kv_seconds.observe(time.perf_counter() - started)
            self.metrics.kv_bytes.inc(ack.bytes_received)
            return ack.bytes_received
        except grpc.aio.AioRpcError as exc:
            self.metrics.kv_failures.inc()
            # ABORTED tells the router this worker is fine: the hand-off failed
            # (the decode worker refused it or went away), so it re-plans the decode side.
            # The pieces not sent are dropped with the outbox.
            raise RequestError(f"KV transfer to {target.address} failed: {exc.code().name}: {exc.details()}", grpc.StatusCode.ABORTED) from exc
        finally:
            self.inflight_transfers -= 1

    async def _pull_kv(self, target: KvTarget, result, prompt_len: int, timeout: float | None) -> int:
        """NIXL: stages the KV in a registered buffer and asks the decode worker to read it."""
        loop = asyncio.get_running_loop()
        limit = self.config.kv_send_timeout if timeout is None else min(timeout, self.config.kv_send_timeout)
        buffer = await asyncio.wait_for(self._staging.get(), limit)
        log.debug("staging buffer %x for %s", buffer.address, target.reservation_id)
        self.inflight_transfers += 1
        try:
            await loop.run_in_executor(self._device, self._stage, buffer, result.layers)
            request = wpb.PullKvRequest(
                reservation_id=target.reservation_id,
                agent_name=self.nixl.name,
                agent_metadata=self.nixl.metadata,
                address=buffer.address,
                prompt_len=prompt_len,
                num_layers=self.info.num_layers,
                first_token=result.first_token,
            )
            started = time.perf_counter()
            ack = await wgrpc.DecodeServiceStub(self._channel(target.address)).PullKv(request, timeout=limit)
            self.metrics.kv_seconds.observe(time.perf_counter() - started)
            self.metrics.kv_bytes.inc(ack.bytes_received)
            return ack.bytes_received
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                log.info("decode worker %s has no NIXL transport: pushing KV over gRPC to it", target.address)
                self._push_only.add(target.address)
                raise _PushInstead from exc
            self.metrics.kv_failures.inc()
            log.warning("KV pull of %s by %s failed: %s: %s", target.reservation_id, target.address, exc.code().name, exc.details())
            raise RequestError(f"KV pull by {target.address} failed: {exc.code().name}: {exc.details()}", grpc.StatusCode.ABORTED) from exc
        finally:
            self.inflight_transfers -= 1
            log.debug("staging buffer %x free after %s", buffer.address, target.reservation_id)
            self._staging.put_nowait(buffer)  # the decode side reads before it answers: the buffer is free again

    def _stage(self, buffer, layers) -> None:
        for layer, (keys, values) in enumerate(layers):
            self.nixl.stage_layer(buffer, layer, keys, values)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self.config.tls)
        return self._channels[address]

    def busy(self) -> bool:
        return self.pending > 0 or self.inflight_transfers > 0

    def load(self) -> dict:
        return {"capacity": 1, "queued": self.pending, "inflight_transfers": self.inflight_transfers}


class _PushInstead(Exception):
    """The decode worker has no NIXL transport: send this request's KV over gRPC."""


def open_nixl_source(info, buffers: int):
    import torch

    from disagg.kv.layout import KvGeometry
    from disagg.kv.nixl_transport import NixlSource

    itemsize = torch.empty(0, dtype=getattr(torch, info.dtype)).element_size()
    geometry = KvGeometry(info.num_layers, info.kv_heads, info.head_dim, itemsize, info.max_seq_len)
    source = NixlSource(geometry, max_tokens=info.max_seq_len, buffers=buffers)
    log.info("KV transport: NIXL agent %s, %d staging buffers of %.1f MiB", source.name, buffers, geometry.prompt_bytes(info.max_seq_len) / 2**20)
    return source

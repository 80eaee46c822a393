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
from disagg.engine.requests import Sampling
from disagg.flags import pin_this_thread
from disagg.metrics import PrefillMetrics, outcome_label
from disagg.rpc import RequestError
from disagg.security import open_channel

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
        metrics.queued.set_function(lambda: self.pending)

    async def stop(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._device.shutdown(wait=True)

    def validate(self, token_ids: list[int]) -> None:
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
        self.validate(token_ids)
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue = asyncio.Queue()

        def on_layer(layer: int, keys, values) -> None:
            # Device thread: cut this layer while the next one computes.
            pieces = encode(layer, KvKind.KEY, keys, self.config.kv_piece_bytes) + encode(layer, KvKind.VALUE, values, self.config.kv_piece_bytes)
            loop.call_soon_threadsafe(outbox.put_nowait, pieces)

        sender = None
        if target is not None and self.config.streams_kv_during_prefill:
            sender = asyncio.create_task(self._send_kv(target, outbox, timeout))
        started = time.perf_counter()
        self.pending += 1
        outcome = "cancelled"
        try:
            result = await loop.run_in_executor(self._device, self.backend.prefill, token_ids, sampling, on_layer if target else None, first_step)
            self.metrics.prefill.observe(time.perf_counter() - started)
            yield FirstToken(result.first_token, time.perf_counter() - started)
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

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self.config.tls)
        return self._channels[address]

    def busy(self) -> bool:
        return self.pending > 0 or self.inflight_transfers > 0

    def load(self) -> dict:
        return {"capacity": 1, "queued": self.pending, "inflight_transfers": self.inflight_transfers}

"""The NIXL KV transport's control on gRPC (pull): the prefill worker stages a
prompt's KV in registered memory and calls the decode worker's PullKv, which
reads it straight into the reserved slot and then answers.

The bytes move through NIXL (`nixl_transport`); the reservation, the staging
address, the peer's agent metadata, the commit and the acknowledgement travel
on gRPC, so leases, cancellation and deadlines work as for the push.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc

from disagg.engine.threads import pin_this_thread
from disagg.rpc.server import RequestError
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

from .layout import KvGeometry

if TYPE_CHECKING:
    from .spans import KvSpan

log = logging.getLogger(__name__)

TRANSPORT = "nixl"


class PeerHasNoNixl(Exception):
    """The decode worker answered FAILED_PRECONDITION: it runs --kv-transport grpc."""


class NixlPullSender:
    """Prefill side: a pool of registered staging buffers, each lent to one prompt
    from staging until the decode worker has read it."""

    def __init__(self, source, channel_for, metrics, send_timeout: float, cpus: frozenset[int] | None = None):
        self.source = source  # nixl_transport.NixlSource
        # A finished prompt is staged on a thread of its own: on the model thread the copy
        # would queue behind every prefill submitted after the prompt, and its decode worker
        # would wait for all of them (the first of 8 concurrent 64-token prompts waited 2.3 s
        # for its second token). One thread: a reused buffer is written in order.
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-stage", initializer=pin_this_thread, initargs=(cpus,))
        self._channel_for = channel_for
        self.metrics = metrics
        self.send_timeout = send_timeout
        self.no_nixl: set[str] = set()  # decode workers that answered they have no NIXL transport
        # Free buffers, taken and given back on the event loop, so a cancelled request cannot lose one.
        self._free: asyncio.Queue = asyncio.Queue()
        for buffer in source.buffers:
            self._free.put_nowait(buffer)

    @classmethod
    def open(cls, info, buffers: int, channel_for, metrics, send_timeout: float, backend: str = "UCX", cpus: frozenset[int] | None = None) -> NixlPullSender:
        from .nixl_transport import NixlSource

        geometry = KvGeometry.of(info, info.max_seq_len)
        source = NixlSource(geometry, max_tokens=info.max_seq_len, buffers=buffers, backend=backend)
        log.info(
            "KV transport: NIXL agent %s (%s), %d staging buffers of %.1f MiB", source.name, backend, buffers, geometry.prompt_bytes(info.max_seq_len) / 2**20
        )
        return cls(source, channel_for, metrics, send_timeout, cpus)

    def close(self) -> None:
        self._stager.shutdown(wait=True)

    def serves(self, address: str) -> bool:
        return address not in self.no_nixl

    def limit(self, timeout: float | None) -> float:
        return self.send_timeout if timeout is None else min(timeout, self.send_timeout)

    async def send(self, address: str, reservation_id: str, spans: list[KvSpan], first_token: int, timeout: float | None, prompt_len: int | None = None) -> int:
        """Stages `spans` (per layer, the K/V of tokens [token_start, prompt_len), spans.KvSpan),
        compactly, asks the decode worker to read them, and returns the bytes it read.
        prompt_len: default, where the spans end."""
        prompt_len = spans[0].end if prompt_len is None else prompt_len
        limit = self.limit(timeout)
        try:
            buffer = await asyncio.wait_for(self._free.get(), limit)
        except asyncio.TimeoutError:  # TimeoutError itself from 3.11 on
            # Every buffer stayed lent for the whole deadline: a clear status, not an UNKNOWN.
            raise RequestError(f"no KV staging buffer came free within {limit:.1f}s", grpc.StatusCode.RESOURCE_EXHAUSTED) from None
        try:
            generation = await asyncio.get_running_loop().run_in_executor(self._stager, self._stage, buffer, spans)
            request = wpb.PullKvRequest(
                reservation_id=reservation_id,
                agent_name=self.source.name,
                agent_metadata=self.source.metadata,
                address=buffer.address,
                prompt_len=prompt_len,
                num_layers=len(spans),
                first_token=first_token,
                generation=generation,
                token_start=spans[0].start,
                kv_dtype=self.source.geometry.kv_dtype,
                scale_block=self.source.geometry.scale_block,
            )
            started = time.perf_counter()
            with self.source.reading():
                ack = await wgrpc.DecodeServiceStub(self._channel_for(address)).PullKv(request, timeout=limit)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                log.info("decode worker %s has no NIXL transport: pushing KV over gRPC to it", address)
                self.no_nixl.add(address)
                raise PeerHasNoNixl from exc
            self.metrics.kv_failures.labels(TRANSPORT).inc()
            log.warning("KV pull of %s by %s failed: %s: %s", reservation_id, address, exc.code().name, exc.details())
            # ABORTED: this worker is fine, the hand-off failed; the router re-plans the decode side.
            raise RequestError(f"KV pull by {address} failed: {exc.code().name}: {exc.details()}", grpc.StatusCode.ABORTED) from exc
        finally:
            # The decode worker reads before it answers, and a read still in flight when its
            # call is cancelled is released (cancelled) before that worker writes the slot again.
            self._free.put_nowait(buffer)
        self.metrics.kv_seconds.labels(TRANSPORT).observe(time.perf_counter() - started)
        self.metrics.kv_bytes.labels(TRANSPORT).inc(ack.bytes_received)
        return ack.bytes_received

    def _stage(self, buffer, spans: list[KvSpan]) -> int:
        generation = buffer.next_generation()  # before any byte of this prompt: see nixl_transport
        for layer, span in enumerate(spans):
            offset = 0
            for keys, values in zip(span.keys, span.values):  # [token_start, prompt_len), compact: the parts end to end
                self.source.stage_layer(buffer, layer, keys, values, span.tokens, offset)
                offset += keys.shape[1]
        return generation

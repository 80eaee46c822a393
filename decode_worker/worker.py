"""The decode worker's request logic, on the asyncio side: reservations, KV
receive, token streams. Protobuf stays in grpc_edge.py; the model stays in
the decode loop's threads."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from disagg.engine.backends import Backend
from disagg.engine.constraints.compiler import model_compiler
from disagg.engine.constraints.rows import RowMatcher
from disagg.engine.faults import (
    TEST_FAIL_DECODE_STEP,
    TEST_FAIL_KV_WRITE,
    TEST_HOLD_DECODE_STEP,
    DeviceLost,
    describe,
    with_injected_faults,
    with_injected_hold,
)
from disagg.engine.kv_blocks import BlockPool, block_hashes, blocks_for, cache_salt
from disagg.engine.quantization.kv_cache import code_dtype, kv_bytes
from disagg.engine.requests import FinishReason, InvalidField, Sampling, Stopping, check_prompt_len
from disagg.engine.slot_manager import Reservation, SlotManager, SlotState
from disagg.engine.speculation.rows import row_speculation
from disagg.kv_transport import open_fallible
from disagg.kv_transport.chunk_codec import KvChunkError, KvCommit, KvCoverage, KvKind, KvPiece, decode, wire_dtype
from disagg.kv_transport.nixl_transport import NixlTransferError
from disagg.rpc import worker_messages
from disagg.rpc.metrics import DecodeMetrics
from disagg.rpc.server import RequestError

from .config import DecodeWorkerConfig
from .decode_loop import DecodeLoop, Sequence, TokenEvent

log = logging.getLogger(__name__)

WRITES_IN_FLIGHT = 8


@dataclass
class DecodeStream:
    """One open Decode call: its reservation and the events bound for it."""

    reservation: Reservation
    sampling: Sampling
    stopping: Stopping
    first_step: int
    context_ids: tuple[int, ...] = ()  # the prompt_len ids behind the KV, when a penalty needs them
    matcher: RowMatcher | None = None  # a constrained request's, started from the tokens before this worker
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # TokenEvent | RequestError
    transferring: bool = False

    @property
    def key(self) -> str:
        return self.reservation.reservation_id


def _first_merged(waiting: list) -> tuple:
    """The first item, with the token events right behind it merged in; and the rest.

    An error is never merged: it is raised after the tokens that came before it.
    """
    first, rest = waiting[0], waiting[1:]
    while isinstance(first, TokenEvent) and first.finish is FinishReason.NONE and rest and isinstance(rest[0], TokenEvent):
        logprobs = None if first.logprobs is None else first.logprobs + (rest[0].logprobs or [])
        first = TokenEvent(first.key, first.token_ids + rest[0].token_ids, rest[0].finish, logprobs)
        rest = rest[1:]
    return first, rest


class DecodeWorker:
    def __init__(self, backend: Backend, config: DecodeWorkerConfig, metrics: DecodeMetrics, proposer=None):
        """proposer: speculation's draft model (disagg/engine/speculation/draft.py), where --speculative-method draft."""
        self.backend = backend
        self.metrics = metrics
        self.config = config
        self.info = backend.info
        self.blocks = BlockPool(config.num_blocks, config.block_size, caching=config.prefix_caching) if config.num_blocks else None
        self.slots = SlotManager(config.batch_size, blocks=self.blocks)
        self._salt = cache_salt(self.info.name, self.info.dtype, self.info.kv_cache_dtype)
        self._streams: dict[str, DecodeStream] = {}
        # One writer thread: KV writes land in submission order, so a write for a
        # released reservation always finishes before the slot's next owner writes.
        self._kv_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-writer")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failure: str | None = None  # why the device stopped being trusted; the process then exits non-zero
        step = with_injected_faults(backend.decode_step, TEST_FAIL_DECODE_STEP)  # read once, here; unset: the backend's step
        step = with_injected_hold(step, TEST_HOLD_DECODE_STEP)  # likewise
        self._write_kv = with_injected_faults(backend.write_kv, TEST_FAIL_KV_WRITE)  # likewise: the backend's write_kv
        self.decode_loop = DecodeLoop(
            backend, self._publish_threadsafe, self._retired_threadsafe, async_mode=config.async_mode, metrics=metrics,
            device_cpus=config.device_cpus, on_fatal=self._fatal_threadsafe, decode_step=step, speculation=config.speculation(),
            proposer=proposer,
        )
        metrics.slots_in_use.set_function(lambda: self.slots.num_slots - self.slots.free_slots)
        metrics.slots.set_function(lambda: self.slots.num_slots)
        if self.blocks is not None:
            metrics.watch_blocks(self.blocks)
        self._reaper: asyncio.Task | None = None
        self.nixl = None  # the NIXL sink, with --kv-transport nixl
        # Constraints compile on threads of their own (the tokenizer's token table is built there now).
        self.constraints = model_compiler(config.model, self.info.vocab_size, self.info.eos_token_ids)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        config = self.config
        cache_bytes = await self._loop.run_in_executor(
            None, self.backend.allocate_slots, config.batch_size, config.num_blocks, config.block_size if config.num_blocks else 0
        )
        if config.speculative_method is not None:  # the step the slots chose (over an 8-bit cache, the native one only)
            refuse_unless_scores_guesses(self.backend, "the model's")
        await self._loop.run_in_executor(None, self.constraints.wait_ready)  # before serving: its build stops every thread (compiler.wait_ready)
        if config.num_blocks:
            blocks, mib = config.num_blocks - 1, cache_bytes / 2**20
            log.info("KV cache: %d blocks x %d positions for %d sequences, %.1f MiB", blocks, config.block_size, config.batch_size, mib)
        else:
            log.info("slot cache: %d slots x %d positions, %.1f MiB", config.batch_size, self.info.max_seq_len, cache_bytes / 2**20)
        if self.config.kv_transport == "nixl":
            self.nixl = open_fallible(lambda: open_nixl_sink(self.backend, self._write_kv, self.config.nixl_backend), self.config)
        log.info("KV transport: %s", f"NIXL agent {self.nixl.agent.name}, slot cache registered" if self.nixl else "gRPC stream")
        self.decode_loop.start()
        self._reaper = asyncio.create_task(self._reap_expired_leases())

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.decode_loop.stop)
        self._kv_writer.shutdown(wait=True)
        self.constraints.close()
        if self.failure is not None:  # non-zero, so the supervisor starts a fresh process on a fresh device
            raise SystemExit(f"decode_worker: stopped serving: {self.failure}")

    # -- Decode stream -----------------------------------------------------
    def open_stream(
        self, request_id: str, prompt_len: int, sampling: Sampling, stopping: Stopping, first_step: int = 0, context_ids: tuple[int, ...] = (),
        matcher: RowMatcher | None = None,
    ) -> DecodeStream:
        """matcher: a constrained request's (row_matcher), which the caller starts first."""
        if self.failure is not None:
            raise RequestError(f"decode worker is stopping: {self.failure}", grpc.StatusCode.UNAVAILABLE)
        # The server checked the order already (worker_messages.decode_order_from_pb); in-process callers get the same rules.
        with worker_messages.worker_names():
            check_prompt_len("prompt_len", prompt_len, self.info.max_seq_len)
            if stopping.max_new_tokens < 1:
                raise InvalidField("stopping.max_new_tokens", f"must be at least 1, got {stopping.max_new_tokens}")
            worker_messages.checked_context(context_ids, prompt_len, sampling.needs_history, self.info.vocab_size)
            if (sampling.constraint is None) != (matcher is None):
                raise InvalidField("sampling.constraint", "needs its matcher (DecodeWorker.row_matcher)")
        worker_messages.check_sampling(self.backend, sampling)
        hashes, total_blocks = self._blocks_wanted(prompt_len, stopping, context_ids)
        if not self.slots.can_reserve(hashes, total_blocks):
            held = f"all {self.slots.num_slots} slots are in use"
            if self.blocks is not None and self.slots.free_slots:
                held = f"{total_blocks} KV blocks are needed and {self.blocks.available()} are free"
            raise RequestError(held, grpc.StatusCode.RESOURCE_EXHAUSTED)
        reservation = self.slots.reserve(request_id, prompt_len, self.config.lease_seconds, hashes, total_blocks)
        stream = DecodeStream(reservation, sampling, stopping, first_step, tuple(context_ids), matcher)
        self._streams[stream.key] = stream
        return stream

    async def row_matcher(self, sampling: Sampling, prompt_len: int, first_step: int, context_ids: tuple[int, ...]) -> RowMatcher | None:
        """A constrained request's matcher, compiled (or found cached) off the event loop and started
        from the tokens generated before this worker (the last first_step of the context); None without one."""
        if sampling.constraint is None:
            return None
        worker_messages.check_sampling(self.backend, sampling)
        with worker_messages.worker_names():
            worker_messages.checked_context(context_ids, prompt_len, True, self.info.vocab_size)
            return await self.constraints.row(sampling.constraint, context_ids[prompt_len - first_step :])

    def _blocks_wanted(self, prompt_len: int, stopping: Stopping, context_ids) -> tuple[list[bytes], int]:
        """(the prompt's full blocks' hashes, where its ids are known; the blocks the sequence can fill:
        its prompt and max_new_tokens, reserved up front so that it never outgrows the pool)."""
        if self.blocks is None:
            return [], 0
        longest = min(prompt_len + stopping.max_new_tokens, self.info.max_seq_len)
        hashes = block_hashes(list(context_ids), self.blocks.block_size, self._salt) if self.blocks.caching and context_ids else []
        return hashes, blocks_for(longest, self.blocks.block_size)

    async def events(self, stream: DecodeStream) -> AsyncIterator[TokenEvent]:
        """The stream's tokens; steps that queued up while the caller was writing come as one event."""
        waiting: list = []  # TokenEvent | RequestError, in arrival order
        while True:
            if not waiting:
                waiting.append(await stream.events.get())
            while not stream.events.empty():
                waiting.append(stream.events.get_nowait())
            event, waiting = _first_merged(waiting)
            if isinstance(event, Exception):
                raise event
            yield event
            if event.finish is not FinishReason.NONE:
                return

    def close_stream(self, stream: DecodeStream) -> None:
        """The Decode call ended (finished, cancelled or failed): free what it holds."""
        self._streams.pop(stream.key, None)
        reservation = self.slots.get(stream.key)
        if reservation is None:
            return
        if reservation.state is SlotState.ACTIVE:
            self.decode_loop.evict(stream.key)  # the slot is released when retired
        else:
            self.slots.release(stream.key)

    def _fail(self, key: str, error: RequestError) -> None:
        stream = self._streams.get(key)
        if stream is not None:
            stream.events.put_nowait(error)
        if self.slots.is_reserved(key):
            self.slots.release(key)

    # -- KV receive --------------------------------------------------------
    async def receive_kv(self, messages: AsyncIterator[tuple[str, KvPiece | KvCommit]]) -> int:
        """Consumes one transfer; returns the bytes received.

        A transfer that is refused or breaks leaves its reservation waiting for
        KV, so the router can send it again from another prefill worker; the
        lease still frees the slot if nothing complete arrives in time.
        """
        stream: DecodeStream | None = None  # set once this transfer owns a reservation
        received = 0
        started = time.perf_counter()
        # Each piece is copied into the cache on the writer thread while the next
        # one is read off the wire; at most WRITES_IN_FLIGHT pieces wait in memory.
        writes: collections.deque[asyncio.Future] = collections.deque()
        try:
            async for reservation_id, message in messages:
                if stream is None:
                    stream = self._begin_transfer(reservation_id)
                    coverage = KvCoverage(self.info.num_layers, stream.reservation.prompt_len, stream.reservation.cached_tokens)
                elif reservation_id and reservation_id != stream.key:
                    raise RequestError(f"reservation_id changed mid-transfer from {stream.key!r} to {reservation_id!r}")
                if isinstance(message, KvCommit):
                    while writes:
                        await writes.popleft()
                    self._commit(stream, coverage.missing(), message)
                    self._count_received("grpc", received, started)
                    return received
                writes.append(self._write_piece(stream, coverage, message))
                received += message.nbytes  # codes and scales, for an 8-bit KV
                if len(writes) >= WRITES_IN_FLIGHT:
                    await writes.popleft()
            raise RequestError("KV transfer ended without a commit", grpc.StatusCode.ABORTED)
        except BaseException as exc:
            raise self._transfer_failed(exc, "KV chunk refused", "grpc") from None
        finally:
            for write in writes:  # a broken transfer's copies still finish, in order, before any later owner's
                write.add_done_callback(lambda done: done.cancelled() or done.exception())
            if stream is not None:
                stream.transferring = False

    async def pull_kv(self, pull: KvPull, timeout: float | None) -> int:
        """NIXL: reads a staged prompt's KV straight into the reserved slot, then commits.

        The read runs on the KV writer thread, so it finishes before any later
        write into the same slot, whatever happens to the reservation meanwhile.
        """
        if self.nixl is None:
            raise RequestError("this decode worker has no NIXL transport (--kv-transport grpc)", grpc.StatusCode.FAILED_PRECONDITION)
        stream = self._begin_transfer(pull.reservation_id)
        started = time.perf_counter()
        try:
            reservation = stream.reservation
            if pull.prompt_len != reservation.prompt_len or pull.num_layers != self.info.num_layers:
                raise KvChunkError(
                    f"staged KV of {pull.prompt_len} tokens x {pull.num_layers} layers does not match the reservation"
                    f" ({reservation.prompt_len} x {self.info.num_layers})"
                )
            if pull.token_start != reservation.cached_tokens:  # the cached blocks are shared: nothing may write them
                raise KvChunkError(f"staged KV starts at token {pull.token_start}; this reservation needs tokens from {reservation.cached_tokens}")
            self._check_staged_dtype(pull)
            deadline = time.monotonic() + min(timeout or self.config.lease_seconds, self.config.lease_seconds)
            read = functools.partial(
                self.nixl.read_into, list(reservation.table), pull.agent_name, pull.agent_metadata, pull.address,
                pull.token_start, pull.prompt_len, pull.generation, deadline,
            )
            reading = self._loop.run_in_executor(self._kv_writer, read)
            try:
                received = await asyncio.shield(reading)
            except NixlTransferError as exc:
                raise RequestError(str(exc), grpc.StatusCode.ABORTED) from exc
            except asyncio.CancelledError:
                # The call ended (deadline, cancel) while the read goes on, as it must: see above.
                # Its end is still observed: a failure is logged once here; the transfer is counted
                # failed below, and the router resumes the request from another prefill.
                reading.add_done_callback(functools.partial(log_orphaned_read, pull.reservation_id, pull.agent_name))
                raise
            log.debug("pulled %d bytes for %s from %s", received, pull.reservation_id, pull.agent_name)
            self._commit(stream, [], KvCommit(pull.first_token, pull.prompt_len, pull.num_layers))
            self._count_received("nixl", received, started)
            return received
        except BaseException as exc:
            raise self._transfer_failed(exc, "KV pull refused", "nixl") from None
        finally:
            stream.transferring = False

    def _count_received(self, transport: str, received: int, started: float) -> None:
        self.metrics.kv_bytes.labels(transport).inc(received)
        self.metrics.kv_seconds.labels(transport).observe(time.perf_counter() - started)

    def _transfer_failed(self, exc: BaseException, refused: str, transport: str) -> BaseException:
        """Counts a failed transfer; a malformed one becomes INVALID_ARGUMENT naming what was wrong.
        A write that lost the device fails every row and takes the worker down, as a fatal step does:
        the slots it shares with the running sequences cannot be trusted any more."""
        self.metrics.kv_failures.labels(transport).inc()
        exc = self.backend.device_error(exc) if isinstance(exc, Exception) else exc
        if isinstance(exc, DeviceLost):
            self.decode_loop.device_failed(f"KV write failed: {describe(exc)}")
            error = RequestError(f"KV write failed: {describe(exc)}; this decode worker stops serving", grpc.StatusCode.INTERNAL)
            error.__cause__ = exc
            return error
        if isinstance(exc, KvChunkError):
            error = RequestError(f"{refused}: {exc}")
            error.__cause__ = exc
            return error
        return exc

    def _begin_transfer(self, key: str) -> DecodeStream:
        stream = self._streams.get(key)
        if stream is None or not self.slots.is_reserved(key):
            raise RequestError(f"reservation_id {key!r} is unknown, expired or already filled", grpc.StatusCode.NOT_FOUND)
        if stream.transferring:
            raise RequestError(f"reservation_id {key!r} already has a transfer in progress", grpc.StatusCode.ALREADY_EXISTS)
        stream.transferring = True
        return stream

    def _held_kv(self) -> str:
        """What this worker's KV cache holds, as a refusal names it."""
        info = self.info
        if info.kv_quantized:
            return f"an 8-bit KV cache ({info.kv_cache_dtype}: {wire_dtype(info.kv_cache_dtype)} codes, a scale per {info.kv_block_size} positions)"
        return f"an unquantized {info.dtype} KV cache"

    def _check_staged_dtype(self, pull: KvPull) -> None:
        """NIXL: the staged bytes are read as this worker's own layout, so a prompt staged in another must not be read."""
        info = self.info
        if (pull.kv_dtype, pull.scale_block) != (wire_dtype(info.kv_cache_dtype), info.kv_block_size):
            staged = f"{pull.kv_dtype} codes with a scale per {pull.scale_block} positions" if pull.kv_dtype else "unquantized"
            raise KvChunkError(f"staged KV (kv_dtype {pull.kv_dtype!r}, scale_block {pull.scale_block}) is {staged}; this worker holds {self._held_kv()}")

    def _check_piece_dtype(self, piece: KvPiece) -> None:
        """An 8-bit worker takes only its own codes and scale block; an unquantized one only its dtype, without scales."""
        info = self.info
        if info.kv_quantized:
            if piece.dtype != wire_dtype(info.kv_cache_dtype) or piece.scale_block != info.kv_block_size:
                raise KvChunkError(f"piece of dtype {piece.dtype!r} with scale_block {piece.scale_block}; this worker holds {self._held_kv()}")
        elif piece.scales or piece.scale_block:
            raise KvChunkError(f"piece of 8-bit {piece.dtype!r} codes with scales (scale_block {piece.scale_block}); this worker holds {self._held_kv()}")
        elif piece.dtype != info.dtype:
            raise KvChunkError(f"dtype {piece.dtype!r} does not match the cache dtype {info.dtype!r}")

    def _write_piece(self, stream: DecodeStream, coverage: KvCoverage, piece: KvPiece) -> asyncio.Future:
        """Checks the piece, then starts its copy into the slot (an 8-bit piece's as a QuantizedKv,
        which write_kv takes as it takes a tensor); the future ends with the copy."""
        info = self.info
        if not self.slots.is_reserved(stream.key):
            raise RequestError(f"reservation_id {stream.key!r} expired during the transfer", grpc.StatusCode.NOT_FOUND)
        if not 0 <= piece.layer < info.num_layers:
            raise KvChunkError(f"layer {piece.layer} is not in [0, {info.num_layers})")
        self._check_piece_dtype(piece)
        if len(piece.shape) != 3 or piece.shape[0] != info.kv_heads or piece.shape[2] != info.head_dim:
            raise KvChunkError(f"shape {list(piece.shape)} does not match [kv_heads={info.kv_heads}, tokens, head_dim={info.head_dim}]")
        if piece.token_start < 0 or piece.token_end > stream.reservation.prompt_len:
            raise KvChunkError(f"tokens [{piece.token_start}, {piece.token_end}) fall outside the prompt of {stream.reservation.prompt_len}")
        tensor = decode(piece)
        coverage.add(piece)
        table = list(stream.reservation.table)
        return self._loop.run_in_executor(self._kv_writer, self._write_kv, table, piece.layer, piece.kind, piece.token_start, tensor)

    def _commit(self, stream: DecodeStream, missing: list[str], commit: KvCommit) -> None:
        # The last piece's write yielded to the loop: the lease may have run out or the
        # Decode call may have ended meanwhile.
        if not self.slots.is_reserved(stream.key):
            raise RequestError(f"reservation_id {stream.key!r} expired or was released during the transfer", grpc.StatusCode.NOT_FOUND)
        if commit.prompt_len != stream.reservation.prompt_len or commit.num_layers != self.info.num_layers:
            raise KvChunkError(
                f"commit for {commit.prompt_len} tokens x {commit.num_layers} layers does not match the reservation"
                f" ({stream.reservation.prompt_len} x {self.info.num_layers})"
            )
        if not 0 <= commit.first_token < self.info.vocab_size:
            raise KvChunkError(f"first_token {commit.first_token} is not in the vocabulary")
        if missing:
            raise KvChunkError("missing KV: " + "; ".join(missing[:4]) + ("; ..." if len(missing) > 4 else ""))
        reservation = self.slots.activate(stream.key)
        stream.transferring = False
        self.decode_loop.admit(self._sequence(stream, reservation, commit.first_token))

    def _sequence(self, stream: DecodeStream, reservation: Reservation, first_token: int) -> Sequence:
        speculation = row_speculation(self.decode_loop.speculation, reservation.slot, stream.context_ids, first_token)
        return Sequence(
            stream.key, reservation.slot, reservation.prompt_len, first_token, stream.sampling, stream.stopping, stream.first_step,
            stream.context_ids if stream.sampling.penalized or self.backend.starts_every_sequence else (),
            table=tuple(reservation.table) if self.blocks is not None else (),
            matcher=stream.matcher, speculation=speculation,
        )

    # -- colocated mode: prefill on this worker's own device thread --------------
    async def colocated_fill(self, key: str, token_ids: list[int], first_token: int, layers) -> int:
        """Copies a local prefill's KV into the reserved slot and admits it: no wire, no codec."""
        stream = self._streams.get(key)
        if stream is None or not self.slots.is_reserved(key) or stream.reservation.prompt_len != len(token_ids):
            raise RequestError(f"reservation_id {key!r} is unknown, expired or for another prompt", grpc.StatusCode.NOT_FOUND)
        table, cached = list(stream.reservation.table), stream.reservation.cached_tokens

        def copy() -> int:
            # Only past the cached blocks: those are shared, and other sequences may be reading them.
            for layer, (keys, values) in enumerate(layers):
                self._write_kv(table, layer, KvKind.KEY, cached, keys[:, cached:])
                self._write_kv(table, layer, KvKind.VALUE, cached, values[:, cached:])
            return sum(kv_bytes(k[:, cached:]) * 2 for k, _ in layers)

        copied = await asyncio.wrap_future(self.decode_loop.run_on_device(copy))
        if not self.slots.is_reserved(key):
            raise RequestError(f"reservation_id {key!r} was released during the copy", grpc.StatusCode.NOT_FOUND)
        reservation = self.slots.activate(key)
        self.decode_loop.admit(self._sequence(stream, reservation, first_token))
        return copied

    # -- from the decode loop's thread ------------------------------------------
    def _publish_threadsafe(self, events: list[TokenEvent]) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, events)

    def _retired_threadsafe(self, keys: list[str]) -> None:
        self._loop.call_soon_threadsafe(self._release, keys)

    def _fatal_threadsafe(self, cause: str) -> None:
        self._loop.call_soon_threadsafe(self._stop_serving, cause)

    def _stop_serving(self, cause: str) -> None:
        """Steps can no longer be trusted: drain as on SIGTERM (NOT_SERVING, new calls refused,
        the calls in flight end), then stop() exits non-zero."""
        self.failure = cause
        log.error("decode worker failing: %s; draining, then exiting non-zero", cause)
        os.kill(os.getpid(), signal.SIGTERM)  # the one drain path: rpc.serve_until_signal

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            stream = self._streams.get(event.key)
            if stream is not None:
                stream.events.put_nowait(RequestError(event.error, grpc.StatusCode.INTERNAL) if event.error else event)

    def _release(self, keys: list[str]) -> None:
        for key in keys:
            self.slots.release(key)

    async def _reap_expired_leases(self) -> None:
        interval = min(1.0, self.config.lease_seconds / 4)
        while True:
            await asyncio.sleep(interval)
            for reservation in self.slots.expired():
                log.warning("reservation %s: no KV within %.1fs; freeing slot %d", reservation.reservation_id, self.config.lease_seconds, reservation.slot)
                self._fail(
                    reservation.reservation_id, RequestError(f"KV did not arrive within the {self.config.lease_seconds}s lease", grpc.StatusCode.ABORTED)
                )

    # -- load ----------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self._streams) or self.slots.free_slots < self.slots.num_slots

    def load(self) -> dict:
        return {
            "capacity": self.slots.num_slots,
            "slots_in_use": self.slots.num_slots - self.slots.free_slots,
            "reservations": self.slots.count(SlotState.RESERVED),
            "active": self.decode_loop.active_count,
            "inflight_transfers": sum(1 for s in self._streams.values() if s.transferring),
        }


def log_orphaned_read(reservation_id: str, agent_name: str, reading: asyncio.Future) -> None:
    """The end of a NIXL read whose PullKv call had already ended."""
    if not reading.cancelled() and reading.exception() is not None:
        log.warning("KV read for %s from %s, left running when its call ended, failed: %s", reservation_id, agent_name, reading.exception())


@dataclass(frozen=True)
class KvPull:
    """Where a prompt's KV waits in a prefill worker's NIXL staging buffer."""

    reservation_id: str
    agent_name: str
    agent_metadata: bytes
    address: int
    prompt_len: int
    num_layers: int
    first_token: int
    generation: int
    token_start: int = 0  # the staged KV is of tokens [token_start, prompt_len)
    kv_dtype: str = ""  # an 8-bit KV's code dtype ("int8", "float8_e4m3fn"); "": unquantized
    scale_block: int = 0  # positions per scale of an 8-bit KV


def open_nixl_sink(backend: Backend, write_kv=None, nixl_backend: str = "UCX"):
    """The slot cache registered with NIXL where it is host memory; otherwise one
    registered host buffer the KV lands in first (Neuron, CUDA, an 8-bit KV: see
    docs/neuron.md), copied into the cache by write_kv (default: the backend's)."""
    import torch

    from disagg.kv_transport.layout import KvGeometry
    from disagg.kv_transport.nixl_transport import NixlHostStagingSink, NixlSink

    info = backend.info
    write = write_kv or backend.write_kv
    if info.kv_quantized:  # codes and scales are rebuilt per layer and kind, then written as a prefill's are
        log.info("KV transport: an 8-bit KV cache; NIXL reads codes and scales into a host staging buffer first")
        return NixlHostStagingSink(KvGeometry.of(info, info.max_seq_len), code_dtype(info.kv_cache_dtype), write, backend=nixl_backend)
    dtype = getattr(torch, info.dtype)
    cache = getattr(backend, "cache", None)
    paged = getattr(backend, "paged", False)
    # The cache's own positions per slot: a compiled step's cache has a scratch position past max_seq_len.
    positions = cache.keys[0].shape[2] if cache is not None and not paged else info.max_seq_len
    geometry = KvGeometry.of(info, positions)
    if cache is not None and cache.keys[0].device.type == "cpu" and not paged:
        return NixlSink(geometry, cache.keys, cache.values, backend=nixl_backend)
    log.info("KV transport: the KV cache is paged or not in host memory; NIXL reads into a host staging buffer first")
    return NixlHostStagingSink(geometry, dtype, write, backend=nixl_backend)


def refuse_unless_scores_guesses(backend, whose: str) -> None:
    """Speculation needs steps that take a sequence's guesses as rows of their own (Backend.scores_guesses):
    refused with one line where the backend's step would not (the compiled step, chosen by default on CUDA; over an
    8-bit KV cache, any but the native step). A backend that speculates inside its own step (tokens_per_step > 1,
    NxDI's fused speculation) needs no guess rows."""
    if not backend.scores_guesses and backend.tokens_per_step == 1:
        raise SystemExit(f"decode_worker: --speculative-method: {whose} {type(backend).__name__} step does not score guesses: {backend.guesses_refusal}")

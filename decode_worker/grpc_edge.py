"""The decode worker's gRPC edge: DecodeService, converting at the boundary."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys

import grpc
import torch

from disagg.engine.backends import load_backend
from disagg.engine.memory import sampled_process_memory
from disagg.kv_transport.chunk_codec import KvChunkError
from disagg.kv_transport.grpc_push import PULL_KV, PUSH_KV, chunk_from_pb, split_kv_chunk
from disagg.rpc import startup, worker_messages
from disagg.rpc.metrics import DecodeMetrics, serve_metrics
from disagg.rpc.server import (
    INTERNAL_MESSAGE_BYTES,
    RequestError,
    UnparsableMessage,
    announce_ports,
    check_parsed,
    lenient_parser,
    load_while_not_serving,
    serve_until_signal,
    start_server,
    stop_on_failure,
)
from disagg.v1 import worker_pb2 as wpb

from .colocated import ColocatedPrefillServicer
from .config import DecodeWorkerConfig
from .worker import DecodeWorker, KvPull, refuse_unless_scores_guesses

log = logging.getLogger(__name__)
SERVICE = wpb.DESCRIPTOR.services_by_name["DecodeService"]


class DecodeServicer:
    """Thin: converts protobuf to engine types and back; the worker does the work."""

    def __init__(self):
        self.worker: DecodeWorker | None = None  # set once the model is loaded

    async def _ready(self, context) -> DecodeWorker:
        if self.worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker is not serving yet: {startup.current().describe()}")
        return self.worker

    async def Decode(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext):
        worker = await self._ready(context)
        try:
            order = worker_messages.decode_order_from_pb(check_parsed(request), worker.info)
            matcher = await worker.row_matcher(order.sampling, order.prompt_len, order.first_step, order.context_ids)
            stream = worker.open_stream(
                order.request_id, order.prompt_len, order.sampling, order.stopping, order.first_step, order.context_ids, matcher
            )
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
        try:
            r = stream.reservation
            yield wpb.DecodeEvent(reserved=wpb.Reserved(
                reservation_id=r.reservation_id, slot=r.slot, lease_seconds=worker.config.lease_seconds, cached_tokens=r.cached_tokens
            ))
            async for event in worker.events(stream):
                logprobs = [worker_messages.logprobs_to_pb(x) for x in event.logprobs] if event.logprobs else None
                yield wpb.DecodeEvent(tokens=wpb.DecodeTokens(token_ids=event.token_ids, finish=int(event.finish), logprobs=logprobs))
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
        finally:
            worker.close_stream(stream)

    async def PushKv(self, request_iterator, context: grpc.aio.ServicerContext) -> wpb.KvAck:
        worker = await self._ready(context)

        async def messages():
            async for chunk in request_iterator:  # parsed by parse_kv_chunk
                if isinstance(chunk, UnparsableMessage):
                    raise KvChunkError(chunk.as_error().args[0])
                worker_messages.check_chunk_header(chunk[0])
                try:
                    yield chunk_from_pb(*chunk)
                except ValueError as exc:
                    raise KvChunkError(str(exc)) from exc

        try:
            received = await worker.receive_kv(messages())
        except RequestError as exc:
            await _drain(request_iterator)
            await context.abort(exc.code, str(exc))
        return wpb.KvAck(bytes_received=received)

    async def PullKv(self, request: wpb.PullKvRequest, context: grpc.aio.ServicerContext) -> wpb.KvAck:
        worker = await self._ready(context)
        try:
            worker_messages.check_pull(check_parsed(request), worker.info)
            pull = KvPull(
                request.reservation_id, request.agent_name, request.agent_metadata, request.address,
                request.prompt_len, request.num_layers, request.first_token, request.generation, request.token_start,
                request.kv_dtype, request.scale_block,
            )
            received = await worker.pull_kv(pull, context.time_remaining())
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
        return wpb.KvAck(bytes_received=received)

    async def GetLoad(self, request, context) -> wpb.WorkerLoad:
        worker = await self._ready(context)
        return worker_messages.worker_load("decode", worker.info, worker.config, **worker.load())


_parse_kv_header = lenient_parser(wpb.KvChunk)


def parse_kv_chunk(raw: bytes) -> tuple[wpb.KvChunk, memoryview | None] | UnparsableMessage:
    """PushKv's deserializer: the tensor bytes stay where gRPC put them (no copy)."""
    try:
        header, data = split_kv_chunk(raw)
    except ValueError as exc:
        return UnparsableMessage(wpb.KvChunk.DESCRIPTOR.full_name, str(exc))
    message = _parse_kv_header(header)
    return message if isinstance(message, UnparsableMessage) else (message, data)


def backend_options(config) -> dict:
    neuron = {**config.neuron, "async_mode": config.async_mode, **config.quantization_options(), **config.neuron_speculation_options(),
              **config.neuron_kv_cache_options()}
    torch_options = dict(
        compile=config.compile_choice(), prepack=config.prepack, native_step=config.native_step, share_weights=config.share_weights,
        batch_buckets=config.batch_buckets, token_buckets=config.token_buckets, verify_rows=config.verify_rows(),
        step_hidden=config.speculative_method == "eagle", **config.quantization_options(),
        **config.kv_cache_options(config.block_size),
    )
    return dict(
        model=config.model, dtype=config.dtype, device=config.device, max_seq_len=config.max_seq_len, global_topk=config.global_topk,
        batch_size=config.slots_before_load(), neuron=neuron, torch=torch_options,
    )


def size_slots(config: DecodeWorkerConfig, info, pages_kv: bool = False) -> DecodeWorkerConfig:
    """The config with its slot count settled: given, or sized from the KV budget now that the model is known.
    Where the backend pages its KV, the budget is blocks, and the slots (rows of the batch) are --batch-size or --max-batch-size."""
    itemsize = torch.empty(0, dtype=getattr(torch, info.dtype)).element_size()
    if pages_kv:
        slots = config.batch_size or config.max_batch_size
        blocks = config.blocks_for(info.kv_block_bytes(itemsize, config.block_size), info.max_seq_len, slots)
        log.info(
            "paged KV cache: %d blocks of %d positions (--kv-cache-gib %g), %d sequences at a time, prefix caching %s",
            blocks - 1, config.block_size, config.kv_cache_gib, slots, "on" if config.prefix_caching else "off",
        )
        return dataclasses.replace(config, batch_size=slots, num_blocks=blocks)
    per_slot = info.kv_bytes_per_token(itemsize) * info.max_seq_len
    slots = config.slots_before_load() or config.slots_for(per_slot)
    how = "--batch-size" if config.batch_size else f"--kv-cache-gib {config.kv_cache_gib:g}, at most --max-batch-size {config.max_batch_size}"
    log.info("decode slots: %d (%s; %.1f MiB per slot of %d positions)", slots, how, per_slot / 2**20, info.max_seq_len)
    return dataclasses.replace(config, batch_size=slots)


# The device thread waits for the GIL each time the event loop or the host loop
# holds it; Python's default 5 ms switch interval would let one busy thread keep
# the device idle for that long between steps.
GIL_SWITCH_SECONDS = 0.001


def draft_proposer(config: DecodeWorkerConfig, backend):
    """--speculative-method draft: the draft model, checked against the model's tokenizer, loaded by the
    same backend with a KV slot per decode slot (disagg/engine/speculation/draft.py); eagle: the EAGLE
    head over the model's own hidden states (eagle.py); else None, as where the backend runs the draft inside its
    own step (tokens_per_step > 1: NxDI's fused speculation)."""
    if backend.tokens_per_step > 1:
        return None
    if config.speculative_method == "eagle":
        from disagg.engine.speculation.eagle import EagleProposer, load_eagle_head

        head = load_eagle_head(config.draft_model)
        log.info("speculation: EAGLE head %s, %d layer(s), up to %s guesses a row", config.draft_model, len(head.layers), config.speculation().num_tokens)
        return EagleProposer(backend, head, config.batch_size)
    if config.speculative_method != "draft":
        return None
    from disagg.engine.speculation.draft import DraftProposer

    draft_config = dataclasses.replace(config, model=config.draft_model, quantization=None, kv_cache_dtype=None, compile=False)
    draft = load_backend(config.backend, **backend_options(draft_config))
    refuse_unless_scores_guesses(draft, "the draft model's")
    draft.allocate_slots(config.batch_size)
    log.info("speculation: draft model %s, %d layers, up to %s guesses a row", config.draft_model, draft.info.num_layers, config.speculation().num_tokens)
    return DraftProposer(draft)


def check_draft(config: DecodeWorkerConfig) -> None:
    """A draft model of another tokenizer, or an EAGLE head that does not fit the model, is refused with one line, before the model loads."""
    if config.speculative_method in ("draft", "eagle"):
        from disagg.engine.speculation.draft import check_draft_matches
        from disagg.engine.speculation.eagle import check_eagle_matches, load_eagle_head

        try:
            if config.speculative_method == "draft":
                check_draft_matches(config.model, config.draft_model)
            else:
                check_eagle_matches(config.model, config.draft_model)
                load_eagle_head(config.draft_model)  # its tensors, by name and shape (a small file: one or two layers)
        except (ValueError, OSError) as exc:
            raise SystemExit(f"decode_worker: {exc}") from None


async def serve(config: DecodeWorkerConfig) -> None:
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    check_draft(config)
    servicer = DecodeServicer()
    credentials = config.tls.server_credentials(require_client_cert=True) if config.tls else None
    services = [(servicer, SERVICE)]
    if config.colocated:
        services.append((ColocatedPrefillServicer(servicer), wpb.DESCRIPTOR.services_by_name["PrefillService"]))
    # While draining, KV still arrives for slots reserved before SIGTERM.
    server = await start_server(
        config.address, services, INTERNAL_MESSAGE_BYTES, credentials, drain_exempt=(PUSH_KV, PULL_KV), deserializers={PUSH_KV: parse_kv_chunk}
    )
    metrics, metrics_port = serve_metrics(config.metrics_port, config.address.rsplit(":", 1)[0], DecodeMetrics)
    announce_ports(config.port_file, server.port, metrics_port)
    reporter = startup.install(config.status_file)
    startup.report(startup.Phase.LOADING, f"decode worker on port {server.port}: loading {config.model} ({config.backend} backend)")
    backend = await load_while_not_serving(server, lambda: load_backend(config.backend, **backend_options(config)))
    config = size_slots(config, backend.info, backend.pages_kv)
    if config.speculative_method is not None:
        await stop_on_failure(server, lambda: refuse_unless_scores_guesses(backend, "the model's"))
    if not backend.pages_kv:
        log.info("KV cache: one slot of max_seq_len positions per sequence (%s backend%s): no paging, no prefix caching",
                 config.backend, ", compiled step" if config.backend == "torch" else "")
    proposer = await load_while_not_serving(server, lambda: draft_proposer(config, backend))
    worker = DecodeWorker(backend, config, metrics, proposer)
    await stop_on_failure(server, worker.start)
    servicer.worker = worker
    await server.set_serving(True)
    startup.report(startup.Phase.SERVING, "serving")
    reporter.stop()  # the launcher reads health from here on
    log.info("decode worker serving on port %d (%s, %d slots, async=%s); memory: %s", server.port, backend.info.dtype, config.batch_size,
             config.async_mode, sampled_process_memory().describe())
    await serve_until_signal(server, config.grace_seconds, busy=worker.busy)
    await worker.stop()


# A refused push's pieces still on their way are read (and dropped) for at most this long before the refusal is sent.
DRAIN_SECONDS = 2.0


async def _drain(request_iterator) -> None:
    """Reads what the sender is still writing, so that it meets the refusal's status, not its own write's failure:
    grpc's client, writing into a call the server has just ended, reports INTERNAL ("Internal error from Core")
    in place of the server's status (1 run of a refusal test in 6 here)."""

    async def read_rest() -> None:
        async for _ in request_iterator:
            pass

    with contextlib.suppress(Exception):
        await asyncio.wait_for(read_rest(), DRAIN_SECONDS)

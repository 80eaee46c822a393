"""The prefill worker's gRPC edge: PrefillService, converting at the boundary."""

from __future__ import annotations

import logging

import grpc

from disagg.engine.backends import load_backend
from disagg.engine.memory import sampled_process_memory
from disagg.rpc import startup, worker_messages
from disagg.rpc.metrics import PrefillMetrics, serve_metrics
from disagg.rpc.server import (
    INTERNAL_MESSAGE_BYTES,
    RequestError,
    announce_ports,
    check_parsed,
    load_while_not_serving,
    serve_until_signal,
    start_server,
    stop_on_failure,
)
from disagg.v1 import worker_pb2 as wpb

from .config import PrefillWorkerConfig
from .worker import FirstToken, KvTarget, PrefillWorker

log = logging.getLogger(__name__)
SERVICE = wpb.DESCRIPTOR.services_by_name["PrefillService"]


class PrefillServicer:
    def __init__(self):
        self.worker: PrefillWorker | None = None  # set once the model is loaded

    async def _ready(self, context) -> PrefillWorker:
        if self.worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill worker is not serving yet: {startup.current().describe()}")
        return self.worker

    async def Prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext):
        worker = await self._ready(context)
        try:
            order = worker_messages.prefill_order_from_pb(check_parsed(request), worker.info)
            target = KvTarget(*order.target) if order.target else None
            events = worker.prefill(order.token_ids, order.sampling, target, order.first_step, context.time_remaining())
            async for event in events:
                if isinstance(event, FirstToken):
                    logprobs = worker_messages.logprobs_to_pb(event.logprobs) if event.logprobs else None
                    yield wpb.PrefillEvent(first_token=wpb.FirstToken(token_id=event.token_id, prefill_seconds=event.prefill_seconds, logprobs=logprobs))
                else:
                    yield wpb.PrefillEvent(kv_sent=wpb.KvSent(bytes=event.bytes, seconds=event.seconds))
        except RequestError as exc:
            await context.abort(exc.code, str(exc))

    async def GetLoad(self, request, context) -> wpb.WorkerLoad:
        worker = await self._ready(context)
        return worker_messages.worker_load("prefill", worker.info, worker.config, **worker.load())


async def serve(config: PrefillWorkerConfig) -> None:
    servicer = PrefillServicer()
    credentials = config.tls.server_credentials(require_client_cert=True) if config.tls else None
    server = await start_server(config.address, [(servicer, SERVICE)], INTERNAL_MESSAGE_BYTES, credentials)
    metrics, metrics_port = serve_metrics(config.metrics_port, config.address.rsplit(":", 1)[0], PrefillMetrics)
    announce_ports(config.port_file, server.port, metrics_port)
    reporter = startup.install(config.status_file)
    startup.report(startup.Phase.LOADING, f"prefill worker on port {server.port}: loading {config.model} ({config.backend} backend)")
    options = dict(model=config.model, dtype=config.dtype, device=config.device, max_seq_len=config.max_seq_len, global_topk=config.global_topk, batch_size=1,
                   neuron={**config.neuron, **config.quantization_options(), **config.neuron_speculation_options(), **config.neuron_kv_cache_options()},
                   torch=dict(prepack=config.prepack, native_step=config.native_step, share_weights=config.share_weights, **config.quantization_options(),
                              **config.kv_cache_options(config.block_size)))
    backend = await load_while_not_serving(server, lambda: load_backend(config.backend, **options))
    servicer.worker = await stop_on_failure(server, lambda: PrefillWorker(backend, config, metrics))
    await servicer.worker.start()  # the decode pool resolved before the first kv_target is checked
    await server.set_serving(True)
    startup.report(startup.Phase.SERVING, "serving")
    reporter.stop()  # the launcher reads health from here on
    log.info("prefill worker serving on port %d (%s); memory: %s", server.port, backend.info.dtype, sampled_process_memory().describe())
    await serve_until_signal(server, config.grace_seconds, busy=servicer.worker.busy)
    await servicer.worker.stop()

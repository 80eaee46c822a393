"""The router process: the public gRPC and HTTP edges, the worker pool and the metrics port, started and
stopped together. The router's core is `core.py`; each edge converts at its boundary."""

from __future__ import annotations

import asyncio
import logging

from disagg.rpc.metrics import RouterMetrics, serve_metrics
from disagg.rpc.security import BearerTokenInterceptor
from disagg.rpc.server import PUBLIC_MESSAGE_BYTES, announce_ports, serve_until_signal, start_server

from .config import RouterConfig
from .core import Router, model_facts
from .grpc_edge import SERVICE, GenerationServicer
from .http import start_http_front
from .prefix_index import PrefixIndex
from .workers import Worker, WorkerPool

log = logging.getLogger(__name__)


async def serve(config: RouterConfig) -> None:
    from transformers import AutoTokenizer

    servicer = GenerationServicer()
    credentials = config.public_tls.server_credentials(require_client_cert=False) if config.public_tls else None
    interceptors = (BearerTokenInterceptor(config.auth_token),) if config.auth_token else ()
    server = await start_server(config.address, [(servicer, SERVICE)], PUBLIC_MESSAGE_BYTES, credentials, interceptors)
    http = await start_http_front(config, lambda: servicer.router, lambda: server.drain.draining)
    metrics, metrics_port = serve_metrics(config.metrics_port, config.address.rsplit(":", 1)[0], RouterMetrics)
    announce_ports(config.port_file, server.port, metrics_port, http_port=http.port if http else None)
    log.info("router on port %d: waiting for workers", server.port)
    tokenizer = await asyncio.get_running_loop().run_in_executor(None, AutoTokenizer.from_pretrained, config.model)
    prefix = PrefixIndex(config.block_size, config.prefix_caching, config.prefix_index_tokens, observe=metrics.observe_routed)
    pool = WorkerPool.connect(
        config.prefill_workers, config.decode_workers, config.max_queue, config.load_poll_seconds, config.tls, config.resolve_seconds, config.grace_seconds,
        prefix=prefix, worker_wait_seconds=config.worker_wait_seconds,
    )
    pool.observe_health = lambda worker: count_health(pool, worker, metrics)
    await pool.start()
    await pool.wait_ready()
    servicer.router = Router(config, tokenizer, model_facts(config, pool), pool, metrics)
    await server.set_serving(True)
    log.info("router serving on port %d", server.port)
    health = asyncio.create_task(follow_workers(server, pool))
    await serve_until_signal(server, config.grace_seconds, busy=lambda: bool(servicer.router.in_flight))
    health.cancel()
    if http:
        await http.stop()
    await pool.close()


def count_health(pool: WorkerPool, worker: Worker, metrics: RouterMetrics) -> None:
    role = pool.prefill if worker.role == "prefill" else pool.decode
    metrics.workers_available.labels(worker.role).set(sum(w.healthy for w in role))
    if worker.healthy and worker.times_ready > 1:
        metrics.worker_returns.labels(worker.role).inc()


async def follow_workers(server, pool: WorkerPool) -> None:
    """The router's health follows its workers: NOT_SERVING while no prefill or no decode worker is up
    (a load balancer or probe then sends clients elsewhere), SERVING again once one of each is. The
    calls that arrive meanwhile are answered UNAVAILABLE by the router itself, as before."""
    serving = True
    while not server.drain.draining:
        await pool.wait_changed()
        ready = pool.ready()
        if ready != serving and not server.drain.draining:
            serving = ready
            await server.set_serving(ready)
            log.log(logging.INFO if ready else logging.WARNING, "router %s", "serving again" if ready else "NOT_SERVING: no prefill or no decode worker is up")

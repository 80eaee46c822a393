"""The router's gRPC edge: the public GenerationService, converting at the boundary."""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from disagg.engine.model_files import eos_token_ids, vocab_size
from disagg.metrics import RouterMetrics, outcome_label, serve_metrics
from disagg.rpc import PUBLIC_MESSAGE_BYTES, RequestError, announce_ports, check_parsed, serve_until_signal, start_server
from disagg.security import BearerTokenInterceptor
from disagg.v1 import generation_pb2 as pb

from .choices import choice_requests, merged_choices
from .coalesce import coalesced
from .config import RouterConfig
from .grpc_edge import chunk_to_pb, params_from_pb
from .http import start_http_front
from .lifecycle import Lifecycle
from .params import GenerateParams
from .prompts import prompt_ids
from .tokenizing import TokenizerThreads, text_chars
from .validation import GenerationRequest, ModelFacts, build_request, check_params
from .workers import WorkerPool

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"]


class Router:
    """Validation, tokenization and in-flight bookkeeping around the request lifecycle."""

    def __init__(self, config: RouterConfig, tokenizer, facts: ModelFacts, pool: WorkerPool, metrics: RouterMetrics):
        self.config = config
        self.tokenizer = tokenizer
        self.facts = facts
        self.pool = pool
        self.metrics = metrics
        self.lifecycle = Lifecycle(pool, tokenizer, facts, metrics)
        self.in_flight: set[str] = set()
        metrics.in_flight.set_function(lambda: len(self.in_flight))
        metrics.queued.set_function(lambda: pool.queued)
        # Tokenizing a long prompt takes milliseconds: keep it off the event loop (a huge one on threads of its own).
        self._tokenizer_threads = TokenizerThreads(config.test_long_tokenize_gate)
        # One token decoded alone (logprobs name their tokens): microseconds, and cached.
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._tokenizer_threads.run(len(text), lambda: self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def prepare(self, params: GenerateParams) -> GenerationRequest:
        """Validates a request from either edge and tokenizes (or renders) its prompt."""
        check_params(params, self.config.limits, self.facts)
        ids = await self._tokenizer_threads.run(text_chars(params), prompt_ids, self.tokenizer, params)
        return build_request(params, ids, self.config.limits, self.facts)

    async def generate(self, request: GenerationRequest, timeout: float | None = None):
        """The chunks of all the request's choices (Chunk.index), each choice ending with its finish."""
        if request.request_id in self.in_flight:
            raise RequestError(f"request_id {request.request_id!r} is already in flight")
        self.in_flight.add(request.request_id)
        outcome = "cancelled"
        try:
            async for chunk in merged_choices(choice_requests(request), lambda choice: self.lifecycle.run(choice, timeout)):
                yield chunk
            outcome = "ok"
        except RequestError as exc:
            outcome = outcome_label(exc.code)
            raise
        finally:
            self.in_flight.discard(request.request_id)
            self.metrics.requests.labels(outcome).inc()


class GenerationServicer:
    def __init__(self):
        self.router: Router | None = None  # set once the workers are ready

    async def _ready(self, context) -> Router:
        if self.router is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router is waiting for its workers")
        return self.router

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        router = await self._ready(context)
        try:
            generation = await router.prepare(params_from_pb(request))
            async for chunk in coalesced(router.generate(generation, context.time_remaining())):
                yield chunk_to_pb(chunk, generation.request_id, router.token_text)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        router = await self._ready(context)
        try:
            check_parsed(request)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
        ids = await router.tokenize(request.text, request.add_special_tokens)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        router = await self._ready(context)
        facts, limits = router.facts, router.config.limits
        return pb.GetModelInfoResponse(
            model_name=facts.name,
            max_seq_len=facts.max_seq_len,
            vocab_size=facts.vocab_size,
            eos_token_ids=facts.eos_token_ids,
            default_max_new_tokens=limits.default_max_new_tokens,
            max_new_tokens_cap=limits.max_new_tokens_cap,
            backend=facts.backend,
            dtype=facts.dtype,
            prefill_workers=sum(w.healthy for w in router.pool.prefill),
            decode_workers=sum(w.healthy for w in router.pool.decode),
        )


def model_facts(config: RouterConfig, pool: WorkerPool) -> ModelFacts:
    loads = [w.load for w in pool.workers if w.healthy and w.load is not None]
    names = {load.model_name for load in loads}
    if len(names) > 1:
        log.warning("workers report different models: %s", sorted(names))
    first = loads[0]
    return ModelFacts(
        name=first.model_name,
        vocab_size=vocab_size(config.model),
        max_seq_len=min(load.max_seq_len for load in loads),
        eos_token_ids=eos_token_ids(config.model),
        backend=first.backend,
        dtype=first.dtype,
    )


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
    pool = WorkerPool.connect(config.prefill_workers, config.decode_workers, config.max_queue, config.load_poll_seconds, config.tls, config.resolve_seconds, config.grace_seconds)
    await pool.start()
    await pool.wait_ready()
    servicer.router = Router(config, tokenizer, model_facts(config, pool), pool, metrics)
    await server.set_serving(True)
    log.info("router serving on port %d", server.port)
    await serve_until_signal(server, config.grace_seconds, busy=lambda: bool(servicer.router.in_flight))
    if http:
        await http.stop()
    await pool.close()

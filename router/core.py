"""The router's core, apart from either edge: validation, tokenization, choices and in-flight bookkeeping
around each request's lifecycle (`lifecycle.py`). The gRPC edge (`grpc_edge.py`) and the HTTP edge (`http/`)
convert their messages to GenerateParams and call `Router.prepare` and `Router.generate`."""

from __future__ import annotations

import functools
import logging

from disagg.engine.constraints.compiler import ConstraintCompiler
from disagg.engine.model_files import eos_token_ids, vocab_size
from disagg.engine.requests import InvalidField
from disagg.rpc.metrics import RouterMetrics, outcome_label
from disagg.rpc.server import RequestError

from .choices import choice_requests, merged_choices
from .config import RouterConfig
from .lifecycle import Lifecycle
from .params import GenerateParams
from .prompts import prompt_ids
from .tokenizing import TokenizerThreads, text_chars
from .validation import GenerationRequest, ModelFacts, build_request, check_params, refuse
from .workers import WorkerPool

log = logging.getLogger(__name__)


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
        # Constraints compile here first, so a bad one is refused before any prefill (cached by text).
        self.constraints = ConstraintCompiler(lambda: tokenizer, facts.vocab_size, facts.eos_token_ids, config.constraint_compile_seconds)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._tokenizer_threads.run(len(text), lambda: self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def prepare(self, params: GenerateParams) -> GenerationRequest:
        """Validates a request from either edge and tokenizes (or renders) its prompt."""
        check_params(params, self.config.limits, self.facts)
        if params.constraint is not None:
            try:
                await self.constraints.check(params.constraint)
            except InvalidField as exc:
                raise refuse(exc.field, exc.rule) from None
        ids, hashes = await self._tokenizer_threads.run(text_chars(params), self._ids_and_hashes, params)
        return build_request(params, ids, self.config.limits, self.facts, hashes)

    def _ids_and_hashes(self, params: GenerateParams) -> tuple[list[int], tuple[bytes, ...]]:
        """The prompt's token ids and its block hashes for cache-aware routing, on a tokenizer thread:
        hashing a long prompt takes milliseconds too."""
        ids = prompt_ids(self.tokenizer, params)
        return ids, self.pool.prefix.hashes(ids)

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


def model_facts(config: RouterConfig, pool: WorkerPool) -> ModelFacts:
    loads = [w.load for w in pool.workers if w.healthy and w.load is not None]
    names = {load.model_name for load in loads}
    if len(names) > 1:
        log.warning("workers report different models: %s", sorted(names))
    dtypes = {load.dtype for load in loads}
    if len(dtypes) > 1:  # --dtype auto on hosts of different classes: KV of one dtype is refused by a cache of another
        log.warning("workers report different dtypes: %s (name one with --dtype)", sorted(dtypes))
    kv_dtypes = {load.kv_cache_dtype or "unquantized" for load in loads}
    if len(kv_dtypes) > 1:  # a decode worker refuses KV in another format: every hand-off between them fails
        log.warning("workers hold their KV caches in different formats: %s (give every worker the same --kv-cache-dtype)", sorted(kv_dtypes))
    first = loads[0]
    return ModelFacts(
        name=first.model_name,
        vocab_size=vocab_size(config.model),
        max_seq_len=min(load.max_seq_len for load in loads),
        eos_token_ids=eos_token_ids(config.model),
        backend=first.backend,
        dtype=first.dtype,
    )

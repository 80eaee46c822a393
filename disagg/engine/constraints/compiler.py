"""Compiles constraints against the model's tokenizer, once per text, off the event loop and
off the device thread, and starts a row's matcher.

The llguidance tokenizer (every token's bytes, built once per process from the Hugging
Face tokenizer) is made on the compile thread as soon as the compiler exists, so the
first constrained request does not pay for it. A compiled constraint is a fresh matcher
that each row deep-copies: compiling is paid once per distinct text (LRU cache), and a
text that fails to compile fails fast the next time too.

Bounds: a constraint's size is checked before it reaches here (spec.Constraint.check);
compiling is bounded by llguidance's own fuel limits (lexer fuel, grammar size) and by
`compile_seconds` on the caller's side; each step's mask is bounded by llguidance's
per-step fuel, so a pathological grammar costs its own row a truncated mask, never the
batch an unbounded step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import llguidance.hf

from ..requests import InvalidField
from .grammars import to_grammar
from .rows import RowMatcher, first_token_bitmask
from .spec import Constraint

log = logging.getLogger(__name__)

COMPILE_SECONDS = 10.0  # a worker's bound; the router's is its flag (--constraint-compile-seconds)
CACHE_SIZE = 256


class ConstraintCompiler:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, eos_token_ids: Sequence[int] = (),
                 compile_seconds: float = COMPILE_SECONDS, cache_size: int = CACHE_SIZE, threads: int = 1, local_tokenizer: bool = True):
        """load_tokenizer: returns the model's (fast) Hugging Face tokenizer; called once, on a compile thread.
        vocab_size: the logits' width (the bitmask covers it; ids past the tokenizer's are never allowed)."""
        self.vocab_size = vocab_size
        self.compile_seconds = compile_seconds
        self.local_tokenizer = local_tokenizer  # load_tokenizer reads local files only: wait_ready may wait for it
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="constraint-compile")
        self._tokenizer: Future = self._threads.submit(self._llg_tokenizer, load_tokenizer, list(eos_token_ids))
        self._cache: collections.OrderedDict[Constraint, Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # constraints compiled (cache misses), for the tests and the benchmark

    def _llg_tokenizer(self, load_tokenizer, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
        started = time.perf_counter()
        tokenizer = llguidance.hf.from_tokenizer(load_tokenizer(), n_vocab=self.vocab_size, eos_token=eos_token_ids or None)
        log.info("constraint tokenizer ready in %.2f s", time.perf_counter() - started)
        return tokenizer

    def wait_ready(self) -> None:
        """Returns once the tokenizer is built (a build that failed says why with the first constraint).
        A worker waits for it before it serves: llguidance's constructor holds the GIL throughout (6.2 s
        for a 49,152-token vocabulary on this project's CPU, the worker's every thread stopped meanwhile),
        so a worker that served first would answer no health check, load poll or step until it ends.
        Not where the checkpoint has no tokenizer.json of its own (workers deal in token ids): loading one
        from elsewhere may wait on a hub that does not answer, and a worker must not wait on that to serve."""
        if not self.local_tokenizer:
            return
        try:
            self._tokenizer.result()
        except Exception:  # noqa: BLE001 - reported where a constraint needs it
            pass

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def compile_future(self, constraint: Constraint) -> Future:
        """The compiled constraint (a template matcher) as a concurrent future, from the cache or compiling."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                return future
            future = self._threads.submit(self._compile, constraint)
            self._cache[constraint] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        tokenizer = self._tokenizer.result()
        self.compiles += 1
        try:
            grammar = to_grammar(constraint)
        except Exception as exc:  # llguidance and the GBNF converter raise their own types for bad input
            raise InvalidField(constraint.field, f"does not compile: {exc}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidField(constraint.field, f"does not compile: {first_lines(matcher.get_error())}")
        return matcher

    def compiled(self, constraint: Constraint, timeout: float | None = None) -> llguidance.LLMatcher:
        """Blocking: the template matcher; InvalidField when it does not compile in time or at all."""
        future = self.compile_future(constraint)
        try:
            return future.result(timeout=self.compile_seconds if timeout is None else timeout)
        except FutureTimeout:  # not the builtin TimeoutError before Python 3.11
            raise InvalidField(constraint.field, f"did not compile within {self.compile_seconds:g} s") from None

    def start_row(self, constraint: Constraint, history: Sequence[int]) -> RowMatcher:
        """Blocking: a row's matcher that has consumed `history` (the tokens generated before this worker)."""
        matcher = self.compiled(constraint).deep_copy()
        if history and not matcher.consume_tokens(list(history)):
            raise InvalidField(constraint.field, f"does not accept the {len(history)} tokens generated before: {first_lines(matcher.get_error())}")
        return RowMatcher(matcher)

    async def check(self, constraint: Constraint) -> None:
        """Compiles (or finds) the constraint without blocking the event loop; InvalidField if it cannot."""
        await asyncio.get_running_loop().run_in_executor(None, self.compiled, constraint)

    async def row(self, constraint: Constraint, history: Sequence[int]) -> RowMatcher:
        return await asyncio.get_running_loop().run_in_executor(None, self.start_row, constraint, history)

    async def first_bitmask(self, constraint: Constraint, history: Sequence[int]):
        """A prefill's [1, words] mask: what may follow `history` (the tokens generated before)."""
        fill = lambda: first_token_bitmask(self.start_row(constraint, history), self.vocab_size)  # noqa: E731
        return await asyncio.get_running_loop().run_in_executor(None, fill)


def first_lines(message: str, lines: int = 3) -> str:
    return " ".join(message.strip().splitlines()[:lines])


def model_compiler(model: str, vocab_size: int, eos_token_ids: Sequence[int], compile_seconds: float = COMPILE_SECONDS) -> ConstraintCompiler:
    """A worker's compiler: the tokenizer of the checkpoint it serves (the router passes its own loaded one)."""

    def load():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)

    return ConstraintCompiler(load, vocab_size, eos_token_ids, compile_seconds, local_tokenizer=os.path.isfile(os.path.join(model, "tokenizer.json")))

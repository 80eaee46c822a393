"""Typed request parameters as the engine sees them (converted from protobuf at the edges),
and the one set of rules every edge checks them with (the router's public APIs and
the workers' own): an edge converts what it received, calls these, and renames the
refused field to its own API's name (see InvalidField).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .constraints.spec import Constraint

# Bounds that hold at every edge. The router may lower them for its clients (router/config.py
# Limits), never raise them: a worker refuses anything past them whoever sends it.
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_STOP_TOKEN_IDS = 64  # a client's own; the router adds the model's EOS ids to them
MAX_REQUEST_ID_CHARS = 128
INT64 = (-(2**63), 2**63 - 1)


class InvalidField(ValueError):
    """A request value outside its rule. `field` is the engine's name for it (a Sampling or
    Stopping attribute, or the public API's name where the two differ: "top_logprobs"); each
    edge maps it to its own API's field name and answers INVALID_ARGUMENT."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"{field} {rule}")
        self.field = field
        self.rule = rule


class FinishReason(enum.IntEnum):
    # Values equal the public proto's FinishReason and the worker proto's WorkerFinish.
    NONE = 0
    LENGTH = 1
    STOP = 2
    STOP_SEQUENCE = 3


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling. temperature 0 is greedy; top_k 0, top_p 1.0, min_p 0
    and the neutral penalties (0, 0, 1.0) are off.

    logprobs: -1 returns none; n >= 0 returns each sampled token's logprob and
    its n most likely alternatives (see sampler.py for the distribution).
    constraint: the grammar every generated token must follow (disagg/engine/constraints), or None.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = -1
    constraint: Constraint | None = None

    @property
    def needs_history(self) -> bool:
        """Whether a worker needs the ids of the tokens before it (penalties count them, a matcher replays them)."""
        return self.penalized or self.constraint is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def features_used(self) -> list[str]:
        """The Sampling fields beyond NxDI's (top_k, top_p, temperature) that this request sets."""
        used = {
            "min_p": self.min_p != 0.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "logprobs": self.logprobs >= 0,
            "constraint": self.constraint is not None,
        }
        return [name for name, on in used.items() if on]

    def check(self, max_top_logprobs: int = MAX_TOP_LOGPROBS, max_constraint_chars: int | None = None) -> None:
        """Raises InvalidField for the first value the sampler must not be given
        (a NaN temperature, top_p 7, top_k -5, min_p 3, more alternatives than the bound,
        a constraint over its size or malformed; whether it compiles is the compiler's to say)."""
        if not _finite(self.temperature) or self.temperature < 0:
            raise InvalidField("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (_finite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidField("top_p", f"must be in (0, 1], got {self.top_p}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise InvalidField("top_k", f"must be >= 0 (0 turns it off), got {self.top_k}")
        if not (_finite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidField("min_p", f"must be in [0, 1] (0 turns it off), got {self.min_p}")
        if not (_integer(self.seed) and INT64[0] <= self.seed <= INT64[1]):
            raise InvalidField("seed", f"must fit in a signed 64-bit integer, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_finite(value) and -2 <= value <= 2):
                raise InvalidField(name, f"must be in [-2, 2] (0 turns it off), got {value}")
        if not (_finite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidField("repetition_penalty", f"must be a finite number > 0 (1 turns it off), got {self.repetition_penalty}")
        if self.logprobs != -1:
            check_logprobs(True, self.logprobs, max_top_logprobs)
        if self.constraint is not None:
            self.constraint.check() if max_constraint_chars is None else self.constraint.check(max_constraint_chars)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def stop_token_bound(eos_count: int) -> int:
    """How many stop ids a worker may be sent: a client's own, and the model's EOS ids the router adds."""
    return MAX_STOP_TOKEN_IDS + eos_count


def check_logprobs(logprobs: bool, top_logprobs: int, max_top_logprobs: int = MAX_TOP_LOGPROBS) -> None:
    """The (logprobs, top_logprobs) pair as both APIs carry it; Sampling.logprobs folds it into one int."""
    if not (_integer(top_logprobs) and 0 <= top_logprobs <= max_top_logprobs):
        raise InvalidField("top_logprobs", f"must be in [0, {max_top_logprobs}], got {top_logprobs}")
    if top_logprobs and not logprobs:
        raise InvalidField("top_logprobs", "needs logprobs set to true")


def check_token_ids(name: str, ids: Iterable[int], vocab_size: int, max_count: int | None = None) -> None:
    """Every id a token of the vocabulary, and (with max_count) not too many of them."""
    ids = ids if isinstance(ids, (list, tuple, frozenset, set)) else list(ids)
    if max_count is not None and len(ids) > max_count:
        raise InvalidField(name, f"has {len(ids)} ids; at most {max_count} are allowed")
    bad = next((t for t in ids if not (_integer(t) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise InvalidField(name, f"contains {bad}, outside the vocabulary [0, {vocab_size})")


def check_prompt_len(name: str, prompt_len: int, max_seq_len: int) -> None:
    """A prompt (or a resumed request's context) that leaves room for at least one new token."""
    if prompt_len < 1:
        raise InvalidField(name, "is empty")
    if prompt_len >= max_seq_len:
        raise InvalidField(name, f"has {prompt_len} tokens; the maximum sequence length {max_seq_len} leaves no room to generate")


def check_request_id(request_id: str, max_chars: int = MAX_REQUEST_ID_CHARS) -> None:
    if len(request_id) > max_chars:
        raise InvalidField("request_id", f"has {len(request_id)} characters; at most {max_chars} are allowed")


def check_first_step(first_step: int, prompt_len: int) -> None:
    """The sampling counter of a resumed request: the tokens generated before, all part of its context."""
    if not 0 <= first_step < max(prompt_len, 1):
        raise InvalidField("first_step", f"must be in [0, {max(prompt_len, 1)}) for a context of {prompt_len} tokens, got {first_step}")


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and its most likely alternatives, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Stopping:
    """Token-level stops, decided in the decode worker (and for the first token, the router)."""

    max_new_tokens: int
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)

    def check(self, prompt_len: int, vocab_size: int, max_seq_len: int, max_stop_token_ids: int) -> None:
        """Raises InvalidField unless the stops fit a context of prompt_len tokens.

        max_stop_token_ids: the bound on the merged set (a client's MAX_STOP_TOKEN_IDS
        plus the model's EOS ids, which the router adds)."""
        if not _integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidField("max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        if prompt_len + self.max_new_tokens > max_seq_len:
            total = prompt_len + self.max_new_tokens
            together = f"together {total}, over the maximum sequence length {max_seq_len}"
            raise InvalidField("max_new_tokens", f"is {self.max_new_tokens} and the prompt has {prompt_len} tokens: {together}")
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size, max_stop_token_ids)


def token_finish(token: int, generated: int, seq_len: int, stopping: Stopping, max_seq_len: int) -> FinishReason:
    """Why generation ends after `token`, the `generated`-th new token, at total length `seq_len`."""
    if token in stopping.stop_token_ids:
        return FinishReason.STOP
    if generated >= stopping.max_new_tokens or seq_len >= max_seq_len:
        return FinishReason.LENGTH
    return FinishReason.NONE

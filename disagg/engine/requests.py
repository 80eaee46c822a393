"""Typed request parameters as the engine sees them (converted from protobuf at the edges)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
        }
        return [name for name, on in used.items() if on]


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


def token_finish(token: int, generated: int, seq_len: int, stopping: Stopping, max_seq_len: int) -> FinishReason:
    """Why generation ends after `token`, the `generated`-th new token, at total length `seq_len`."""
    if token in stopping.stop_token_ids:
        return FinishReason.STOP
    if generated >= stopping.max_new_tokens or seq_len >= max_seq_len:
        return FinishReason.LENGTH
    return FinishReason.NONE

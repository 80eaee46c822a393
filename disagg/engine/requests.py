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
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1.0 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


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

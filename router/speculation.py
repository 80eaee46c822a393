"""Speculation across the split: every prefill and decode worker the router routes to carries the same
speculative decoding settings (method, guesses a step, draft model), as vLLM checks that both sides'
configs match at its prefill/decode handshake. A worker reports its settings with its load (WorkerLoad);
the pool (router/workers.py) takes a worker in only where they are the pool's.

The pool's settings: those of the workers it serves on. When it serves on none (at start, or after every
worker went away), the settings most of the workers answering that poll carry, ties going to the first of
them in the pool's order (prefill workers, then decode workers, each as given on the command line). A
worker whose settings differ is refused (no requests) until it comes back with the pool's; the service goes
on serving on the others. docs/speculation.md#one-setting-for-the-whole-service.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass

from disagg.v1 import worker_pb2 as wpb


@dataclass(frozen=True)
class Speculation:
    """A worker's speculation settings; method "" is off."""

    method: str = ""
    num_tokens: int = 0
    draft_model: str = ""

    @classmethod
    def from_load(cls, load: wpb.WorkerLoad) -> Speculation:
        spec = load.speculation
        return cls(spec.method, spec.num_tokens, spec.draft_model) if load.HasField("speculation") else cls()

    def __str__(self) -> str:
        if not self.method:
            return "off"
        draft = f" {self.draft_model}" if self.draft_model else ""
        return f"{self.method}{draft}, {self.num_tokens} tokens"


def most_carried(loads: Iterable[wpb.WorkerLoad]) -> Speculation:
    """The settings most of these loads carry; in a tie, the first's (Counter keeps first-seen order among equals)."""
    return collections.Counter(Speculation.from_load(load) for load in loads).most_common(1)[0][0]


def refusal(role: str, address: str, carried: Speculation, pool: Speculation) -> str:
    """The one line the router logs for a worker it refuses."""
    return (f"{role} worker {address} refused: its speculation ({carried}) is not the pool's ({pool}); it gets no requests until it"
            " comes back with the pool's (every prefill and decode worker needs the same --speculative-method, --num-speculative-tokens"
            " and --draft-model)")

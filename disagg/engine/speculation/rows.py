"""One sequence's speculation state on the decode worker: its tokens, its guess length, and
how far the draft model's KV of it reaches (the draft proposer's)."""

from __future__ import annotations

from . import SpeculationConfig
from .acceptance import AdaptiveLength, kept_tokens
from .ngram import NgramIndex

EXPECTATION_RECOVERY = 0.02  # a row that does not guess is trusted again after about 25 steps


class RowSpeculation:
    def __init__(self, config: SpeculationConfig, slot: int, context_ids: tuple[int, ...], first_token: int):
        self.slot = slot
        self.index = NgramIndex([*context_ids, first_token], config.ngram_min, config.ngram_max)
        self.length = AdaptiveLength(config.num_tokens)
        self.draft_seen = 0  # positions whose K/V the draft model holds (draft.py; eagle.py: pairs); 0 until its prefill
        self.first_position = len(context_ids)  # first_token's: the first decode step's input
        self.proposed = 0  # guesses made, over the row's life
        self.accepted = 0  # of those, kept
        # Tokens its guesses add to a step, recently (halved each step with guesses, then the step's kept guesses
        # added at half weight); while it does not guess it drifts back up, so a row is tried again in time.
        self.expected = 1.0

    @property
    def tokens(self) -> list[int]:
        """The sequence so far: context, then every token kept; the last is the next step's input."""
        return self.index.tokens

    @property
    def ready(self) -> bool:
        """Whether the row would guess at its next step (not resting): the loop then waits for the
        step in flight, since guesses follow the row's newest token."""
        return not self.length.resting

    def wanted(self, budget: int, may_rest: bool = True) -> int:
        """How many guesses this step: the adaptive length, at most budget (what the row's length limits allow).
        may_rest: whether misses at this step count towards a rest (not in a batch small enough that they cost nothing)."""
        self.length.may_rest = may_rest
        return max(0, min(self.length.wanted(), budget))

    def no_proposal(self) -> None:
        self.length.no_proposal()  # text that never repeats rests the row
        self.expected *= 0.5

    def step_without_guesses(self) -> None:
        """A step the row joins without guessing (its input token not on the host yet, or guesses not worth a
        step's wait): a resting row's rest goes on, and its expectation drifts back up."""
        self.length.wanted()
        self.expected = min(1.0, self.expected + EXPECTATION_RECOVERY)

    def kept(self, guesses: list[int], produced: list[int]) -> list[int]:
        """The tokens the row keeps from its step (produced: the target's, one per row), counted."""
        kept = kept_tokens(guesses, produced)
        accepted = len(kept) - 1
        self.proposed += len(guesses)
        self.accepted += accepted
        self.length.observe(len(guesses), accepted)
        self.expected = 0.5 * self.expected + 0.5 * accepted
        # The draft's K/V at the guesses' positions holds for the guesses kept only.
        self.draft_seen = min(self.draft_seen, len(self.tokens) + accepted)
        return kept

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)


def row_speculation(config: SpeculationConfig | None, slot: int, context_ids: tuple[int, ...], first_token: int):
    """The row's speculation, or None with speculation off. Every row speculates: penalized ones (their
    guesses counted as generated, torch_backend.guesses_before) and constrained ones (their matcher
    advanced by each guess the grammar allows, and taken back to the kept ones: constraints/rows.py)."""
    if config is None:
        return None
    return RowSpeculation(config, slot, context_ids, first_token)

"""One sequence's speculation state on the decode worker: its proposer and its guess length."""

from __future__ import annotations

from . import SpeculationConfig
from .acceptance import AdaptiveLength, kept_tokens
from .ngram import NgramIndex


class RowSpeculation:
    def __init__(self, config: SpeculationConfig, context_ids: tuple[int, ...], first_token: int):
        self.index = NgramIndex([*context_ids, first_token], config.ngram_min, config.ngram_max)
        self.length = AdaptiveLength(config.num_tokens)
        self.proposed = 0  # guesses made, over the row's life
        self.accepted = 0  # of those, kept

    @property
    def ready(self) -> bool:
        """Whether the row would guess at its next step (not resting): the loop then waits for the
        step in flight, since guesses follow the row's newest token."""
        return not self.length.resting

    def guesses(self, budget: int) -> list[int]:
        """This step's guesses, at most budget (what the row's length limits still allow)."""
        wanted = min(self.length.wanted(), budget)
        if wanted <= 0:
            return []
        guesses = self.index.propose(wanted)
        if not guesses:
            self.length.no_proposal()  # text that never repeats rests the row
        return guesses

    def step_without_guesses(self) -> None:
        """A step the row joins without guessing (its input token not on the host yet): a resting row's rest goes on."""
        self.length.wanted()

    def kept(self, guesses: list[int], produced: list[int]) -> list[int]:
        """The tokens the row keeps from its step (produced: the target's, one per row), counted."""
        kept = kept_tokens(guesses, produced)
        self.proposed += len(guesses)
        self.accepted += len(kept) - 1
        self.length.observe(len(guesses), len(kept) - 1)
        return kept

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)


def row_speculation(config: SpeculationConfig | None, context_ids: tuple[int, ...], first_token: int, penalized: bool, constrained: bool):
    """The row's speculation, or None where it decodes one token a step: speculation off, or a row
    with penalties or a constraint (their state per guess is not built yet; such rows run beside
    speculating ones in the same steps, unchanged)."""
    if config is None or penalized or constrained:
        return None
    return RowSpeculation(config, context_ids, first_token)

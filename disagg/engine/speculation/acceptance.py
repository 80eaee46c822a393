"""Which of a row's tokens a speculative step keeps, and how many guesses it gets next.

Row j of a speculating sequence's step reads guess j (row 0 its known input token)
and produces the target's token t_j for the position after it. t_j is valid only if
every guess before it was what the target produced there: the row keeps t_0 and
each t_j whose guess j equals t_{j-1}. For sampled rows this is rejection sampling
with the guesses as point proposals (accepted with the target's probability of the
guess), drawn with the draw the target would make without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass


def kept_tokens(guesses: list[int], produced: list[int]) -> list[int]:
    """produced: the target's tokens after the input and after each guess (len(guesses) + 1)."""
    kept = [produced[0]]
    for guess, token in zip(guesses, produced[1:]):
        if guess != kept[-1]:
            break
        kept.append(token)
    return kept


@dataclass
class AdaptiveLength:
    """A row's guesses per step: grows by one after a step that kept every guess, shrinks to
    the kept ones plus one after a miss; after `misses_before_rest` steps in a row that kept
    no guess the row rests (no guesses) for `rest_steps` steps, twice as long after each rest
    that ended in misses again (up to `longest_rest`), so text that does not repeat costs
    next to nothing; a kept guess starts the rests short again."""

    limit: int
    length: int = 0
    misses: int = 0
    resting: int = 0
    misses_before_rest: int = 2
    rest_steps: int = 8
    shortest_rest: int = 8
    longest_rest: int = 256
    may_rest: bool = True  # set per step: alone or nearly, a miss costs next to nothing and the row keeps guessing

    def __post_init__(self):
        self.length = self.limit

    def wanted(self) -> int:
        if self.resting:
            self.resting -= 1
            return 0
        return self.length

    def observe(self, guessed: int, accepted: int) -> None:
        if guessed == 0:
            return
        if accepted == guessed:
            self.length = min(self.limit, self.length + 1)
            self.misses, self.rest_steps = 0, self.shortest_rest
            return
        self.length = max(1, accepted + 1)
        if accepted:
            self.misses, self.rest_steps = 0, self.shortest_rest
        else:
            self._missed()

    def no_proposal(self) -> None:
        """The proposer had nothing to guess: a miss, the length kept for when it has."""
        self._missed()

    def _missed(self) -> None:
        if not self.may_rest:
            return
        self.misses += 1
        if self.misses >= self.misses_before_rest:
            self.misses, self.resting = 0, self.rest_steps
            self.rest_steps = min(2 * self.rest_steps, self.longest_rest)

"""Whether guessing pays at a batch size, from the steps' measured wall time.

A step with guesses is synchronous: the host must see each row's newest token before it
can guess what follows, so the step waits for the one before it and every row loses the
async overlap (decode_loop.py). Whether the tokens the guesses add pay for that depends
on the host, the model, the batch and the proposer, so it is measured rather than assumed:
for each batch size, the seconds between the steps the loop takes in, and the tokens each
emits, of steps with guesses and of steps without. Until both kinds have been seen at a
batch size, the rows' recent kept guesses decide (the loop's `worth_share`); after, guessing
goes on where the tokens the ready rows are expected to emit, over a guessing step's
measured seconds, at least match what steps without guesses measured. A decision that has
held for `recheck_every` steps is turned once, so the other kind's figure stays current.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Rate:
    seconds: float  # smoothed wall time a step takes, between the loop's takings-in
    tokens: float  # smoothed tokens a step emits
    count: int = 1

    def add(self, seconds: float, tokens: int, smoothing: float) -> None:
        self.seconds += smoothing * (seconds - self.seconds)
        self.tokens += smoothing * (tokens - self.tokens)
        self.count += 1


class StepPayoff:
    def __init__(self, smoothing: float = 0.25, min_samples: int = 3, recheck_every: int = 64):
        self.smoothing = smoothing
        self.min_samples = min_samples
        self.recheck_every = recheck_every
        self._plain: dict[int, _Rate] = {}
        self._guessing: dict[int, _Rate] = {}
        self._streak: dict[int, tuple[bool, int]] = {}  # batch -> (guessed, steps of that kind in a row)

    def observe(self, batch: int, guessed: bool, seconds: float, tokens: int) -> None:
        """One step of `batch` sequences, taken in `seconds` after the one before it, emitted `tokens`."""
        rates = self._guessing if guessed else self._plain
        if batch in rates:
            rates[batch].add(seconds, tokens, self.smoothing)
        else:
            rates[batch] = _Rate(seconds, tokens)
        kind, run = self._streak.get(batch, (guessed, 0))
        self._streak[batch] = (guessed, run + 1 if kind == guessed else 1)

    def worth_guessing(self, batch: int, expected_tokens: float, promising: bool) -> bool:
        """expected_tokens: what a step with guesses should emit (a token a row and the ready rows'
        expected kept guesses); promising: the kept-guesses rule's answer, used until both are measured."""
        plain, guessing = self._plain.get(batch), self._guessing.get(batch)
        if plain is None or guessing is None or min(plain.count, guessing.count) < self.min_samples:
            return promising
        pays = expected_tokens / guessing.seconds >= plain.tokens / plain.seconds
        kind, run = self._streak.get(batch, (pays, 0))
        if kind == pays and run >= self.recheck_every:
            return not pays  # measure the other kind again: its figure may be stale
        return pays

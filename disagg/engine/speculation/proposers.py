"""Proposers: each speculating row's guesses for a step, from its tokens so far.

`ngram` looks the row's latest tokens up earlier in the row (ngram.py) on the decode loop's
thread: no model. `draft` runs a second, smaller model (draft.py) on the device thread.
"""

from __future__ import annotations

from .rows import RowSpeculation


class NgramProposer:
    on_device = False  # cheap host work: on the decode loop's thread

    def propose(self, wanted: list[tuple[RowSpeculation, int]]) -> list[list[int]]:
        return [row.index.propose(count) for row, count in wanted]

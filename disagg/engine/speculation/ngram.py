"""Prompt lookup (n-gram) proposals: the sequence's latest n tokens, found earlier in its
prompt or output, propose the tokens that followed them there.

The index keeps, for each n in [min_n, max_n], where each n-gram last ended, updated
as tokens arrive (a dictionary write a size, a token), so a proposal costs a look-up a size
however long the sequence: no scan of the history per step.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, tokens: list[int], min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n -> {n-gram: the index just past its latest occurrence that has a token after it}
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here now get a following token
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[n][tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, count: int) -> list[int]:
        """Up to count tokens: what followed the latest earlier occurrence of the longest suffix found."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._ends[n].get(tuple(self.tokens[length - n :]))
            if end is not None:
                return self.tokens[end : end + count]
        return []

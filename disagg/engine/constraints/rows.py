"""A row's matcher, and a step's bitmask over all rows.

A row's matcher is fed the row's tokens in order: on the decode worker, each step's
input token just before that step's mask is filled (the input token is the previous
step's output, so async mode needs no host round trip to know it). It is touched by
one thread at a time: the compile thread that starts it, then the decode loop's mask
thread, step after step.
"""

from __future__ import annotations

import logging

import llguidance
import torch

log = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class RowMatcher:
    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self._warned = False
        self.guessed = 0  # speculative guesses consumed in the step being computed (taken back after it: keep_guesses)
        self._guessing = False

    def advance(self, token: int) -> None:
        """The row produced `token`. A token the grammar refuses (it was masked: only when the
        matcher is already stopped or failed) leaves the matcher failed, whose mask allows only EOS."""
        if not self.matcher.consume_token(token) and not self._warned:
            self._warned = True
            log.warning("constraint matcher refused token %d: %s", token, self.matcher.get_error().splitlines()[:1])

    def advance_guess(self, token: int) -> bool:
        """A speculative guess follows: consumed where the grammar allows it (the next row's mask is then
        the grammar's after it); a guess it refuses is not consumed, and this step's later guesses neither:
        the token sampled before it cannot equal it, so no row after it is kept."""
        self._guessing = self._guessing and self.matcher.try_consume_tokens([token]) == 1
        self.guessed += self._guessing
        return self._guessing

    def start_step(self) -> None:
        self.guessed, self._guessing = 0, True

    def keep_guesses(self, kept: int) -> None:
        """After a speculative step: of the guesses consumed, the first `kept` stay (the row kept them)."""
        if self.guessed > kept:
            self.matcher.rollback(self.guessed - kept)
        self.guessed = 0

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] (EOS only once the grammar is done or failed).

        The matcher writes the row's words itself, as llguidance.torch.fill_next_token_bitmask has it do; that
        module is not imported: it compiles a kernel with torch.compile at import, which loads TorchDynamo and
        Inductor (about 2 s of every worker's start, for a function this project does not call)."""
        if bitmask.dtype != torch.int32 or not bitmask.is_cpu or bitmask.dim() != 2 or not bitmask[row].is_contiguous():
            raise ValueError(f"a token bitmask is [rows, words] int32 on the CPU, rows contiguous: got {tuple(bitmask.shape)} {bitmask.dtype}")
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()


def first_token_bitmask(matcher: RowMatcher, vocab_size: int) -> torch.Tensor:
    """[1, words] int32: the mask of a prefill's one token."""
    bitmask = torch.full((1, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    matcher.fill(bitmask, 0)
    return bitmask


def step_bitmask(matchers: list[RowMatcher | None], input_ids: list[int], vocab_size: int, guess_rows: list[bool] | None = None) -> torch.Tensor:
    """[n, words] int32 for one decode step: each constrained row's matcher advanced by its input
    token, then its mask filled; the unconstrained rows' rows all ones. guess_rows: which rows are a
    speculating row's guesses (its matcher repeated on them, in order: each advanced by its guess)."""
    bitmask = torch.full((len(matchers), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for row, (matcher, token) in enumerate(zip(matchers, input_ids)):
        if matcher is None:
            continue
        if guess_rows is not None and guess_rows[row]:
            if matcher.advance_guess(token):
                matcher.fill(bitmask, row)
            continue  # past a refused guess: the row is not kept, its mask does not matter
        matcher.advance(token)
        matcher.start_step()
        matcher.fill(bitmask, row)
    return bitmask

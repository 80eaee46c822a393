"""Speculative decoding on the decode worker: more than one token from one pass over the weights.

A proposer guesses each row's next tokens; the decode step scores the row's input
token and its guesses as consecutive rows over the sequence's own block table (the
same kernels, each row attending over the positions up to its own, its K/V written
first), and the row keeps its target's token at every position up to the first
guess the target did not pick (acceptance.py). A kept token is therefore exactly
the token the step would have produced without speculation: the same logits, and
for sampled rows the same draw (the counter-based generator is keyed by the token's
position), so greedy, seeded and sampled output are what they are without it. The
K/V of rejected guesses lies past the sequence's length: never read, and written
over by the next step.

Proposers (proposers.py): `ngram` (prompt lookup, ngram.py), `draft` (a smaller model with the
same tokenizer, draft.py) and `eagle` (a draft head over the model's own hidden states, eagle.py).
The number of guesses a row gets
follows its acceptance (acceptance.AdaptiveLength), down to none, and whether a step of several
sequences guesses at all follows its measured payoff (payoff.py).
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft", "eagle")
# As llama.cpp's n-gram drafts (up to 48 tokens by default): a row reciting its prompt keeps them all, and on
# bench/speculation.py's target a step of 33 rows took 9.7 ms where one of 17 took 6.3 (docs/benchmarks.md).
MAX_SPECULATIVE_TOKENS = 64
DEFAULT_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True)
class SpeculationConfig:
    method: str  # ngram, draft or eagle
    num_tokens: int  # the most guesses a row gets in one step
    ngram_max: int = 4  # prompt lookup: the longest suffix looked for earlier in the sequence
    ngram_min: int = 2  # and the shortest (one token found earlier predicts too little: proposals wasted 3x as often here)
    max_batch: int = 8  # rows guess only in steps of at most this many sequences: above it, async steps of one token a row are worth more
    rest_above: int = 2  # rows that keep missing rest only in steps of more sequences than this (below, a guess row costs next to nothing)
    # Above rest_above sequences, a step waits for the one before it (to guess) only where the rows' recent kept
    # guesses add at least this share of the batch's tokens: the wait costs every row its async overlap.
    worth_share: float = 0.25

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--speculative-method {self.method!r}: expected one of {', '.join(METHODS)}")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--num-speculative-tokens must be 1..{MAX_SPECULATIVE_TOKENS}, got {self.num_tokens}")

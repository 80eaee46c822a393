"""The draft-model proposer: a second, smaller checkpoint with the target's tokenizer, run by the
same backend on the decode worker's device thread, with a KV slot of its own per decode slot.

The first time a row guesses, the draft computes the K/V of the row's context into its slot
(recomputed here rather than sent by the prefill worker: a draft is the cheap model, and its
prefill of a prompt costs a fraction of the target's; and a row that never guesses, in a batch
too large to speculate, costs the draft nothing). Each time, it first takes in the tokens the
row kept since it last ran (several rows of one sequence in one step, as a verify step takes a
row's guesses, in pieces of at most CATCH_UP_ROWS), then guesses greedily one token a step. Its K/V past the guesses the
target kept is written over by the next catch-up, as the target's is.
"""

from __future__ import annotations

import torch

from ..backends import Backend, StepInputs
from ..cpu_kernels.greedy import greedy_ids
from ..requests import Sampling
from ..sampler import params_row
from .rows import RowSpeculation


def check_draft_matches(target: str, draft: str) -> None:
    """Raises ValueError naming the mismatch where the draft's tokenizer is not the target's: its
    guesses would be other tokens' ids."""
    from transformers import AutoConfig, AutoTokenizer

    target_vocab, draft_vocab = (AutoConfig.from_pretrained(path).vocab_size for path in (target, draft))
    if target_vocab != draft_vocab:
        raise ValueError(f"--draft-model {draft}: its vocabulary has {draft_vocab} tokens, the model's {target_vocab}")
    target_tokenizer, draft_tokenizer = (AutoTokenizer.from_pretrained(path) for path in (target, draft))
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"--draft-model {draft}: its tokenizer's vocabulary differs from the model's")
    specials = [(t.bos_token_id, t.eos_token_id) for t in (target_tokenizer, draft_tokenizer)]
    if specials[0] != specials[1]:
        raise ValueError(f"--draft-model {draft}: its BOS/EOS ids {specials[1]} are not the model's {specials[0]}")


CATCH_UP_ROWS = 64  # a row's tokens the draft takes in at once (a prompt's, the first time): the native step's prefill size


class DraftProposer:
    """Runs on the device thread only (propose)."""

    on_device = True

    def __init__(self, backend: Backend):
        self.backend = backend
        self._greedy = params_row(Sampling())

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[RowSpeculation, int]]) -> list[list[int]]:
        wanted = [(row, min(count, self.backend.info.max_seq_len - len(row.tokens))) for row, count in wanted]
        guesses: list[list[int]] = [[] for _ in wanted]
        # First step: each row's tokens the draft has not seen, its newest last; the last row's logits give the first guess.
        # (At least the newest token: its K/V may be there from guesses made for a step that was rebuilt, but not its logits.)
        live = [i for i, (_, count) in enumerate(wanted) if count > 0]
        if not live:
            return guesses
        feeds = []
        for i in live:
            row = wanted[i][0]
            start = self._caught_up(row)
            feeds.append((row.slot, row.tokens[start:], start))
        tokens = self._step(feeds)
        for i, token in zip(live, tokens):
            row = wanted[i][0]
            guesses[i].append(token)
            row.draft_seen = len(row.tokens)
        for _ in range(max(count for _, count in wanted) - 1):
            live = [i for i in live if len(guesses[i]) < wanted[i][1]]
            if not live:
                break
            feeds = [(wanted[i][0].slot, [guesses[i][-1]], len(wanted[i][0].tokens) + len(guesses[i]) - 1) for i in live]
            for i, token in zip(live, self._step(feeds)):
                guesses[i].append(token)
                wanted[i][0].draft_seen += 1
        return guesses

    def _caught_up(self, row: RowSpeculation) -> int:
        """Takes in the row's unseen tokens but the last CATCH_UP_ROWS (whose last row's logits give the first
        guess) in pieces of CATCH_UP_ROWS; returns where the rest starts."""
        start = min(row.draft_seen, len(row.tokens) - 1)
        while len(row.tokens) - start > CATCH_UP_ROWS:
            self._step([(row.slot, row.tokens[start : start + CATCH_UP_ROWS], start)])
            start += CATCH_UP_ROWS
        return start

    def _step(self, feeds: list[tuple[int, list[int], int]]) -> list[int]:
        """One draft step: per feed (slot, tokens, first position) its rows; the greedy token after each feed's last row."""
        slots = [slot for slot, tokens, _ in feeds for _ in tokens]
        positions = [start + j for _, tokens, start in feeds for j in range(len(tokens))]
        ids = [token for _, tokens, _ in feeds for token in tokens]
        n = len(ids)
        inputs = StepInputs(
            slots=torch.tensor(slots), positions=torch.tensor(positions), input_ids=torch.tensor(ids),
            params=torch.tensor([self._greedy] * n, dtype=torch.float32), seeds=torch.zeros(n, dtype=torch.long),
            steps=torch.zeros(n, dtype=torch.long), kv_len=max(positions) + 1, contiguous_from=None, min_position=min(positions),
        )
        logits = self.backend.decode_logits(inputs)
        last_rows, end = [], 0
        for _, tokens, _ in feeds:
            end += len(tokens)
            last_rows.append(end - 1)
        return greedy_ids(logits[torch.tensor(last_rows)]).tolist()

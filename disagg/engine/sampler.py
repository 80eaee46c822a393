"""Batched sampling where the logits are, with per-row parameters and per-row seeds.

Parameters come as one [batch, 7] tensor whose first three columns are
(top_k, top_p, temperature), as NxDI's dynamic on-device sampling takes them,
then min_p and the three penalties. Randomness is counter-based: row i's
uniform draw is a hash of (its seed, its step), so a seeded request gets the
same tokens alone or in any batch; no shared generator is consumed.

Per row, in order (transformers' and vLLM's order):
  0. a constraint's bitmask (disagg/engine/constraints): tokens it forbids get -inf,
     for the whole batch in one op (rows without a constraint are all ones);
  1. penalties on the raw logits: repetition_penalty over the prompt and the
     generated tokens (transformers' RepetitionPenaltyLogitsProcessor: positive
     logits divided, negative multiplied), then OpenAI's
     logit -= frequency_penalty * count + presence_penalty * (count > 0)
     over the generated tokens;
  2. temperature (0: greedy, the argmax of step 1);
  3. top-k, top-p, min-p truncation (min-p as transformers' MinPLogitsWarper);
  4. the seeded draw.
Logprobs are the log-softmax after steps 1 and 2, before truncation: the
distribution the request's own parameters shape, as vLLM's
logprobs_mode="processed_logprobs" (vLLM's default is the raw model output);
with a constraint, over the allowed tokens only (the constrained distribution).
Every step is a tensor op over all rows; only token ids (and the logprobs a
request asked for) leave this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .cpu_kernels.greedy import greedy_ids as first_maxima
from .requests import Sampling

_MASK32 = 0xFFFFFFFF
# Columns of the params tensor.
TOP_K, TOP_P, TEMPERATURE, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(7)
NUM_PARAMS = 7


def params_tensor(samplings: list[Sampling], device="cpu") -> torch.Tensor:
    """[batch, 7] float32 rows of (top_k, top_p, temperature, min_p, presence, frequency, repetition)."""
    return torch.tensor([params_row(s) for s in samplings], dtype=torch.float32, device=device).reshape(-1, NUM_PARAMS)


def params_row(s: Sampling) -> tuple[float, ...]:
    return (
        float(s.top_k), float(s.top_p), float(s.temperature), float(s.min_p),
        float(s.presence_penalty), float(s.frequency_penalty), float(s.repetition_penalty),
    )


@dataclass
class SampleOutput:
    """What one sampling call returns, on the logits' device."""

    token_ids: torch.Tensor  # [n] int64
    logprobs: torch.Tensor | None = None  # [n] float32, the sampled tokens'
    top_ids: torch.Tensor | None = None  # [n, k] int64, best first
    top_logprobs: torch.Tensor | None = None  # [n, k] float32

    def rows(self, wanted: list[int]) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Host side, per row: (logprob, the row's `wanted` top alternatives), or None where wanted < 0."""
        if self.logprobs is None:
            return [None] * len(wanted)
        logprobs = self.logprobs.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else [[]] * len(wanted)
        top_values = self.top_logprobs.tolist() if self.top_logprobs is not None else [[]] * len(wanted)
        # A constraint's forbidden tokens (-inf) are no alternatives: a row may list fewer than it asked.
        return [
            None if k < 0 else (logprobs[i], [(t, v) for t, v in zip(top_ids[i][:k], top_values[i][:k]) if v != float("-inf")]) for i, k in enumerate(wanted)
        ]


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (lowbias32) on int64 tensors; masking keeps the
    # low 32 bits exact even where the int64 product wraps.
    x = x & _MASK32
    x = (x ^ (x >> 16)) * 0x7FEB352D & _MASK32
    x = (x ^ (x >> 15)) * 0x846CA68B & _MASK32
    return x ^ (x >> 16)


def uniform_draws(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per row, a pure function of (seed, step)."""
    seeds = seeds.to(torch.int64)
    h = _mix32(seeds ^ _mix32(seeds >> 32) * 0x9E3779B9)
    h = _mix32(h ^ steps.to(torch.int64))
    low = _mix32(h ^ 0x5BD1E995)
    # 53 random bits: 32 from h, 21 from low.
    return ((h << 21) | (low >> 11)).to(torch.float64) / float(1 << 53)


_BIT_SHIFTS: dict = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab]; bitmask [n, ceil(vocab / 32)] int32, bit j of word w allows token 32w + j.

    On the CPU the forbidden tokens are numpy's unpacking of the inverted words (one pass
    that writes a byte per token) and the logits are masked in place: every pass over
    [n, vocab] counts there (32 rows of a 49k vocabulary: 6 ms this way, 15 with shifts)."""
    device = logits.device
    if device.type == "cpu":
        forbidden = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[-1]]
        return logits.masked_fill_(torch.from_numpy(forbidden.view(np.bool_)), float("-inf"))
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((bitmask.to(device)[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def apply_penalties(logits: torch.Tensor, params: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] float32; counts [n, vocab] of generated tokens; in_prompt [n, vocab] bool.

    Neutral rows (1.0, 0, 0) come out bit-identical: x * 1, x / 1 and x - 0 are exact.
    """
    repetition = params[:, REPETITION, None]
    seen = in_prompt | (counts > 0)
    repeated = torch.where(logits < 0, logits * repetition, logits / repetition)
    logits = torch.where(seen, repeated, logits)
    counts = counts.to(logits.dtype)
    return logits - params[:, FREQUENCY, None] * counts - params[:, PRESENCE, None] * (counts > 0).to(logits.dtype)


def sample(
    logits: torch.Tensor,
    params: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    global_topk: int = 0,
    counts: torch.Tensor | None = None,
    in_prompt: torch.Tensor | None = None,
    top_logprobs: int = -1,
    bitmask: torch.Tensor | None = None,
    greedy: bool = False,
) -> SampleOutput:
    """Token ids [batch] from logits [batch, vocab].

    top_k 0 means the whole vocabulary, unless `global_topk` > 0 caps every
    row's candidates at that many (NxDI's global_topk, a speed/fidelity knob).
    counts/in_prompt: the rows' token counts (given when a row has a penalty).
    top_logprobs: -1 when no row wants logprobs, else the most alternatives any row wants.
    bitmask: [batch, ceil(vocab / 32)] int32, the tokens each row may produce (None: all).
    greedy: every row is greedy, as the caller knows (params are then not read: after a CPU step
    each torch call costs microseconds, its dispatch pushed out of the caches by the weights).
    """
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    if counts is not None:
        logits = apply_penalties(logits.float(), params, counts, in_prompt)
    greedy_ids = first_maxima(logits)  # logits.argmax(dim=-1)'s indices (greedy.c on CPU)
    if greedy and top_logprobs < 0:
        return SampleOutput(greedy_ids)
    top_k, top_p, temperature, min_p = params[:, TOP_K], params[:, TOP_P], params[:, TEMPERATURE], params[:, MIN_P]
    greedy = (temperature <= 0) | (top_k == 1)
    all_greedy = bool(greedy.all())
    if all_greedy and top_logprobs < 0:
        return SampleOutput(greedy_ids)
    scaled = logits.float() / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    token_ids = greedy_ids if all_greedy else torch.where(greedy, greedy_ids, _draw(scaled, top_k, top_p, min_p, seeds, steps, global_topk))
    if top_logprobs < 0:
        return SampleOutput(token_ids)
    return _with_logprobs(token_ids, scaled, top_logprobs)


def _draw(scaled: torch.Tensor, top_k, top_p, min_p, seeds, steps, global_topk: int) -> torch.Tensor:
    """The seeded draw of every row from its truncated distribution."""
    vocab = scaled.shape[-1]
    row_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, global_topk or vocab)).clamp(max=vocab)
    k_cap = int(row_k.max())
    values, indices = scaled.topk(k_cap, dim=-1)  # sorted descending
    rank = torch.arange(k_cap, device=scaled.device)[None, :]
    values = values.masked_fill(rank >= row_k[:, None], float("-inf"))
    probs = values.softmax(dim=-1)
    # Nucleus: keep a token while the mass before it is below top_p (the first always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    # min-p: drop a token less likely than min_p times the most likely one (first column).
    dropped = (mass_before >= top_p[:, None]) | (probs < min_p[:, None] * probs[:, :1])
    probs = probs.masked_fill(dropped, 0.0)
    cdf = probs.double().cumsum(dim=-1)
    u = uniform_draws(seeds, steps).to(cdf.device) * cdf[:, -1]
    choice = torch.searchsorted(cdf, u[:, None]).clamp(max=k_cap - 1)
    return indices.gather(-1, choice)[:, 0]


def _with_logprobs(token_ids: torch.Tensor, scaled: torch.Tensor, top: int) -> SampleOutput:
    logprobs = scaled.log_softmax(dim=-1)  # [n, vocab]
    chosen = logprobs.gather(-1, token_ids[:, None])[:, 0]
    if top == 0:
        return SampleOutput(token_ids, chosen)
    top_values, top_ids = logprobs.topk(top, dim=-1)
    return SampleOutput(token_ids, chosen, top_ids, top_values)


class SlotTokenCounts:
    """Per decode slot, on the device: how often each token was generated, and
    which tokens the prompt holds (repetition_penalty covers both).

    Set whole when a sequence joins (`start`) and updated by one index op per
    step (`add`), so penalties never loop over rows on the host.
    """

    def __init__(self, num_slots: int, vocab_size: int, device):
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)

    @property
    def nbytes(self) -> int:
        return self.counts.numel() * self.counts.element_size() + self.in_prompt.numel()

    def start(self, slot: int, prompt_ids: list[int], generated_ids: list[int]) -> None:
        counts, in_prompt = token_rows(prompt_ids, generated_ids, self.counts.shape[1], self.counts.device)
        self.counts[slot] = counts[0]
        self.in_prompt[slot] = in_prompt[0]

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.counts[slots], self.in_prompt[slots]

    def add(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        ones = torch.ones(len(slots), dtype=self.counts.dtype, device=self.counts.device)
        self.counts.index_put_((slots.to(self.counts.device), token_ids.to(self.counts.device)), ones, accumulate=True)


def token_rows(prompt_ids: list[int], generated_ids: list[int], vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's (counts [1, vocab] int32, in_prompt [1, vocab] bool)."""
    generated = torch.tensor(generated_ids, dtype=torch.long, device=device)
    counts = torch.bincount(generated, minlength=vocab_size).to(torch.int32)[None]
    in_prompt = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
    in_prompt[0, torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
    return counts, in_prompt

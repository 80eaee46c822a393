"""Batched sampling where the logits are, with per-row parameters and per-row seeds.

Parameters come as one [batch, 3] tensor of (top_k, top_p, temperature), as
NxDI's dynamic on-device sampling takes them. Randomness is counter-based: row
i's uniform draw is a hash of (its seed, its step), so a seeded request gets
the same tokens alone or in any batch; no shared generator is consumed.
Only the sampled ids leave this function.
"""

from __future__ import annotations

import torch

from .requests import Sampling

_MASK32 = 0xFFFFFFFF


def params_tensor(samplings: list[Sampling], device="cpu") -> torch.Tensor:
    """[batch, 3] float32 rows of (top_k, top_p, temperature)."""
    rows = [(float(s.top_k), float(s.top_p), float(s.temperature)) for s in samplings]
    return torch.tensor(rows, dtype=torch.float32, device=device).reshape(-1, 3)


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


def sample(logits: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, global_topk: int = 0) -> torch.Tensor:
    """Token ids [batch] from logits [batch, vocab].

    top_k 0 means the whole vocabulary, unless `global_topk` > 0 caps every
    row's candidates at that many (NxDI's global_topk, a speed/fidelity knob).
    """
    greedy_ids = logits.argmax(dim=-1)
    top_k, top_p, temperature = params[:, 0], params[:, 1], params[:, 2]
    greedy = (temperature <= 0) | (top_k == 1)
    if bool(greedy.all()):
        return greedy_ids
    vocab = logits.shape[-1]
    row_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, global_topk or vocab)).clamp(max=vocab)
    k_cap = int(row_k.max())
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    values, indices = scaled.topk(k_cap, dim=-1)  # sorted descending
    rank = torch.arange(k_cap, device=logits.device)[None, :]
    values = values.masked_fill(rank >= row_k[:, None], float("-inf"))
    probs = values.softmax(dim=-1)
    # Nucleus: keep a token while the mass before it is below top_p (the first always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    cdf = probs.double().cumsum(dim=-1)
    u = uniform_draws(seeds, steps).to(cdf.device) * cdf[:, -1]
    choice = torch.searchsorted(cdf, u[:, None]).clamp(max=k_cap - 1)
    sampled = indices.gather(-1, choice)[:, 0]
    return torch.where(greedy, greedy_ids, sampled)

"""Per-row query positions for transformers' attention-mask builders.

transformers builds every mask (causal, sliding window, chunked, padding) from
a mask function of (batch, head, q_idx, kv_idx) evaluated at `q_offset +
arange(q_length)`, with one `q_offset` for the whole batch. In a continuous
batch each row stands at its own position, so `DecodeCache.get_query_offset`
answers a 1-d tensor of positions, one per row. This module wraps the "sdpa"
and "eager" mask builders so that such an offset is evaluated row by row with
the model's own mask function; any other offset goes to transformers' builder
unchanged. The override uses the mapping's local slot, the documented way to
replace one builder in one process.
"""

from __future__ import annotations

import functools

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, and_masks, padding_mask_function, prepare_padding_mask

WRAPPED = ("sdpa", "eager")


def is_row_offset(q_offset) -> bool:
    return isinstance(q_offset, torch.Tensor) and q_offset.ndim == 1


def row_mask(batch_size: int, q_length: int, kv_length: int, q_offset: torch.Tensor, kv_offset: int, mask_function, attention_mask, device) -> torch.Tensor:
    """[batch, 1, q_length, kv_length] bool: True where row b's query may attend."""
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    batch = torch.arange(batch_size, device=device)[:, None, None, None]
    head = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
    query = (q_offset.to(device)[:, None] + torch.arange(q_length, device=device))[:, None, :, None]
    key = (torch.arange(kv_length, device=device) + kv_offset)[None, None, None, :]
    return mask_function(batch, head, query, key).expand(batch_size, 1, q_length, kv_length)


def _per_row(name: str, builder):
    @functools.wraps(builder)
    def build(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, dtype=torch.float32, device="cpu", **kwargs):
        if not is_row_offset(q_offset):
            extra = {} if mask_function is None else {"mask_function": mask_function}
            return builder(
                batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                dtype=dtype, device=device, **extra, **kwargs,
            )
        allowed = row_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, device)
        if name == "sdpa":
            return allowed
        # eager adds the mask to the scores: 0 where allowed, the dtype's minimum elsewhere (as transformers' eager_mask).
        return torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)

    build.disagg_row_masks = True
    return build


def install() -> None:
    """Idempotent: wraps the sdpa and eager mask builders once per process."""
    for name in WRAPPED:
        builder = ALL_MASK_ATTENTION_FUNCTIONS[name]
        if not getattr(builder, "disagg_row_masks", False):
            ALL_MASK_ATTENTION_FUNCTIONS[name] = _per_row(name, builder)

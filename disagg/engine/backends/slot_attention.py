"""An attention function, registered with transformers, that owns the KV cache.

Transformers calls a registered attention function once per layer with that
layer's new keys and values (rotary embedding already applied). This module
uses that hook to keep any transformers decoder-only model intact while the
KV cache lives in our own slot layout, as NxDI's continuous batching does:

- prefill (one sequence): causal attention over the prompt; the layer's K/V
  are handed to a callback so they can be sent while later layers compute;
- decode (one token per active slot): each row writes its K/V line at its own
  position in its slot, then attends over that slot's prefix.

The model is called with `use_cache=False` and an `AttentionContext` under the
keyword `slot_attention`, which transformers passes through to this function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "disagg_slots"
CONTEXT_KWARG = "slot_attention"

# Called as on_layer(layer_idx, keys, values) with tensors [kv_heads, tokens, head_dim].
LayerKvCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass
class SlotKvCache:
    """Per layer, keys and values of shape [slots, kv_heads, max_seq_len, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, num_layers: int, slots: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype, device) -> "SlotKvCache":
        shape = (slots, kv_heads, max_seq_len, head_dim)
        return cls(
            keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            values=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class PrefillContext:
    on_layer: LayerKvCallback | None = None


@dataclass
class DecodeContext:
    cache: SlotKvCache
    slots: torch.Tensor  # [n] int64, sorted ascending
    positions: torch.Tensor  # [n] int64: where each row's new token goes
    kv_len: int  # max(positions) + 1: how much of the cache the step reads
    # Attention over rows [first, first + n) of the cache can use a view when the
    # slots are one contiguous run, instead of gathering a copy.
    contiguous_from: int | None = None
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def mask(self) -> torch.Tensor:
        # [n, 1, 1, kv_len]: row i sees positions 0..positions[i]; computed once per step.
        if self._mask is None:
            span = torch.arange(self.kv_len, device=self.positions.device)
            self._mask = (span[None, :] <= self.positions[:, None])[:, None, None, :]
        return self._mask


def _prefill_attention(module, query, key, value, scaling, ctx: PrefillContext):
    # query [1, heads, L, d], key/value [1, kv_heads, L, d]
    if ctx.on_layer is not None:
        ctx.on_layer(module.layer_idx, key[0], value[0])
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _decode_attention(module, query, key, value, scaling, ctx: DecodeContext):
    # query [n, heads, 1, d], key/value [n, kv_heads, 1, d]
    layer = module.layer_idx
    cache_k, cache_v = ctx.cache.keys[layer], ctx.cache.values[layer]
    cache_k[ctx.slots, :, ctx.positions] = key[:, :, 0]
    cache_v[ctx.slots, :, ctx.positions] = value[:, :, 0]
    if ctx.contiguous_from is not None:
        rows = slice(ctx.contiguous_from, ctx.contiguous_from + ctx.slots.numel())
        keys, values = cache_k[rows, :, : ctx.kv_len], cache_v[rows, :, : ctx.kv_len]
    else:
        keys, values = cache_k[ctx.slots, :, : ctx.kv_len], cache_v[ctx.slots, :, : ctx.kv_len]
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=ctx.mask(), scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def slot_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctx = kwargs.get(CONTEXT_KWARG)
    if isinstance(ctx, DecodeContext):
        return _decode_attention(module, query, key, value, scaling, ctx), None
    if isinstance(ctx, PrefillContext):
        return _prefill_attention(module, query, key, value, scaling, ctx), None
    raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs a `{CONTEXT_KWARG}` context; got {type(ctx).__name__}")


AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention_forward)

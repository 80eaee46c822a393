"""Byte geometry of a prompt's KV: where each layer, kind and head lives in the
prefill side's compact staging buffer and in a decode slot.

An 8-bit KV (scale_block > 0) stages its codes in the same layout, one byte a
value, then, right after the last code, their float32 scales
[layer][K, V][kv_heads][blocks]: the codes keep the layout both sides already
address, and the scales are one more compact run, so a read is still one range.
The scales' first byte need not be 4-byte aligned (no padding: the bytes read are
exactly codes + scales), so both sides move them as bytes."""

from __future__ import annotations

from dataclasses import dataclass

SCALE_BYTES = 4  # float32


@dataclass(frozen=True)
class KvGeometry:
    num_layers: int
    kv_heads: int
    head_dim: int
    itemsize: int  # bytes a value: 1 for an 8-bit KV's codes
    max_seq_len: int  # positions per slot in the decode cache
    scale_block: int = 0  # positions per float32 scale of an 8-bit KV; 0: unquantized, no scales
    kv_dtype: str = ""  # an 8-bit KV's code dtype name ("int8", "float8_e4m3fn"); "": unquantized

    @classmethod
    def of(cls, info, positions: int) -> KvGeometry:
        """A model's KV (backends.base.ModelInfo) with `positions` a slot: an 8-bit KV is one
        byte a code, with a float32 scale per info.kv_block_size positions and head."""
        import torch

        from .chunk_codec import wire_dtype

        if info.kv_quantized:
            return cls(info.num_layers, info.kv_heads, info.head_dim, 1, positions, info.kv_block_size, wire_dtype(info.kv_cache_dtype))
        itemsize = torch.empty(0, dtype=getattr(torch, info.dtype)).element_size()
        return cls(info.num_layers, info.kv_heads, info.head_dim, itemsize, positions)

    @property
    def quantized(self) -> bool:
        return self.scale_block > 0

    def run_bytes(self, tokens: int) -> int:
        """One head's tokens: the unit both sides keep contiguous."""
        return tokens * self.head_dim * self.itemsize

    def layer_kind_bytes(self, tokens: int) -> int:
        """One layer's keys (or values): their values or codes, without scales."""
        return self.kv_heads * self.run_bytes(tokens)

    def codes_bytes(self, tokens: int) -> int:
        return 2 * self.num_layers * self.layer_kind_bytes(tokens)

    def blocks(self, tokens: int) -> int:
        """Scales per head of `tokens` positions from a block's start (0 when unquantized)."""
        return -(-tokens // self.scale_block) if self.quantized else 0

    def layer_kind_scale_bytes(self, tokens: int) -> int:
        return self.kv_heads * self.blocks(tokens) * SCALE_BYTES

    def scales_bytes(self, tokens: int) -> int:
        return 2 * self.num_layers * self.layer_kind_scale_bytes(tokens)

    def prompt_bytes(self, tokens: int) -> int:
        """What is staged and read for `tokens` positions: the values (or codes), then any scales."""
        return self.codes_bytes(tokens) + self.scales_bytes(tokens)

    def staging_offset(self, layer: int, kind: int, tokens: int) -> int:
        """[layer][K, V][kv_heads][tokens][head_dim], compact."""
        return (2 * layer + kind) * self.layer_kind_bytes(tokens)

    def scale_offset(self, layer: int, kind: int, tokens: int) -> int:
        """[layer][K, V][kv_heads][blocks] float32, compact, from the end of the codes."""
        return self.codes_bytes(tokens) + (2 * layer + kind) * self.layer_kind_scale_bytes(tokens)

    @property
    def slot_head_stride(self) -> int:
        return self.max_seq_len * self.head_dim * self.itemsize

    def slot_address(self, cache_address: int, slot: int) -> int:
        """First byte of a slot in one layer's [slots, kv_heads, max_seq_len, head_dim] cache."""
        return cache_address + slot * self.kv_heads * self.slot_head_stride

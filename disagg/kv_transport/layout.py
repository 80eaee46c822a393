"""Byte geometry of a prompt's KV: where each layer, kind and head lives in the
prefill side's compact staging buffer and in a decode slot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvGeometry:
    num_layers: int
    kv_heads: int
    head_dim: int
    itemsize: int
    max_seq_len: int  # positions per slot in the decode cache

    def run_bytes(self, tokens: int) -> int:
        """One head's tokens: the unit both sides keep contiguous."""
        return tokens * self.head_dim * self.itemsize

    def layer_kind_bytes(self, tokens: int) -> int:
        return self.kv_heads * self.run_bytes(tokens)

    def prompt_bytes(self, tokens: int) -> int:
        return 2 * self.num_layers * self.layer_kind_bytes(tokens)

    def staging_offset(self, layer: int, kind: int, tokens: int) -> int:
        """[layer][K, V][kv_heads][tokens][head_dim], compact."""
        return (2 * layer + kind) * self.layer_kind_bytes(tokens)

    @property
    def slot_head_stride(self) -> int:
        return self.max_seq_len * self.head_dim * self.itemsize

    def slot_address(self, cache_address: int, slot: int) -> int:
        """First byte of a slot in one layer's [slots, kv_heads, max_seq_len, head_dim] cache."""
        return cache_address + slot * self.kv_heads * self.slot_head_stride

"""KV lines between NxDI's per-rank cache layout and the wire's canonical one.

Canonical (on the wire): one layer's K or V as [kv_heads, tokens, head_dim],
the model's own heads. NxDI keeps, per tensor-parallel rank, a cache of
[batch, heads_per_rank, max_len, head_dim] (K as [batch, heads, head_dim, max_len]
when k_cache_transposed). How the model's KV heads map to ranks follows NxDI's
GQA sharding (modules/attention/gqa.py):

- SHARD: kv_heads divisible by tp: rank r holds heads [r*k, (r+1)*k), k = kv_heads/tp;
- REPLICATE: tp divisible by kv_heads (and kv_heads < tp): every rank holds one
  head, rank r holds head r // (tp / kv_heads) (REPLICATE_TO_TP_DEGREE);
- anything else NxDI turns into full MHA with padded heads (CONVERT_TO_MHA); that
  layout is not converted here, and a worker refuses it at start-up.

Prefill and decode workers may use different tp degrees: each converts to and
from the canonical layout, so any two supported layouts interoperate.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Sharding(enum.Enum):
    SHARD = "shard"
    REPLICATE = "replicate"


class UnsupportedLayout(ValueError):
    pass


@dataclass(frozen=True)
class KvLayout:
    tp_degree: int
    kv_heads: int  # the model's own KV heads
    num_attention_heads: int
    k_transposed: bool = False

    def __post_init__(self):
        if self.num_attention_heads == self.kv_heads:  # MHA: NxDI pads heads to a multiple of tp
            if self.kv_heads % self.tp_degree:
                raise UnsupportedLayout(
                    f"{self.kv_heads} attention heads do not divide by tp_degree {self.tp_degree}: NxDI pads the heads, "
                    f"which this KV conversion does not cover; choose a tp_degree that divides {self.kv_heads}"
                )
        elif self.kv_heads % self.tp_degree and self.tp_degree % self.kv_heads:
            raise UnsupportedLayout(
                f"{self.kv_heads} KV heads and tp_degree {self.tp_degree}: neither divides the other, so NxDI converts "
                f"GQA to MHA with padded heads, which this KV conversion does not cover; choose a tp_degree that divides "
                f"{self.kv_heads} or a multiple of it"
            )

    @property
    def sharding(self) -> Sharding:
        return Sharding.SHARD if self.kv_heads % self.tp_degree == 0 else Sharding.REPLICATE

    @property
    def heads_per_rank(self) -> int:
        return self.kv_heads // self.tp_degree if self.sharding is Sharding.SHARD else 1

    def rank_heads(self, rank: int) -> list[int]:
        """The model's KV heads that rank holds, in order."""
        if self.sharding is Sharding.SHARD:
            k = self.heads_per_rank
            return list(range(rank * k, (rank + 1) * k))
        return [rank // (self.tp_degree // self.kv_heads)]

    def _owner(self, head: int) -> int:
        # The first rank holding a head: where a replicated head is read from.
        return next(r for r in range(self.tp_degree) if head in self.rank_heads(r))

    # -- one slot's lines, for one layer's K or V ------------------------------------
    def read_line(self, rank_caches: list[torch.Tensor], slot: int, length: int, is_key: bool) -> torch.Tensor:
        """[kv_heads, length, head_dim] from per-rank caches."""
        heads = []
        for head in range(self.kv_heads):
            rank = self._owner(head)
            index = self.rank_heads(rank).index(head)
            cache = rank_caches[rank]
            if is_key and self.k_transposed:
                heads.append(cache[slot, index, :, :length].transpose(0, 1))  # [D, S] -> [S, D]
            else:
                heads.append(cache[slot, index, :length, :])
        return torch.stack(heads).contiguous()

    def rank_pieces(self, line: torch.Tensor, is_key: bool) -> list[torch.Tensor]:
        """Canonical [kv_heads, tokens, head_dim] -> each rank's [heads_per_rank, tokens, head_dim]
        (or [heads_per_rank, head_dim, tokens] for a transposed K)."""
        pieces = []
        for rank in range(self.tp_degree):
            part = line[self.rank_heads(rank)]
            pieces.append(part.transpose(1, 2).contiguous() if is_key and self.k_transposed else part)
        return pieces

    def write_line(self, rank_caches: list[torch.Tensor], slot: int, start: int, line: torch.Tensor, is_key: bool) -> None:
        end = start + line.shape[1]
        for cache, piece in zip(rank_caches, self.rank_pieces(line, is_key)):
            target = cache[slot, :, :, start:end] if is_key and self.k_transposed else cache[slot, :, start:end, :]
            target.copy_(piece.to(device=target.device, dtype=target.dtype))


def sort_rows(slots: list[int]) -> tuple[list[int], list[int]]:
    """(order, inverse): rows sorted by seq_id as NxDI's contiguous cache needs, and
    the permutation that puts the outputs back in the caller's order."""
    order = sorted(range(len(slots)), key=lambda i: slots[i])
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return order, inverse

"""KV lines between NxDI's per-rank cache layout and the KV transport's canonical one.

Canonical (as the KV transport carries it): one layer's K or V as [kv_heads, tokens, head_dim],
the model's own heads. NxDI keeps, per tensor-parallel rank, a cache of
[lines, heads_per_rank, max_len, head_dim]. How the model's KV heads map to ranks follows NxDI's
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

    # -- one slot's lines, for one layer's K or V ------------------------------------
    def read_line(self, rank_caches: list[torch.Tensor], slot: int, length: int) -> torch.Tensor:
        """[kv_heads, length, head_dim] on the host, from per-rank device caches.

        One copy to the host per rank that owns a head not read yet (every rank when heads are
        sharded; one per distinct head when replicated): the slot's first `length` positions of
        the heads it holds, not the whole state."""
        heads: dict[int, torch.Tensor] = {}
        for rank, cache in enumerate(rank_caches):
            wanted = [index for index, head in enumerate(self.rank_heads(rank)) if head not in heads]
            if not wanted:
                continue
            block = cache.narrow(0, slot, 1).narrow(2, 0, length).to("cpu")[0]  # [heads_per_rank, length, head_dim]
            for index in wanted:
                heads[self.rank_heads(rank)[index]] = block[index]
        return torch.stack([heads[head] for head in range(self.kv_heads)])

    def write_line(self, rank_caches: list[torch.Tensor], slot: int, start: int, line: torch.Tensor) -> None:
        """Writes canonical [kv_heads, tokens, head_dim] into a slot of the per-rank caches.

        Each copy is one contiguous run of the device state ([1, 1, tokens, head_dim] of
        one head) from host memory: the form the Neuron runtime takes (narrow + copy_
        host-to-device), where a strided slice or a device-to-device copy between
        differently sized tensors is refused (docs/neuron.md). A slot's positions are one run
        per head: one copy per rank when a rank holds one head (GQA at tp = kv_heads, or
        replicated heads), one per head otherwise."""
        tokens = line.shape[1]
        host = line.to(device="cpu")
        for rank, cache in enumerate(rank_caches):
            for index, head in enumerate(self.rank_heads(rank)):
                run = cache.narrow(0, slot, 1).narrow(1, index, 1).narrow(2, start, tokens)
                run.copy_(host[head].to(dtype=cache.dtype).contiguous().view(run.shape))


def sort_rows(slots: list[int]) -> tuple[list[int], list[int]]:
    """(order, inverse): rows sorted by seq_id as NxDI's contiguous cache needs, and
    the permutation that puts the outputs back in the caller's order."""
    order = sorted(range(len(slots)), key=lambda i: slots[i])
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return order, inverse

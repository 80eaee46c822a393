"""What the prefill side sends of one layer: the K and V of tokens [start, end), as parts
laid end to end along the token axis.

The decode worker may hold a prompt's first tokens already (its own prefix cache:
KvTarget.token_start), and the prefill worker's prefix cache may have supplied the
prompt's first P tokens, which the prefill did not compute. So what goes out is
[token_start, prompt_len): from the cached prefix where token_start < P, then the
computed tokens. Both stay views here; each transport copies the parts once (the
gRPC pieces' bytes, the NIXL staging buffer), never a concatenation first.

An 8-bit KV's parts are QuantizedKv (codes and per-block scales), sliced the same
way: token_start and P are whole cache blocks, so every cut falls at a block's
start and each part carries its own blocks' scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagg.engine.quantization.kv_cache import QuantizedKv

from .chunk_codec import KvKind, KvPiece, encode

Kv = torch.Tensor | QuantizedKv  # [kv_heads, tokens, head_dim]: values, or 8-bit codes with their scales


@dataclass(frozen=True)
class KvSpan:
    start: int  # the first token's position in the prompt
    keys: tuple[Kv, ...]  # parts, each [kv_heads, tokens, head_dim]
    values: tuple[Kv, ...]

    @property
    def tokens(self) -> int:
        return sum(part.shape[1] for part in self.keys)

    @property
    def end(self) -> int:
        return self.start + self.tokens

    @classmethod
    def whole(cls, keys: Kv, values: Kv) -> KvSpan:
        """A whole prompt's K/V, from token 0."""
        return cls(0, (keys,), (values,))

    @classmethod
    def of(cls, token_start: int, prefix: tuple[Kv, Kv] | None, keys: Kv, values: Kv) -> KvSpan:
        """Tokens [token_start, P + computed) of a layer whose prompt's first P tokens are
        `prefix` ((keys, values), or None: P = 0) and whose next ones were computed (keys, values)."""
        prefix_len = 0 if prefix is None else prefix[0].shape[1]
        parts = []
        if token_start < prefix_len:
            parts.append((prefix[0][:, token_start:], prefix[1][:, token_start:]))
        skip = max(token_start - prefix_len, 0)
        if skip < keys.shape[1]:
            parts.append((keys[:, skip:], values[:, skip:]))
        return cls(token_start, tuple(k for k, _ in parts), tuple(v for _, v in parts))

    def pieces(self, layer: int, max_piece_bytes: int) -> list[KvPiece]:
        """The gRPC push's pieces: every key piece of the span, then every value piece."""
        out = []
        for kind, parts in ((KvKind.KEY, self.keys), (KvKind.VALUE, self.values)):
            start = self.start
            for part in parts:
                out += encode(layer, kind, part, max_piece_bytes, token_start=start)
                start += part.shape[1]
        return out

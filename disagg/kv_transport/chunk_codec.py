"""The KV chunk codec: one layer's keys or values <-> raw-byte pieces under a size limit.

A piece is a token range of one layer's K or V, [kv_heads, tokens, head_dim],
as raw bytes with its dtype and shape. Pieces are cut along the token axis so
each fits in one gRPC message. Decoding checks that bytes, dtype and shape agree.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass

import torch

# decode() shares a received message's bytes read-only on purpose (no copy; the
# cache copy follows), which torch warns about once per process.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KvKind(enum.IntEnum):
    # Values equal the worker proto's KvKind.
    KEY = 1
    VALUE = 2


class KvChunkError(ValueError):
    """A piece whose bytes, dtype or shape do not describe a valid tensor."""


@dataclass(frozen=True)
class KvPiece:
    layer: int
    kind: KvKind
    token_start: int
    dtype: str
    shape: tuple[int, int, int]
    data: bytes

    @property
    def token_end(self) -> int:
        return self.token_start + self.shape[1]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode(layer: int, kind: KvKind, tensor: torch.Tensor, max_piece_bytes: int, token_start: int = 0) -> list[KvPiece]:
    """Cuts tensor [kv_heads, tokens, head_dim], the prompt's tokens from token_start on, into pieces of at most max_piece_bytes."""
    heads, tokens, head_dim = tensor.shape
    bytes_per_token = heads * head_dim * tensor.element_size()
    step = max(1, max_piece_bytes // bytes_per_token)
    pieces = []
    for start in range(0, tokens, step):
        part = tensor[:, start : start + step].contiguous()
        data = part.view(torch.uint8).numpy().tobytes()
        pieces.append(KvPiece(layer, kind, token_start + start, dtype_name(tensor.dtype), tuple(part.shape), data))
    return pieces


def decode(piece: KvPiece) -> torch.Tensor:
    dtype = DTYPES.get(piece.dtype)
    if dtype is None:
        raise KvChunkError(f"dtype {piece.dtype!r} is not one of {sorted(DTYPES)}")
    if len(piece.shape) != 3 or min(piece.shape) < 1:
        raise KvChunkError(f"shape {list(piece.shape)} is not [kv_heads, tokens, head_dim]")
    expected = piece.shape[0] * piece.shape[1] * piece.shape[2] * dtype.itemsize
    if len(piece.data) != expected:
        raise KvChunkError(f"{len(piece.data)} bytes do not match shape {list(piece.shape)} of {piece.dtype} ({expected} bytes)")
    # Shares the message's bytes without a copy; the caller copies them into the cache.
    return torch.frombuffer(piece.data, dtype=dtype).view(piece.shape)


@dataclass(frozen=True)
class KvCommit:
    """The last message of a transfer: the first token travels with the KV."""

    first_token: int
    prompt_len: int
    num_layers: int


class KvCoverage:
    """Which token ranges of each layer's K and V have arrived, refusing overlaps."""

    def __init__(self, num_layers: int, prompt_len: int, token_start: int = 0):
        """Expects tokens [token_start, prompt_len): the ones before are held already (prefix cache hits)."""
        self.num_layers = num_layers
        self.prompt_len, self.token_start = prompt_len, token_start
        self._ranges: dict[tuple[int, KvKind], list[tuple[int, int]]] = {}

    def add(self, piece: KvPiece) -> None:
        if piece.token_start < self.token_start:
            raise KvChunkError(f"tokens [{piece.token_start}, {piece.token_end}) overlap the {self.token_start} tokens held already (cached)")
        ranges = self._ranges.setdefault((piece.layer, piece.kind), [])
        for start, end in ranges:
            if piece.token_start < end and start < piece.token_end:
                raise KvChunkError(f"layer {piece.layer} {piece.kind.name.lower()} tokens [{piece.token_start}, {piece.token_end}) arrived twice")
        ranges.append((piece.token_start, piece.token_end))

    def missing(self) -> list[str]:
        gaps = []
        for layer in range(self.num_layers):
            for kind in KvKind:
                covered = sum(end - start for start, end in self._ranges.get((layer, kind), []))
                if covered != self.prompt_len - self.token_start:
                    gaps.append(f"layer {layer} {kind.name.lower()} has {covered} of tokens [{self.token_start}, {self.prompt_len})")
        return gaps

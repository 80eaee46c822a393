"""The KV chunk codec: one layer's keys or values <-> raw-byte pieces under a size limit.

A piece is a token range of one layer's K or V, [kv_heads, tokens, head_dim],
as raw bytes with its dtype and shape. Pieces are cut along the token axis so
each fits in one gRPC message. Decoding checks that bytes, dtype and shape agree.

An 8-bit KV (engine/quantization/kv_cache.py's QuantizedKv) travels as its codes
(`data`, one byte a value) and their float32 scales (`scales`, [kv_heads, blocks]),
one per `scale_block` positions and head. Its pieces are cut at whole blocks, so
each carries exactly the scales of its own codes and lands in whole cache blocks.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass

import torch

from disagg.engine.quantization.kv_cache import QuantizedKv, code_dtype

# decode() shares a received message's bytes read-only on purpose (no copy; the
# cache copy follows), which torch warns about once per process.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# An 8-bit KV's code dtypes: valid only in a piece that carries scales.
CODE_DTYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
SCALE_BYTES = 4  # float32, little endian


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
    scales: bytes = b""  # an 8-bit piece's float32 scales [kv_heads, blocks]
    scale_block: int = 0  # positions per scale; 0: unquantized

    @property
    def token_end(self) -> int:
        return self.token_start + self.shape[1]

    @property
    def nbytes(self) -> int:
        """What the piece moves: its values (or codes) and its scales."""
        return len(self.data) + len(self.scales)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_dtype(kv_cache_dtype: str) -> str:
    """--kv-cache-dtype ("int8", "fp8") -> its codes' dtype name on the wire; "" (unquantized) stays ""."""
    return dtype_name(code_dtype(kv_cache_dtype)) if kv_cache_dtype else ""


def encode(layer: int, kind: KvKind, tensor: torch.Tensor | QuantizedKv, max_piece_bytes: int, token_start: int = 0) -> list[KvPiece]:
    """Cuts tensor [kv_heads, tokens, head_dim], the prompt's tokens from token_start on, into pieces of at most max_piece_bytes
    (an 8-bit KV: of whole blocks, at least one a piece)."""
    if isinstance(tensor, QuantizedKv):
        return _encode_quantized(layer, kind, tensor, max_piece_bytes, token_start)
    heads, tokens, head_dim = tensor.shape
    bytes_per_token = heads * head_dim * tensor.element_size()
    step = max(1, max_piece_bytes // bytes_per_token)
    pieces = []
    for start in range(0, tokens, step):
        part = tensor[:, start : start + step].contiguous()
        data = part.view(torch.uint8).numpy().tobytes()
        pieces.append(KvPiece(layer, kind, token_start + start, dtype_name(tensor.dtype), tuple(part.shape), data))
    return pieces


def _encode_quantized(layer: int, kind: KvKind, kv: QuantizedKv, max_piece_bytes: int, token_start: int) -> list[KvPiece]:
    heads, tokens, head_dim = kv.shape
    block = kv.block_size
    if token_start % block:
        raise ValueError(f"quantized KV from token {token_start}: not at the start of a block of {block}")
    bytes_per_block = heads * (block * head_dim * kv.codes.element_size() + SCALE_BYTES)
    step = max(1, max_piece_bytes // bytes_per_block) * block
    pieces = []
    for start in range(0, tokens, step):
        part = kv[:, start : start + step]
        data = part.codes.contiguous().view(torch.uint8).numpy().tobytes()
        scales = part.scales.contiguous().numpy().astype("<f4", copy=False).tobytes()
        pieces.append(KvPiece(layer, kind, token_start + start, dtype_name(kv.dtype), tuple(part.shape), data, scales, block))
    return pieces


def decode(piece: KvPiece) -> torch.Tensor | QuantizedKv:
    """The piece's tensor, or its QuantizedKv where it carries scales; KvChunkError naming the field that is wrong."""
    quantized = bool(piece.scales) or piece.scale_block != 0
    dtypes = CODE_DTYPES if quantized else DTYPES
    dtype = dtypes.get(piece.dtype)
    if dtype is None:
        kind = "an 8-bit piece (with scales)" if quantized else "a piece without scales"
        raise KvChunkError(f"dtype {piece.dtype!r} is not one of {sorted(dtypes)}, for {kind}")
    if len(piece.shape) != 3 or min(piece.shape) < 1:
        raise KvChunkError(f"shape {list(piece.shape)} is not [kv_heads, tokens, head_dim]")
    expected = piece.shape[0] * piece.shape[1] * piece.shape[2] * dtype.itemsize
    if len(piece.data) != expected:
        raise KvChunkError(f"{len(piece.data)} bytes do not match shape {list(piece.shape)} of {piece.dtype} ({expected} bytes)")
    # Shares the message's bytes without a copy; the caller copies them into the cache.
    tensor = torch.frombuffer(piece.data, dtype=torch.uint8).view(dtype).view(piece.shape)
    return QuantizedKv(tensor, _decode_scales(piece), piece.scale_block) if quantized else tensor


def _decode_scales(piece: KvPiece) -> torch.Tensor:
    """An 8-bit piece's scales [kv_heads, blocks], checked against its shape and position."""
    block = piece.scale_block
    if block < 1:
        raise KvChunkError(f"scale_block {block} must be positive for a piece with scales (dtype {piece.dtype!r})")
    if piece.token_start % block:
        raise KvChunkError(f"token_start {piece.token_start} is not at the start of a block of scale_block {block}")
    heads, blocks = piece.shape[0], -(-piece.shape[1] // block)
    expected = heads * blocks * SCALE_BYTES
    if len(piece.scales) != expected:
        raise KvChunkError(
            f"scales has {len(piece.scales)} bytes; shape {list(piece.shape)} in blocks of {block} needs float32 [{heads}, {blocks}] ({expected} bytes)"
        )
    scales = torch.frombuffer(piece.scales, dtype=torch.float32).view(heads, blocks)
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise KvChunkError("scales holds a value that is negative, infinite or NaN: every scale must be finite and >= 0")
    return scales


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

"""The 8-bit KV cache (`--kv-cache-dtype int8|fp8`): codes and scales per block and head.

A layer's keys (or values) for tokens [t0, t0 + T) travel and rest as
- codes [kv_heads, T, head_dim]: int8, or float8 e4m3 (stored as such), and
- scales [kv_heads, ceil(T / block_size)] float32: one per block of block_size
  positions and head, where t0 is a multiple of block_size,
so a value is code * scale of its (block, head). The scale is the block's
largest magnitude over the format's largest code (127 for int8, 448 for e4m3):
every code of the block uses the format's whole range, and a block of small
values keeps its precision whatever the rest of the sequence holds. Per block
and head costs 4 bytes a block-head (1028 bytes against bf16's 2048 for 16
positions of 64): the same budget holds 1.99x bf16's tokens, 3.98x float32's.

Who quantizes: the prefill, once, as each layer's K/V is computed; the codes
and scales cross the wire as they are, and the decode worker writes them into
its blocks unchanged (so the hand-off moves about half of bf16's bytes and the
decode worker's blocks hold exactly the prefill's numbers). The prefill's own
attention, the prefix caches and the decode attention all read the same
dequantized values, so a prompt served from cached blocks sees what a prompt
computed whole sees.

A block the decode fills one position at a time (the prompt's last, partial
block and the generated tokens' blocks) keeps the largest magnitude written so
far: a new line within the scale is coded with it; a larger one grows the
scale, and the block's earlier codes are coded again under the new scale
(code * old / new, rounded), as the scale of a block written whole would have
been. Scales are dynamic, per block, and carried with the KV: vLLM's P/D split
carries only static per-layer scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("int8", "fp8")
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# The largest code of each format: a block's scale maps its largest magnitude onto it.
LARGEST_CODE = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def code_dtype(name: str) -> torch.dtype:
    if name not in CODE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}")
    return CODE_DTYPES[name]


def to_codes(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values already divided by their scale (float32) -> codes: int8 rounded half to even, e4m3 by torch's cast."""
    limit = LARGEST_CODE[dtype]
    clamped = scaled.clamp(-limit, limit)
    return clamped.round().to(dtype) if dtype == torch.int8 else clamped.to(dtype)


def block_scales(tensor: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """tensor [kv_heads, T, head_dim] (its first token at a block's start) -> [kv_heads, ceil(T / block_size)] float32."""
    heads, tokens, head_dim = tensor.shape
    blocks = -(-tokens // block_size)
    padded = torch.zeros(heads, blocks * block_size, head_dim, dtype=torch.float32, device=tensor.device)
    padded[:, :tokens] = tensor
    return padded.view(heads, blocks, block_size * head_dim).abs().amax(-1) / LARGEST_CODE[dtype]


def per_position(scales: torch.Tensor, block_size: int, tokens: int, offset: int = 0) -> torch.Tensor:
    """[..., blocks] -> [..., tokens]: each position's scale, from position `offset` of the first block."""
    return scales.repeat_interleave(block_size, dim=-1)[..., offset : offset + tokens]


def divided(tensor: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """tensor / scales, where a zero scale (a block of zeros) gives zeros."""
    return tensor.float() / torch.where(scales > 0, scales, torch.ones_like(scales))


@dataclass(frozen=True)
class QuantizedKv:
    """One layer's keys or values for tokens [t0, t0 + T), t0 at a block's start: codes
    [kv_heads, T, head_dim] and scales [kv_heads, ceil(T / block_size)] float32.

    Stands where a [kv_heads, T, head_dim] tensor stands in the prefill's callbacks, the
    spans sent and the caches' writes: `shape`, `dtype` and slicing along the token axis
    from a block's start (every cut there is: prefix hits and transfers are whole blocks)."""

    codes: torch.Tensor
    scales: torch.Tensor
    block_size: int

    def __post_init__(self):
        heads, tokens, _ = self.codes.shape
        expected = (heads, -(-tokens // self.block_size))
        if self.codes.dtype not in LARGEST_CODE or self.scales.dtype != torch.float32 or tuple(self.scales.shape) != expected:
            raise ValueError(
                f"quantized KV: codes {tuple(self.codes.shape)} {self.codes.dtype} with scales {tuple(self.scales.shape)} {self.scales.dtype};"
                f" expected int8 or float8_e4m3fn codes and float32 scales {list(expected)} (blocks of {self.block_size})"
            )

    @classmethod
    def quantize(cls, tensor: torch.Tensor, block_size: int, dtype: torch.dtype) -> QuantizedKv:
        """tensor [kv_heads, T, head_dim], its first token at a block's start."""
        scales = block_scales(tensor, block_size, dtype)
        codes = to_codes(divided(tensor, per_position(scales, block_size, tensor.shape[1])[..., None]), dtype)
        return cls(codes, scales, block_size)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def __getitem__(self, index) -> QuantizedKv:
        """[:, a:b] with a at a block's start (b anywhere, or None)."""
        heads, tokens = index if isinstance(index, tuple) else (index, slice(None))
        if heads != slice(None) or not isinstance(tokens, slice) or tokens.step not in (None, 1):
            raise IndexError(f"quantized KV slices along its tokens only, got {index!r}")
        start, stop, _ = tokens.indices(self.codes.shape[1])
        if start % self.block_size:
            raise IndexError(f"quantized KV: a cut at token {start} splits a block of {self.block_size}")
        stop = max(stop, start)
        first, last = start // self.block_size, -(-stop // self.block_size)
        return QuantizedKv(self.codes[:, start:stop], self.scales[:, first:last], self.block_size)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        scales = per_position(self.scales, self.block_size, self.codes.shape[1])
        return (self.codes.float() * scales[..., None]).to(dtype)

    def to(self, device) -> QuantizedKv:
        return QuantizedKv(self.codes.to(device), self.scales.to(device), self.block_size)


def dequantized(tensor, dtype: torch.dtype) -> torch.Tensor:
    """A plain tensor in `dtype`, whether `tensor` is one or a QuantizedKv."""
    return tensor.dequantize(dtype) if isinstance(tensor, QuantizedKv) else tensor.to(dtype)


def concatenated(parts: list[QuantizedKv]) -> QuantizedKv:
    """Parts laid end to end, each but the last a whole number of blocks."""
    if any(part.shape[1] % part.block_size for part in parts[:-1]):
        raise ValueError("quantized KV: only the last part may end inside a block")
    return QuantizedKv(torch.cat([p.codes for p in parts], 1), torch.cat([p.scales for p in parts], 1), parts[0].block_size)


@dataclass
class QuantizedBlocks:
    """One layer's keys or values in the paged cache: codes [blocks, kv_heads, block_size, head_dim]
    and scales [blocks, kv_heads] float32."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.codes.shape[2]

    def write(self, table: list[int], token_start: int, kv: QuantizedKv) -> None:
        """The sequence's tokens [token_start, ...) from the wire or a prefill: codes and scales as they are."""
        size = self.block_size
        if kv.block_size != size or token_start % size:
            raise ValueError(f"quantized KV in blocks of {kv.block_size} from token {token_start}: this cache's blocks hold {size} positions")
        tokens = kv.shape[1]
        for i in range(-(-tokens // size)):
            block = table[token_start // size + i]
            run = min(size, tokens - i * size)
            self.codes[block, :, :run].copy_(kv.codes[:, i * size : i * size + run])
            self.scales[block].copy_(kv.scales[:, i])

    def append_lines(self, blocks: torch.Tensor, offsets: torch.Tensor, lines: torch.Tensor) -> None:
        """One new position per row: lines [n, kv_heads, head_dim] at offsets [n] of blocks [n]
        (no two rows in one block). A block's scale grows to hold its new line, and its codes
        are coded again under the grown scale."""
        dtype = self.codes.dtype
        needed = lines.float().abs().amax(-1) / LARGEST_CODE[dtype]  # [n, kv_heads]
        old = self.scales[blocks]
        fresh = (offsets == 0)[:, None]  # the block's first line: its scale is whatever the block held before
        scales = torch.where(fresh, needed, torch.maximum(old, needed))
        grown = ~fresh & (scales > old) & (old > 0)
        if bool(grown.any()):
            codes = self.codes[blocks]  # [n, kv_heads, block_size, head_dim]
            ratio = torch.where(grown, old / torch.where(scales > 0, scales, torch.ones_like(scales)), torch.ones_like(scales))
            recoded = to_codes(codes.float() * ratio[..., None, None], dtype)
            self.codes[blocks] = torch.where(grown[..., None, None], recoded, codes)
        self.scales[blocks] = scales
        self.codes[blocks, :, offsets] = to_codes(divided(lines, scales[..., None]), dtype)

    def gather(self, tables: torch.Tensor, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """[n, kv_heads, length, head_dim] in `dtype`: positions [start, start + length) of each row's
        sequence through tables [n, w], dequantized."""
        from ..backends.slot_kv_cache import gather_rows

        size = self.block_size
        codes = gather_rows(self.codes.view(torch.uint8), tables, start, length).view(self.codes.dtype)
        first, last = start // size, -(-(start + length) // size)
        scales = self.scales[tables[:, first:last]].transpose(1, 2)  # [n, kv_heads, blocks]
        return (codes.float() * per_position(scales, size, length, start - first * size)[..., None]).to(dtype)

    def read(self, table: list[int], start: int, tokens: int) -> QuantizedKv:
        """A sequence's tokens [start, start + tokens) (start at a block's start) as they are held."""
        size = self.block_size
        ids = torch.tensor(table[start // size : -(-(start + tokens) // size)], dtype=torch.long, device=self.codes.device)
        picked = self.codes.view(torch.uint8).index_select(0, ids).transpose(0, 1)  # [kv_heads, blocks, size, head_dim]
        codes = picked.reshape(picked.shape[0], -1, picked.shape[3])[:, :tokens].view(self.codes.dtype)
        return QuantizedKv(codes.contiguous(), self.scales.index_select(0, ids).t().contiguous(), size)


def kv_bytes(tensor) -> int:
    """The bytes a tensor or a QuantizedKv (codes and scales) holds."""
    return tensor.nbytes if isinstance(tensor, QuantizedKv) else tensor.numel() * tensor.element_size()

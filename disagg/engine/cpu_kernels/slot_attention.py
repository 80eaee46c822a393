"""A decode step's attention read in place from the slot KV cache (`slot_attention.c`).

transformers' attention takes each row's keys and values as one batch. When a
step's slots are one contiguous run, the cache hands it a view; otherwise
`_DecodeLayer.update` copies every row's span out of the cache (index_select)
and SDPA reads the copy again. Under load the slots are scattered (requests
end at different steps), and at 16 rows the copies and SDPA took ~20 ms of a
~100 ms float32 step on this project's CPU.

With this module the layer returns its whole cache span instead (every slot,
no copy), tagged with the rows' slots, and transformers' "sdpa" attention
function, wrapped here, reads each row's own slot where it lies. A call the
kernel does not serve (softcapping, sinks, a position bias, dropout, a float
mask, more than one query position, another dtype) gathers the rows and runs
transformers' sdpa unchanged.

An 8-bit cache (`--kv-cache-dtype int8|fp8`, `quantization.kv_cache`) is read the
same way by its own builds: the codes widened in registers, each block-and-head
scale applied once per position (to the key's dot, and to the value's softmax
weight), never a dequantized copy; its gather dequantizes to the query's dtype. Used for float32 on an AVX2 CPU where the C
compiler builds it (as `small_gemm`), for models whose attention is "sdpa";
`TorchBackend` checks at start-up that a step read in place gives the logits
of a gathered one, and otherwise keeps the gather.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
from dataclasses import dataclass

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..quantization.kv_cache import LARGEST_CODE, QuantizedBlocks
from . import small_gemm

SOURCE = pathlib.Path(__file__).with_name("slot_attention.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
LIBRARIES = ("-lmvec", "-lm")  # glibc's vector expf
# The cache's dtype -> the flags of its build (bf16 lines are widened to float32 as they are read).
KV_FLAGS = {torch.float32: (), torch.bfloat16: ("-DKV_BF16",), torch.int8: ("-DKV_INT8",), torch.float8_e4m3fn: ("-DKV_FP8", "-mf16c")}
# The 8-bit codes' dtypes: their builds export slot_attention_scaled, which takes the scales besides.
SCALED = tuple(LARGEST_CODE)
# Keyword arguments that change the attention's arithmetic: a call with any of them set goes to transformers' sdpa.
UNSERVED = ("softcap", "sinks", "s_aux", "position_bias", "sliding_window_size", "alibi")


class SlotAttention:
    def __init__(self, library: ctypes.CDLL, kv_dtype: torch.dtype = torch.float32):
        self.kv_dtype = kv_dtype
        self.scaled = kv_dtype in SCALED
        self._call = library.slot_attention_scaled if self.scaled else library.slot_attention
        long, pointer = ctypes.c_long, ctypes.c_void_p
        self._call.argtypes = [
            pointer, long, long, long, long, pointer, pointer, long, long, long, pointer, long, long, long, long, pointer, ctypes.c_float, pointer, pointer,
        ] + ([pointer, pointer, long] if self.scaled else [])
        self._call.restype = None

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, start: int, length: int,
        mask: torch.Tensor | None, scale: float, key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [n, q_heads, d]; keys/values: a layer's blocks [blocks, kv_heads, block_size, d]
        (d contiguous, the same strides); tables [n, w] int64: row r reads positions [start,
        start + length) of its sequence through its block table; mask [n, length] bool or None
        -> [n, q_heads, d]. An 8-bit cache's keys/values are codes, and key_scales/value_scales
        [blocks, kv_heads] float32 (contiguous) their scales; a float cache has none."""
        n, q_heads, d = query.shape
        blocks, kv_heads, block_size, _ = keys.shape
        # The C side reads raw pointers: anything off here would read past the buffers, not fail.
        same_dtypes = query.dtype == torch.float32 and keys.dtype == values.dtype == self.kv_dtype
        if not same_dtypes or keys.stride() != values.stride() or keys.shape != values.shape or keys.stride(3) != 1 or q_heads % kv_heads or keys.shape[3] != d:
            raise ValueError(
                f"slot_attention: keys {tuple(keys.shape)} {keys.stride()} {keys.dtype} values {tuple(values.shape)} {values.stride()} {values.dtype}"
                f" query {tuple(query.shape)} {query.dtype} (a {self.kv_dtype} cache, a float32 query)"
            )
        if keys.stride(0) % keys.stride(2) or keys.stride(2) != d:
            raise ValueError(f"slot_attention: keys {tuple(keys.shape)} {keys.stride()}: positions must be d apart, blocks whole positions apart")
        if tables.dim() != 2 or tables.shape[0] != n or tables.dtype != torch.long or (mask is not None and mask.shape != (n, length)):
            raise ValueError(
                f"slot_attention: tables {tuple(tables.shape)} {tables.dtype}, mask {None if mask is None else tuple(mask.shape)} for {n} rows of {length}"
            )
        tables = tables.contiguous()
        if n and (start < 0 or start + length > tables.shape[1] * block_size or int(tables.min()) < 0 or int(tables.max()) >= blocks):
            raise ValueError(f"slot_attention: positions [{start}, {start + length}) or block ids outside tables {tuple(tables.shape)} of {blocks} blocks")
        scales = self._checked_scales(key_scales, value_scales, blocks, kv_heads)
        query = query.contiguous()
        mask = None if mask is None else mask.contiguous().view(torch.uint8)
        out = torch.empty(n, q_heads, d, dtype=torch.float32)
        scratch = torch.empty(q_heads // kv_heads * length, dtype=torch.float32)
        self._call(
            query.data_ptr(), n, q_heads, kv_heads, d, keys.data_ptr(), values.data_ptr(),
            keys.stride(0), keys.stride(1), keys.stride(2), tables.data_ptr(), tables.shape[1], block_size, start, length,
            None if mask is None else mask.data_ptr(), scale, out.data_ptr(), scratch.data_ptr(), *scales,
        )
        return out

    def _checked_scales(self, key_scales: torch.Tensor | None, value_scales: torch.Tensor | None, blocks: int, kv_heads: int) -> tuple:
        """The scales' arguments to the C call (none for a float cache): checked, as the C side reads them by block id."""
        given = [t is not None for t in (key_scales, value_scales)]
        if not self.scaled:
            if any(given):
                raise ValueError(f"slot_attention: scales given for a {self.kv_dtype} cache (only an 8-bit cache has them)")
            return ()
        for name, t in (("key_scales", key_scales), ("value_scales", value_scales)):
            if t is None or t.dtype != torch.float32 or tuple(t.shape) != (blocks, kv_heads) or not t.is_contiguous() or t.device.type != "cpu":
                described = None if t is None else f"{tuple(t.shape)} {t.dtype} {t.stride()} on {t.device}"
                raise ValueError(f"slot_attention: {name} {described}; a {self.kv_dtype} cache needs float32 [{blocks}, {kv_heads}] contiguous on the CPU")
        return key_scales.data_ptr(), value_scales.data_ptr(), kv_heads


def kernel(kv_dtype: torch.dtype = torch.float32) -> SlotAttention | None:
    """The kernel over a cache of this dtype (float32, bfloat16, or int8 / float8_e4m3fn codes with their scales),
    or None where it cannot run here (logged once)."""
    return _kernel(kv_dtype)  # one object per dtype, however it is asked for


@functools.cache
def _kernel(kv_dtype: torch.dtype) -> SlotAttention | None:
    if kv_dtype not in KV_FLAGS:
        return None
    library = small_gemm.load_library(SOURCE, FLAGS + KV_FLAGS[kv_dtype], LIBRARIES, f"decode attention over a {kv_dtype} cache gathers scattered slots")
    return SlotAttention(library, kv_dtype) if library is not None else None


@dataclass(frozen=True)
class PagedRead:
    """What a tagged layer hands the attention: its blocks, and where each row reads them."""

    keys: torch.Tensor  # the layer's blocks [blocks, kv_heads, block_size, head_dim]: values, or an 8-bit cache's codes
    values: torch.Tensor
    tables: torch.Tensor  # [n, w]
    start: int
    length: int
    key_scales: torch.Tensor | None = None  # an 8-bit cache's scales [blocks, kv_heads] float32; None for a float cache
    value_scales: torch.Tensor | None = None

    def __post_init__(self):
        scaled = self.keys.dtype in SCALED
        if any((t is not None) != scaled for t in (self.key_scales, self.value_scales)):
            raise ValueError(f"a paged read of a {self.keys.dtype} cache takes {'both' if scaled else 'no'} scales")

    def gathered(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' keys and values [n, kv_heads, length, head_dim]: a float cache's as held, an 8-bit cache's dequantized to `dtype`."""
        from ..backends.slot_kv_cache import gather_rows

        if self.key_scales is None:
            return gather_rows(self.keys, self.tables, self.start, self.length), gather_rows(self.values, self.tables, self.start, self.length)
        pairs = ((self.keys, self.key_scales), (self.values, self.value_scales))
        keys, values = (QuantizedBlocks(codes, scales).gather(self.tables, self.start, self.length, dtype) for codes, scales in pairs)
        return keys, values


def tag(
    keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, start: int, length: int, *,
    key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None, dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the rows' keys and values, [n, kv_heads, length, head_dim] in shape only
    (no memory: every element is one), tagged with where the kernel reads them in place.
    An 8-bit cache's codes come with their scales; the stand-ins' dtype (default: the cache's)
    is what the attention sees them as: the model's dtype where the cache holds codes."""
    n, heads, head_dim = tables.shape[0], keys.shape[1], keys.shape[3]
    read = PagedRead(keys, values, tables, start, length, key_scales, value_scales)
    shaped = [torch.zeros((), dtype=dtype or t.dtype, device=t.device).expand(n, heads, length, head_dim) for t in (keys, values)]
    for stand_in in shaped:
        stand_in.disagg_paged = read
    return shaped[0], shaped[1]


def _served(query, key, value, attention_mask, dropout, kwargs) -> bool:
    n = query.shape[0]
    return (
        query.dtype == key.dtype == value.dtype == torch.float32
        and query.device.type == "cpu"
        and query.shape[2] == 1
        and not dropout
        and all(kwargs.get(name) is None for name in UNSERVED)
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
        and query.shape[1] % key.shape[1] == 0
        and (attention_mask is None or (
            attention_mask.dtype == torch.bool
            and attention_mask.dim() == 4
            and attention_mask.shape[1:3] == (1, 1)
            and attention_mask.shape[0] in (1, n)
            and attention_mask.shape[3] == key.shape[2]
        ))
    )


def _wrap(sdpa):
    @functools.wraps(sdpa)
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        read: PagedRead | None = getattr(key, "disagg_paged", None)
        if read is None:
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        reader = kernel(read.keys.dtype)
        if reader is None or not _served(query, key, value, attention_mask, dropout, kwargs):
            key, value = read.gathered(query.dtype)
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        n, q_heads, _, d = query.shape
        mask = None if attention_mask is None else attention_mask.expand(n, 1, 1, key.shape[2]).reshape(n, key.shape[2])
        scale = scaling if scaling is not None else d**-0.5
        out = reader.attend(
            query.reshape(n, q_heads, d), read.keys, read.values, read.tables, read.start, read.length, mask, scale, read.key_scales, read.value_scales,
        )
        return out.view(n, 1, q_heads, d), None  # [n, q_length, heads, d], as transformers' sdpa returns it

    attention.disagg_slot_reads = True
    return attention


def install() -> None:
    """Idempotent: wraps transformers' "sdpa" attention function once per process (its local slot, as row_masks does)."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not getattr(sdpa, "disagg_slot_reads", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _wrap(sdpa)

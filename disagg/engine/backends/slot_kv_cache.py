"""The slot KV cache, presented to any transformers model as its own `Cache`.

Every decoder-only model in transformers writes its new keys and values through
`past_key_values.update(...)`, asks the cache how long the keys it returns are
(`get_mask_sizes`) and where its query stands (`get_query_offset`), builds its
masks from those answers, and then runs its own attention (eager or sdpa, with
its own scaling, softcapping, sinks, ALiBi). So the engine owns the KV memory in
NxDI's continuous-batching layout while the model code, masks included, stays
transformers' own:

- `PrefillCache` (one sequence): keeps nothing, hands each layer's K/V to a
  callback as it is produced (so it can be sent while later layers compute),
  and returns them so the layer attends over the prompt exactly as with a
  fresh `DynamicCache`; given a cached prefix's K/V, it returns prefix + new
  rows and answers the prefix's length, as a `DynamicCache` holding the prefix.
- `DecodeCache` (one token per active slot): writes each row's K/V line at its
  own position in its slot and returns the slot rows' prefix. Rows stand at
  different positions, so the query offset is a per-row tensor; `row_masks`
  teaches transformers' mask builders to read it. A sliding-window layer
  returns only the positions its window can still see. Where `slot_attention`
  serves the model (float32 "sdpa" on an AVX2 CPU), the layer returns the span
  of every slot instead, tagged with the rows' slots, and the attention reads
  each row's slot in place; otherwise a view when the rows' slots are one
  contiguous run, else the rows gathered.

With an 8-bit KV cache (`KvQuantization`, disagg/engine/quantization/kv_cache.py) the
blocks hold codes and a float32 scale per block and head: the prefill hands on each
layer's codes and scales (`QuantizedKv`) and attends over the values they stand for, a
decode step appends its lines under the blocks' growing scales, and reads them through
slot_attention's 8-bit builds or dequantized as it gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..cpu_kernels import slot_attention
from ..quantization.kv_cache import QuantizedBlocks, QuantizedKv, dequantized
from .base import LayerKvCallback  # noqa: F401  (the torch backend's modules import it from here)

# Layer types whose attention reads (a window of) ordinary per-token K/V. The
# others (linear attention, convolution, compressed or indexed attention, layers
# that reuse another layer's cache) keep state this cache does not hold.
SLIDING_TYPES = ("sliding_attention", "chunked_attention")
SERVED_LAYER_TYPES = ("full_attention", *SLIDING_TYPES)


@dataclass(frozen=True)
class LayerPlan:
    """What one decoder layer keeps: its type and, for a sliding layer, its window."""

    layer_type: str
    window: int | None = None

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == "sliding_attention"


def layer_plans(config) -> list[LayerPlan]:
    """Per decoder layer, as transformers' own DynamicCache reads the config."""
    text_config = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(text_config)
    return [LayerPlan(t, kw.get("sliding_window") if t == "sliding_attention" else None) for t, kw in zip(types, kwargs)]


@dataclass(frozen=True)
class KvQuantization:
    """An 8-bit KV cache's codes and the positions each scale covers (disagg/engine/quantization/kv_cache.py)."""

    code_dtype: torch.dtype
    block_size: int

    def quantize(self, tensor: torch.Tensor) -> QuantizedKv:
        return QuantizedKv.quantize(tensor, self.block_size, self.code_dtype)


@dataclass
class PagedKvCache:
    """Per layer, keys and values of shape [blocks, kv_heads, block_size, head_dim]. A sequence's
    position p lies in block table[p // block_size] at offset p % block_size. The slot layout is
    the case of one block per slot holding every position (block_size = max_seq_len, table = [slot]).
    An 8-bit cache holds codes there and, per layer, float32 scales [blocks, kv_heads] beside them."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_scales: list[torch.Tensor] | None = None
    value_scales: list[torch.Tensor] | None = None

    @classmethod
    def allocate(
        cls, num_layers: int, blocks: int, kv_heads: int, block_size: int, head_dim: int, dtype, device, heads_outermost: bool = False,
        code_dtype: torch.dtype | None = None,
    ) -> "PagedKvCache":
        """heads_outermost: each layer's memory laid out [kv_heads, blocks, block_size, head_dim] (the tensors are
        views of it in the [blocks, kv_heads, ...] order): a gather of rows' blocks is then one copy into the layout
        attention reads (gather_rows), where [blocks, kv_heads, ...] memory takes a second copy to put heads first.
        code_dtype (int8, float8_e4m3fn): an 8-bit cache, with a scale per block and head."""
        stored = code_dtype or dtype
        if heads_outermost:
            def new():
                return torch.zeros((kv_heads, blocks, block_size, head_dim), dtype=stored, device=device).permute(1, 0, 2, 3)
        else:
            def new():
                return torch.zeros((blocks, kv_heads, block_size, head_dim), dtype=stored, device=device)
        cache = cls(keys=[new() for _ in range(num_layers)], values=[new() for _ in range(num_layers)])
        if code_dtype is not None:
            cache.key_scales = [torch.zeros(blocks, kv_heads, device=device) for _ in range(num_layers)]
            cache.value_scales = [torch.zeros(blocks, kv_heads, device=device) for _ in range(num_layers)]
        return cache

    @property
    def block_size(self) -> int:
        return self.keys[0].shape[2]

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

    def blocks(self, layer: int, keys: bool) -> QuantizedBlocks:
        """An 8-bit cache's codes and scales of one layer's keys or values."""
        if keys:
            return QuantizedBlocks(self.keys[layer], self.key_scales[layer])
        return QuantizedBlocks(self.values[layer], self.value_scales[layer])

    @property
    def nbytes(self) -> int:
        scales = (*self.key_scales, *self.value_scales) if self.quantized else ()
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *scales))

    def write(self, table: list[int], layer: int, target_is_keys: bool, token_start: int, tensor) -> None:
        """tensor [kv_heads, tokens, head_dim] (a QuantizedKv in an 8-bit cache, or a tensor it quantizes,
        token_start then at a block's start): the sequence's positions token_start.. through its block table."""
        if self.quantized:
            blocks = self.blocks(layer, target_is_keys)
            if not isinstance(tensor, QuantizedKv):
                tensor = QuantizedKv.quantize(tensor, self.block_size, blocks.codes.dtype)
            blocks.write(table, token_start, tensor)
            return
        if isinstance(tensor, QuantizedKv):
            raise ValueError(f"8-bit KV ({tensor.dtype}) for a cache of {self.keys[0].dtype}")
        target, size = (self.keys if target_is_keys else self.values)[layer], self.block_size
        done, tokens = 0, tensor.shape[1]
        while done < tokens:
            position = token_start + done
            offset = position % size
            run = min(size - offset, tokens - done)
            target[table[position // size], :, offset : offset + run].copy_(tensor[:, done : done + run])
            done += run


def gather_rows(pool: torch.Tensor, tables: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """[n, kv_heads, length, head_dim]: positions [start, start + length) of each row's sequence,
    copied out of one layer's blocks [blocks, kv_heads, block_size, head_dim] through tables [n, w]."""
    size = pool.shape[2]
    if tables.shape[1] == 1:  # one block per row (the slot layout): copy the span alone
        return pool[:, :, start : start + length].index_select(0, tables[:, 0])
    first, last = start // size, -(-(start + length) // size)
    n, heads, head_dim = tables.shape[0], pool.shape[1], pool.shape[3]
    ids = tables[:, first:last].reshape(-1)
    if pool.stride(1) > pool.stride(0):  # heads outermost in memory: one copy, then views
        picked = pool.transpose(0, 1).index_select(1, ids).view(heads, n, last - first, size, head_dim).transpose(0, 1)
        spans = picked.reshape(n, heads, (last - first) * size, head_dim)  # merges (blocks, positions): a view
    else:
        picked = pool.index_select(0, ids).view(n, last - first, heads, size, head_dim)
        spans = picked.transpose(1, 2).reshape(n, heads, (last - first) * size, head_dim)
    return spans[:, :, start - first * size : start - first * size + length]


class _Layer(CacheLayerMixin):
    """The parts of transformers' layer protocol both caches share."""

    def __init__(self, plan: LayerPlan):
        super().__init__()
        self.plan = plan
        self.is_sliding = plan.is_sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def get_max_length(self) -> int:
        return -1


class _PrefillLayer(_Layer):
    def __init__(self, plan: LayerPlan, index: int, on_layer: LayerKvCallback, prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                 quantization: KvQuantization | None = None):
        super().__init__(plan)
        self.index, self.on_layer, self.length, self.quantization = index, on_layer, 0, quantization
        self.prefix = prefix  # the cached prefix's (keys, values), [kv_heads, P, head_dim] each
        self.prefix_len = 0 if prefix is None else prefix[0].shape[1]

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states/value_states [1, kv_heads, L - P, head_dim]: the new tokens'
        if self.length:
            raise RuntimeError(f"layer {self.index} wrote its KV twice in one prefill")
        self.length = key_states.shape[-2]
        if self.quantization is None:
            self.on_layer(self.index, key_states[0], value_states[0])
        else:
            # Handed on as codes and scales; attended as the values they stand for, as every later reader of the cache sees them.
            keys, values = self.quantization.quantize(key_states[0]), self.quantization.quantize(value_states[0])
            self.on_layer(self.index, keys, values)
            key_states, value_states = keys.dequantize(key_states.dtype)[None], values.dequantize(value_states.dtype)[None]
        if self.prefix is None:
            return key_states, value_states
        # The new rows attend over the prefix and themselves, as with a DynamicCache holding the
        # prefix; a sliding layer too gets the whole prefix: its own mask cuts what its window cannot see.
        keys, values = (dequantized(t, key_states.dtype) for t in self.prefix)
        return torch.cat([keys[None], key_states], dim=-2), torch.cat([values[None], value_states], dim=-2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.prefix_len + query_length, 0  # the keys returned: positions [0, P + query_length)

    def get_seq_length(self) -> int:
        return self.prefix_len  # transformers' query offset: the first new row stands at position P


class PrefillCache(Cache):
    """A fresh cache for one prompt; every layer's K/V goes to on_layer. With prefix_kv (per
    layer (keys, values) [kv_heads, P, head_dim], the KV of the prompt's first P tokens), the
    model runs the tokens after them only: each layer attends over prefix + new rows and hands
    on the new rows' K/V."""

    def __init__(self, plans: list[LayerPlan], on_layer: LayerKvCallback, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 quantization: KvQuantization | None = None):
        """quantization: an 8-bit KV cache's; on_layer then gets QuantizedKv, and the prompt attends over their values."""
        prefixes = prefix_kv if prefix_kv is not None else [None] * len(plans)
        super().__init__(layers=[_PrefillLayer(plan, i, on_layer, prefix, quantization) for i, (plan, prefix) in enumerate(zip(plans, prefixes))])


@dataclass(frozen=True)
class DecodeStep:
    """Where the rows of one decode step read and write."""

    slots: torch.Tensor  # [n] int64, sorted ascending
    positions: torch.Tensor  # [n] int64: where each row's new token goes
    kv_len: int  # max(positions) + 1
    min_position: int  # min(positions), known on the host
    tables: torch.Tensor  # [n, w] int64: each row's block table, its first w blocks (w blocks cover kv_len)
    # Rows [first, first + n) of the cache are read as a view, not a gathered
    # copy, when the slots are one contiguous run (the slot layout only).
    contiguous_from: int | None = None
    # Either way, the rows' tables, tagged for slot_attention to read each row's
    # blocks in place (True); else the view, or the rows' spans gathered.
    read_in_place: bool = False


class _DecodeLayer(_Layer):
    def __init__(self, plan: LayerPlan, keys: torch.Tensor, values: torch.Tensor, step: DecodeStep, written: tuple[torch.Tensor, torch.Tensor],
                 quantized: tuple[QuantizedBlocks, QuantizedBlocks] | None = None):
        super().__init__(plan)
        self.keys, self.values, self.step, self.written, self.quantized = keys, values, step, written, quantized
        # A sliding layer's rows see positions > position - window: skip what none of them sees.
        self.start = max(0, step.min_position - plan.window + 1) if plan.is_sliding else 0

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states/value_states [n, kv_heads, 1, head_dim]
        step, (blocks, offsets) = self.step, self.written
        if self.quantized is not None:
            return self._update_quantized(key_states, value_states)
        self.keys[blocks, :, offsets] = key_states[:, :, 0]
        self.values[blocks, :, offsets] = value_states[:, :, 0]
        length = step.kv_len - self.start
        if step.read_in_place:  # contiguous or not: the kernel reads the blocks in place faster than SDPA reads a copy
            return slot_attention.tag(self.keys, self.values, step.tables, self.start, length)
        if step.contiguous_from is not None:
            rows, span = slice(step.contiguous_from, step.contiguous_from + step.slots.numel()), slice(self.start, step.kv_len)
            return self.keys[rows, :, span], self.values[rows, :, span]
        # index_select copies whole rows of the span: 3.4x faster than the same gather
        # written as advanced indexing (keys[slots, :, span]), which copies element-wise.
        return gather_rows(self.keys, step.tables, self.start, length), gather_rows(self.values, step.tables, self.start, length)

    def _update_quantized(self, key_states, value_states):
        step, (blocks, offsets), (keys, values) = self.step, self.written, self.quantized
        keys.append_lines(blocks, offsets, key_states[:, :, 0])
        values.append_lines(blocks, offsets, value_states[:, :, 0])
        length = step.kv_len - self.start
        if step.read_in_place:  # the kernel widens the codes and applies the scales as it reads them
            return slot_attention.tag(keys.codes, values.codes, step.tables, self.start, length,
                                      key_scales=keys.scales, value_scales=values.scales, dtype=key_states.dtype)
        dtype = key_states.dtype
        return keys.gather(step.tables, self.start, length, dtype), values.gather(step.tables, self.start, length, dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.kv_len - self.start, self.start

    def get_seq_length(self) -> int:
        return self.step.kv_len - 1


class DecodeCache(Cache):
    """One decode step's view of the slot cache."""

    def __init__(self, plans: list[LayerPlan], store: PagedKvCache, step: DecodeStep):
        # Where each row's new K/V line goes, the same in every layer: its position's block and offset.
        size = store.block_size
        written = (step.tables.gather(1, (step.positions // size)[:, None])[:, 0], step.positions % size)
        layers = [
            _DecodeLayer(plan, store.keys[i], store.values[i], step, written, (store.blocks(i, True), store.blocks(i, False)) if store.quantized else None)
            for i, plan in enumerate(plans)
        ]
        super().__init__(layers=layers)
        self.step = step

    def get_query_offset(self, layer_idx: int = 0):
        # [n]: each row's own position. transformers' own caches answer an int
        # (or a 0-d tensor); row_masks builds per-row masks from a 1-d one.
        return self.step.positions


@dataclass(frozen=True)
class BucketStep:
    """One decode step padded to a bucket, for the compiled step: row i is slot i,
    for every slot below the batch bucket. A row whose slot is not decoding writes
    its K/V line to the scratch slot (never reserved), so no slot's KV, landed or
    landing, is touched; its logits are dropped. Every row attends over the first
    `kv_len` positions (the KV-length bucket), masked by its own position."""

    positions: torch.Tensor  # [batch]: where each row's input token goes (0 on a padding row)
    write_slots: torch.Tensor  # [batch]: the row's own slot, or the scratch slot
    kv_len: int  # the KV-length bucket (a symbolic size when compiled)
    # A verify step (compiled.CompiledDecode.verify_logits): row i reads slot read_slots[i], a sequence's rows its
    # slot each (its input and its guesses at consecutive positions); None: row i is slot i.
    read_slots: torch.Tensor | None = None


class _BucketLayer(_Layer):
    def __init__(self, plan: LayerPlan, keys: torch.Tensor, values: torch.Tensor, step: BucketStep):
        super().__init__(plan)
        self.keys, self.values, self.step = keys, values, step

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states/value_states [batch, kv_heads, 1, head_dim]
        step = self.step
        heads = torch.arange(key_states.shape[1], device=key_states.device)
        where = (step.write_slots[:, None], heads[None, :], step.positions[:, None])  # [batch, kv_heads]
        self.keys.index_put_(where, key_states[:, :, 0])
        self.values.index_put_(where, value_states[:, :, 0])
        if step.read_slots is not None:
            # Every row's K/V is written above before any row reads: a guess's row sees the rows before it of its
            # sequence (its own mask keeps it from the ones after).
            return self.keys[:, :, : step.kv_len].index_select(0, step.read_slots), self.values[:, :, : step.kv_len].index_select(0, step.read_slots)
        rows = key_states.shape[0]
        # A view, never a gather: the rows are the slots [0, batch).
        return self.keys[:rows, :, : step.kv_len], self.values[:rows, :, : step.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # A sliding layer too attends over the whole bucket: its own mask function drops what its window cannot see.
        return self.step.kv_len, 0

    def get_seq_length(self) -> int:
        return self.step.kv_len - 1


class BucketDecodeCache(Cache):
    """One bucketed decode step's view of the slot cache (see BucketStep)."""

    def __init__(self, plans: list[LayerPlan], store: PagedKvCache, step: BucketStep):
        super().__init__(layers=[_BucketLayer(plan, store.keys[i], store.values[i], step) for i, plan in enumerate(plans)])
        self.step = step

    def get_query_offset(self, layer_idx: int = 0):
        return self.step.positions

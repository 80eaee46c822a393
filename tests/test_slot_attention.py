"""The decode attention that reads each row's slot in place (slot_attention), against SDPA over gathered rows."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from disagg.engine.backends import load_backend
from disagg.engine.backends.base import StepInputs
from disagg.engine.backends.slot_kv_cache import gather_rows
from disagg.engine.cpu_kernels import slot_attention

kernel = slot_attention.kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="slot_attention needs an AVX2 CPU and a C compiler")


def gathered_sdpa(query, keys, values, tables, start, length, mask, scale):
    """What transformers' sdpa computes for one query per row, after the rows' spans are gathered."""
    n, q_heads, d = query.shape
    kv_heads = keys.shape[1]
    k, v = gather_rows(keys, tables, start, length), gather_rows(values, tables, start, length)
    grouped = query.view(n, kv_heads, q_heads // kv_heads, d)  # query head i reads KV head i // group
    attn_mask = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(grouped, k, v, attn_mask=attn_mask, scale=scale).reshape(n, q_heads, d)


def layout(kind: str, head_dim: int, generator):
    """(keys, values, tables): the slot layout (a block of 50 positions per slot, tables = slots)
    or blocks of 8 positions, each row's table a scattered list of them."""
    if kind == "slots":
        blocks, size, tables = 7, 50, torch.tensor([[1], [4], [5]])
    else:
        blocks, size = 25, 8
        tables = torch.tensor([[3, 9, 1, 20, 7, 2, 11], [5, 6, 4, 8, 12, 13, 14], [24, 23, 22, 21, 19, 18, 17]])
    keys = torch.randn(blocks, 2, size, head_dim, generator=generator)
    return keys, torch.randn(blocks, 2, size, head_dim, generator=generator), tables


@pytest.mark.parametrize("kind", ["slots", "blocks"])
@pytest.mark.parametrize("head_dim", [64, 40, 4])  # 40 and 4: the loops' tails past 16 and 8 lanes
@pytest.mark.parametrize("masked", [True, False])
def test_kernel_equals_sdpa_over_gathered_rows(kind, head_dim, masked):
    generator = torch.Generator().manual_seed(head_dim)
    keys, values, tables = layout(kind, head_dim, generator)
    start, length = 6, 37  # a span of each sequence, as a sliding layer reads it (crossing blocks of 8 mid-block)
    query = torch.randn(3, 6, head_dim, generator=generator)  # 6 query heads over 2 KV heads
    mask = None
    if masked:  # each row sees up to its own position
        mask = torch.arange(length)[None, :] <= torch.tensor([36, 20, 0])[:, None]
    got = kernel.attend(query, keys, values, tables, start, length, mask, 0.3)
    torch.testing.assert_close(got, gathered_sdpa(query, keys, values, tables, start, length, mask, 0.3), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("kind", ["slots", "blocks"])
@pytest.mark.parametrize("head_dim", [64, 40, 4])
def test_the_bf16_cache_build_reads_the_lines_widened(kind, head_dim):
    """A bf16 cache (a bf16 model's) is widened exactly as read: the same attention as over
    its float32 copy, with a float32 query; a cache of the other dtype is refused."""
    generator = torch.Generator().manual_seed(head_dim)
    keys, values, tables = layout(kind, head_dim, generator)
    keys, values = keys.to(torch.bfloat16), values.to(torch.bfloat16)
    query = torch.randn(3, 6, head_dim, generator=generator)
    mask = torch.arange(37)[None, :] <= torch.tensor([36, 20, 0])[:, None]
    bf16_kernel = slot_attention.kernel(torch.bfloat16)
    got = bf16_kernel.attend(query, keys, values, tables, 6, 37, mask, 0.3)
    torch.testing.assert_close(got, kernel.attend(query, keys.float(), values.float(), tables, 6, 37, mask, 0.3), rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="bfloat16 cache"):
        bf16_kernel.attend(query, keys.float(), values.float(), tables, 6, 37, mask, 0.3)
    with pytest.raises(ValueError, match="float32 cache"):
        kernel.attend(query, keys, values, tables, 6, 37, mask, 0.3)


def test_kernel_refuses_shapes_it_would_read_past():
    keys = torch.zeros(4, 2, 8, 16)
    with pytest.raises(ValueError, match="slot_attention"):
        kernel.attend(torch.zeros(2, 6, 16), keys, torch.zeros(4, 2, 9, 16), torch.tensor([[0], [1]]), 0, 8, None, 1.0)
    with pytest.raises(ValueError, match="slot_attention"):
        kernel.attend(torch.zeros(2, 6, 16), keys, keys, torch.tensor([[0], [1]], dtype=torch.int32), 0, 8, None, 1.0)
    with pytest.raises(ValueError, match="outside"):  # past the tables' positions
        kernel.attend(torch.zeros(2, 6, 16), keys, keys, torch.tensor([[0, 1], [1, 2]]), 4, 13, None, 1.0)
    with pytest.raises(ValueError, match="outside"):  # a block id past the cache
        kernel.attend(torch.zeros(2, 6, 16), keys, keys, torch.tensor([[0, 1], [1, 4]]), 0, 16, None, 1.0)


def test_a_call_the_kernel_does_not_serve_gathers_and_runs_sdpa():
    """A float mask (an additive bias) is not the kernel's: the wrapped sdpa gathers the rows instead."""
    slot_attention.install()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    generator = torch.Generator().manual_seed(1)
    cache_keys, cache_values = torch.randn(5, 1, 4, 8, generator=generator), torch.randn(5, 1, 4, 8, generator=generator)
    tables = torch.tensor([[0, 2], [3, 1]])
    keys, values = slot_attention.tag(cache_keys, cache_values, tables, 0, 6)
    query = torch.randn(2, 2, 1, 8, generator=generator)
    bias = torch.randn(2, 1, 1, 6, generator=generator)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, True, False
    out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, keys, values, bias, scaling=0.5)
    rows_k, rows_v = gather_rows(cache_keys, tables, 0, 6), gather_rows(cache_values, tables, 0, 6)
    assert torch.equal(rows_k[1, :, 5], cache_keys[1, :, 1])  # position 5 of row 1: its second block (1), offset 1
    expected = F.scaled_dot_product_attention(query.view(2, 1, 2, 8), rows_k, rows_v, attn_mask=bias, scale=0.5)
    torch.testing.assert_close(out, expected.reshape(2, 1, 2, 8), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,in_place", [("llama", True), ("mistral-sw", True), ("qwen2", True), ("gptj", False), ("gemma2-sw", False)])
def test_backend_reads_slots_in_place_where_the_model_attends_with_sdpa(name, in_place):
    """sdpa models read in place, and a step over scattered slots (past the sliding
    window) gives the gathered step's logits; eager-attention models keep the gather."""
    backend = load_backend("torch", model=tiny_model(name), dtype="float32")
    backend.allocate_slots(6)
    assert backend.reads_in_place is in_place
    if not in_place:
        return
    generator = torch.Generator().manual_seed(2)
    for cache in (*backend.cache.keys, *backend.cache.values):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    positions = torch.tensor([30, 3, 17])
    inputs = StepInputs(
        slots=torch.tensor([0, 3, 5]), positions=positions, input_ids=torch.tensor([5, 6, 7]), params=torch.zeros(3, 7),
        seeds=torch.zeros(3, dtype=torch.long), steps=torch.zeros(3, dtype=torch.long), kv_len=31, contiguous_from=None, min_position=3,
    )
    with torch.inference_mode():
        in_place_logits = backend._eager_logits(inputs, read_in_place=True)
        gathered = backend._eager_logits(inputs, read_in_place=False)
    torch.testing.assert_close(in_place_logits, gathered, rtol=1e-4, atol=1e-4)


def test_bfloat16_keeps_the_gather():
    backend = load_backend("torch", model=tiny_model("llama"), dtype="bfloat16")
    backend.allocate_slots(4)
    assert backend.reads_in_place is False

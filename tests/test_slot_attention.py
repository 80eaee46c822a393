"""The decode attention that reads each row's slot in place (slot_attention), against SDPA over gathered rows."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from disagg.engine.backends import load_backend
from disagg.engine.backends.base import StepInputs
from disagg.engine.backends.slot_kv_cache import gather_rows
from disagg.engine.cpu_kernels import slot_attention
from disagg.engine.quantization.kv_cache import LARGEST_CODE, QuantizedBlocks

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


CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]


def code_kernel(dtype):
    """The 8-bit build for these codes, or a skip where it cannot build here."""
    found = slot_attention.kernel(dtype)
    if found is None:
        pytest.skip(f"slot_attention over {dtype} codes did not build here")
    return found


def random_codes(shape, dtype, generator):
    """Codes of every finite value of the format (e4m3's two NaN codes, 0x7f and 0xff, left out)."""
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
    raw = torch.randint(0, 254, shape, generator=generator, dtype=torch.uint8)
    return torch.where(raw >= 0x7f, raw + 1, raw).view(torch.float8_e4m3fn)  # 0..253 onto 0..0xfe less 0x7f


def quantized_layout(kind, dtype, heads_outermost, head_dim, generator):
    """(keys, values): QuantizedBlocks over the layout's blocks, codes allocated [kv_heads, blocks, ...]
    and permuted where heads_outermost (as the float caches are), and the rows' tables."""
    keys, _, tables = layout(kind, head_dim, generator)
    blocks, heads, size, _ = keys.shape
    largest = LARGEST_CODE[dtype]
    pairs = []
    for _ in range(2):
        if heads_outermost:
            codes = random_codes((heads, blocks, size, head_dim), dtype, generator).permute(1, 0, 2, 3)
        else:
            codes = random_codes((blocks, heads, size, head_dim), dtype, generator)
        scales = (1 + 2 * torch.rand(blocks, heads, generator=generator)) / largest  # dequantized magnitudes up to 1..3
        pairs.append(QuantizedBlocks(codes, scales))
    return pairs[0], pairs[1], tables


def dequantized_sdpa(query, keys, values, tables, start, length, mask, scale):
    """SDPA (float32) over the rows' positions dequantized by QuantizedBlocks.gather."""
    n, q_heads, d = query.shape
    k, v = keys.gather(tables, start, length, torch.float32), values.gather(tables, start, length, torch.float32)
    grouped = query.view(n, k.shape[1], q_heads // k.shape[1], d)
    attn_mask = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(grouped, k, v, attn_mask=attn_mask, scale=scale).reshape(n, q_heads, d)


@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize("kind", ["slots", "blocks"])
@pytest.mark.parametrize("heads_outermost", [True, False])
@pytest.mark.parametrize("head_dim", [64, 40, 4])
@pytest.mark.parametrize("masked", [True, False])
def test_8bit_kernel_equals_sdpa_over_dequantized_rows(dtype, kind, heads_outermost, head_dim, masked):
    """Codes read in place, each block-and-head scale applied to the dots and the weights, give
    the attention over the dequantized rows (2 query heads per KV head, from position 6 on)."""
    attend = code_kernel(dtype)
    generator = torch.Generator().manual_seed(head_dim)
    keys, values, tables = quantized_layout(kind, dtype, heads_outermost, head_dim, generator)
    start, length = 6, 37
    query = torch.randn(3, 4, head_dim, generator=generator)
    mask = torch.arange(length)[None, :] <= torch.tensor([36, 20, 0])[:, None] if masked else None
    scale = head_dim**-0.5
    got = attend.attend(query, keys.codes, values.codes, tables, start, length, mask, scale, keys.scales, values.scales)
    expected = dequantized_sdpa(query, keys, values, tables, start, length, mask, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_every_code_widens_exactly(dtype, flush_denormal):
    """Each of the 256 codes, read as a value of one position (weight 1, scale 1), comes out as
    torch's float32 of it, NaN codes NaN, e4m3's subnormals too where the CPU flushes denormals;
    the codes are laid so every one passes both the vector columns and the scalar tail (7 of 263)."""
    attend = code_kernel(dtype)
    rows, d = 37, 263
    codes = ((torch.arange(d)[None, :] + 7 * torch.arange(rows)[:, None]) % 256).to(torch.uint8)  # row r's tail: codes 7r .. 7r + 6
    values = codes.view(dtype)[:, None, None, :]  # [blocks = rows, 1 head, 1 position, d]
    keys = torch.zeros_like(codes).view(dtype)[:, None, None, :]
    ones = torch.ones(rows, 1)
    previous = torch.is_flush_denormal_enabled() if hasattr(torch, "is_flush_denormal_enabled") else False
    torch.set_flush_denormal(flush_denormal)
    try:
        got = attend.attend(torch.zeros(rows, 1, d), keys, values, torch.arange(rows)[:, None], 0, 1, None, 1.0, ones, ones)
    finally:
        torch.set_flush_denormal(previous)
    assert set(codes[:, 256:].flatten().tolist()) == set(range(256))
    torch.testing.assert_close(got[:, 0], codes.view(dtype).to(torch.float32), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_8bit_kernel_refuses_scales_it_would_misread(dtype):
    attend = code_kernel(dtype)
    generator = torch.Generator().manual_seed(3)
    keys, values, tables = quantized_layout("blocks", dtype, True, 16, generator)
    query = torch.zeros(3, 4, 16)

    def call(key_scales, value_scales):
        return attend.attend(query, keys.codes, values.codes, tables, 0, 16, None, 1.0, key_scales, value_scales)

    good = keys.scales
    call(good, values.scales)
    bad = {
        "missing": None,
        "float64": good.double(),
        "bfloat16": good.bfloat16(),
        "too few blocks": good[:-1],
        "a head short": good[:, :1].contiguous(),
        "flat": good.flatten(),
        "not contiguous": good.t().contiguous().t(),
    }
    for name, scales in bad.items():
        with pytest.raises(ValueError, match="scales"):
            call(scales, values.scales)
        with pytest.raises(ValueError, match="scales"):
            call(good, scales)
    with pytest.raises(ValueError, match="scales"):  # a float cache has none
        kernel.attend(query, keys.codes.float(), values.codes.float(), tables, 0, 16, None, 1.0, good, values.scales)
    with pytest.raises(ValueError, match="cache"):  # codes of the other format
        other = torch.int8 if dtype != torch.int8 else torch.float8_e4m3fn
        call_codes = keys.codes.view(torch.uint8).view(other)
        attend.attend(query, call_codes, call_codes, tables, 0, 16, None, 1.0, good, values.scales)
    with pytest.raises(ValueError, match="scales"):  # a tagged read of codes without their scales
        slot_attention.tag(keys.codes, values.codes, tables, 0, 16, dtype=torch.float32)


@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_wrapped_sdpa_reads_a_tagged_8bit_cache(dtype, bias, monkeypatch):
    """A tagged read of codes (float32 stand-ins) goes to the kernel with its scales; a float
    mask (not the kernel's) gathers the rows dequantized and runs sdpa: the same attention either way."""
    code_kernel(dtype)
    slot_attention.install()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []
    original = slot_attention.SlotAttention.attend
    monkeypatch.setattr(slot_attention.SlotAttention, "attend", lambda self, *a, **k: calls.append(self.kv_dtype) or original(self, *a, **k))
    generator = torch.Generator().manual_seed(4)
    keys, values, tables = quantized_layout("blocks", dtype, True, 16, generator)
    start, length = 3, 30
    tagged = slot_attention.tag(keys.codes, values.codes, tables, start, length, key_scales=keys.scales, value_scales=values.scales, dtype=torch.float32)
    assert tagged[0].dtype == torch.float32 and tagged[0].shape == (3, 2, length, 16)
    query = torch.randn(3, 4, 1, 16, generator=generator)
    if bias:
        mask = torch.randn(3, 1, 1, length, generator=generator)
    else:
        mask = (torch.arange(length)[None, :] <= torch.tensor([29, 10, 0])[:, None])[:, None, None, :]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, True, False
    out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, *tagged, mask, scaling=0.25)
    assert calls == ([] if bias else [dtype])
    k, v = keys.gather(tables, start, length, torch.float32), values.gather(tables, start, length, torch.float32)
    expected = F.scaled_dot_product_attention(query.view(3, 2, 2, 16), k, v, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, expected.reshape(3, 1, 4, 16), rtol=1e-5, atol=2e-6)


def test_a_tagged_8bit_read_gathers_in_the_query_dtype():
    """bf16 stand-ins (a bf16 model's) are not the kernel's: the rows are dequantized to bf16."""
    generator = torch.Generator().manual_seed(5)
    keys, values, tables = quantized_layout("blocks", torch.int8, False, 8, generator)
    tagged = slot_attention.tag(keys.codes, values.codes, tables, 0, 20, key_scales=keys.scales, value_scales=values.scales, dtype=torch.bfloat16)
    assert tagged[1].dtype == torch.bfloat16
    got_k, got_v = tagged[0].disagg_paged.gathered(torch.bfloat16)
    assert got_k.dtype == got_v.dtype == torch.bfloat16
    assert torch.equal(got_v, values.gather(tables, 0, 20, torch.bfloat16))

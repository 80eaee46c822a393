"""prefill_attention.c: a long bf16 prompt's causal attention, against float32 attention
over the same bf16 inputs, its causality bit for bit, its place in transformers' modules
and its start-up check."""

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import checkpoints_root, tiny_model

from disagg.engine.backends import load_backend
from disagg.engine.cpu_kernels import prefill_attention
from disagg.tools.tinymodel import TinyModelSpec, ensure_tiny_model

needs_kernel = pytest.mark.skipif(prefill_attention.kernel() is None, reason="no AVX512_BF16 CPU or C compiler: long bf16 prompts keep SDPA here")
# Heads of 64 (the test suite's other tiny models have heads of 16, which the kernel does not serve).
HEADS_OF_64 = TinyModelSpec(vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1, train_steps=0)


@functools.cache
def heads_of_64_model() -> str:
    return str(ensure_tiny_model(HEADS_OF_64, root=checkpoints_root()))


def inputs(q_heads: int, kv_heads: int, rows: int, prefix: int, d: int, seed: int = 0):
    """query as transformers hands it ([1, heads, rows, d], a view of [1, rows, heads, d]), keys and values."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, rows, q_heads, d, generator=generator).to(torch.bfloat16).transpose(1, 2)
    keys, values = (torch.randn(1, kv_heads, prefix + rows, d, generator=generator).to(torch.bfloat16) for _ in range(2))
    return query, keys, values


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("q_heads,kv_heads,rows,prefix,d", [(9, 3, 333, 0, 64), (4, 2, 70, 30, 128), (2, 1, 17, 100, 64), (4, 4, 129, 0, 64)])
def test_the_kernel_is_float32_attention_within_bf16_rounding(q_heads, kv_heads, rows, prefix, d, threads):
    query, keys, values = inputs(q_heads, kv_heads, rows, prefix, d)
    mask = prefill_attention.causal_mask(rows, prefix + rows)[None, None]
    reference = F.scaled_dot_product_attention(query.float(), keys.float(), values.float(), attn_mask=mask, enable_gqa=True).transpose(1, 2)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = prefill_attention.kernel().attend(query, keys, values, d**-0.5)
    finally:
        torch.set_num_threads(previous)
    assert ours.shape == (1, rows, q_heads, d) and ours.dtype == torch.bfloat16
    # The output and the probabilities each rounded to bf16 once (8 bits): a wrong key or position moves a row by its scale.
    torch.testing.assert_close(ours.float(), reference, rtol=2**-7, atol=2**-7)


@needs_kernel
def test_a_row_reads_keys_up_to_its_own_position_and_none_after():
    rows, prefix = 40, 25  # row i at position 25 + i
    query, keys, values = inputs(4, 2, rows, prefix, 64, seed=1)
    values = torch.cat([values, values], dim=3)[..., :64]  # rows 128 apart, the keys' 64: each read with its own strides
    before = prefill_attention.kernel().attend(query, keys, values, 0.125)
    row = 10  # position 35
    later_keys, later_values = keys.clone(), values.clone()
    later_keys[:, :, prefix + row + 1 :] = 7.0
    later_values[:, :, prefix + row + 1 :] = -7.0
    after = prefill_attention.kernel().attend(query, later_keys, later_values, 0.125)
    assert torch.equal(after[0, : row + 1], before[0, : row + 1])  # rows up to 10 never read positions past 35
    assert not torch.equal(after[0, row + 1], before[0, row + 1])  # row 11 reads position 36
    own = values.clone()
    own[:, :, prefix + row] = 7.0
    changed = prefill_attention.kernel().attend(query, keys, own, 0.125)
    assert torch.equal(changed[0, :row], before[0, :row]) and not torch.equal(changed[0, row], before[0, row])


@needs_kernel
def test_shapes_it_cannot_read_are_refused_before_the_c_side_reads_them():
    query, keys, values = inputs(4, 2, 20, 0, 64)
    for bad in (
        (query.float(), keys, values),  # float32
        (query, keys[:, :, :10], values[:, :, :10]),  # more query rows than keys
        (query[..., :32], keys[..., :32], values[..., :32]),  # heads of 32
        (query, keys, values.transpose(2, 3).contiguous().transpose(2, 3)),  # values' d not contiguous
        (query.expand(2, -1, -1, -1), keys.expand(2, -1, -1, -1), values.expand(2, -1, -1, -1)),  # two sequences
    ):
        with pytest.raises(ValueError, match="prefill_attention"):
            prefill_attention.kernel().attend(*bad, 0.125)


def bf16_backend(dtype: str = "bfloat16"):
    """Prompts through transformers' modules (no native prefill), where the kernel sits."""
    return load_backend("torch", model=heads_of_64_model(), dtype=dtype, torch={"native_step": False})


def prefill(backend, prompt: list[int], served: bool) -> torch.Tensor:
    prefill_attention.serve(backend.model.modules(), served)
    try:
        return backend.prefill_logits(prompt, lambda *kv: None)[0].float()
    finally:
        prefill_attention.serve(backend.model.modules(), backend.prefill_attention)


@needs_kernel
def test_a_long_bf16_prefill_attends_in_the_kernel_and_stays_as_close_to_float32_as_sdpa(one_torch_thread):
    backend = bf16_backend()
    assert backend.prefill_attention
    calls = []
    original = prefill_attention.PrefillAttention.attend
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefill_attention.PrefillAttention, "attend", lambda self, *args: calls.append(args[0].shape) or original(self, *args))
        prompt = [(11 * i + 3) % backend.info.vocab_size for i in range(300)]
        ours = prefill(backend, prompt, True)
    assert len(calls) == backend.info.num_layers and calls[0][2] == 300  # every layer's attention, all 300 rows
    sdpa = prefill(backend, prompt, False)
    exact = bf16_backend("float32").prefill_logits(prompt, lambda *kv: None)[0]
    # Both round in bf16, differently; the kernel no further from float32 arithmetic than SDPA (with room for the order of sums).
    assert (ours - exact).abs().max() <= 1.5 * (sdpa - exact).abs().max() + 1e-2 * exact.abs().max()


@needs_kernel
def test_short_prompts_sliding_windows_and_unserved_modules_keep_sdpa(one_torch_thread):
    backend = bf16_backend()
    calls = []
    original = prefill_attention.PrefillAttention.attend
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefill_attention.PrefillAttention, "attend", lambda self, *args: calls.append(1) or original(self, *args))
        short = list(range(prefill_attention.MIN_ROWS - 1))
        assert torch.equal(prefill(backend, short, True), prefill(backend, short, False))
        prefill(backend, list(range(100)), False)
        assert not calls
        query, keys, values = inputs(2, 1, 40, 0, 64)
        module = torch.nn.Module()
        prefill_attention.serve([module])
        attention = prefill_attention._wrap(lambda *args, **kwargs: "sdpa")
        assert attention(module, query, keys, values, None, scaling=0.125, sliding_window=16) == "sdpa"  # a window shorter than the keys
        assert attention(module, query, keys, values, None, scaling=0.125, softcap=30.0) == "sdpa"
        assert attention(torch.nn.Module(), query, keys, values, None, scaling=0.125) == "sdpa"  # not marked served
        assert attention(module, query, keys, values, None, scaling=0.125, is_causal=False) == "sdpa"  # bidirectional
        module.is_causal = False
        assert attention(module, query, keys, values, None, scaling=0.125) == "sdpa"
        del module.is_causal
        assert not calls
        out, _ = attention(module, query, keys, values, None, scaling=0.125, sliding_window=4096)
        assert calls and out.shape == (1, 40, 2, 64)


@needs_kernel
def test_a_kernel_that_changes_the_logits_is_not_used(one_torch_thread, monkeypatch):
    monkeypatch.setattr(prefill_attention.PrefillAttention, "attend", lambda self, query, key, value, scale: torch.zeros_like(query.transpose(1, 2)))
    backend = bf16_backend()
    assert not backend.prefill_attention
    assert not any(getattr(module, prefill_attention.SERVES, False) for module in backend.model.modules())


@needs_kernel
def test_a_model_whose_attention_the_kernel_does_not_serve_keeps_sdpa(one_torch_thread):
    backend = load_backend("torch", model=tiny_model("llama"), dtype="bfloat16", torch={"native_step": False})  # heads of 16
    assert not backend.prefill_attention
    assert not any(getattr(module, prefill_attention.SERVES, False) for module in backend.model.modules())


def test_without_avx512_bf16_long_prompts_keep_sdpa(monkeypatch):
    monkeypatch.setattr(prefill_attention, "cpu_flags", lambda: {"avx2", "fma"})
    prefill_attention._kernel.cache_clear()
    try:
        assert prefill_attention.kernel() is None
        assert not bf16_backend().prefill_attention
    finally:
        prefill_attention._kernel.cache_clear()

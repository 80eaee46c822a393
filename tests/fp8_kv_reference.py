"""An fp8 KV cache as NxDI's KVCacheManager keeps it (kv_cache_quant, or kv_quant_config with a direct cast), over
transformers itself: the reference of tests/test_neuron_kv_fp8.py and tests/test_neuron_on_nxdi_cpu.py, written
here independently of the engine and of the stand-in.

A step's attention takes the positions before it as e4m3 values and its own new K/V as computed (NxDI's context
encoding attends over the prompt's K/V before they are cast; token generation over the cached lines and the new
token's own, compute_for_token_gen); the cache keeps each new line cast to e4m3."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(E4M3).to(x.dtype)


def fp8_lines_greedy(model, ids: list[int], count: int) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Greedy tokens (the first from the prompt), the prompt's cached lines [kv_heads, len, head_dim] and every
    position's after the last step (the prompt and count - 1 tokens), e4m3 values."""
    from transformers import DynamicCache

    cached: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: [1, kv_heads, positions, head_dim], e4m3 values

    class Fp8Lines(DynamicCache):
        def update(self, keys, values, layer_idx, cache_kwargs=None):
            if layer_idx == len(cached):
                cached.append((keys[:, :, :0], values[:, :, :0]))
            past_keys, past_values = cached[layer_idx]
            cached[layer_idx] = (torch.cat([past_keys, e4m3(keys)], dim=2), torch.cat([past_values, e4m3(values)], dim=2))
            super().update(keys, values, layer_idx, cache_kwargs)  # its lengths and masks; what attends is returned here
            return torch.cat([past_keys, keys], dim=2), torch.cat([past_values, values], dim=2)

    cache = Fp8Lines()
    tokens, position, prompt = [], 0, None
    with torch.no_grad():
        step = ids
        for _ in range(count):
            out = model(torch.tensor([step]), position_ids=torch.arange(position, position + len(step))[None], past_key_values=cache, use_cache=True)
            if prompt is None:  # after the prompt's own step: its lines
                prompt = [(k[0].clone(), v[0].clone()) for k, v in cached]
            position += len(step)
            tokens.append(int(out.logits[0, -1].argmax()))
            step = [tokens[-1]]
    return tokens, prompt, [(k[0], v[0]) for k, v in cached]


def same_lines(got: torch.Tensor, want: torch.Tensor) -> bool:
    """e4m3 values in float32, the reference's but where a value sat on a rounding boundary (the stand-in and NxDI
    pad a prompt to its bucket, so their products round apart in the last bits)."""
    return got.dtype == torch.float32 and torch.equal(e4m3(got), got) and bool((got != want).float().mean() < 0.01) and bool(
        (got - want).abs().max() <= 2 ** -3 * want.abs().max())



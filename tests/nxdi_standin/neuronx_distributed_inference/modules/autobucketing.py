"""Stand-in for NxDI 0.9.0 modules/autobucketing.py: the buckets each model is compiled for
(0.7 and 0.8 generate the same ones)."""

from __future__ import annotations

from math import log2


def generate_buckets(min_length: int, max_length: int) -> list[int]:
    """generate_buckets: powers of two from min_length up to, not including, 2**round(log2(max_length)),
    then max_length itself (so 128..300 gives [128, 300], 128..384 gives [128, 256, 384])."""
    if min_length == max_length:
        return [max_length]
    low, high = int(log2(min_length)), round(log2(max_length))
    return [2**i for i in range(low, high)] + [max_length]


def generate_buckets_for_cte(neuron_config) -> list[int]:
    """generate_buckets_for_cte (no prefix caching, no chunked prefill): custom buckets are used
    only with enable_bucketing, as given; without bucketing one bucket of max_context_length."""
    if not neuron_config.enable_bucketing:
        return generate_buckets(neuron_config.max_context_length, neuron_config.max_context_length)
    if neuron_config.context_encoding_buckets is not None:
        return neuron_config.context_encoding_buckets
    return generate_buckets(128, neuron_config.max_context_length)


def generate_buckets_for_tkg(neuron_config) -> list[int]:
    """generate_buckets_for_tkg (no prefix caching, no batch bucketing)."""
    if not neuron_config.enable_bucketing:
        return generate_buckets(neuron_config.max_length, neuron_config.max_length)
    if neuron_config.token_generation_buckets is not None:
        return neuron_config.token_generation_buckets
    return generate_buckets(128, neuron_config.max_length)


def generate_buckets_for_fused_spec(inference_config) -> list[int]:
    """generate_buckets_for_fused_spec (no prefix caching): as the token-generation model's."""
    return generate_buckets_for_tkg(inference_config.neuron_config)

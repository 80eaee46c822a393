"""End to end through real processes for the architectures the slot cache once got
wrong: sliding-window models past their window, GPT-J (partial rotary, its own
attention classes) and Bloom (ALiBi), against transformers generate()."""

from __future__ import annotations

import asyncio

import pytest
from conftest import TEST_MODELS, assert_nothing_held, reference, start_cluster

from disagg.clients.grpc_client import AsyncClient
from disagg.tools.tinymodel import paragraphs


def long_prompts(count: int, words: int) -> list[str]:
    texts = paragraphs()
    return [" ".join(" ".join(texts[i:] + texts[:i]).split()[: words + 7 * i]) for i in range(count)]


def run_all(cluster, prompts: list[str], max_new_tokens: int):
    async def run():
        async with AsyncClient(cluster.router_address, timeout=180) as client:
            return await asyncio.gather(*(client.complete(p, max_new_tokens=max_new_tokens) for p in prompts))

    return asyncio.run(run())


def assert_generate_output(cluster, model: str, prompts: list[str], max_new_tokens: int) -> None:
    ref = reference(model)
    for prompt, result in zip(prompts, run_all(cluster, prompts, max_new_tokens)):
        assert result.token_ids == ref.greedy(prompt, max_new_tokens), prompt
    assert_nothing_held(cluster)


@pytest.mark.parametrize("model,prefill,decode", [("mistral-sw", 1, 1), ("mistral-sw", 2, 2), ("gemma2-sw", 1, 1)])
def test_sliding_window_models_past_their_window_equal_generate(cluster_logs, model, prefill, decode):
    window = TEST_MODELS[model].sliding_window
    prompts = long_prompts(6, words=40)
    ref = reference(model)
    assert all(len(ref.ids(p)) > 3 * window for p in prompts), "each prompt must run well past the window"
    # Eager: tests/test_compiled.py runs each of these models' compiled step in process (Gemma 2's sliding and full
    # layers too), and the shared llama cluster runs it through the service; a compile here cost CI about 40 s.
    cluster = start_cluster(cluster_logs, model, prefill=prefill, decode=decode, batch_size=4)
    try:
        assert_generate_output(cluster, model, prompts, max_new_tokens=24)
    finally:
        cluster.stop()


@pytest.mark.parametrize("model", ["gptj", "bloom"])
def test_gptj_and_bloom_equal_generate(cluster_logs, model):
    cluster = start_cluster(cluster_logs, model)
    try:
        assert_generate_output(cluster, model, long_prompts(5, words=6), max_new_tokens=24)
    finally:
        cluster.stop()

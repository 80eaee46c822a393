"""The paged KV cache and prefix caching end to end: router, prefill and decode workers as
real processes, over both KV transports, against transformers generate().

A prompt that shares whole blocks with an earlier one is served from the decode worker's
cached blocks: the prefill sends only the KV past them (the bytes the decode worker
receives say how many), and the tokens are generate()'s."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from conftest import DEFAULT_TRANSPORT, assert_nothing_held, kv_bytes_received, reference, start_cluster, tiny_model
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoConfig

from disagg.clients.grpc_client import AsyncClient, Client
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wpb_grpc

BLOCK = 16
CONTEXT = (
    "The harbour town wakes before dawn. Fishermen check their nets, the baker lights the ovens, "
    "and the ferry captain reads the weather from the colour of the sky over the hills. "
)
QUESTIONS = ["What does the baker do?", "Who reads the weather?", "When does the town wake?", "What do the fishermen check?"]


def decode_metric(cluster, name: str, labels: dict | None = None) -> float:
    """The sum of a sample over the cluster's decode workers, from their /metrics."""
    total = 0.0
    for process in cluster.processes:
        if process.name.startswith("decode"):
            text = urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5).read().decode()
            for family in text_string_to_metric_families(text):
                total += sum(s.value for s in family.samples if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()))
    return total


def kv_bytes_per_token(architecture: str) -> int:
    config = AutoConfig.from_pretrained(tiny_model(architecture))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # float32


def shared_blocks(a: list[int], b: list[int]) -> int:
    """Whole blocks of b that a published: its leading full blocks equal to a's."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(same, len(a), len(b)) // BLOCK


@pytest.fixture(scope="module")
def paged_cluster(transport, cluster_logs):
    cluster = start_cluster(cluster_logs, "llama", transport=transport, compile=False, decode_args=["--block-size", str(BLOCK)])
    yield cluster
    cluster.stop()


def test_a_shared_prefix_is_received_once_and_tokens_equal_generate(paged_cluster, transport):
    ref = reference("llama")
    first, second = CONTEXT + QUESTIONS[0], CONTEXT + QUESTIONS[1]
    ids_first, ids_second = ref.ids(first), ref.ids(second)
    hits = shared_blocks(ids_first, ids_second)
    assert hits >= 3, "the test needs a context of several whole blocks"
    per_token = kv_bytes_per_token("llama")
    with Client(paged_cluster.router_address, timeout=60) as client:
        before = kv_bytes_received(paged_cluster, transport)
        assert client.complete(first, max_new_tokens=12).token_ids == ref.greedy(first, 12)
        middle = kv_bytes_received(paged_cluster, transport)
        hit_tokens = decode_metric(paged_cluster, "disagg_decode_prefix_hit_tokens_total")
        assert client.complete(second, max_new_tokens=12).token_ids == ref.greedy(second, 12)
        after = kv_bytes_received(paged_cluster, transport)
    assert middle - before == len(ids_first) * per_token  # nothing cached yet: the whole prompt
    assert after - middle == (len(ids_second) - hits * BLOCK) * per_token  # only past the cached blocks
    assert decode_metric(paged_cluster, "disagg_decode_prefix_hit_tokens_total") - hit_tokens == hits * BLOCK
    assert_nothing_held(paged_cluster)
    assert decode_metric(paged_cluster, "disagg_decode_kv_blocks", {"state": "used"}) == 0


def test_concurrent_requests_sharing_blocks_and_a_cancel_among_them(paged_cluster):
    """Many requests read the same cached blocks at once while one of them is cancelled
    mid-stream: the others' tokens are generate()'s, and every block is released."""
    ref = reference("llama")
    prompts = [CONTEXT + q for q in QUESTIONS] * 2

    async def run():
        async with AsyncClient(paged_cluster.router_address, timeout=120) as client:
            await client.complete(prompts[0], max_new_tokens=4)  # publishes the context's blocks
            streaming = asyncio.Event()

            async def doomed_stream():
                async for chunk in client.generate(CONTEXT + "Tell a long story about the harbour", max_new_tokens=200, ignore_eos=True):
                    if chunk.token_ids:
                        streaming.set()

            doomed = asyncio.create_task(doomed_stream())
            others = [asyncio.create_task(client.complete(p, max_new_tokens=16)) for p in prompts]
            # Cancelled at its first token, with 199 to go, while the others (all sent) read the same blocks:
            # whatever the host's speed, it is mid-stream.
            await streaming.wait()
            doomed.cancel()
            with pytest.raises((asyncio.CancelledError, grpc.aio.AioRpcError)):
                await doomed
            return await asyncio.gather(*others)

    for prompt, result in zip(prompts, asyncio.run(run())):
        assert result.token_ids == ref.greedy(prompt, 16), prompt
    assert_nothing_held(paged_cluster, within=10)
    assert decode_metric(paged_cluster, "disagg_decode_kv_blocks", {"state": "used"}) == 0
    assert decode_metric(paged_cluster, "disagg_decode_prefix_hit_tokens_total") > 0


@pytest.fixture(scope="module")
def small_pool_cluster(cluster_logs):
    """Llama with a decode KV budget of 36 blocks: two prompts' cached blocks fill it, so later
    prompts evict them while others still read theirs (the budget must hold one max_seq_len sequence: 32 blocks)."""
    budget = 36 * BLOCK * kv_bytes_per_token("llama") / 2**30
    decode_args = ["--block-size", str(BLOCK), "--kv-cache-gib", f"{budget:.10f}", "--batch-size", "4"]
    cluster = start_cluster(cluster_logs, "llama", decode=1, prefill=1, compile=False, decode_args=decode_args, router_args=[])
    yield cluster
    cluster.stop()


def test_evictions_under_memory_pressure_keep_tokens_exact(small_pool_cluster):
    ref = reference("llama")
    places = ["river", "mountain", "desert", "forest", "island", "valley"]
    contexts = [f"Story {n}: " + 2 * CONTEXT.replace("harbour", place) for n, place in enumerate(places)]
    prompts = [contexts[n // 3] + QUESTIONS[n % 3] for n in range(18)]

    async def run():
        async with AsyncClient(small_pool_cluster.router_address, timeout=120) as client:
            results = []
            for wave in range(0, len(prompts), 3):  # a context's first prompt publishes its blocks; two more read them together
                results.append(await client.complete(prompts[wave], max_new_tokens=10))
                results += await asyncio.gather(*(client.complete(p, max_new_tokens=10) for p in prompts[wave + 1 : wave + 3]))
            return results

    for prompt, result in zip(prompts, asyncio.run(run())):
        assert result.token_ids == ref.greedy(prompt, 10), prompt
    assert decode_metric(small_pool_cluster, "disagg_decode_prefix_evicted_blocks_total") > 0
    assert decode_metric(small_pool_cluster, "disagg_decode_prefix_hit_tokens_total") > 0
    assert_nothing_held(small_pool_cluster)


def test_a_sliding_window_model_served_from_cached_blocks(cluster_logs):
    """Mistral with a 16-token window: the cached prefix is longer than the window."""
    if DEFAULT_TRANSPORT is None:
        pytest.skip("no transport")
    ref = reference("mistral-sw")
    cluster = start_cluster(cluster_logs, "mistral-sw", compile=False, decode_args=["--block-size", str(BLOCK)])
    try:
        with Client(cluster.router_address, timeout=60) as client:
            for question in QUESTIONS[:3]:
                prompt = CONTEXT + question
                assert client.complete(prompt, max_new_tokens=12).token_ids == ref.greedy(prompt, 12), prompt
        assert decode_metric(cluster, "disagg_decode_prefix_hit_tokens_total") > 0
        assert_nothing_held(cluster)
    finally:
        cluster.stop()


def test_a_paged_decode_worker_holds_more_short_requests_than_slots_would(lone_paged_decode_worker):
    """The same KV budget, 64 blocks of 16 positions (two sequences of max_seq_len 512 in the slot
    layout): requests of 20 prompt tokens and 16 new each hold 3 blocks, so 21 fit."""
    address, budget_blocks = lone_paged_decode_worker
    calls, reserved = [], 0

    async def run():
        nonlocal reserved
        async with grpc.aio.insecure_channel(address) as channel:
            stub = wpb_grpc.DecodeServiceStub(channel)
            while True:
                call = stub.Decode(wpb.DecodeRequest(
                    request_id=f"r{reserved}", prompt_len=20, sampling=wpb.WorkerSampling(), stopping=wpb.WorkerStopping(max_new_tokens=16),
                ))
                calls.append(call)
                try:
                    event = await call.read()
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "KV blocks" in exc.details(), exc.details()
                    break
                assert event.reserved.reservation_id
                reserved += 1
            for call in calls:
                call.cancel()

    asyncio.run(run())
    slot_layout = budget_blocks * BLOCK // 512
    assert slot_layout == 2
    assert reserved == budget_blocks // 3 == 21


@pytest.fixture(scope="module")
def lone_paged_decode_worker(cluster_logs):
    from disagg.tools.local_cluster import ClusterSpec, LocalCluster

    blocks = 64
    budget = blocks * BLOCK * kv_bytes_per_token("llama") / 2**30
    cluster = LocalCluster(ClusterSpec(
        model=tiny_model("llama"), dtype="float32", compile=False, threads_per_worker=1, log_dir=str(cluster_logs / "lone-paged"),
    ))
    worker = cluster.add_worker("decode", ["--kv-cache-gib", f"{budget:.10f}", "--max-batch-size", "64", "--block-size", str(BLOCK)])
    try:
        cluster.wait_serving(120, worker.address)
        yield worker.address, blocks
    finally:
        cluster.stop()


def test_penalties_and_seeded_sampling_are_unchanged_by_hits(paged_cluster, transport):
    """The same requests before and after their context is cached (hits on both workers): penalized
    greedy tokens equal transformers' with the same processing, and seeded samples do not move."""
    from test_sampling_e2e import reference_run

    if transport != DEFAULT_TRANSPORT:
        pytest.skip("sampling does not depend on the transport")
    ref = reference("llama")
    context = "Penalties and seeds. " + CONTEXT
    penalized = dict(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5, presence_penalty=-0.5, frequency_penalty=2.0)
    seeded = dict(max_new_tokens=16, ignore_eos=True, temperature=1.0, top_p=0.95, seed=1234)
    expected, _ = reference_run(ref, ref.ids(context + QUESTIONS[0]), repetition=1.5, presence=-0.5, frequency=2.0, max_new_tokens=16)
    with Client(paged_cluster.router_address, timeout=60) as client:
        hits = decode_metric(paged_cluster, "disagg_decode_prefix_hit_tokens_total")
        cold = [client.complete(context + QUESTIONS[0], **penalized).token_ids, client.complete(context + QUESTIONS[1], **seeded).token_ids]
        warm = [client.complete(context + QUESTIONS[0], **penalized).token_ids, client.complete(context + QUESTIONS[1], **seeded).token_ids]
    assert decode_metric(paged_cluster, "disagg_decode_prefix_hit_tokens_total") - hits >= 3 * 2 * BLOCK  # the warm pair, at least
    assert cold == warm and cold[0] == expected

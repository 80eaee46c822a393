"""The router's decode admission: first come first served, bounded, and what
happens when it is full; unit tests on WorkerPool, then a real overload."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conftest import assert_nothing_held, start_cluster
from test_e2e import PROMPTS

from disagg.clients.grpc_client import AsyncClient
from disagg.rpc.server import RequestError
from disagg.v1 import worker_pb2 as wpb
from router.workers import Worker, WorkerPool


def pool_with(capacities: list[int], max_queue: int) -> WorkerPool:
    decode = [Worker(f"d{i}", "decode", None, None, None, healthy=True, load=wpb.WorkerLoad(capacity=c)) for i, c in enumerate(capacities)]
    return WorkerPool(prefill=[], decode=decode, max_queue=max_queue, poll_seconds=1.0)


def test_waiters_are_served_in_arrival_order_and_the_bound_is_enforced():
    async def run():
        pool = pool_with([1, 1], max_queue=3)
        holders = [await pool.acquire_decode(), await pool.acquire_decode()]
        assert {w.address for w in holders} == {"d0", "d1"}
        order = []

        async def wait(i):
            worker = await pool.acquire_decode()
            order.append(i)
            return worker

        waiters = [asyncio.ensure_future(wait(i)) for i in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(RequestError) as full:
            await pool.acquire_decode()
        assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "3 requests already waiting" in str(full.value)
        for _ in range(3):
            pool.release_decode(holders.pop(0))
            holders.append(await asyncio.wait_for(asyncio.shield(waiters[len(order)]), 1))
        assert order == [0, 1, 2]

    asyncio.run(run())


def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing():
    async def run():
        pool = pool_with([1], max_queue=2)
        holder = await pool.acquire_decode()
        waiter = asyncio.ensure_future(pool.acquire_decode())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.sleep(0)
        assert pool.queued == 0
        pool.release_decode(holder)
        assert pool.decode[0].outstanding == 0

    asyncio.run(run())


def test_waiters_get_unavailable_when_the_last_decode_worker_goes():
    async def run():
        pool = pool_with([1], max_queue=2)
        await pool.acquire_decode()
        waiter = asyncio.ensure_future(pool.acquire_decode())
        await asyncio.sleep(0)
        pool.mark_unavailable(pool.decode[0])
        with pytest.raises(RequestError) as error:
            await waiter
        assert error.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())


@pytest.fixture(scope="module")
def small_cluster(cluster_logs):
    # 2 decode slots, room for 18 more in the router's queue.
    cluster = start_cluster(cluster_logs, "llama", batch_size=2, router_args=["--max-queue", "18"], http_port=0)
    yield cluster
    cluster.stop()


def test_ten_times_the_slots_all_complete_exactly(small_cluster, llama_ref):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(20)]

    async def run():
        async with AsyncClient(small_cluster.router_address, timeout=120) as client:
            return await asyncio.gather(*(client.complete(p, max_new_tokens=30) for p in prompts))

    for prompt, result in zip(prompts, asyncio.run(run())):
        assert result.token_ids == llama_ref.greedy(prompt, 30)
    assert_nothing_held(small_cluster)


async def with_prefill_frozen(cluster, calls: list, refused_type) -> list:
    """The calls' results, sent while the prefill worker is stopped (SIGSTOP): the first two take
    the decode slots and wait on the prefill, the next 18 fill the router's queue, and the rest
    must be refused at once. Nothing can free a slot until the prefill goes on (SIGCONT), so
    which requests are refused does not depend on how fast the host decodes. The stop lasts
    until those refusals are in: well within the two missed load polls (1 s timeout each)
    that would make the router doubt the prefill worker."""
    import signal

    tasks = [asyncio.ensure_future(call) for call in calls]
    cluster.signal("prefill-0", signal.SIGSTOP)
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while sum(task.done() for task in tasks) < len(tasks) - 20:  # polling the condition
            assert asyncio.get_running_loop().time() < deadline, [task.done() for task in tasks]
            await asyncio.sleep(0.01)
        assert all(isinstance(task.result(), refused_type) for task in tasks if task.done())
    finally:
        cluster.signal("prefill-0", signal.SIGCONT)
    return await asyncio.gather(*tasks)


def test_past_the_queue_bound_requests_are_refused_at_once_and_the_rest_complete(small_cluster, llama_ref):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(40)]

    async def one(client, prompt):
        try:
            return await client.complete(prompt, max_new_tokens=40, ignore_eos=True)
        except grpc.aio.AioRpcError as exc:
            return exc

    async def run():
        async with AsyncClient(small_cluster.router_address, timeout=120) as client:
            return await with_prefill_frozen(small_cluster, [one(client, p) for p in prompts], grpc.aio.AioRpcError)

    results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 20 and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting for a decode slot" in r.details() for r in refused)
    for prompt, result in zip(prompts, results):
        if not isinstance(result, grpc.aio.AioRpcError):
            assert result.token_ids == llama_ref.greedy(prompt, 40, ignore_eos=True)
    assert_nothing_held(small_cluster)


def test_past_the_queue_bound_the_http_api_answers_429_and_the_rest_complete(small_cluster, llama_ref):
    import openai

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(40)]

    async def one(client, prompt):
        try:
            stream = await client.completions.create(model=None, prompt=prompt, max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        except openai.RateLimitError as exc:
            return exc

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{small_cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await with_prefill_frozen(small_cluster, [one(client, p) for p in prompts], openai.RateLimitError)

    results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 20 and all(r.status_code == 429 and "waiting for a decode slot" in r.message for r in refused)
    for prompt, result in zip(prompts, results):
        if isinstance(result, str):
            expected = llama_ref.greedy(prompt, 40, ignore_eos=True)  # past EOS, as the API detokenizes
            assert result == llama_ref.tokenizer.decode(expected, skip_special_tokens=True)
    assert_nothing_held(small_cluster)

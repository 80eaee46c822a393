"""Client cancels and deadlines at random moments: everything held is freed on
every worker, and every request that was not cancelled is exact."""

from __future__ import annotations

import asyncio
import random

import grpc

from disagg.client import AsyncClient
from conftest import assert_nothing_held
from test_e2e import PROMPTS

REQUESTS = 300


def test_random_cancels_and_deadlines_free_everything_and_the_rest_is_exact(llama_cluster, llama_ref):
    rng = random.Random(7)
    expected = {p: llama_ref.greedy(p, 40) for p in PROMPTS}
    outcomes = {"ok": 0, "cancelled": 0, "deadline": 0}

    async def one(client, hurried, i, gate):
        prompt, n = PROMPTS[i % len(PROMPTS)], 5 + (i * 11) % 36
        fate = rng.random()
        async with gate:
            if fate < 0.15:  # a deadline that passes in some phase of the request
                try:
                    result = await hurried.complete(prompt, max_new_tokens=n)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                    outcomes["deadline"] += 1
                    return
            else:
                task = asyncio.ensure_future(client.complete(prompt, max_new_tokens=n))
                if fate < 0.55:  # cancel at a random moment: queued, prefilling, transferring or decoding
                    await asyncio.sleep(rng.uniform(0, 0.06))
                    task.cancel()
                try:
                    result = await task
                except asyncio.CancelledError:
                    outcomes["cancelled"] += 1
                    return
            assert result.token_ids == expected[prompt][:n], (prompt, n)
            outcomes["ok"] += 1

    async def run():
        gate = asyncio.Semaphore(24)  # 3x the decode slots: some wait in the router's queue
        async with AsyncClient(llama_cluster.router_address, timeout=120) as client, AsyncClient(llama_cluster.router_address, timeout=0.03) as hurried:
            await asyncio.gather(*(one(client, hurried, i, gate) for i in range(REQUESTS)))

    asyncio.run(run())
    print(outcomes)
    assert sum(outcomes.values()) == REQUESTS
    assert outcomes["ok"] > 100 and outcomes["cancelled"] > 20 and outcomes["deadline"] > 10, outcomes
    assert_nothing_held(llama_cluster, within=1.0)  # freed on every worker within a second

"""Client cancels and deadlines at random moments: everything held is freed on
every worker, and every request that was not cancelled is exact.

What each request meets is made to happen, not left to the host's speed: a cancel
mid-stream comes after the stream's k-th token of hundreds; a deadline of at most
25 ms falls on a request for the whole context (440 tokens through three processes,
which no host streams that fast); so the counts below hold on a slow 2-core machine
and a fast 64-core one alike.
Cancels at a random moment (queued, prefilling, transferring or decoding) come on
top: each ends cancelled or exact, whichever the host's speed makes it."""

from __future__ import annotations

import asyncio
import collections
import random

import grpc
from conftest import assert_nothing_held
from test_e2e import PROMPTS

from disagg.clients.grpc_client import AsyncClient

REQUESTS = 300
WHOLE_CONTEXT = 440  # new tokens a long request asks for: the cluster's 512 positions less the longest prompt (37)
FATES = (("plain", 0.45), ("deadline", 0.15), ("cancel mid-stream", 0.2), ("cancel at a random moment", 0.2))


def fates(rng: random.Random) -> list[str]:
    return rng.choices([name for name, _ in FATES], weights=[share for _, share in FATES], k=REQUESTS)


async def until_deadline(hurried: AsyncClient, prompt: str) -> str:
    """A request for the whole context under a deadline of at most 25 ms: it must end DEADLINE_EXCEEDED."""
    try:
        await hurried.complete(prompt, max_new_tokens=WHOLE_CONTEXT, ignore_eos=True)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
        return "deadline"
    raise AssertionError(f"{WHOLE_CONTEXT} tokens within the deadline")


async def cancel_mid_stream(client: AsyncClient, prompt: str, k: int, expected: list[int]) -> str:
    """Streams the whole context and leaves after k tokens, long before its end: the call is cancelled."""
    received = []
    async for chunk in client.generate(prompt, max_new_tokens=WHOLE_CONTEXT, ignore_eos=True):
        assert chunk.finish_reason is None, chunk
        received += chunk.token_ids
        if len(received) >= k:
            break  # the generator's exit cancels the call
    assert received[: len(expected)] == expected[: len(received)], prompt  # exact as far as the reference goes
    return "cancelled"


async def cancel_at_random(client: AsyncClient, prompt: str, n: int, after: float, expected: list[int]) -> str:
    """Cancelled at a random moment: cancelled, or finished first and exact."""
    task = asyncio.ensure_future(client.complete(prompt, max_new_tokens=n))
    await asyncio.sleep(after)  # the moment of the cancel, not a wait for anything
    task.cancel()
    try:
        result = await task
    except asyncio.CancelledError:
        return "cancelled"
    assert result.token_ids == expected[:n], (prompt, n)
    return "ok"


def test_random_cancels_and_deadlines_free_everything_and_the_rest_is_exact(llama_cluster, llama_ref):
    rng = random.Random(7)
    planned = fates(rng)
    expected = {p: llama_ref.greedy(p, 40) for p in PROMPTS}
    long_expected = {p: llama_ref.greedy(p, 60, ignore_eos=True) for p in PROMPTS}
    draws = [(rng.randint(1, 30), rng.uniform(0, 0.025), rng.uniform(0, 0.06)) for _ in range(REQUESTS)]

    async def one(client, hurried, i, gate):
        prompt, n, (k, deadline, after) = PROMPTS[i % len(PROMPTS)], 5 + (i * 11) % 36, draws[i]
        async with gate:
            if planned[i] == "deadline":
                return planned[i], await until_deadline(hurried[min(int(deadline * 200), 4)], prompt)
            if planned[i] == "cancel mid-stream":
                return planned[i], await cancel_mid_stream(client, prompt, k, long_expected[prompt])
            if planned[i] == "cancel at a random moment":
                return planned[i], await cancel_at_random(client, prompt, n, after, expected[prompt])
            result = await client.complete(prompt, max_new_tokens=n)
            assert result.token_ids == expected[prompt][:n], (prompt, n)
            return planned[i], "ok"

    async def run():
        gate = asyncio.Semaphore(24)  # 3x the decode slots: some wait in the router's queue
        # Deadlines of 5 to 25 ms: they pass in every phase, from the router's queue to decoding.
        hurried = [AsyncClient(llama_cluster.router_address, timeout=0.005 * (j + 1)) for j in range(5)]
        async with AsyncClient(llama_cluster.router_address, timeout=120) as client:
            try:
                return await asyncio.gather(*(one(client, hurried, i, gate) for i in range(REQUESTS)))
            finally:
                for h in hurried:
                    await h.close()

    outcomes = collections.Counter(asyncio.run(run()))
    print(outcomes)
    planned_counts = collections.Counter(planned)
    assert outcomes[("plain", "ok")] == planned_counts["plain"] > 100, outcomes
    assert outcomes[("deadline", "deadline")] == planned_counts["deadline"] > 20, outcomes
    assert outcomes[("cancel mid-stream", "cancelled")] == planned_counts["cancel mid-stream"] > 20, outcomes
    randomly = outcomes[("cancel at a random moment", "cancelled")] + outcomes[("cancel at a random moment", "ok")]
    assert randomly == planned_counts["cancel at a random moment"], outcomes
    assert_nothing_held(llama_cluster, within=1.0)  # freed on every worker within a second

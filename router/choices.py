"""A request's n choices: n independent generations, their chunks merged into one stream.

Each choice runs the whole lifecycle on its own (its own decode slot and
prefill; nothing is shared), so a choice fails over, stops and frees its slot
on its own, and a batch of n behaves as n requests would. Choice i samples
with seed + i (wrapped to int64), as vLLM seeds its parallel-sampling
children: with a seed the choices differ and are the same on every call, and
choice 0 equals the same request with n = 1.

Closing the merged stream (client cancel, deadline, an error in one choice)
cancels every choice, so each one's worker calls are cancelled and every
worker frees what it held.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from .lifecycle import Chunk
from .validation import GenerationRequest

_INT64 = 2**64


def choice_seed(seed: int, index: int) -> int:
    return (seed + index + 2**63) % _INT64 - 2**63


def choice_requests(request: GenerationRequest) -> list[GenerationRequest]:
    if request.n == 1:
        return [request]
    return [
        replace(request, request_id=f"{request.request_id}/{i}", sampling=replace(request.sampling, seed=choice_seed(request.sampling.seed, i)), n=1)
        for i in range(request.n)
    ]


_DONE = object()


async def merged_choices(requests: list[GenerationRequest], run: Callable[[GenerationRequest], AsyncIterator[Chunk]]) -> AsyncIterator[Chunk]:
    """The chunks of every choice as they come, each with its index."""
    if len(requests) == 1:
        async with contextlib.aclosing(run(requests[0])) as chunks:
            async for chunk in chunks:
                yield chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, request: GenerationRequest) -> None:
        try:
            async with contextlib.aclosing(run(request)) as chunks:
                async for chunk in chunks:
                    chunk.index = index
                    queue.put_nowait(chunk)
            queue.put_nowait(_DONE)
        except Exception as exc:  # handed to the reader, which raises it and cancels the other choices
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

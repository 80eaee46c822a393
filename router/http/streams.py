"""The chunks of one HTTP request's generations, merged into one stream.

A completions request with a batch of prompts runs one generation per prompt
(each with its n choices); their chunks interleave as they come, each tagged
with its choice index as OpenAI numbers them (prompt i, choice j: i * n + j).
Each generation runs in its own task, so closing the stream (a client gone,
an error in one generation) cancels every one of them, and with them their
worker calls: the router's lifecycle frees what each held on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from router.lifecycle import Chunk

_DONE = object()


@dataclass
class Tagged:
    index: int  # the OpenAI choice index
    chunk: Chunk


class MergedGenerations:
    """`async for tagged in merged` after `await merged.start()`; always `await merged.aclose()`."""

    def __init__(self, router, generations: list[tuple[object, int]], timeout: float | None = None):
        """generations: (GenerationRequest, index of its first choice)."""
        self._router = router
        self._queue: asyncio.Queue = asyncio.Queue()
        self._generations = generations
        self._timeout = timeout
        self._tasks: list[asyncio.Task] = []
        self._first: list[asyncio.Future] = []
        self._running = 0

    async def start(self) -> None:
        """Starts every generation and waits for each one's first chunk, so a
        refusal (full queue, no worker) can still be an HTTP status, not a
        stream that breaks off."""
        loop = asyncio.get_running_loop()
        for request, offset in self._generations:
            first = loop.create_future()
            self._first.append(first)
            self._tasks.append(asyncio.create_task(self._run(request, offset, first)))
        self._running = len(self._tasks)
        await asyncio.gather(*self._first)

    async def _run(self, request, offset: int, first: asyncio.Future) -> None:
        try:
            async with contextlib.aclosing(self._router.generate(request, self._timeout)) as chunks:
                async for chunk in chunks:
                    if not first.done():
                        first.set_result(None)
                    self._queue.put_nowait(Tagged(offset + chunk.index, chunk))
            self._queue.put_nowait(_DONE)
        except Exception as exc:  # handed to the reader, which raises it
            if not first.done():
                first.set_exception(exc)
            self._queue.put_nowait(exc)
        finally:
            if not first.done():
                first.set_result(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Tagged:
        while self._running:
            item = await self._queue.get()
            if item is _DONE:
                self._running -= 1
                continue
            if isinstance(item, Exception):
                raise item
            return item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for first in self._first:  # a refusal already raised by start() is not "never retrieved"
            if first.done() and not first.cancelled():
                first.exception()

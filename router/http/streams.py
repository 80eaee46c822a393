"""The chunks of one HTTP request's generations, merged into one stream.

A completions request with a batch of prompts runs one generation per prompt
(each with its n choices); their chunks interleave as they come, each tagged
with its choice index as OpenAI numbers them (prompt i, choice j: i * n + j).
Each generation runs in its own task, so closing the stream (a client gone,
an error in one generation) cancels every one of them, and with them their
worker calls: the router's lifecycle frees what each held on the workers.
Every wait is bounded by the request's deadline (RequestDeadline): past it,
the stream raises DEADLINE_EXCEEDED, and its generations are cancelled by the
aclose() that always follows.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc

from disagg.rpc.server import RequestError
from router.lifecycle import Chunk

_DONE = object()


@dataclass
class Tagged:
    index: int  # the OpenAI choice index
    chunk: Chunk


class RequestDeadline:
    """When an HTTP request must have been answered: nothing it waits on waits longer."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._at = asyncio.get_running_loop().time() + seconds

    def remaining(self) -> float:
        return max(0.001, self._at - asyncio.get_running_loop().time())

    async def bound(self, awaitable):
        """awaitable's result, or DEADLINE_EXCEEDED (504) once the deadline passes (awaitable cancelled)."""
        try:
            return await asyncio.wait_for(awaitable, self.remaining())
        except asyncio.TimeoutError:
            message = f"the request was not answered within its deadline of {self.seconds:g} s (--http-timeout-seconds)"
            raise RequestError(message, grpc.StatusCode.DEADLINE_EXCEEDED) from None


class MergedGenerations:
    """`async for tagged in merged` after `await merged.start()`; always `await merged.aclose()`."""

    def __init__(self, router, generations: list[tuple[object, int]], deadline: RequestDeadline):
        """generations: (GenerationRequest, index of its first choice)."""
        self._router = router
        self._queue: asyncio.Queue = asyncio.Queue()
        self._generations = generations
        self._deadline = deadline
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
        await self._deadline.bound(asyncio.gather(*self._first))

    async def _run(self, request, offset: int, first: asyncio.Future) -> None:
        try:
            async with contextlib.aclosing(self._router.generate(request, self._deadline.remaining())) as chunks:
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
            # get_nowait first: a chunk already queued needs no timer (wait_for costs a task).
            item = self._queue.get_nowait() if not self._queue.empty() else await self._deadline.bound(self._queue.get())
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

"""Chunk coalescing: a client that reads slower than tokens arrive gets them merged.

A stream's chunks are pulled from its source by a task of their own, so the
decode side never waits for the client. While the previous message is still
being written (flow control, a busy event loop), new chunks wait in a buffer;
the next write sends all of them as one message. A client that keeps up sees
one message per chunk, with no added delay; one that falls behind sees fewer,
bigger messages, and the router spends its time on tokens rather than on
per-message overhead.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import AsyncIterator

from .lifecycle import Chunk


def merge(chunks: list[Chunk]) -> Chunk:
    """One chunk for several in a row of one choice; the last one's finish, usage and timings stand."""
    if len(chunks) == 1:
        return chunks[0]
    token_ids = [t for chunk in chunks for t in chunk.token_ids]
    logprobs = None if chunks[0].logprobs is None else [x for chunk in chunks for x in chunk.logprobs or ()]
    return replace(chunks[-1], token_ids=token_ids, text="".join(chunk.text for chunk in chunks), logprobs=logprobs)


def merge_per_choice(chunks: list[Chunk]) -> list[Chunk]:
    """One chunk per choice present, in the order the choices first appear."""
    indices = dict.fromkeys(chunk.index for chunk in chunks)
    return [merge([chunk for chunk in chunks if chunk.index == index]) for index in indices]


class _Buffer:
    """Chunks pulled from the source and not yet written; the source's end or error."""

    def __init__(self):
        self.chunks: list[Chunk] = []
        self.ended = False
        self.error: BaseException | None = None
        self.changed = asyncio.Event()

    async def fill(self, source: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in source:
                self.chunks.append(chunk)
                self.changed.set()
        except Exception as exc:  # handed to the writer, which raises it in order
            self.error = exc
        finally:
            self.ended = True
            self.changed.set()

    async def take(self) -> list[Chunk]:
        """Everything buffered, waiting for at least one chunk; [] once the source is done."""
        while not self.chunks and not self.ended:
            self.changed.clear()
            await self.changed.wait()
        taken, self.chunks = self.chunks, []
        return taken


async def coalesced(source: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    """The source's chunks, merged whenever more than one waits to be written.

    Closing this generator (the client went away) cancels the source's task, so
    the request's workers are released as without coalescing.
    """
    buffer = _Buffer()
    filler = asyncio.create_task(buffer.fill(source))
    try:
        while chunks := await buffer.take():
            for chunk in merge_per_choice(chunks):
                yield chunk
        if buffer.error is not None:
            raise buffer.error
    finally:
        filler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await filler

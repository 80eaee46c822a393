"""The prefill worker's channels to decode workers: a bounded LRU.

A send holds its channel (hold ... release) for as long as it uses it. Past `capacity` idle
channels, the least recently used is closed; a channel still held by a send is closed once it is
released. Channels to addresses that left the pool (retain) close the same way. So the cache holds
at most max(capacity, channels held by sends in flight) channels.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

MAX_KV_CHANNELS = 64


@dataclass
class _Entry:
    channel: object  # grpc.aio.Channel
    users: int = 0
    departed: bool = False  # its address left the pool: closed once no send holds it


class ChannelCache:
    def __init__(self, open_channel: Callable[[str], object], capacity: int = MAX_KV_CHANNELS):
        self._open = open_channel
        self.capacity = capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._closing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def addresses(self) -> list[str]:
        return list(self._entries)

    def hold(self, address: str):
        """The channel to address, opened if need be, held until release(address)."""
        entry = self._entries.get(address)
        if entry is None:
            entry = self._entries[address] = _Entry(self._open(address))
        entry.users += 1
        entry.departed = False
        self._entries.move_to_end(address)
        self._evict()
        return entry.channel

    def get(self, address: str):
        """The channel a send holds (KeyError if none: every dial goes through hold)."""
        return self._entries[address].channel

    def release(self, address: str) -> None:
        entry = self._entries[address]
        entry.users -= 1
        if entry.users == 0 and entry.departed:
            self._drop(address)
        self._evict()

    def retain(self, addresses: frozenset[str]) -> None:
        """Closes the channels to addresses not in the pool (once no send holds them)."""
        for address in [a for a in self._entries if a not in addresses]:
            self._entries[address].departed = True
            if self._entries[address].users == 0:
                self._drop(address)

    def _evict(self) -> None:
        idle = [a for a, e in self._entries.items() if e.users == 0]
        for address in idle[: max(0, len(self._entries) - self.capacity)]:
            self._drop(address)

    def _drop(self, address: str) -> None:
        channel = self._entries.pop(address).channel
        task = asyncio.get_running_loop().create_task(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def closes_done(self) -> None:
        """Until the channels dropped so far are closed."""
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def close(self) -> None:
        for address in list(self._entries):
            self._drop(address)
        await self.closes_done()

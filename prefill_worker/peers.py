"""Where this prefill worker may send KV: the decode pool it was given (`--decode`), nowhere else.

A Prefill's kv_target comes from whoever reaches the worker's port. Unchecked, any caller could
have the worker dial any address and stream a prompt's KV there (and keep a channel open to it).
The pool is named as the router names it (disagg/rpc/discovery.py: HOST:PORT, or
dns:[//SERVER/]NAME:PORT resolved again), so one decode target is handed to both, and the router
only ever sends addresses its own discovery produced: the resolved IP:PORT of a DNS target, or a
fixed HOST:PORT as written.

Addresses compare in canonical form (discovery.canonical_address). A fixed target that names a
host (`localhost:5`) admits that name and every IP it resolves to (`127.0.0.1:5`, `[::1]:5`). A
name in a kv_target is admitted only when the pool names it literally: this worker never resolves
a caller's name to check it, since the name could resolve elsewhere by the time it is dialled.

Membership follows DNS: DNS targets are resolved again every REFRESH_SECONDS, and a target not in
the pool resolves them again first (one lookup per MISS_REFRESH_SECONDS at most, shared by every
miss meanwhile), so a pod the router just found is found here too. A lookup that fails keeps the
last answer, as the router's does. A target still not in the pool is refused with
PERMISSION_DENIED naming kv_target.address: the field is well formed, and the same address may be
admitted later once DNS names it, so it is a refusal by policy of where data may go (gRPC's
PERMISSION_DENIED), not a malformed argument (INVALID_ARGUMENT, which a malformed address gets).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import time
from typing import Callable

import grpc

from disagg.rpc.discovery import LookupFailed, Resolver, Target, canonical_address, parse_target, resolve  # moves to shared plumbing with the layout issue
from disagg.rpc.server import RequestError

log = logging.getLogger(__name__)
REFRESH_SECONDS = 5.0  # as the router's --resolve-seconds default (CoreDNS's TTL for Services)
MISS_REFRESH_SECONDS = 2.0
FLAG = "--decode"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def parse_pool(targets: tuple[str, ...]) -> tuple[Target, ...]:
    """The --decode targets; ValueError naming the flag when there are none or one is malformed.
    A prefill worker with no pool could send KV nowhere, so it does not start (as the router
    does not start without --decode)."""
    if not targets:
        raise ValueError(f"{FLAG} is required: the decode workers this prefill worker may send KV to (HOST:PORT or dns:///NAME:PORT, "
                         f"the router's {FLAG} targets); it sends KV to nothing else")
    return tuple(parse_target(t, FLAG) for t in targets)


class DecodePeers:
    def __init__(self, targets: tuple[str, ...], resolver: Resolver = resolve, clock: Callable[[], float] = time.monotonic):
        self.targets = parse_pool(targets)
        self._resolver = resolver
        self._clock = clock
        self._answers: dict[Target, frozenset[str]] = {}
        self.allowed: frozenset[str] = frozenset()
        self._resolved_at: float | None = None
        self._lock = asyncio.Lock()
        self.on_change: Callable[[frozenset[str]], None] | None = None  # the channel cache follows the pool

    @property
    def dynamic(self) -> bool:
        """Whether membership can change (a DNS target, or a fixed one naming a host)."""
        return any(t.dns or not _is_ip(t.host) for t in self.targets)

    async def refresh(self) -> frozenset[str]:
        addresses: set[str] = set()
        for target in self.targets:
            addresses |= await self._lookup(target)
        self._resolved_at = self._clock()
        if addresses != self.allowed:
            log.info("decode pool for KV: %s", ", ".join(sorted(addresses)) or "no addresses")
            self.allowed = frozenset(addresses)
            if self.on_change is not None:
                self.on_change(self.allowed)
        return self.allowed

    async def _lookup(self, target: Target) -> set[str]:
        found = set() if target.dns else {canonical_address(target.address)}
        if target.dns or not _is_ip(target.host):
            try:
                answer = await self._resolver(dataclasses.replace(target, dns=True))
                self._answers[target] = frozenset(canonical_address(a) for a in answer)
            except LookupFailed as exc:
                log.warning("resolving %s failed (%s); keeping its last %d addresses", target.text, exc, len(self._answers.get(target, ())))
            found |= self._answers.get(target, frozenset())
        return found

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await self.refresh()
            except Exception:  # membership must keep following DNS: the next round retries
                log.exception("resolving the decode pool failed; trying again in %.1fs", REFRESH_SECONDS)

    async def admit(self, address: str) -> str:
        """address in canonical form when it is one of the pool's decode workers; otherwise
        RequestError (INVALID_ARGUMENT when it is not HOST:PORT, PERMISSION_DENIED when it is
        not in the pool). Nothing is dialled either way."""
        try:
            canonical = canonical_address(address, "kv_target.address")
        except ValueError as exc:
            raise RequestError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        if canonical not in self.allowed and (self._resolved_at is None or self.dynamic):
            await self._refresh_once(self._resolved_at)
        if canonical not in self.allowed:
            raise RequestError(f"kv_target.address: {address!r} is not a decode worker of this prefill worker's pool ({FLAG}); KV goes nowhere else",
                               grpc.StatusCode.PERMISSION_DENIED)
        return canonical

    async def _refresh_once(self, seen: float | None) -> None:
        """One lookup for every miss that saw the answer of time `seen`, at most one per
        MISS_REFRESH_SECONDS: a miss inside that window waits for the next one rather than
        refuse a pod the router found first (both follow the same DNS name, each on its own
        schedule). Misses never take more lookups than that, however many arrive."""
        async with self._lock:
            if self._resolved_at != seen:
                return  # answered meanwhile, by another miss or the periodic refresh
            if seen is not None:
                await asyncio.sleep(max(0.0, seen + MISS_REFRESH_SECONDS - self._clock()))
            await self.refresh()

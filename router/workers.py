"""The router's view of its workers: membership, reachability, load, and the decode admission queue.

Decode capacity is admitted first-come first-served: a request takes a slot on
the decode worker with the most free slots, or waits in a bounded FIFO queue;
past the bound it is refused with RESOURCE_EXHAUSTED at once.

Membership: fixed addresses stay; DNS targets (disagg/rpc/discovery.py) are
resolved again every `resolve_seconds`. A worker that appears is connected and
used once its health says SERVING; one that disappears is retired: it gets no
new requests, the calls it has run to the end, and its channel is closed once
the router holds no request on it (close waits up to `drain_seconds` for calls
still open, such as a KV hand-off).

Speculation (router/speculation.py): a worker that answers SERVING is used only where its speculation
settings are the pool's; one that carries others is refused with one line and gets no requests.

Cache-aware routing (router/prefix_index.py): with a prompt's block hashes, the
prefill and decode picks weigh where its prefix was sent before against load;
the pool records each choice, and forgets a worker's blocks when it is marked
unavailable or removed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg.rpc.discovery import LookupFailed, Resolver, Target, parse_target, resolve
from disagg.rpc.security import TlsFiles, open_channel
from disagg.rpc.server import RequestError
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

from .prefix_index import PREFILL_QUEUE_SLACK, PrefixIndex, RoutedPrompt, choose_by_overlap
from .speculation import Speculation, most_carried, refusal

log = logging.getLogger(__name__)


class NoWorkerAvailable(RequestError):
    """No worker of a role is up (or none left that has not failed this request)."""

    def __init__(self, message: str):
        super().__init__(message, grpc.StatusCode.UNAVAILABLE)


@dataclass
class Worker:
    address: str
    role: str  # "prefill" or "decode"
    channel: grpc.aio.Channel
    stub: object
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    missed_polls: int = 0  # consecutive polls without an answer
    times_ready: int = 0  # how often its health turned SERVING: past 1, it came back (a restart, a healed network)
    load: wpb.WorkerLoad | None = None
    outstanding: int = 0  # this router's requests on it now
    closing: asyncio.Task | None = None  # retired: the channel is closing
    refused: Speculation | None = None  # serving, but with speculation settings other than the pool's: not used

    @property
    def free_slots(self) -> int:
        return (self.load.capacity if self.load else 0) - self.outstanding

    @property
    def prefill_load(self) -> int:
        """Prefills ahead of a new one: this router's in flight, and those the worker last said were queued."""
        return self.outstanding + (self.load.queued if self.load else 0)


@dataclass(eq=False)
class _Waiter:
    """A request waiting for a decode slot, on a worker not in avoid."""

    future: asyncio.Future
    avoid: frozenset[str]
    prompt: RoutedPrompt


def _connect(address: str, role: str, tls: TlsFiles | None) -> Worker:
    channel = open_channel(address, tls)
    stub = wgrpc.PrefillServiceStub(channel) if role == "prefill" else wgrpc.DecodeServiceStub(channel)
    return Worker(address, role, channel, stub, health_pb2_grpc.HealthStub(channel))


@dataclass
class WorkerPool:
    prefill: list[Worker]
    decode: list[Worker]
    max_queue: int
    poll_seconds: float
    targets: dict[str, tuple[Target, ...]] = field(default_factory=dict)  # role -> where to find its workers
    resolve_seconds: float = 5.0
    drain_seconds: float = 30.0
    tls: TlsFiles | None = None
    resolver: Resolver = resolve
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(enabled=False))  # where prompts were sent (off: load alone)
    worker_wait_seconds: float = 0.0  # with no worker of a role up, how long a request waits for one (wait_for_worker)
    # Called with the worker whenever its health changes (the router's metrics and its own health follow it).
    observe_health: Callable[[Worker], None] | None = None
    speculation: Speculation | None = None  # the pool's speculation settings (router/speculation.py); None until a worker is taken in
    retired: list[Worker] = field(default_factory=list)  # gone from DNS, finishing their calls
    _answers: dict[Target, frozenset[str]] = field(default_factory=dict)  # last good answer per DNS target
    _waiters: collections.deque = field(default_factory=collections.deque)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def connect(
        cls,
        prefill: Iterable[str],
        decode: Iterable[str],
        max_queue: int,
        poll_seconds: float,
        tls: TlsFiles | None = None,
        resolve_seconds: float = 5.0,
        drain_seconds: float = 30.0,
        resolver: Resolver = resolve,
        prefix: PrefixIndex | None = None,
        worker_wait_seconds: float = 0.0,
    ) -> WorkerPool:
        """A pool over targets (HOST:PORT or dns:...); start() resolves the DNS ones. prefix: cache-aware routing (None: off)."""
        targets = {"prefill": tuple(parse_target(t, "--prefill") for t in prefill), "decode": tuple(parse_target(t, "--decode") for t in decode)}
        pool = cls(
            [], [], max_queue, poll_seconds, targets, resolve_seconds, drain_seconds, tls, resolver, prefix or PrefixIndex(enabled=False), worker_wait_seconds
        )
        for role, role_targets in targets.items():
            pool._apply(role, [t.address for t in role_targets if not t.dns])
        return pool

    @property
    def workers(self) -> list[Worker]:
        return self.prefill + self.decode

    def _role(self, role: str) -> list[Worker]:
        return self.prefill if role == "prefill" else self.decode

    async def start(self) -> None:
        if any(t.dns for targets in self.targets.values() for t in targets):
            await self.discover()
            self._tasks.append(asyncio.create_task(self._discover_forever()))
        self._tasks.append(asyncio.create_task(self._poll_forever()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for worker in self.workers + self.retired:
            await worker.channel.close()

    def ready(self) -> bool:
        """Whether at least one prefill and one decode worker have their model loaded and answer."""
        return any(w.healthy for w in self.prefill) and any(w.healthy for w in self.decode)

    async def wait_ready(self) -> None:
        while not self.ready():
            await self.wait_changed()

    async def wait_changed(self) -> None:
        """Until the next poll or membership change."""
        self._changed.clear()
        await self._changed.wait()

    async def wait_for_worker(self, role: str, avoid: Iterable[str] = ()) -> bool:
        """Whether a worker of the role (not in avoid) is up within worker_wait_seconds. Why wait: a worker
        that died is restarted within seconds, and the router sees the one left or the one back only at its
        next poll; a request that arrives meanwhile is served late rather than refused."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.worker_wait_seconds
        while not any(w.healthy and w.address not in avoid for w in self._role(role)):
            if loop.time() >= until:
                return False
            try:
                await asyncio.wait_for(self.wait_changed(), until - loop.time())
            except TimeoutError:
                return False
        return True

    # -- membership -----------------------------------------------------------
    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_seconds)
            try:
                await self.discover()
            except Exception:  # membership must keep following DNS: the next round retries
                log.exception("worker discovery failed; trying again in %.1fs", self.resolve_seconds)

    async def discover(self) -> None:
        """Resolves every DNS target again and adds or retires workers to match."""
        for role, targets in self.targets.items():
            addresses: list[str] = []
            for target in targets:
                addresses += sorted(await self._lookup(target))
            self._apply(role, addresses)
        self._changed.set()

    async def _lookup(self, target: Target) -> frozenset[str]:
        if not target.dns:
            return frozenset({target.address})
        try:
            found = await self.resolver(target)
        except LookupFailed as exc:
            log.warning("resolving %s failed (%s); keeping its last %d addresses", target.text, exc, len(self._answers.get(target, ())))
            return self._answers.get(target, frozenset())
        if found != self._answers.get(target):
            log.info("%s -> %s", target.text, ", ".join(sorted(found)) or "no addresses")
        self._answers[target] = found
        return found

    def _apply(self, role: str, addresses: list[str]) -> None:
        """Makes the role's workers these addresses; new ones join in the order given
        (the targets' order, as on the command line: ties in load go to the first)."""
        workers, wanted = self._role(role), set(addresses)
        present = {w.address for w in workers}
        for address in dict.fromkeys(a for a in addresses if a not in present):
            log.info("%s worker %s added", role, address)
            workers.append(_connect(address, role, self.tls))
        for worker in [w for w in workers if w.address not in wanted]:
            log.info("%s worker %s removed: draining (%d requests on it)", role, worker.address, worker.outstanding)
            workers.remove(worker)
            self.retired.append(worker)
            self.prefix.forget(worker)  # gets no new requests; a worker that comes back at this address starts cold
        self._close_idle_retired()
        self._fail_waiters_if_no_decode()

    def _close_idle_retired(self) -> None:
        for worker in self.retired:
            if worker.outstanding == 0 and worker.closing is None:
                worker.closing = asyncio.create_task(self._close_retired(worker))

    async def _close_retired(self, worker: Worker) -> None:
        # close(grace) lets calls still open (a prefill's KV hand-off) end first.
        await worker.channel.close(grace=self.drain_seconds)
        self.retired.remove(worker)
        log.info("%s worker %s drained and disconnected", worker.role, worker.address)

    # -- load polling --------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            workers = self.workers
            serving = await asyncio.gather(*(self._poll(w) for w in workers))
            self._take_in([w for w, up in zip(workers, serving) if up and w not in self.retired])
            self._changed.set()
            self._admit_waiters()
            self._fail_waiters_if_no_decode()
            self._close_idle_retired()
            await asyncio.sleep(self.poll_seconds)

    async def _poll(self, worker: Worker) -> bool:
        """Whether the worker says SERVING, its load taken in (`_take_in` then decides whether it is used);
        one that does not is marked unavailable here and now."""
        # A worker takes requests while its health says SERVING: a draining
        # worker (SIGTERM) says NOT_SERVING and finishes what it has.
        timeout = max(1.0, self.poll_seconds)
        try:
            health = await worker.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            serving = health.status == health_pb2.HealthCheckResponse.SERVING
            if serving:
                worker.load = await worker.stub.GetLoad(wpb.LoadRequest(), timeout=timeout)
            worker.missed_polls = 0
        except grpc.aio.AioRpcError as exc:
            # One slow answer on a busy machine is not a dead worker; a refused
            # connection or a failed call marks it down at once (mark_unavailable).
            worker.missed_polls += 1
            serving = worker.healthy and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and worker.missed_polls < 2
            reason = exc.code().name
        else:
            reason = "NOT_SERVING"
        if not serving:
            if worker.healthy:
                log.warning("%s worker %s is unavailable (%s)", worker.role, worker.address, reason)
            worker.refused = None  # one refused that comes back is checked (and told about) afresh
            self.prefix.forget(worker)  # down, draining or restarting: its cache will not be there when it is back
            self._set_healthy(worker, False)
        return serving

    def _take_in(self, serving: list[Worker]) -> None:
        """Uses the workers that answered SERVING this poll, but those whose speculation settings are not
        the pool's (router/speculation.py: the pool's are decided anew, by most of these, when it serves on none)."""
        if not any(w.healthy for w in self.workers) and serving:
            decided = most_carried(w.load for w in serving)
            if decided != self.speculation:
                log.info("the pool's speculation: %s (carried by %d of the %d workers answering)", decided,
                         sum(Speculation.from_load(w.load) == decided for w in serving), len(serving))
            self.speculation = decided
        for worker in serving:
            carried = Speculation.from_load(worker.load)
            if carried != self.speculation:
                if worker.refused != carried:
                    log.error(refusal(worker.role, worker.address, carried, self.speculation))
                worker.refused = carried
                self.prefix.forget(worker)
                self._set_healthy(worker, False)
                continue
            if not worker.healthy:
                log.info("%s worker %s is ready", worker.role, worker.address)
            worker.refused = None
            self._set_healthy(worker, True)

    def _set_healthy(self, worker: Worker, serving: bool) -> None:
        if serving == worker.healthy:
            return
        worker.healthy = serving
        worker.times_ready += serving
        if self.observe_health is not None:
            self.observe_health(worker)

    def mark_unavailable(self, worker: Worker) -> None:
        """A call found the worker gone; the poller brings it back when it answers again."""
        if worker.healthy:
            log.warning("%s worker %s stopped answering", worker.role, worker.address)
        self._set_healthy(worker, False)
        self.prefix.forget(worker)
        self._fail_waiters_if_no_decode()

    def _fail_waiters_if_no_decode(self) -> None:
        for waiter in [w for w in self._waiters if not self.has_decode(w.avoid)]:
            self._waiters.remove(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(NoWorkerAvailable("no decode worker is available"))

    def has_decode(self, avoid: Iterable[str] = ()) -> bool:
        """Whether a healthy decode worker is left outside avoid."""
        return any(w.healthy and w.address not in avoid for w in self.decode)

    # -- prefill choice -----------------------------------------------------
    def pick_prefill(self, exclude: set[str] = frozenset(), prompt: RoutedPrompt = RoutedPrompt()) -> Worker:
        """The healthy prefill worker not in exclude where the prompt's prefix most likely is, unless
        its queue is too deep, else the least-loaded; when none is healthy, one the poller doubts is
        still worth a try before giving up. The choice is recorded in the prefix index."""
        untried = [w for w in self.prefill if w.address not in exclude]
        candidates = [w for w in untried if w.healthy] or (untried if exclude else [])
        if not candidates:
            raise NoWorkerAvailable("no prefill worker is available" + (" (the others failed this request)" if exclude else ""))
        worker = choose_by_overlap(
            candidates, lambda w: w.prefill_load, lambda w: self.prefix.overlap(w, prompt), self.prefix.block_size, PREFILL_QUEUE_SLACK
        ) or min(candidates, key=lambda w: (not w.healthy, w.prefill_load))
        self.prefix.record(worker, prompt)
        return worker

    # -- decode admission ---------------------------------------------------
    def _best_decode(self, avoid: frozenset[str] = frozenset(), prompt: RoutedPrompt = RoutedPrompt()) -> Worker | None:
        """Of the healthy decode workers with a free slot, not in avoid: where the prompt's prefix most
        likely is, unless its extra load outweighs that, else the one with the most free slots."""
        candidates = [w for w in self.decode if w.healthy and w.free_slots > 0 and w.address not in avoid]
        if not candidates:
            return None
        return choose_by_overlap(candidates, lambda w: -w.free_slots, lambda w: self.prefix.overlap(w, prompt), self.prefix.block_size) or max(
            candidates, key=lambda w: w.free_slots
        )

    def _take_slot(self, worker: Worker, prompt: RoutedPrompt) -> Worker:
        worker.outstanding += 1
        self.prefix.record(worker, prompt)
        return worker

    async def acquire_decode(self, avoid: frozenset[str] = frozenset(), prompt: RoutedPrompt = RoutedPrompt()) -> Worker:
        """A decode worker (not in avoid: those failed this request) with a slot counted for this request,
        chosen for the prompt's prefix as well as load (recorded in the prefix index); waits in FIFO order.
        With no decode worker up, waits for one (wait_for_worker), once, then refuses."""
        try:
            return await self._acquire_decode(avoid, prompt)
        except NoWorkerAvailable:
            if not await self.wait_for_worker("decode", avoid):
                raise
            return await self._acquire_decode(avoid, prompt)

    async def _acquire_decode(self, avoid: frozenset[str], prompt: RoutedPrompt) -> Worker:
        if not self.has_decode(avoid):
            raise NoWorkerAvailable("no decode worker is available")
        if not self._waiters:
            worker = self._best_decode(avoid, prompt)
            if worker is not None:
                return self._take_slot(worker, prompt)
        if len(self._waiters) >= self.max_queue:
            raise RequestError(f"server is at capacity: {len(self._waiters)} requests already waiting for a decode slot", grpc.StatusCode.RESOURCE_EXHAUSTED)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), avoid, prompt)
        self._waiters.append(waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release_decode(waiter.future.result())  # handed a slot just as the client left
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release_decode(self, worker: Worker) -> None:
        worker.outstanding -= 1
        if worker.outstanding == 0 and worker in self.retired:
            self._close_idle_retired()
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        while self._waiters:
            worker = self._best_decode(self._waiters[0].avoid, self._waiters[0].prompt)
            if worker is None:
                return
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(self._take_slot(worker, waiter.prompt))

    @property
    def queued(self) -> int:
        return len(self._waiters)

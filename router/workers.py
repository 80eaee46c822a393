"""The router's view of its workers: reachability, load, and the decode admission queue.

Decode capacity is admitted first-come first-served: a request takes a slot on
the decode worker with the most free slots, or waits in a bounded FIFO queue;
past the bound it is refused with RESOURCE_EXHAUSTED at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg.rpc import RequestError
from disagg.security import TlsFiles, open_channel
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


@dataclass
class Worker:
    address: str
    role: str  # "prefill" or "decode"
    channel: grpc.aio.Channel
    stub: object
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    missed_polls: int = 0  # consecutive polls without an answer
    load: wpb.WorkerLoad | None = None
    outstanding: int = 0  # this router's requests on it now

    @property
    def free_slots(self) -> int:
        return (self.load.capacity if self.load else 0) - self.outstanding


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
    _waiters: collections.deque = field(default_factory=collections.deque)
    _poller: asyncio.Task | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def connect(cls, prefill: tuple[str, ...], decode: tuple[str, ...], max_queue: int, poll_seconds: float, tls: TlsFiles | None = None) -> "WorkerPool":
        return cls([_connect(a, "prefill", tls) for a in prefill], [_connect(a, "decode", tls) for a in decode], max_queue, poll_seconds)

    @property
    def workers(self) -> list[Worker]:
        return self.prefill + self.decode

    async def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller:
            self._poller.cancel()
        for worker in self.workers:
            await worker.channel.close()

    async def wait_ready(self) -> None:
        """Until at least one prefill and one decode worker have their model loaded."""
        while not (any(w.healthy for w in self.prefill) and any(w.healthy for w in self.decode)):
            self._changed.clear()
            await self._changed.wait()

    # -- load polling --------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(w) for w in self.workers))
            self._changed.set()
            self._admit_waiters()
            self._fail_waiters_if_no_decode()
            await asyncio.sleep(self.poll_seconds)

    async def _poll(self, worker: Worker) -> None:
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
        if serving != worker.healthy:
            log.log(logging.INFO if serving else logging.WARNING, "%s worker %s is %s", worker.role, worker.address, "ready" if serving else f"unavailable ({reason})")
        worker.healthy = serving

    def mark_unavailable(self, worker: Worker) -> None:
        """A call found the worker gone; the poller brings it back when it answers again."""
        if worker.healthy:
            log.warning("%s worker %s stopped answering", worker.role, worker.address)
        worker.healthy = False
        self._fail_waiters_if_no_decode()

    def _fail_waiters_if_no_decode(self) -> None:
        if any(w.healthy for w in self.decode):
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(RequestError("no decode worker is available", grpc.StatusCode.UNAVAILABLE))

    # -- prefill choice -----------------------------------------------------
    def pick_prefill(self, exclude: set[str] = frozenset()) -> Worker:
        """The least-loaded healthy prefill worker not in exclude; when none is
        healthy, one the poller doubts is still worth a try before giving up."""
        untried = [w for w in self.prefill if w.address not in exclude]
        candidates = [w for w in untried if w.healthy] or (untried if exclude else [])
        if not candidates:
            raise RequestError("no prefill worker is available" + (" (the others failed this request)" if exclude else ""), grpc.StatusCode.UNAVAILABLE)
        return min(candidates, key=lambda w: (not w.healthy, w.outstanding + (w.load.queued if w.load else 0)))

    # -- decode admission ---------------------------------------------------
    def _best_decode(self) -> Worker | None:
        candidates = [w for w in self.decode if w.healthy and w.free_slots > 0]
        return max(candidates, key=lambda w: w.free_slots) if candidates else None

    async def acquire_decode(self) -> Worker:
        """A decode worker with a slot counted for this request; waits in FIFO order."""
        if not any(w.healthy for w in self.decode):
            raise RequestError("no decode worker is available", grpc.StatusCode.UNAVAILABLE)
        if not self._waiters:
            worker = self._best_decode()
            if worker is not None:
                worker.outstanding += 1
                return worker
        if len(self._waiters) >= self.max_queue:
            raise RequestError(f"server is at capacity: {len(self._waiters)} requests already waiting for a decode slot", grpc.StatusCode.RESOURCE_EXHAUSTED)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release_decode(waiter.result())  # handed a slot just as the client left
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release_decode(self, worker: Worker) -> None:
        worker.outstanding -= 1
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        while self._waiters:
            worker = self._best_decode()
            if worker is None:
                return
            waiter = self._waiters.popleft()
            if not waiter.done():
                worker.outstanding += 1
                waiter.set_result(worker)

    @property
    def queued(self) -> int:
        return len(self._waiters)

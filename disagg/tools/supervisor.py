"""`disagg serve`'s supervisor: a part that exits is started again, and the rest keep serving.

On one machine `disagg serve` is what systemd's `Restart=on-failure` or a
Kubernetes Deployment is past it: a worker (or the router) that exits, whether
killed, out of memory, or on purpose (a decode worker whose device failed exits
1 for its supervisor to restart), is started again with the same command, on the
same ports, so the router and the prefill workers find it where it was. The
router already drains a worker that stops answering and takes it back once its
health says SERVING, and moves its streams to another decode worker meanwhile.

A part's states, in order: RUNNING; WAITING (it exited; restarted after a
backoff that doubles with each exit in the window); STARTING (started again,
not serving yet: it may take as long as it makes progress, as at the first
start, and one silent past `silence` is killed, which counts as an exit); back to
RUNNING. A part that exits more than `limit` times in `window` seconds is LEFT_DOWN
with one line, and the service goes on with the others of its role; where it is
the last of its role (no prefill, no decode, or the router), it is not left
down but tried again every `max_delay` seconds, while the router says
NOT_SERVING.
"""

from __future__ import annotations

import collections
import enum
import os
import time
from dataclasses import dataclass, field

from disagg.rpc import startup
from disagg.tools.process_progress import ProgressWatch


class PartState(str, enum.Enum):
    RUNNING = "running"
    WAITING = "waiting"  # exited; restarts when its backoff ends
    STARTING = "starting"  # restarted, not serving yet
    LEFT_DOWN = "left down"  # kept failing; the others of its role serve


@dataclass(frozen=True)
class RestartPolicy:
    limit: int = 5  # exits in `window` seconds past which a part is left down
    window: float = 60.0
    max_delay: float = 30.0  # the longest backoff, and how often the last of a role is tried again
    silence: float = 120.0  # a restarted part with no progress for this long has failed its start

    def __post_init__(self):
        if self.limit < 1 or self.window <= 0 or self.max_delay <= 0 or self.silence <= 0:
            raise ValueError(f"restart policy needs limit >= 1 and positive seconds, got {self}")

    def delay(self, recent_exits: int) -> float:
        """Backoff before restart number `recent_exits` in the window: the first at once (a worker
        killed once should be back within seconds), then 1, 2, 4 ... s up to max_delay."""
        return 0.0 if recent_exits <= 1 else min(self.max_delay, 2.0 ** (recent_exits - 2))


@dataclass
class Part:
    name: str
    state: PartState = PartState.RUNNING
    exits: collections.deque = field(default_factory=collections.deque)  # monotonic times, within the window
    restarts: int = 0
    due: float = 0.0  # WAITING: when it is started again
    last_code: int | None = None
    watch: ProgressWatch | None = None  # STARTING: its progress

    @property
    def role(self) -> str:
        return self.name.split("-")[0]


class Supervisor:
    """Watches a started LocalCluster's processes; poll() does one round (call it every fraction of a second)."""

    def __init__(self, cluster, policy: RestartPolicy = RestartPolicy(), say=print, clock=time.monotonic):
        """say: called with one line per event (an exit, a restart, a part left down, the service down or back)."""
        self.cluster, self.policy, self.say, self.clock = cluster, policy, say, clock
        self.parts = {p.name: Part(p.name) for p in cluster.processes}
        self._unavailable: set[str] = set()  # roles with no part up, already said

    @property
    def restarts(self) -> int:
        return sum(part.restarts for part in self.parts.values())

    def poll(self) -> None:
        now = self.clock()
        for part in self.parts.values():
            self._step(part, now)
        self._say_availability()

    def status_line(self) -> str:
        """e.g. `router running; prefill 2/2; decode 1/2 (decode-0 starting); 3 restarts`."""
        roles = collections.defaultdict(list)
        for part in self.parts.values():
            roles[part.role].append(part)
        shown = []
        for role, parts in roles.items():
            up = sum(p.state is PartState.RUNNING for p in parts)
            others = ", ".join(f"{p.name} {p.state.value}" for p in parts if p.state is not PartState.RUNNING)
            shown.append(f"{role} {up}/{len(parts)}" + (f" ({others})" if others else ""))
        return "; ".join(shown) + f"; {self.restarts} restart{'s' if self.restarts != 1 else ''}"

    # -- one part -------------------------------------------------------------
    def _step(self, part: Part, now: float) -> None:
        process = self.cluster.process(part.name)
        if part.state in (PartState.RUNNING, PartState.STARTING):
            code = process.popen.poll()
            if code is not None:
                self._exited(part, code, now)
            elif part.state is PartState.STARTING:
                self._check_start(part, process)
        if part.state is PartState.WAITING and now >= part.due:
            self._restart(part, now)

    def _exited(self, part: Part, code: int, now: float) -> None:
        part.last_code, part.watch = code, None
        part.exits.append(now)
        while part.exits and part.exits[0] < now - self.policy.window:
            part.exits.popleft()
        recent = len(part.exits)
        if recent > self.policy.limit and not self._last_of_role(part):
            part.state = PartState.LEFT_DOWN
            self.say(f"disagg serve: {part.name} exited {recent} times in {self.policy.window:.0f} s (last: {describe_exit(code)}): "
                     f"left down, the other {role_name(part.role)}s serve{self.cluster.last_lines(part.name)}")
            return
        delay = self.policy.max_delay if recent > self.policy.limit else self.policy.delay(recent)
        part.state, part.due = PartState.WAITING, now + delay
        self.say(f"disagg serve: {part.name} exited ({describe_exit(code)}); restarting it " + (f"in {delay:.0f} s" if delay else "now"))

    def _restart(self, part: Part, now: float) -> None:
        process = self.cluster.restart(part.name)
        part.state, part.restarts = PartState.STARTING, part.restarts + 1
        part.watch = ProgressWatch(process.popen.pid, clock=self.clock)
        self.say(f"disagg serve: {part.name} restarted on {process.address} (restart {part.restarts}); {self.status_line()}")

    def _check_start(self, part: Part, process) -> None:
        """A restarted part is up once it serves (a worker: its published phase) or, the router, once it has
        bound its ports (it then waits for the workers, using no CPU); one silent past the bound is killed."""
        status = self.cluster.startup_status(process) if part.role != "router" else None
        if (status is not None and status.phase is startup.Phase.SERVING) or (part.role == "router" and os.path.exists(self.cluster.port_file(part.name))):
            part.state, part.watch = PartState.RUNNING, None
            self.say(f"disagg serve: {part.name} is serving again; {self.status_line()}")
            return
        compiling = status is not None and status.phase in startup.COMPILE_PHASES and time.time() - status.updated < self.cluster.spec.stall_seconds
        silent = part.watch.silent_for(status.phase if status else None)
        if silent > self.policy.silence and not compiling:
            self.say(f"disagg serve: {part.name} made no progress for {silent:.0f} s after its restart: killing it")
            process.popen.kill()

    def _last_of_role(self, part: Part) -> bool:
        return not any(p is not part and p.role == part.role and p.state is not PartState.LEFT_DOWN for p in self.parts.values())

    def _say_availability(self) -> None:
        """One line when a role has no part up (the service cannot serve) and one when it is back."""
        for role in {p.role for p in self.parts.values()}:
            up = any(p.role == role and p.state is PartState.RUNNING for p in self.parts.values())
            if not up and role not in self._unavailable:
                self._unavailable.add(role)
                self.say(f"disagg serve: no {role_name(role)} is up: the service is unavailable until one is back (the router's health says NOT_SERVING)")
            elif up and role in self._unavailable:
                self._unavailable.discard(role)
                self.say(f"disagg serve: a {role_name(role)} is up again; {self.status_line()}")


def role_name(role: str) -> str:
    return role if role == "router" else f"{role} worker"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            import signal

            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

"""What a worker is doing before it serves, published for whoever started it.

A worker's health says NOT_SERVING until its model is ready; it does not say
why. A first Neuron compile takes minutes to tens of minutes, so the launcher
must tell a worker that is compiling from one that is stuck. Each worker
publishes its phase here: the model's loader reports phases (`phase()`), a
heartbeat thread writes the status to `--status-file` every second (a worker
that is stopped or wedged stops beating) and logs a progress line while a
compile runs. The launcher reads the file (`read_status`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0
PROGRESS_LOG_SECONDS = 30.0


class Phase(str, enum.Enum):
    LOADING = "loading"  # reading and preparing the model
    COMPILING = "compiling"  # a first compile for this configuration: no start timeout
    WAITING_FOR_COMPILE = "waiting_for_compile"  # another process compiles this configuration; this one loads it after
    SERVING = "serving"


COMPILE_PHASES = frozenset({Phase.COMPILING, Phase.WAITING_FOR_COMPILE})


@dataclasses.dataclass(frozen=True)
class StartupStatus:
    phase: Phase
    detail: str  # e.g. "compiling Llama-3.2-1B for Neuron (tp 2, 9 lines, seq 2048, bfloat16)"
    since: float  # wall-clock time the phase began
    updated: float  # last heartbeat, wall clock
    pid: int

    def elapsed(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.since

    def describe(self, now: float | None = None) -> str:
        return f"{self.detail}: {self.elapsed(now):.0f} s"


class StartupReporter:
    """The process's current phase; with a path, a heartbeat thread publishes it."""

    def __init__(self, path: str | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._status = StartupStatus(Phase.LOADING, "starting", time.time(), time.time(), os.getpid())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> StartupStatus:
        with self._lock:
            return self._status

    def set(self, phase: Phase, detail: str) -> None:
        now = time.time()
        with self._lock:
            self._status = StartupStatus(phase, detail, now, now, os.getpid())
        if phase is not Phase.SERVING:  # the server logs its own line once serving
            log.info("%s", detail)
        self._publish()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="startup-status", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self) -> None:
        last_log = time.monotonic()
        while not self._stop.wait(HEARTBEAT_SECONDS):
            self._publish()
            status = self.current()
            if status.phase in COMPILE_PHASES and time.monotonic() - last_log >= PROGRESS_LOG_SECONDS:
                last_log = time.monotonic()
                log.info("%s", status.describe())

    def _publish(self) -> None:
        if not self.path:
            return
        with self._lock:
            self._status = dataclasses.replace(self._status, updated=time.time())
            record = dataclasses.asdict(self._status)
        record["phase"] = record["phase"].value
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with self._write_lock:  # the heartbeat and a phase change write the one temporary file
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self.path)  # a reader never sees half a file


_reporter = StartupReporter()


def install(path: str | None) -> StartupReporter:
    """This process's reporter, publishing to path (None: logs only); its heartbeat starts now."""
    global _reporter
    _reporter = StartupReporter(path)
    _reporter.start()
    return _reporter


def current() -> StartupStatus:
    return _reporter.current()


def report(phase: Phase, detail: str) -> None:
    _reporter.set(phase, detail)


@contextlib.contextmanager
def phase(during: Phase, detail: str, after: str):
    """Reports `during` for the block, then LOADING with `after` (also when the block fails)."""
    report(during, detail)
    try:
        yield
    finally:
        report(Phase.LOADING, after)


def read_status(path: str) -> StartupStatus | None:
    """The status a worker last published, or None when there is none (yet) or it is unreadable."""
    try:
        with open(path) as f:
            record = json.load(f)
        return StartupStatus(Phase(record["phase"]), record["detail"], record["since"], record["updated"], record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None

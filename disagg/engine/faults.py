"""What a worker does when a model step raises, and the test-only hook that makes one raise.

A step that raises fails only the requests in it; the worker goes on. A worker
whose steps fail FAILURES_BEFORE_EXIT times in a row, or once with DeviceLost,
cannot trust its device any more: it goes NOT_SERVING, drains and exits
non-zero, so its supervisor (Kubernetes, systemd, the launcher's user)
starts a fresh one.

DISAGG_TEST_FAIL_DECODE_STEP / DISAGG_TEST_FAIL_PREFILL_STEP ("after=3,count=1",
optionally ",fatal=1") make steps after..after+count of a worker raise, for the
tests that prove the above through real processes; DISAGG_TEST_FAIL_KV_WRITE does
the same to the decode worker's copies of received KV into its cache (write_kv).
DISAGG_TEST_HOLD_KV_SEND=PATH makes a prefill worker's gRPC KV send stop after its
first piece until PATH exists, so a test can kill it mid-transfer.
DISAGG_TEST_HOLD_DECODE_STEP="after=N,until=PATH" makes a decode worker's steps after
its Nth wait (on the step's own thread) until PATH exists: a test can then act on a
stream that is certainly still running, however fast the host.
They are read once when the worker starts; unset, the step is the backend's own
function, untouched.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from dataclasses import dataclass

FAILURES_BEFORE_EXIT = 3  # consecutive failing steps that end the worker

TEST_FAIL_DECODE_STEP = "DISAGG_TEST_FAIL_DECODE_STEP"
TEST_FAIL_PREFILL_STEP = "DISAGG_TEST_FAIL_PREFILL_STEP"
TEST_FAIL_KV_WRITE = "DISAGG_TEST_FAIL_KV_WRITE"
TEST_HOLD_KV_SEND = "DISAGG_TEST_HOLD_KV_SEND"
TEST_HOLD_DECODE_STEP = "DISAGG_TEST_HOLD_DECODE_STEP"
HOLD_POLL_SECONDS = 0.01


class DeviceLost(RuntimeError):
    """The device cannot be trusted any more (on Neuron, a runtime error such as a
    lost core or a failed DMA; on CUDA, a lost context): the worker must restart.
    A backend raises it for errors no later step can recover from."""


class InjectedStepFailure(RuntimeError):
    """Raised by the test-only hook in place of the backend's step."""


def describe(exc: BaseException) -> str:
    """The cause as a caller reads it in a status message."""
    return f"{type(exc).__name__}: {exc}"


@dataclass
class FailureStreak:
    """Consecutive failing steps of one worker; says when the worker must go."""

    limit: int = FAILURES_BEFORE_EXIT
    count: int = 0

    def failed(self, exc: BaseException) -> bool:
        """Counts a failing step; true when the worker must stop serving."""
        self.count += 1
        return isinstance(exc, DeviceLost) or self.count >= self.limit

    def succeeded(self) -> None:
        self.count = 0

    def cause(self, exc: BaseException, what: str) -> str:
        """Why the worker stops: the fatal error itself, or the streak it ended (what: "steps", "prefills")."""
        return describe(exc) if self.count < self.limit else f"{self.count} {what} in a row failed; the last: {describe(exc)}"


@dataclass
class InjectedFaults:
    """Test-only: steps after+1 .. after+count raise (DeviceLost when fatal)."""

    variable: str
    after: int
    count: int
    fatal: bool = False
    steps: int = 0

    @classmethod
    def parse(cls, variable: str, text: str) -> InjectedFaults:
        fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        unknown = set(fields) - {"after", "count", "fatal"}
        if unknown or not fields:
            raise ValueError(f"{variable}={text!r}: expected after=N,count=M[,fatal=1]")
        faults = cls(variable, int(fields.get("after", 0)), int(fields.get("count", 1)), fields.get("fatal", "0") not in ("0", ""))
        if faults.after < 0 or faults.count < 1:
            raise ValueError(f"{variable}={text!r}: after must be >= 0 and count >= 1")
        return faults

    def check(self) -> None:
        self.steps += 1
        if self.after < self.steps <= self.after + self.count:
            error = DeviceLost if self.fatal else InjectedStepFailure
            raise error(f"{self.variable}: injected failure of step {self.steps}")


def with_injected_faults(step, variable: str, environ=os.environ):
    """step itself unless the test-only variable is set; then step behind the injected faults."""
    text = environ.get(variable)
    if not text:
        return step
    faults = InjectedFaults.parse(variable, text)

    @functools.wraps(step)
    def faulty_step(*args, **kwargs):
        faults.check()
        return step(*args, **kwargs)

    return faulty_step


def injected_hold(variable: str, environ=os.environ):
    """Test-only: None unless the variable names a path; then an async wait until that path exists."""
    path = environ.get(variable)
    if not path:
        return None

    async def hold() -> None:
        while not os.path.exists(path):
            await asyncio.sleep(0.01)

    return hold


def with_injected_hold(step, variable: str, environ=os.environ):
    """step itself unless the test-only variable is set ("after=N,until=PATH"); then
    steps after the Nth wait, on the caller's thread, until PATH exists."""
    text = environ.get(variable)
    if not text:
        return step
    fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    if set(fields) != {"after", "until"} or not fields["after"].isdigit():
        raise ValueError(f"{variable}={text!r}: expected after=N,until=PATH")
    after, path = int(fields["after"]), fields["until"]
    steps = 0

    @functools.wraps(step)
    def held_step(*args, **kwargs):
        nonlocal steps
        steps += 1
        while steps > after and not os.path.exists(path):
            time.sleep(HOLD_POLL_SECONDS)
        return step(*args, **kwargs)

    return held_step

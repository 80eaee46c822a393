"""Waiting in tests for a condition, never for a guessed time: the condition is
polled until it holds or a deadline passes (a loaded CI machine is slow, not wrong)."""

from __future__ import annotations

import time
import typing

T = typing.TypeVar("T")


def wait_for(condition: typing.Callable[[], T], within: float = 30.0, what: str = "the condition", every: float = 0.02) -> T:
    """condition()'s first truthy value; fails naming `what` if none comes within `within` seconds."""
    deadline = time.monotonic() + within
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} did not hold within {within}s"
        time.sleep(every)
    return value


def eventually(check: typing.Callable[[], T], within: float = 30.0, every: float = 0.02) -> T:
    """check() once it stops raising AssertionError (its value); past the deadline, its last failure."""
    deadline = time.monotonic() + within
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(every)

"""Where the engine's threads run: a worker's device thread (and the KV staging thread) pinned to its CPUs."""

from __future__ import annotations

import os


def pin_this_thread(cpus: frozenset[int] | None) -> None:
    """On Linux, pid 0 names the calling thread: only it (and threads it starts) move."""
    if cpus:
        os.sched_setaffinity(0, cpus)

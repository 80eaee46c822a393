"""Whether a starting process is getting anywhere, read from /proc.

A fixed start-up timeout fails a start that is slow for a good reason (a loaded
machine, a first kernel build, a compile in a child process); waiting forever
hides one that is wedged. So the launcher and the supervisor wait for as long as
a part makes progress: CPU time spent by the process or any of its descendants
(a compiler it runs, say), or a new start-up phase it publishes. A part silent
past a bound has failed its start.
"""

from __future__ import annotations

import os
import time

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# CPU time below this between two looks is noise (a sleeping thread's wake-ups), not progress.
MIN_PROGRESS_SECONDS = 0.02


def _own_cpu_seconds(pid: int) -> float:
    """user + system time of the process and of the children it has waited for."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    # fields[0] is field 3 (state); utime, stime, cutime, cstime are fields 14-17.
    return sum(int(v) for v in fields[11:15]) / CLOCK_TICKS


def _children(pid: int) -> list[int]:
    found = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:  # gone, or a kernel without CONFIG_PROC_CHILDREN: the process's own time still counts
        pass
    return found


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of the process and its live descendants (None once the process is gone)."""
    try:
        total = _own_cpu_seconds(pid)
    except (OSError, ValueError, IndexError):
        return None
    for child in _children(pid):
        total += tree_cpu_seconds(child) or 0.0
    return total


class ProgressWatch:
    """How long a process has gone without progress."""

    def __init__(self, pid: int, clock=time.monotonic, cpu_seconds=tree_cpu_seconds):
        self.pid = pid
        self._clock, self._cpu_seconds = clock, cpu_seconds
        self._cpu = cpu_seconds(pid) or 0.0
        self._phase: object = None
        self._last_progress = clock()

    def silent_for(self, phase: object = None) -> float:
        """Seconds since the process last spent CPU time or entered a new phase (phase: what it publishes, if anything)."""
        now, cpu = self._clock(), self._cpu_seconds(self.pid)
        if cpu is not None and cpu - self._cpu >= MIN_PROGRESS_SECONDS:
            self._cpu, self._last_progress = cpu, now
        if phase is not None and phase != self._phase:
            self._phase, self._last_progress = phase, now
        return now - self._last_progress

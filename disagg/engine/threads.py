"""Where the engine's threads run: a worker's device thread (and the KV staging thread) pinned
to its CPUs, and a prefill worker's torch compute threads bound one per CPU."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def pin_this_thread(cpus: frozenset[int] | None) -> None:
    """On Linux, pid 0 names the calling thread: only it (and threads it starts) move."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def start_compute_thread(cpus: frozenset[int] | None, bind_compute: bool) -> None:
    """A device thread's start: pinned to cpus, then (bind_compute) its torch threads bound one per CPU."""
    pin_this_thread(cpus)
    if bind_compute:
        bind_compute_threads()


def bind_compute_threads() -> list[int] | None:
    """The calling thread's torch compute threads (OpenMP's team, the caller first) bound one
    per CPU it may run on, where there is one thread per CPU (a prefill worker that has the
    host's cores: cpu_kernels/omp_team.c says why); the CPUs, or None where they stay unbound.
    Fewer threads than CPUs (several workers sharing the host) stay unbound: bound, each
    worker's first thread would take the same CPU."""
    import torch

    cpus, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if threads < 2 or threads != len(cpus) or not torch.backends.openmp.is_available():
        why = "PyTorch's threads are not OpenMP's" if threads >= 2 and threads == len(cpus) else f"{threads} torch threads for {len(cpus)} CPUs"
        log.info("torch compute threads not bound to CPUs: %s", why)
        return None
    from .cpu_kernels import omp_team

    if not omp_team.bind(cpus):
        return None
    log.info("torch compute threads bound one per CPU (%s): a product's even split never waits on two threads sharing a CPU",
             ", ".join(map(str, cpus)))
    return cpus

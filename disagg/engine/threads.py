"""Where the engine's threads run: a worker's device thread (and the KV staging thread) pinned
to its CPUs, and a prefill worker's torch compute threads bound one per CPU."""

from __future__ import annotations

import contextlib
import logging
import os
import threading

log = logging.getLogger(__name__)
# The CPU the calling thread's bound team leaves it (bind_compute_threads), per thread.
_team = threading.local()


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
    """The calling thread's torch compute threads (OpenMP's team) bound one per CPU it may run
    on, where there is one thread per CPU (a prefill worker that has the host's cores:
    cpu_kernels/omp_team.c says why): the team's other threads on all but the first CPU, which
    the caller takes inside on_the_teams_cpu. The CPUs, or None where they stay unbound.
    Fewer threads than CPUs (several workers sharing the host) stay unbound: bound, each
    worker's threads would take the same CPUs."""
    import torch

    cpus, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if threads < 2 or threads != len(cpus) or not torch.backends.openmp.is_available():
        why = "PyTorch's threads are not OpenMP's" if threads >= 2 and threads == len(cpus) else f"{threads} torch threads for {len(cpus)} CPUs"
        log.info("torch compute threads not bound to CPUs: %s", why)
        return None
    from .cpu_kernels import omp_team

    if not omp_team.bind(cpus):
        return None
    _team.caller_cpu = cpus[0]
    log.info("torch compute threads bound one per CPU (%s; the model thread on %d through oneDNN's products): a product's "
             "even split never waits on two of them sharing a CPU", ", ".join(map(str, cpus[1:])), cpus[0])
    return cpus


@contextlib.contextmanager
def on_the_teams_cpu():
    """The calling thread on the one CPU its bound team leaves it (bind_compute_threads), for
    the products inside: oneDNN splits each evenly across the team, caller included, so free,
    it could share a CPU with a member and hold every product back (a 900-token prompt beside
    4 streams: TTFT 1.2-1.4 s against 0.9-1.0 s on its own CPU). Only there: the few-row
    kernel's products split with a helper thread the scheduler wakes beside the caller, which
    a caller kept on one CPU makes wait (a 64-token bf16 prefill 61 -> 93 ms). Nothing where
    the thread bound no team."""
    cpu = getattr(_team, "caller_cpu", None)
    if cpu is None:
        yield
        return
    from .cpu_kernels import small_gemm

    small_gemm.meet_this_thread()  # what the kernels read once per thread from its CPUs: from its own, not the one below
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)

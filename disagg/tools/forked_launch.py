"""Parts of a local cluster started as forks of one process that has imported the libraries
they all import (torch, transformers, grpc), for test suites that start hundreds of them.

Why: a worker spends about 3.5 s of CPU importing torch and transformers before it does
anything of its own, and the test suite starts about 300 parts (routers, prefill and decode
workers, restarts) on two cores. A fork of a process that has imported them starts at once.
Each part is still a process of its own, with its own pid, session, log, environment and
exit code, running the same `python -m MODULE` entry point.

What differs from `python -m MODULE` (so this is opt-in: ClusterSpec.forked, set by the
tests, never by `disagg serve`): the libraries were imported with the environment of the
first launch (the environment a part is given still applies to everything imported after:
every module of this project reads its variables when it runs; PYTHONPATH's entries go
first on sys.path, as a new interpreter puts them), OpenMP's settings among them (the
tests' workers run one torch thread, where OpenMP starts no team); and
pages the libraries' import wrote are shared with the fork server until written, so a
part's proportional memory reads lower (tests/test_memory_report.py launches its own).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

# Imported once by the fork server: what every part imports before its own code runs.
PRELOAD = ["torch", "transformers", "grpc", "numpy", "llguidance", "llguidance.hf", "prometheus_client", "transformers.models.llama.modeling_llama",
           "transformers.models.mistral.modeling_mistral", "transformers.models.qwen2.modeling_qwen2", "transformers.integrations.flash_attention"]

_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run(module: str, argv: list[str], env: dict[str, str], log_path: str | None, new_session: bool, cpus, nice: int) -> None:
    """The part's process: its own session, log, environment and CPUs, then `python -m module argv...`."""
    import runpy

    if new_session:
        os.setsid()
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    # A new interpreter puts PYTHONPATH before the libraries on sys.path (the tests point parts at stand-ins with it).
    sys.path[0:0] = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in sys.path]
    if cpus:
        os.sched_setaffinity(0, cpus)
    if nice:
        from disagg.tools.local_cluster import lower_priority

        lower_priority(nice)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class ForkedPart:
    """What LocalCluster and the tests use of a subprocess.Popen, for a part forked by the fork server."""

    def __init__(self, module: str, argv: list[str], env: dict[str, str], log_path: str | None, new_session: bool = True, cpus=None, nice: int = 0):
        self._process = _forkserver().Process(target=_run, args=(module, argv, env, log_path, new_session, cpus, nice), daemon=True)
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

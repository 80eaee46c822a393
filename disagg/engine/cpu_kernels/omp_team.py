"""torch's compute threads bound one per CPU (`omp_team.c`): why is in the C file.

`bind(cpus)` binds the OpenMP team of the calling thread, the one its torch products
run on; call it on the thread that will run the model, before its first product.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib

from . import small_gemm

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("omp_team.c")
FLAGS = ("-O2", "-fopenmp", "-shared", "-fPIC")


@functools.cache
def library() -> ctypes.CDLL | None:
    built = small_gemm.load_library(SOURCE, FLAGS, (), "torch's compute threads not bound to CPUs")
    if built is not None:
        built.omp_team_bind.argtypes, built.omp_team_bind.restype = [ctypes.POINTER(ctypes.c_int), ctypes.c_int], ctypes.c_int
        built.omp_team_members.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_long), ctypes.POINTER(ctypes.c_int)]
        built.omp_team_members.restype = None
    return built


def bind(cpus: list[int]) -> bool:
    """The calling thread's team of len(cpus) threads, member i on cpus[i] from member 1 on (the
    caller, member 0, stays free: omp_team.c says why). False, with the reason logged, where
    that could not be done."""
    built = library()
    if built is None:
        return False
    bound = built.omp_team_bind((ctypes.c_int * len(cpus))(*cpus), len(cpus))
    if bound != len(cpus) - 1:
        log.warning("torch's compute threads not bound to CPUs %s: %s", cpus,
                    "OpenMP gave the team fewer threads" if bound < 0 else f"only {bound} could be bound")
        return False
    return True


def members(threads: int) -> list[tuple[int, int]]:
    """(thread id, its one CPU or -1) of each member of the calling thread's team of this many threads."""
    built = library()
    tids, cpus = (ctypes.c_long * threads)(), (ctypes.c_int * threads)()
    built.omp_team_members(threads, tids, cpus)
    return list(zip(tids, cpus))

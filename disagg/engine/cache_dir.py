"""Where disagg caches what it builds: compiled CPU kernels, packed weights and the tiny offline checkpoints."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pathlib


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DISAGG_CACHE", pathlib.Path.home() / ".cache" / "disagg"))


@contextlib.contextmanager
def exclusive(path: pathlib.Path, on_wait):
    """Holds an flock on the directory `path` (made if missing); on_wait() is called once
    if another process holds it, before waiting for it."""
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock

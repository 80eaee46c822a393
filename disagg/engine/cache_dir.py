"""Where disagg caches what it builds: compiled CPU kernels and the tiny offline checkpoints."""

from __future__ import annotations

import os
import pathlib


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DISAGG_CACHE", pathlib.Path.home() / ".cache" / "disagg"))

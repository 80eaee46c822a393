"""NeuronCores on this instance, and how `disagg serve --backend neuron` splits them.

Each worker gets `NEURON_RT_VISIBLE_CORES` for its own tp degree's worth of
cores; the Neuron runtime then opens only those, so workers on one instance
never contend for a core. Where the cores come from, first found wins:

1. `--neuron-cores N` (or `DISAGG_NEURON_CORES`): cores 0..N-1, for an instance
   this code cannot read, or to use fewer;
2. `NEURON_RT_VISIBLE_CORES` in the launcher's own environment: the cores it
   was given (a container, a share of the instance);
3. the Neuron driver's sysfs, /sys/devices/virtual/neuron_device/neuron*/core_count;
4. `neuron-ls --json-output` (each device's nc_count).

Trn2 with logical NeuronCores (NEURON_LOGICAL_NC_CONFIG=2, its default) counts
two physical cores as one: sysfs and neuron-ls report physical cores, so the
count is divided by that setting.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess

SYSFS_ROOT = "/sys/devices/virtual/neuron_device"


class NotEnoughCores(ValueError):
    """The workers' tp degrees do not fit the cores available; the message is one line."""


@dataclasses.dataclass(frozen=True)
class CorePool:
    cores: tuple[int, ...]
    source: str  # where the count came from, for the refusal line


def parse_core_list(text: str) -> tuple[int, ...]:
    """'0-3', '0,2,4' or '0-1,4-5' -> core ids, as NEURON_RT_VISIBLE_CORES takes them."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise ValueError(f"{text!r} is not a NeuronCore list such as 0-3 or 0,2")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        cores.extend(range(low, high + 1))
    return tuple(cores)


def format_core_list(cores: tuple[int, ...]) -> str:
    """(2, 3) -> '2-3'; (4,) -> '4'; non-contiguous -> '0,2'."""
    if len(cores) > 1 and list(cores) == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def sysfs_cores(root: str = SYSFS_ROOT) -> tuple[int, int] | None:
    """(devices, physical cores) from the driver's sysfs, or None where there is none."""
    devices = sorted(pathlib.Path(root).glob("neuron[0-9]*"))
    counts = []
    for device in devices:
        try:
            counts.append(int((device / "core_count").read_text().strip()))
        except (OSError, ValueError):
            counts.append(len(list(device.glob("neuron_core[0-9]*"))))
    return (len(devices), sum(counts)) if devices and sum(counts) else None


def neuron_ls_cores(program: str = "neuron-ls") -> tuple[int, int] | None:
    """(devices, physical cores) from `neuron-ls --json-output`, or None where it is absent or fails."""
    if shutil.which(program) is None:
        return None
    try:
        out = subprocess.run([program, "--json-output"], capture_output=True, text=True, timeout=30, check=True).stdout
        devices = json.loads(out)
        return len(devices), sum(int(d["nc_count"]) for d in devices)
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return None


def discover(count: int | None = None, env: dict | None = None, sysfs_root: str = SYSFS_ROOT, neuron_ls: str = "neuron-ls") -> CorePool:
    """The cores the workers may use and where that was read (module docstring)."""
    env = os.environ if env is None else env
    if count:
        return CorePool(tuple(range(count)), "--neuron-cores")
    if env.get("NEURON_RT_VISIBLE_CORES"):
        return CorePool(parse_core_list(env["NEURON_RT_VISIBLE_CORES"]), "NEURON_RT_VISIBLE_CORES")
    logical = max(1, int(env.get("NEURON_LOGICAL_NC_CONFIG", "1") or 1))
    for source, found in ((sysfs_root, sysfs_cores(sysfs_root)), ("neuron-ls", neuron_ls_cores(neuron_ls))):
        if found:
            devices, physical = found
            how = f"{source}: {devices} device{'s' * (devices != 1)}, {physical} cores" + (f" / NEURON_LOGICAL_NC_CONFIG {logical}" if logical > 1 else "")
            return CorePool(tuple(range(physical // logical)), how)
    return CorePool((), f"no Neuron device found ({sysfs_root} is empty or missing and neuron-ls is not on PATH); pass --neuron-cores to say how many")


@dataclasses.dataclass(frozen=True)
class WorkerCores:
    name: str  # the launcher's process name: decode-0, prefill-1, ...
    tp: int


def split(pool: CorePool, workers: list[WorkerCores]) -> dict[str, str]:
    """name -> NEURON_RT_VISIBLE_CORES, consecutive blocks of the pool; the widest tp
    first so every block of a common tp stays aligned to it. NotEnoughCores if they do not fit."""
    need = sum(w.tp for w in workers)
    if need > len(pool.cores):
        wanted = ", ".join(f"{w.name} tp {w.tp}" for w in workers)
        raise NotEnoughCores(f"the workers need {need} NeuronCores ({wanted}) and {len(pool.cores)} are available ({pool.source}); "
                             f"lower --tp or the number of workers")
    out, start = {}, 0
    for worker in sorted(workers, key=lambda w: -w.tp):
        out[worker.name] = format_core_list(pool.cores[start : start + worker.tp])
        start += worker.tp
    return out

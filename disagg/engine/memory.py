"""What a process holds in memory, as the kernel counts it.

Resident (RSS) counts every page the process maps that is in memory, shared or
not; proportional (PSS) divides each shared page between the processes that map
it, so the PSS of the workers on one machine adds up to what they cost together;
shared is the part of RSS other processes map too (a weight file two workers map
counts once in the page cache and in both RSS, half in each PSS). Read from
/proc/PID/smaps_rollup (Linux 4.14+), else RSS alone from /proc/PID/status.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessMemory:
    resident_bytes: int
    proportional_bytes: int  # 0 where the kernel does not say
    shared_bytes: int

    def describe(self) -> str:
        gib = 1 << 30
        return (f"resident {self.resident_bytes / gib:.2f} GiB (proportional {self.proportional_bytes / gib:.2f} GiB, "
                f"shared {self.shared_bytes / gib:.2f} GiB)")


def read_process_memory(pid: int | str = "self") -> ProcessMemory:
    try:
        fields = _kib_fields(f"/proc/{pid}/smaps_rollup")
    except OSError:
        fields = {}
    if "Rss" in fields:
        shared = fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0)
        return ProcessMemory(fields["Rss"] * 1024, fields.get("Pss", 0) * 1024, shared * 1024)
    status = _kib_fields(f"/proc/{pid}/status")
    return ProcessMemory(status.get("VmRSS", 0) * 1024, 0, (status.get("RssFile", 0) + status.get("RssShmem", 0)) * 1024)


def _kib_fields(path: str) -> dict[str, int]:
    """`Name:  1234 kB` lines as {Name: 1234}."""
    out = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                out[name] = int(parts[0])
    return out

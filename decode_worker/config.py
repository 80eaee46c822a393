from __future__ import annotations

from dataclasses import dataclass

from disagg.worker_config import WorkerConfig


@dataclass(frozen=True)
class DecodeWorkerConfig(WorkerConfig):
    address: str = "127.0.0.1:50061"
    batch_size: int = 8
    async_mode: bool = True
    lease_seconds: float = 30.0
    colocated: bool = False  # also serve PrefillService on this process (the non-disaggregated baseline)

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError("--batch-size must be at least 1")
        if self.lease_seconds <= 0:
            raise ValueError("--lease-seconds must be positive")

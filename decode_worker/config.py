from __future__ import annotations

from dataclasses import dataclass, field

from disagg.security import TlsFiles


@dataclass(frozen=True)
class DecodeWorkerConfig:
    model: str
    address: str = "127.0.0.1:50061"
    backend: str = "torch"
    dtype: str = "bfloat16"
    device: str = "cpu"
    batch_size: int = 8
    max_seq_len: int = 0  # 0: the model's limit (at most 4096)
    async_mode: bool = True
    lease_seconds: float = 30.0
    global_topk: int = 0
    threads: int = 0  # torch threads; 0 keeps torch's default
    device_cpus: frozenset[int] | None = None  # CPUs for the model's thread (None: any of the process's)
    metrics_port: int = 0
    port_file: str | None = None  # where to announce the bound ports
    neuron: dict = field(default_factory=dict)  # neuron backend options (tp_degree, buckets, ...)
    colocated: bool = False  # also serve PrefillService on this process (the non-disaggregated baseline)
    grace_seconds: float = 30.0  # SIGTERM: how long streams in flight may take to finish
    tls: TlsFiles | None = None  # mutual TLS for DecodeService (router and prefill workers)

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError("--batch-size must be at least 1")
        if self.lease_seconds <= 0:
            raise ValueError("--lease-seconds must be positive")

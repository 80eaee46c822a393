from __future__ import annotations

from dataclasses import dataclass, field

from disagg.security import TlsFiles


@dataclass(frozen=True)
class PrefillWorkerConfig:
    model: str
    address: str = "127.0.0.1:50051"
    backend: str = "torch"
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_seq_len: int = 0
    global_topk: int = 0
    threads: int = 0
    device_cpus: frozenset[int] | None = None  # CPUs for the model's thread (None: any of the process's)
    kv_piece_bytes: int = 4 * 1024 * 1024  # one gRPC message of KV
    kv_send_timeout: float = 60.0
    grace_seconds: float = 30.0
    metrics_port: int = 0
    port_file: str | None = None  # where to announce the bound ports
    neuron: dict = field(default_factory=dict)  # neuron backend options (tp_degree, buckets, ...)
    tls: TlsFiles | None = None  # mutual TLS: serving PrefillService and connecting to decode workers
    # Send each layer's KV while later layers compute. That overlap is real on an
    # accelerator; on a CPU the send takes cores from the prefill itself (3 ms of
    # a 12 ms TTFT measured here), so there the KV goes right after the first token.
    stream_kv_during_prefill: bool | None = None  # None: only when device is not "cpu"

    @property
    def streams_kv_during_prefill(self) -> bool:
        return self.device != "cpu" if self.stream_kv_during_prefill is None else self.stream_kv_during_prefill

    def __post_init__(self):
        if self.kv_piece_bytes < 1024:
            raise ValueError("--kv-piece-bytes must be at least 1024")

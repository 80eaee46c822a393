from __future__ import annotations

from dataclasses import dataclass


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
    kv_piece_bytes: int = 4 * 1024 * 1024  # one gRPC message of KV
    kv_send_timeout: float = 60.0

    def __post_init__(self):
        if self.kv_piece_bytes < 1024:
            raise ValueError("--kv-piece-bytes must be at least 1024")

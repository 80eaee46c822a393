from __future__ import annotations

from dataclasses import dataclass

from disagg.rpc.worker_config import WorkerConfig

from .peers import parse_pool


@dataclass(frozen=True)
class PrefillWorkerConfig(WorkerConfig):
    address: str = "127.0.0.1:50051"
    kv_piece_bytes: int = 4 * 1024 * 1024  # one gRPC message of KV
    kv_send_timeout: float = 60.0
    kv_staging_buffers: int = 2  # NIXL: prompts staged for decode workers to read at once
    # Send each layer's KV while later layers compute. That overlap is real on an
    # accelerator; on a CPU the send takes cores from the prefill itself (3 ms of
    # a 12 ms TTFT measured here), so there the KV goes right after the first token.
    stream_kv_during_prefill: bool | None = None  # None: only when device is not "cpu"
    # --decode: the decode pool KV may go to, as the router's targets (HOST:PORT, dns:[//SERVER/]NAME:PORT); required
    decode_peers: tuple[str, ...] = ()
    # The prefix cache (prefix_cache.py): prompts' KV kept in blocks of block_size tokens, prefix_cache_gib
    # of them; a prompt that starts with cached blocks computes only the rest. Off on the neuron backend.
    prefix_caching: bool = True
    prefix_cache_gib: float = 1.0  # 0: off
    block_size: int = 16
    # On a CPU, torch's compute threads bound one per CPU where the worker has a thread per CPU
    # (disagg.engine.threads.bind_compute_threads): a product's even split then never waits on
    # two of them sharing a CPU while another process holds the other.
    bind_compute_threads: bool = True

    def memory_need(self, facts):
        """What this worker will hold once serving (disagg/engine/memory.py), before it loads anything."""
        from disagg.engine import memory

        dtype = memory.serving_dtype(self.dtype, self.backend, self.device, self.model)
        packed = self.prepack if self.prepack is not None else self.device == "cpu"
        prefix = self.prefix_cache_gib if self.prefix_caching else 0.0
        return memory.prefill_need(facts, dtype, packed, self.share_weights, facts.max_seq_len(self.max_seq_len), prefix, self.kv_staging_buffers,
                                   memory.Quantized.of(self.quantization, self.quantization_skip))

    @property
    def streams_kv_during_prefill(self) -> bool:
        return self.device != "cpu" if self.stream_kv_during_prefill is None else self.stream_kv_during_prefill

    def __post_init__(self):
        super().__post_init__()
        if self.kv_piece_bytes < 1024:
            raise ValueError("--kv-piece-bytes must be at least 1024")
        if self.kv_staging_buffers < 1:
            raise ValueError("--kv-staging-buffers must be at least 1")
        if self.block_size < 1:
            raise ValueError("--block-size must be at least 1")
        if not self.prefix_cache_gib >= 0:  # NaN too
            raise ValueError("--prefix-cache-gib must be 0 (no prefix cache) or more")
        parse_pool(self.decode_peers)

from __future__ import annotations

from dataclasses import dataclass

from disagg.rpc.worker_config import WorkerConfig

GIB = 2**30
# NxDI compiles for a fixed batch, chosen before the model (and its KV size) is known.
NEURON_DEFAULT_SLOTS = 8


@dataclass(frozen=True)
class DecodeWorkerConfig(WorkerConfig):
    address: str = "127.0.0.1:50061"
    batch_size: int = 0  # decode slots; 0: as many as kv_cache_gib holds, at most max_batch_size
    kv_cache_gib: float = 4.0  # memory for the slot cache when the slots are sized from it (vLLM's KV cache space)
    max_batch_size: int = 64
    async_mode: bool = True
    lease_seconds: float = 30.0
    colocated: bool = False  # also serve PrefillService on this process (the non-disaggregated baseline)
    block_size: int = 16  # KV positions per block where the backend pages its KV (vLLM's default)
    prefix_caching: bool = True  # reuse published blocks of earlier prompts
    num_blocks: int = 0  # settled at load (size_slots): blocks in the cache; 0: a slot of max_seq_len positions per sequence

    def __post_init__(self):
        super().__post_init__()
        if self.batch_size < 0:
            raise ValueError("--batch-size must be at least 1 (or 0: sized from --kv-cache-gib)")
        if self.kv_cache_gib <= 0:
            raise ValueError("--kv-cache-gib must be positive")
        if self.max_batch_size < 1:
            raise ValueError("--max-batch-size must be at least 1")
        if self.lease_seconds <= 0:
            raise ValueError("--lease-seconds must be positive")
        if self.block_size < 1:
            raise ValueError("--block-size must be at least 1")

    def memory_need(self, facts):
        """What this worker will hold once serving (disagg/engine/memory.py), before it loads anything."""
        from disagg.engine import memory

        dtype = memory.serving_dtype(self.dtype, self.backend, self.device, self.model)
        packed = self.prepack if self.prepack is not None else self.device == "cpu"
        return memory.decode_need(facts, dtype, packed, self.share_weights, facts.max_seq_len(self.max_seq_len), self.kv_cache_gib,
                                  self.batch_size or self.max_batch_size, self.block_size,
                                  memory.Quantized.of(self.quantization, self.quantization_skip))

    def slots_before_load(self) -> int:
        """The slot count a backend that compiles for its batch needs before loading (0: decide after)."""
        return self.batch_size or (NEURON_DEFAULT_SLOTS if self.backend == "neuron" else 0)

    def slots_for(self, bytes_per_slot: int) -> int:
        """--batch-size when given, else how many slots of bytes_per_slot fit the KV budget (at least 1)."""
        if self.batch_size:
            return self.batch_size
        fit = int(self.kv_cache_gib * GIB // bytes_per_slot)
        if fit < 1:
            raise ValueError(
                f"--kv-cache-gib {self.kv_cache_gib} holds no slot of {bytes_per_slot / GIB:.2f} GiB (max_seq_len positions);"
                " raise it or lower --max-seq-len"
            )
        return min(fit, self.max_batch_size)

    def blocks_for(self, bytes_per_block: int, max_seq_len: int, sequences: int) -> int:
        """How many blocks of block_size positions the KV budget holds, plus the null block; at least one
        sequence's worth, at most what `sequences` sequences of max_seq_len fill (as many positions as the
        slot layout would hold: memory past that could only keep more cached prefixes, and is touched at start-up)."""
        longest = -(-max_seq_len // self.block_size)
        fit = min(int(self.kv_cache_gib * GIB // bytes_per_block), sequences * longest)
        if fit < longest:
            raise ValueError(
                f"--kv-cache-gib {self.kv_cache_gib} holds {fit} blocks of {self.block_size} positions,"
                f" fewer than one sequence of max_seq_len needs ({longest})"
            )
        return fit + 1

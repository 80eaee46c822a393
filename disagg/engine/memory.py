"""What a process holds in memory, as the kernel counts it.

Resident (RSS) counts every page the process maps that is in memory, shared or
not; proportional (PSS) divides each shared page between the processes that map
it, so the PSS of the workers on one machine adds up to what they cost together;
shared is the part of RSS other processes map too (a weight file two workers map
counts once in the page cache and in both RSS, half in each PSS). Read from
/proc/PID/smaps_rollup (Linux 4.14+), else RSS alone from /proc/PID/status.
"""

from __future__ import annotations

import struct
import threading
import time
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


# How old a sampled reading may be. Why sampled: reading smaps_rollup walks every page the process maps
# (50 ms for 4 GiB resident here), too long for a worker's event loop, which answers the router's GetLoad every second.
# Why not more often: each reading holds a core for that long at normal priority, taking it from the products'
# helper (SCHED_IDLE) of a decode step running beside it. A decode worker of SmolLM-135M's shape with its default
# KV budget (3.7 GB resident) took 37 ms a reading when idle; py-spy at one stream of load counted ~70 ms, 3.5% of a
# core at one reading every 2 s.
SAMPLE_SECONDS = 10.0
_sample: list = []  # [the latest reading], once the sampling thread runs
_sample_lock = threading.Lock()


def sampled_process_memory() -> ProcessMemory:
    """This process's memory as a thread of its own last read it (at most SAMPLE_SECONDS ago); the first
    call reads it here (a worker's start-up line) and starts the thread."""
    with _sample_lock:
        if not _sample:
            _sample.append(read_process_memory())
            threading.Thread(target=_keep_sampling, name="memory-sampler", daemon=True).start()
        return _sample[0]


def _keep_sampling() -> None:
    while True:
        time.sleep(SAMPLE_SECONDS)
        _sample[0] = read_process_memory()


def return_freed_memory() -> bool:
    """Hands the heap's free pages back to the system (glibc's malloc_trim); False where there is no glibc.
    Why: loading leaves gigabytes of freed temporaries (quantizing Llama-3.2-1B's linears at load: its
    float32 copies and 8-bit values, 1.35 GiB) in glibc's heap, where they stay resident unless trimmed.
    Cyclic garbage is collected first: the linears packing replaced hold their weights until then."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


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


# -- what a worker will hold, before it loads ------------------------------------------------------
GIB = 1 << 30
# torch and its libraries, the tokenizer, the gRPC server, activations and scratch buffers: a SmolLM-135M-shaped
# float32 decode worker held 1.1 GiB beyond its weights and KV here (bench/memory.py, 2026-11-26); with a margin.
WORKING_BYTES = 5 << 28  # 1.25 GiB
# Test-only: the available memory, in bytes, as if read from the machine (a test of a start that cannot fit).
TEST_MEMORY_AVAILABLE = "DISAGG_TEST_MEMORY_AVAILABLE_BYTES"


class NotEnoughMemory(RuntimeError):
    """A start that would not fit in the memory the machine (or its cgroup) has free."""


@dataclass(frozen=True)
class MemoryNeed:
    """What one worker holds once serving, in bytes, by what holds it."""

    role: str
    weights: int  # in their serving layout
    kv: int
    prefix_cache: int = 0
    working: int = WORKING_BYTES
    shared: bool = False  # the weights are mapped from the box's packed weights file: the workers of one box hold them once

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.prefix_cache + self.working

    def describe(self) -> str:
        parts = [f"weights {gib(self.weights)} in their serving layout{', shared by the box' if self.shared else ''}", f"KV {gib(self.kv)}"]
        if self.prefix_cache:
            parts.append(f"prefix cache {gib(self.prefix_cache)}")
        return f"{self.role} worker {gib(self.total)} ({', '.join(parts)}, working {gib(self.working)})"


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.0f} MiB"


@dataclass(frozen=True)
class CheckpointFacts:
    """A local checkpoint's sizes, read from its config.json and safetensors headers (no weights loaded)."""

    linear_values: int  # elements of 2-D weights other than embeddings (what PackedLinear lays out again)
    other_values: int  # embeddings, norms, biases
    tied_head_values: int  # an LM head that is the embedding (laid out for products as well, where packed)
    kv_values_per_token: int  # 2 x layers x kv heads x head dim
    max_positions: int
    head_values: int = 0  # an LM head of its own (among linear_values): full precision unless --quantization-skip lets it be quantized

    @classmethod
    def read(cls, model: str) -> CheckpointFacts | None:
        """None where the checkpoint is not a local directory of safetensors files (nothing to read before loading),
        or where its files do not read as such: the loader then says what is wrong with them, not the estimate."""
        try:
            return cls._read(model)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
            return None

    @classmethod
    def _read(cls, model: str) -> CheckpointFacts | None:
        import json
        import os

        files = sorted(f for f in os.listdir(model) if f.endswith(".safetensors")) if os.path.isdir(model) else []
        if not files or not os.path.exists(os.path.join(model, "config.json")):
            return None
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        config = config.get("text_config", config)
        linear = other = embedding = head = 0
        has_head = False
        for name, shape in (item for file in files for item in _safetensors_shapes(os.path.join(model, file))):
            values = _product(shape)
            if "embed" in name or name.endswith(("wte.weight", "wpe.weight")):
                embedding += values
            elif len(shape) == 2:
                linear += values
                has_head = has_head or "lm_head" in name
                head += values if "lm_head" in name else 0
            else:
                other += values
        tied = config.get("tie_word_embeddings", True) and not has_head
        heads = config.get("num_attention_heads") or config.get("n_head") or 1
        head_dim = config.get("head_dim") or (config.get("hidden_size") or config.get("n_embd") or 0) // heads
        kv_heads = config.get("num_key_value_heads") or heads
        layers = config.get("num_hidden_layers") or config.get("n_layer") or 0
        positions = config.get("max_position_embeddings") or config.get("n_positions") or 4096
        return cls(linear, other + embedding, embedding if tied else 0, 2 * layers * kv_heads * head_dim, positions, head)

    def max_seq_len(self, asked: int) -> int:
        """As the torch backend settles it: the asked length, else the model's, at most 4,096, never past the model's."""
        return min(asked or min(self.max_positions, 4096), self.max_positions)

    def weight_bytes(self, itemsize: int, packed: bool, quantization: Quantized | None = None) -> int:
        """packed: the CPU's PackedLinear keeps one layout of every linear weight, a tied LM head's included.
        quantization: the linears in one byte a value (a skipped LM head stays full precision; a tied one
        quantized has 8-bit panels of its own, the embedding staying full precision);
        only where packed do the 8-bit panels replace the full-precision weights."""
        full = (self.linear_values + self.other_values + (self.tied_head_values if packed else 0)) * itemsize
        if quantization is None or not packed:
            return full
        eight_bit = self.linear_values - (0 if quantization.head else self.head_values) + (self.tied_head_values if quantization.head else 0)
        return full - eight_bit * (itemsize - 1)


@dataclass(frozen=True)
class Quantized:
    """What --quantization makes 8-bit, as the estimate counts it."""

    head: bool = False  # the LM head too (--quantization-skip does not name it)

    @classmethod
    def of(cls, method: str | None, skip: tuple[str, ...]) -> Quantized | None:
        return None if method is None else cls(head=not any(part and part in "lm_head" for part in skip))


def _product(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _safetensors_shapes(path: str):
    """(name, shape) of each tensor, from the file's JSON header."""
    import json

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return [(name, tuple(entry["shape"])) for name, entry in header.items() if name != "__metadata__"]


def available_memory() -> tuple[int, str]:
    """(bytes, where from): the machine's MemAvailable, or its cgroup's room under the limit where that is less."""
    import os

    injected = os.environ.get(TEST_MEMORY_AVAILABLE)
    if injected:
        return int(injected), f"{TEST_MEMORY_AVAILABLE}"
    best = (_kib_fields("/proc/meminfo")["MemAvailable"] * 1024, "MemAvailable in /proc/meminfo")
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as limit, open(usage_path) as usage:
                text, used = limit.read().strip(), int(usage.read())
        except (OSError, ValueError):
            continue
        if text.isdigit() and int(text) - used < best[0]:
            best = (max(0, int(text) - used), f"the cgroup's limit ({gib(int(text))}) less its use")
    return best


def check_fits(needs: list[MemoryNeed], what: str, hints: str) -> None:
    """NotEnoughMemory, as one line naming the need, the free memory and the flags that would fit, where the needs do not fit."""
    free, source = available_memory()
    shared = [n.weights for n in needs if n.shared]
    total = sum(n.total for n in needs) - sum(shared) + max(shared, default=0)  # one copy of mapped weights per box
    if total > free:
        raise NotEnoughMemory(f"{what} would hold about {gib(total)} ({'; '.join(n.describe() for n in needs)}), more than the "
                              f"{gib(free)} free ({source}): {hints}")


def serving_dtype(dtype: str, backend: str, device: str, model: str) -> str:
    """The dtype the worker will serve in (--dtype auto settled as the worker settles it)."""
    if dtype == "auto":
        from disagg.engine.dtype_choice import choose_dtype

        dtype, _ = choose_dtype(backend, device, model)
    return dtype


def itemsize_of(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def decode_need(facts: CheckpointFacts, dtype: str, packed: bool, shared: bool, max_seq_len: int, kv_cache_gib: float, sequences: int,
                block_size: int, quantization: Quantized | None = None) -> MemoryNeed:
    """The KV as the decode worker sizes it: its budget, or less where `sequences` sequences of max_seq_len fill less."""
    itemsize = itemsize_of(dtype)
    per_sequence = -(-max_seq_len // block_size) * block_size * facts.kv_values_per_token * itemsize
    kv = min(int(kv_cache_gib * GIB), sequences * per_sequence)
    return MemoryNeed("decode", facts.weight_bytes(itemsize, packed, quantization), kv, shared=packed and shared)


def prefill_need(facts: CheckpointFacts, dtype: str, packed: bool, shared: bool, max_seq_len: int, prefix_cache_gib: float, staging_buffers: int,
                 quantization: Quantized | None = None) -> MemoryNeed:
    """Its KV: the prompts staged for the decode workers (NIXL; the gRPC push holds less) and the prefix cache's budget."""
    itemsize = itemsize_of(dtype)
    staged = staging_buffers * max_seq_len * facts.kv_values_per_token * itemsize
    return MemoryNeed("prefill", facts.weight_bytes(itemsize, packed, quantization), staged, prefix_cache=int(prefix_cache_gib * GIB),
                      shared=packed and shared)


def checks_host_memory(backend: str, device: str) -> bool:
    """Whether the weights and the KV live in this machine's memory (not a GPU's or a NeuronCore's)."""
    return backend == "torch" and device == "cpu"

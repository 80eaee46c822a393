"""The NIXL KV transport (pull): the decode worker reads a prompt's KV from the
prefill worker's registered staging buffer straight into the reserved slot.

Why pull, as vLLM's NIXL connector does: the decode worker decides when bytes
land in its slot. It reads only for a reservation it holds, on the same single
writer thread that orders every other write into the cache, so a slot that is
freed and given to the next request can never receive the previous request's
bytes: the next owner's writes queue behind the read. A push from the prefill
side could land late in a slot that already belongs to someone else.

Layouts (host memory, the UCX backend; on AWS the same calls with LIBFABRIC
and Neuron memory registered as VRAM, see docs/neuron.md):
- staging (prefill): a 64-byte header whose first 8 bytes are the buffer's
  generation, then [layer][K, V][kv_heads][prompt_len][head_dim], compact; an
  8-bit KV's codes so, then their float32 scales [layer][K, V][kv_heads][blocks]
  (layout.KvGeometry), and the decode side lands it through NixlHostStagingSink;
- slot cache (decode): per layer and kind [slots, kv_heads, max_seq_len,
  head_dim]; a slot's prompt is kv_heads runs of prompt_len * head_dim, one
  strided descriptor per layer and kind.
Control (metadata, the staging address, commit, cancel) travels on gRPC.

A staging buffer goes back to the pool when the PullKv call ends, and a call
can end (deadline, cancel) while the reader is still reading. So the buffer's
generation is bumped before each reuse, before any new byte is staged, and the
reader reads the generation after the KV: unchanged, nothing was overwritten
during the read (a seqlock); changed, the transfer fails instead of committing
another prompt's bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid

import numpy as np
import torch

from disagg.engine.quantization.kv_cache import QuantizedKv

from .layout import SCALE_BYTES, KvGeometry

MEMORY = "DRAM"
HEADER_BYTES = 64  # the generation, padded to a cache line so the KV stays aligned
# How often the reader checks a transfer: each read's end is seen this late at
# worst, on a thread that only waits (the KV writer).
POLL_SECONDS = 0.0001


class NixlUnavailable(RuntimeError):
    """NIXL is not installed or the backend asked for does not load."""


class NixlTransferError(RuntimeError):
    """A read did not complete (the peer went away, or the deadline passed)."""


def import_nixl():
    """NIXL's Python API: the `nixl` meta package, or the CUDA 12 build PyPI ships (`nixl-cu12`)."""
    for name in ("nixl", "nixl_cu12"):
        try:
            module = __import__(name, fromlist=["nixl_agent", "nixl_agent_config"])
            if hasattr(module, "nixl_agent"):
                return module
        except ImportError:
            continue
    raise NixlUnavailable("NIXL is not installed: pip install nixl-cu12 (or 'disagg[nixl]')")


def available() -> bool:
    """Whether NIXL is installed, without loading it: its bundled abseil clashes
    with grpc_tools' protoc in one process, so only processes that use it load it."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu12"))


def new_agent(role: str, backend: str = "UCX"):
    """backend: UCX (host memory, shared memory or TCP here) or LIBFABRIC (EFA on AWS;
    needs a NIXL built against libfabric >= 1.21, see docs/neuron.md)."""
    nixl = import_nixl()
    # NIXL's own progress thread polls with no pause for the agent's whole life (a core
    # spent even when idle), so neither side uses it: the reader polls its own
    # transfers, and the side read from is progressed by PassiveProgress while a read runs.
    config = nixl.nixl_agent_config(enable_prog_thread=False, backends=[backend])
    try:
        agent = nixl.nixl_agent(f"disagg-{role}-{uuid.uuid4().hex[:12]}", config)
    except Exception as exc:  # nixlNotFoundError: the backend's plugin is missing or cannot load
        raise NixlUnavailable(f"NIXL's {backend} backend did not load") from exc
    if backend not in agent.backends:
        raise NixlUnavailable(f"NIXL's {backend} backend did not load")
    return agent


@dataclasses.dataclass
class StagingBuffer:
    tensor: torch.Tensor  # uint8, [HEADER_BYTES + capacity]
    generation: int = 0

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def next_generation(self) -> int:
        """Marks the buffer as being rewritten: call before staging anything new into it."""
        self.generation += 1
        self.tensor[:8].view(torch.int64)[0] = self.generation
        return self.generation


class PassiveProgress:
    """Progresses the agent that is read from, but only while some read may be running.

    A read completes only when both UCX workers progress (seen here: over shared
    memory and TCP alike, a read from an agent nobody progresses never finishes,
    even once its bytes have arrived). `reading()` marks a span in which a peer
    may read (from asking it to until its answer); outside those spans the thread
    sleeps, so an idle prefill worker spends no CPU on NIXL. Only this thread calls
    the agent once serving starts, as the agent is not thread-safe (sync mode NONE).
    """

    def __init__(self, agent, poll_seconds: float = POLL_SECONDS):
        self.agent = agent
        self.poll_seconds = poll_seconds
        self._readers = 0
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="nixl-progress", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def reading(self):
        with self._changed:
            self._readers += 1
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._readers -= 1

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._readers > 0)
            self.agent.get_new_notifs()  # progresses every backend of the agent
            time.sleep(self.poll_seconds)


class NixlSource:
    """Prefill side: a pool of registered staging buffers the decode side reads from."""

    def __init__(self, geometry: KvGeometry, max_tokens: int, buffers: int, backend: str = "UCX"):
        self.agent = new_agent("prefill", backend=backend)
        self.geometry = geometry
        self.buffers = [StagingBuffer(torch.zeros(HEADER_BYTES + geometry.prompt_bytes(max_tokens), dtype=torch.uint8)) for _ in range(buffers)]
        self._registered = self.agent.register_memory([b.tensor for b in self.buffers], MEMORY)
        self.metadata = self.agent.get_agent_metadata()
        self.progress = PassiveProgress(self.agent)

    def reading(self):
        """Context manager: a peer may be reading a staging buffer while it is open."""
        return self.progress.reading()

    @property
    def name(self) -> str:
        return self.agent.name

    def stage_layer(self, buffer: StagingBuffer, layer: int, keys, values, tokens: int | None = None, offset: int = 0) -> None:
        """Copies one layer's K and V ([kv_heads, n, head_dim] tensors, or QuantizedKv where the
        geometry is 8-bit) into the buffer's layout of a prompt of `tokens` staged tokens
        (default n), at staged token `offset` (several parts of one layer are staged end to end
        this way; an 8-bit part from a block's start)."""
        tokens = keys.shape[1] if tokens is None else tokens
        if not 0 <= offset <= offset + keys.shape[1] <= tokens:
            raise ValueError(f"staging tokens [{offset}, {offset + keys.shape[1]}) of {tokens}")
        if isinstance(keys, QuantizedKv) != self.geometry.quantized:
            raise ValueError(f"staging {type(keys).__name__} KV into a staging layout for {self.geometry.kv_dtype or 'unquantized'} KV")
        for kind, tensor in enumerate((keys, values)):
            codes = tensor.codes if isinstance(tensor, QuantizedKv) else tensor
            start = HEADER_BYTES + self.geometry.staging_offset(layer, kind, tokens)
            span = buffer.tensor[start : start + self.geometry.layer_kind_bytes(tokens)]
            span.view(codes.dtype).view(codes.shape[0], tokens, codes.shape[2])[:, offset : offset + codes.shape[1]].copy_(codes)
            if isinstance(tensor, QuantizedKv):
                self._stage_scales(buffer, layer, kind, tensor, tokens, offset)

    def _stage_scales(self, buffer: StagingBuffer, layer: int, kind: int, kv: QuantizedKv, tokens: int, offset: int) -> None:
        """A part's scales [kv_heads, its blocks] into the layer and kind's [kv_heads, blocks], as bytes
        (the run may start off a 4-byte boundary)."""
        g = self.geometry
        if kv.block_size != g.scale_block or offset % g.scale_block:
            raise ValueError(f"staging KV in blocks of {kv.block_size} from token {offset}; this layout's scales are per {g.scale_block} positions")
        start = HEADER_BYTES + g.scale_offset(layer, kind, tokens)
        rows = buffer.tensor[start : start + g.layer_kind_scale_bytes(tokens)].view(g.kv_heads, -1)  # [kv_heads, blocks * 4]
        first = offset // g.scale_block * SCALE_BYTES
        scales = kv.scales.contiguous().view(torch.uint8)  # [kv_heads, its blocks * 4]
        rows[:, first : first + scales.shape[1]].copy_(scales)


class _Reader:
    """Decode side, what both landings share: the agent, its peers, the read and the generation check."""

    def __init__(self, geometry: KvGeometry, regions: list[torch.Tensor], poll_seconds: float, backend: str):
        self.agent = new_agent("decode", backend=backend)
        self.geometry = geometry
        self._generation = torch.zeros(1, dtype=torch.int64)  # where the staged generation is read back to
        self._registered = self.agent.register_memory([*regions, self._generation], MEMORY)
        self._peers: dict[str, str] = {}
        self.poll_seconds = poll_seconds

    def _peer(self, agent_name: str, metadata: bytes) -> str:
        if agent_name not in self._peers:
            peer = self.agent.add_remote_agent(metadata)
            self.agent.make_connection(peer)
            self._peers[agent_name] = peer
        return self._peers[agent_name]

    def _forget(self, agent_name: str) -> None:
        """Drops a peer after a failed read: a prefill worker that restarts comes back as a new agent."""
        peer = self._peers.pop(agent_name, None)
        if peer is not None:
            try:
                self.agent.remove_remote_agent(peer)
            except Exception:  # already torn down on NIXL's side
                pass

    def read_into(
        self, table: list[int], agent_name: str, metadata: bytes, address: int, token_start: int, prompt_len: int, generation: int, deadline: float
    ) -> int:
        """Reads every layer's K and V of a staged prompt's tokens [token_start, prompt_len) into
        the sequence's blocks (the slot layout: table [slot]); returns the bytes read.
        Blocks until the read is done: call it on the thread that orders cache writes."""
        tokens = prompt_len - token_start
        try:
            peer = self._peer(agent_name, metadata)
            local, remote, count = self._descriptors(table, address + HEADER_BYTES, token_start, tokens)
            self._read(peer, agent_name, local, remote, count, deadline)
            # The generation after the KV (the seqlock's second read): see the module's docstring.
            tag = np.array([(self._generation.data_ptr(), 8, 0)], dtype=np.uint64), np.array([(address, 8, 0)], dtype=np.uint64)
            self._read(peer, agent_name, *tag, 1, deadline, poll_seconds=0.0)  # 8 bytes: done in microseconds
        except NixlTransferError:
            self._forget(agent_name)
            raise
        except Exception as exc:  # NIXL's own errors (nixlBackendError, ...): the peer is gone or refused
            self._forget(agent_name)
            raise NixlTransferError(f"KV read from {agent_name} failed: {type(exc).__name__}: {exc}") from exc
        if int(self._generation[0]) != generation:
            raise NixlTransferError(f"the staging buffer of {agent_name} was reused during the read (generation {generation} -> {int(self._generation[0])})")
        self._land(table, token_start, tokens)
        return self.geometry.prompt_bytes(tokens)

    def _descriptors(self, table: list[int], address: int, token_start: int, tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
        raise NotImplementedError

    def _land(self, table: list[int], token_start: int, tokens: int) -> None:
        """After a checked read: whatever must still happen for the KV to be in the cache."""

    def _read(self, peer: str, agent_name: str, local: np.ndarray, remote: np.ndarray, count: int, deadline: float, poll_seconds: float | None = None) -> None:
        local_list = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, MEMORY)
        try:
            remote_list = self.agent.prep_xfer_dlist(peer, remote, MEMORY)
            try:
                indices = list(range(count))
                handle = self.agent.make_prepped_xfer("READ", local_list, indices, remote_list, indices)
                try:
                    self._wait(handle, agent_name, deadline, self.poll_seconds if poll_seconds is None else poll_seconds)
                finally:
                    # Releasing a handle still in flight cancels it before the next write into the cache.
                    self.agent.release_xfer_handle(handle)
            finally:
                self.agent.release_dlist_handle(remote_list)
        finally:
            self.agent.release_dlist_handle(local_list)

    def _wait(self, handle, agent_name: str, deadline: float, poll_seconds: float) -> None:
        state = self.agent.transfer(handle)
        while state == "PROC":
            if time.monotonic() > deadline:
                raise NixlTransferError(f"KV read from {agent_name} did not finish in time")
            time.sleep(poll_seconds)
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise NixlTransferError(f"KV read from {agent_name} failed ({state})")



class NixlSink(_Reader):
    """Decode side, the slot cache in host memory (the torch backend): registered once;
    the KV lands straight in the slot, no copy on this side."""

    def __init__(self, geometry: KvGeometry, keys: list[torch.Tensor], values: list[torch.Tensor], poll_seconds: float = POLL_SECONDS, backend: str = "UCX"):
        if geometry.quantized:  # the staged scales have no place in a slot of plain values
            raise ValueError("an 8-bit KV lands through NixlHostStagingSink, not straight into a slot")
        regions = [t for pair in zip(keys, values) for t in pair]  # layer by layer, K then V: the staging order
        # Each region's first byte, kept as an array: a pull's descriptors are then the
        # geometry's own formulas over arrays, not a Python loop over every layer and kind
        # (~0.2 ms a pull).
        self._region_starts = np.array([t.data_ptr() for t in regions], dtype=np.uint64)
        super().__init__(geometry, regions, poll_seconds, backend)

    def _descriptors(self, table: list[int], address: int, token_start: int, tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Strided (address, length, device, stride, count) rows, one per layer and kind
        (address: the staged KV's first byte); each expands to kv_heads descriptors."""
        g = self.geometry
        (slot,) = table  # this sink serves the slot layout only
        run = g.run_bytes(tokens)
        regions = len(self._region_starts)
        layers, kinds = np.divmod(np.arange(regions, dtype=np.uint64), np.uint64(2))  # the regions' order
        local = np.empty((regions, 5), dtype=np.uint64)
        local[:, 0] = g.slot_address(self._region_starts, slot) + np.uint64(g.run_bytes(token_start))
        local[:, 1:] = (run, 0, g.slot_head_stride, g.kv_heads)
        remote = np.empty((regions, 5), dtype=np.uint64)
        remote[:, 0] = address + g.staging_offset(layers, kinds, tokens)
        remote[:, 1:] = (run, 0, run, g.kv_heads)
        return local, remote, regions * g.kv_heads


class NixlHostStagingSink(_Reader):
    """Decode side, a KV cache NIXL cannot reach (Neuron device memory where NIXL
    has no device path for it) or does not address (a cache of blocks: a prompt's
    blocks are scattered): the KV is read into one registered host buffer, then
    each layer's K and V go to `write(table, layer, kind, token_start, tensor)`, the backend's own
    KV write (an 8-bit KV's as a QuantizedKv of its codes and scales, read as they were staged).
    One buffer is enough: reads and writes run on the one KV writer thread.
    vLLM's NIXL connector does the same for accelerators NIXL cannot register
    (kv_buffer_device "cpu")."""

    def __init__(self, geometry: KvGeometry, dtype: torch.dtype, write, poll_seconds: float = POLL_SECONDS, backend: str = "UCX"):
        """dtype: the staged values' (an 8-bit KV's codes')."""
        self._buffer = torch.empty(geometry.prompt_bytes(geometry.max_seq_len), dtype=torch.uint8)
        self._dtype = dtype
        self._write = write
        super().__init__(geometry, [self._buffer], poll_seconds, backend)

    def _descriptors(self, table: list[int], address: int, token_start: int, tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
        """One region: the staging layout is compact on both sides."""
        size = self.geometry.prompt_bytes(tokens)
        return np.array([(self._buffer.data_ptr(), size, 0)], dtype=np.uint64), np.array([(address, size, 0)], dtype=np.uint64), 1

    def _land(self, table: list[int], token_start: int, tokens: int) -> None:
        from .chunk_codec import KvKind

        g = self.geometry
        shape = (g.kv_heads, tokens, g.head_dim)
        scales = self._scales(tokens) if g.quantized else None
        for layer in range(g.num_layers):
            for kind in KvKind:
                start = g.staging_offset(layer, kind - 1, tokens)
                tensor = self._buffer[start : start + g.layer_kind_bytes(tokens)].view(self._dtype).view(shape)
                if scales is not None:
                    tensor = QuantizedKv(tensor, scales[layer, kind - 1], g.scale_block)
                self._write(table, layer, kind, token_start, tensor)

    def _scales(self, tokens: int) -> torch.Tensor:
        """The staged scales [layers, 2, kv_heads, blocks], checked before any layer is written:
        copied out of the buffer (their run may start off a 4-byte boundary)."""
        from .chunk_codec import KvChunkError

        g = self.geometry
        start = g.scale_offset(0, 0, tokens)
        scales = self._buffer[start : start + g.scales_bytes(tokens)].clone().view(torch.float32).view(g.num_layers, 2, g.kv_heads, g.blocks(tokens))
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise KvChunkError("staged scales hold a value that is negative, infinite or NaN: every scale must be finite and >= 0")
        return scales

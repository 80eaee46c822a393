"""The torch backend's compiled decode step, with buckets as NxDI has them.

A decode step runs the model over a batch bucket of rows (row i is slot i, for
every slot below the bucket) and a KV-length bucket of positions, so a few
shapes cover every step. The step is one `torch.compile` graph (fullgraph,
dynamic sizes: each bucket is a shape of the same graph, not a new compile;
on CUDA, each bucket is also captured as a CUDA graph and replayed). The model code
stays transformers' own: the graph is the model's forward over
`BucketDecodeCache`, attention and masks included.

A verify step (speculation: a sequence's input and its guesses as rows of their
own, at consecutive positions of its slot) runs a second graph over row buckets
(`verify_logits`): the same model over a gather of each row's slot rather than a
view of the first slots, every row's K/V written before any row attends.

Every bucket runs once at start-up (`warm_up`), before the worker says
SERVING. Inductor's caches live on disk (`TORCHINDUCTOR_CACHE_DIR`, by default
under ~/.cache/disagg), so a restart loads the compiled code instead of
compiling it again.
"""

from __future__ import annotations

import bisect
import logging
import os
import pathlib
import time

import torch

from .slot_kv_cache import BucketDecodeCache, BucketStep, LayerPlan, PagedKvCache

log = logging.getLogger(__name__)

KV_BUCKET_MIN = 128  # NxDI's smallest default bucket


def default_cache_dir() -> pathlib.Path:
    """Beside the other things disagg caches (DISAGG_CACHE, default ~/.cache/disagg)."""
    return pathlib.Path(os.environ.get("DISAGG_CACHE", pathlib.Path.home() / ".cache" / "disagg")) / "torchinductor"


def use_disk_cache() -> str:
    """Inductor's cache under ~/.cache/disagg unless TORCHINDUCTOR_CACHE_DIR was chosen.
    Importing transformers already fills the variable with Inductor's default (under
    /tmp), so a value equal to that default counts as not chosen."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(inductor_default()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(default_cache_dir())
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2*low, ... below high, then high itself."""
    buckets, size = [], low
    while size < high:
        buckets.append(size)
        size *= 2
    return (*buckets, high)


def default_batch_buckets(num_slots: int, device: torch.device) -> tuple[int, ...]:
    """Powers of two up to the slot count. From 1 on CPU, where one row takes the
    prepacked linears' fast path (a second row costs 1.7x with MKL, bench/results/HISTORY.md,
    The compiled, bucketed decode step); from 2
    on CUDA, where a batch of 1 would be a graph of its own (dynamic sizes specialize
    1) and a padding row costs little."""
    return powers_of_two(1 if device.type == "cpu" else min(2, num_slots), num_slots)


class BadBuckets(ValueError):
    """Buckets some step could fall outside of; the message is one line naming the flag."""


def check_buckets(name: str, buckets: tuple[int, ...], last: int, flag: str) -> tuple[int, ...]:
    """Refuses buckets a step could fall outside of (one line naming the flag)."""
    if list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
        raise BadBuckets(f"{flag} {list(buckets)}: {name} buckets must be positive and strictly ascending")
    if buckets[-1] != last:
        raise BadBuckets(f"{flag} {list(buckets)}: the last {name} bucket must be {last}, or some steps fit no bucket")
    return buckets


def bucket_for(buckets: tuple[int, ...], size: int) -> int:
    return buckets[bisect.bisect_left(buckets, size)]


class CompiledDecode:
    """The decode step's logits through one compiled graph, padded to buckets."""

    def __init__(
        self, model, plans: list[LayerPlan], cache: PagedKvCache, num_slots: int,
        batch_buckets: tuple[int, ...], token_buckets: tuple[int, ...], max_seq_len: int, verify_rows: int = 0, hidden: bool = False,
    ):
        self.model, self.plans, self.cache = model, plans, cache
        # Whether the graphs also return each row's final hidden states (after the final norm: what the LM head
        # multiplies; EAGLE's head reads them): (logits, hidden) then, else logits.
        self.hidden = hidden
        self.scratch_slot = num_slots  # the cache holds one slot more than the worker hands out
        assert cache.keys[0].shape[0] == num_slots + 1, "allocate the scratch slot"
        device = cache.keys[0].device
        self.batch_buckets = check_buckets("batch", batch_buckets or default_batch_buckets(num_slots, device), num_slots, "--batch-buckets")
        self.token_buckets = check_buckets(
            "KV-length", token_buckets or powers_of_two(min(KV_BUCKET_MIN, max_seq_len), max_seq_len), max_seq_len, "--token-buckets"
        )
        self._kv_positions = torch.arange(max_seq_len, device=device)
        log.info("compiled code cached in %s", use_disk_cache())
        # Dynamo keeps compiled entries per code object, so each model in one process
        # (tests build several) adds its own; a worker has one.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._graph = torch.compile(self._forward, fullgraph=True, dynamic=True)
        # Verify steps: rows buckets up to verify_rows (the most rows a step with guesses has), from 2 (an input and a guess).
        self.verify_buckets = powers_of_two(2, max(2, verify_rows)) if verify_rows else ()
        self._verify_graph = torch.compile(self._verify_forward, fullgraph=True, dynamic=True) if verify_rows else None
        # On CUDA, one CUDA graph per bucket, captured at warm-up and replayed from any
        # thread (the decode loop's device thread is not the one that warms up).
        self._cuda_graphs: dict[tuple, _BucketGraph] | None = {} if device.type == "cuda" else None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor, kv_positions: torch.Tensor):
        return self._run(input_ids, positions, BucketStep(positions, write_slots, kv_positions.shape[0]))

    def _verify_forward(self, input_ids, positions, write_slots, read_slots, kv_positions):
        return self._run(input_ids, positions, BucketStep(positions, write_slots, kv_positions.shape[0], read_slots))

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, step: BucketStep):
        cache = BucketDecodeCache(self.plans, self.cache, step)
        if not self.hidden:
            return self.model(input_ids[:, None], position_ids=positions[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
        # The decoder's last hidden state is its final norm's output (what the eager step's norm hook reads), and the LM
        # head over it the logits (transformers' output_hidden_states installs hooks under a lock, which Dynamo cannot
        # trace; a model whose logits are more than its LM head's product fails the start-up check against eager).
        hidden = self.model.model(input_ids[:, None], position_ids=positions[:, None], past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
        return self.model.lm_head(hidden), hidden

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Runs every (batch, KV-length) bucket once with padding rows only (they write
        the scratch slot), then every (rows, KV-length) bucket of the verify graph; returns the seconds it took."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self._cuda_graphs is not None else None
        self._warm("decode", self._graph, self.batch_buckets, 1, pool, started)
        if self._verify_graph is not None:
            self._warm("verify", self._verify_graph, self.verify_buckets, 2, pool, started)  # write and read slots
        return time.perf_counter() - started

    def _warm(self, kind: str, graph, row_buckets: tuple[int, ...], slot_inputs: int, pool, started: float) -> None:
        """Each (rows, KV-length) bucket of one graph once (on CUDA, captured): input ids, positions, slot_inputs
        tensors of slots (every row the scratch slot), the KV-length bucket's positions."""
        device = self._kv_positions.device
        shapes = [(rows, kv_len) for rows in row_buckets for kv_len in self.token_buckets]
        for done, (rows, kv_len) in enumerate(shapes, 1):
            slots = [torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device) for _ in range(slot_inputs)]
            inputs = (torch.zeros(rows, dtype=torch.long, device=device), torch.zeros(rows, dtype=torch.long, device=device), *slots,
                      self._kv_positions[:kv_len])
            if rows > 1:
                # Said outright: left to `dynamic=True`, some models' first graph took the
                # first bucket's rows as fixed (Gemma 2's eager attention) and the next
                # bucket compiled again. One row stays a graph of its own (size 1 specializes).
                for rows_dim in inputs[:-1]:
                    torch._dynamo.mark_dynamic(rows_dim, 0)
            if self._cuda_graphs is None:
                graph(*inputs)
            else:
                self._cuda_graphs[kind, rows, kv_len] = _BucketGraph(graph, inputs, pool)
            log.info("compiled %s bucket %d/%d (rows %d, KV length %d) at %.1fs", kind, done, len(shapes), rows, kv_len, time.perf_counter() - started)

    def logits(self, slots: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor, kv_len: int):
        """[n, vocab] for the n decoding rows (slots ascending), with hidden also their final hidden states [n, width]:
        the step runs over the batch bucket holding the highest slot, then keeps the decoding rows."""
        device = self._kv_positions.device
        rows = bucket_for(self.batch_buckets, int(slots[-1]) + 1)  # on the host: no device sync
        slots = slots.to(device)
        padded_positions = torch.zeros(rows, dtype=torch.long, device=device).index_copy_(0, slots, positions.to(device))
        padded_ids = torch.zeros(rows, dtype=torch.long, device=device).index_copy_(0, slots, input_ids.to(device))
        write_slots = torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device).index_copy_(0, slots, slots)
        kv_positions = self._kv_positions[: bucket_for(self.token_buckets, kv_len)]
        if self._cuda_graphs is not None:
            return _rows(self._cuda_graphs["decode", rows, kv_positions.shape[0]].replay(padded_ids, padded_positions, write_slots), slots)
        return _rows(self._graph(padded_ids, padded_positions, write_slots, kv_positions), slots)


    def verify_logits(self, slots: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor, kv_len: int):
        """[n, vocab] (with hidden, and [n, width]) for a verify step's n rows (a sequence's rows its slot each, at consecutive positions, in order):
        padded to a rows bucket, padding rows writing and reading the scratch slot."""
        n = slots.shape[0]
        if not self.verify_buckets or n > self.verify_buckets[-1]:
            raise ValueError(f"a verify step of {n} rows: the compiled step scores at most {self.verify_buckets[-1] if self.verify_buckets else 0}")
        device = self._kv_positions.device
        rows = bucket_for(self.verify_buckets, n)
        slot_rows = torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device)
        slot_rows[:n] = slots.to(device)
        padded_positions = torch.zeros(rows, dtype=torch.long, device=device)
        padded_positions[:n] = positions.to(device)
        padded_ids = torch.zeros(rows, dtype=torch.long, device=device)
        padded_ids[:n] = input_ids.to(device)
        kv_positions = self._kv_positions[: bucket_for(self.token_buckets, kv_len)]
        if self._cuda_graphs is not None:
            return _rows(self._cuda_graphs["verify", rows, kv_positions.shape[0]].replay(padded_ids, padded_positions, slot_rows, slot_rows), slice(0, n))
        return _rows(self._verify_graph(padded_ids, padded_positions, slot_rows, slot_rows, kv_positions), slice(0, n))


def _rows(out, index):
    """The decoding rows of a graph's output: logits, or (logits, hidden)."""
    return tuple(t[index] for t in out) if isinstance(out, tuple) else out[index]


class _BucketGraph:
    """One bucket's step captured as a CUDA graph: static inputs copied in, replayed, static logits out."""

    def __init__(self, step, inputs: tuple[torch.Tensor, ...], pool):
        self.inputs = inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles and autotunes outside the capture
            for _ in range(2):
                step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = step(*inputs)

    def replay(self, *values: torch.Tensor) -> torch.Tensor:
        """values: the step's tensors, as the graph's first inputs (the KV-length bucket's positions stay as captured)."""
        for static, value in zip(self.inputs, values):
            static.copy_(value)
        self.graph.replay()
        return self.logits  # overwritten by the next replay: the caller indexes a copy out at once

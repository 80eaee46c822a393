"""The backend interface both workers use; `torch` and `neuron` implement it.

Its shape follows NxDI's continuous batching: prefill encodes one sequence;
decode runs one step over the active slots (`seq_ids`), sorted ascending, with
a [batch, 7] sampling-parameter tensor whose first three columns are NxDI's
(top_k, top_p, temperature); a slot's KV lines are written whole before the
slot joins the batch. Tensors cross this interface; token ids (and logprobs)
leave it as tensors so the caller decides when to wait for the device.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.kv_transport.chunk_codec import KvKind

from ..requests import Sampling, TokenLogprobs
from ..sampler import SampleOutput

# Called as on_layer(layer_idx, keys, values) with tensors [kv_heads, tokens, head_dim], as
# each layer's K/V is ready. Defined here, not in the torch backend's slot cache, so that
# the neuron backend (run under NxDI's transformers release) never imports that module.
LayerKvCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    backend: str
    dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_seq_len: int
    # The KV cache in 8 bits (disagg/engine/quantization/kv_cache.py): "int8" or "fp8", with a
    # float32 scale per block of kv_block_size positions and head; "" keeps it in `dtype`.
    kv_cache_dtype: str = ""
    kv_block_size: int = 0
    # The KV's dtype in a backend's own device state where the hand-off carries it in `dtype` (the neuron
    # backend's fp8 cache: "fp8", its e4m3 lines widened exactly); "" otherwise. Reported, so that a pool
    # mixing caches is seen (router.core.model_facts).
    device_kv_dtype: str = ""

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * itemsize

    @property
    def kv_quantized(self) -> bool:
        return bool(self.kv_cache_dtype)

    def kv_block_bytes(self, itemsize: int, block_size: int) -> int:
        """One block of block_size positions over every layer, K and V: the 8-bit codes and their
        scales (4 bytes a head) where the KV is quantized, else itemsize bytes a value."""
        if self.kv_quantized:
            return self.kv_bytes_per_token(1) * block_size + 2 * self.num_layers * self.kv_heads * 4
        return self.kv_bytes_per_token(itemsize) * block_size


# Per layer (keys, values), each [kv_heads, P, head_dim]: the KV of a prompt's first P tokens
# (a prefix cache's hit), which a prefill then attends over instead of computing it again.
PrefixKv = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PrefillResult:
    first_token: int
    # Per layer (keys, values), each [kv_heads, prompt_len - P, head_dim]: the tokens the
    # prefill computed (all of them without prefix_kv; those after the prefix with it).
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    logprobs: TokenLogprobs | None = None  # when sampling.logprobs >= 0


@dataclass
class StepInputs:
    """One decode step over the active slots. Rows are sorted by slot."""

    slots: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64, where each row's input token goes
    input_ids: torch.Tensor  # [n] int64
    params: torch.Tensor  # [n, 7] float32 (top_k, top_p, temperature, min_p, presence, frequency, repetition)
    seeds: torch.Tensor  # [n] int64
    steps: torch.Tensor  # [n] int64, the sampling counter of the token being produced
    kv_len: int  # max(positions) + 1, known on the host
    contiguous_from: int | None  # first slot when slots are one contiguous run
    min_position: int | None = None  # min(positions), known on the host (sliding windows read from it)
    penalized: bool = False  # some row has a penalty: the slots' token counts are read
    top_logprobs: int = -1  # -1: no row wants logprobs; else the most alternatives a row wants
    greedy: bool = False  # every row is greedy (known on the host): the sampler takes the argmax without reading params
    # Some row has a constraint: called after the logits, it returns their [n, ceil(vocab / 32)] int32 bitmask for the sampler.
    token_bitmask: Callable[[], torch.Tensor] | None = None
    # Speculative decoding (disagg/engine/speculation): [n] int64, each row's place among its sequence's rows (0: the
    # input token; j: guess j), the rows of a sequence consecutive; None: one row a sequence. Penalties then count a
    # row's earlier guesses as generated, and only the tokens the sequence keeps join the slot's counts.
    guess_index: torch.Tensor | None = None
    # Called on the device thread once the step's own Python is done and the rest runs without the GIL (native_step.c's
    # one call) by a backend whose signals_launch is true: the decode loop's host work waits for it (decode_loop.py).
    on_launch: Callable[[], None] | None = None


class Backend(abc.ABC):
    info: ModelInfo

    def device_error(self, exc: BaseException) -> BaseException:
        """DeviceLost (from exc) where exc means no later step on this device can be trusted;
        exc itself otherwise. Asked wherever device work failed, also at the host/device sync
        (the decode loop's `.tolist()`), where an asynchronous device's errors surface."""
        return exc

    def unsupported(self, sampling: Sampling) -> list[str]:
        """The Sampling fields this backend cannot serve for this request (none here)."""
        return []

    @abc.abstractmethod
    def prefill(self, token_ids: list[int], sampling: Sampling, on_layer: LayerKvCallback | None = None, first_step: int = 0,
                prefix_kv: PrefixKv | None = None) -> PrefillResult:
        """Encodes one prompt and samples its next token with sampling counter first_step.

        The last first_step of token_ids are tokens generated earlier (a request
        resumed on another worker): penalties count them as generated.

        prefix_kv: the KV of token_ids[:P] (P < len(token_ids)), per layer; the
        prefill then computes only token_ids[P:], attending over the prefix and
        the new tokens (the same logits as a whole prefill, up to rounding), and
        on_layer and the result carry the new tokens' K/V only. Penalties still
        count the whole prompt. A backend that cannot take a prefix raises
        ValueError naming prefix_kv.

        bitmask: [1, ceil(vocab / 32)] int32, the tokens a constraint allows (given only
        for a constrained request, which a backend without constraints refuses).
        """

    @property
    def pages_kv(self) -> bool:
        """Whether the decode cache can be blocks with a table per sequence (allocate_slots with
        num_blocks); otherwise one slot of every position per sequence, its table [slot]."""
        return False

    @property
    def scores_guesses(self) -> bool:
        """Whether a decode step takes several rows of one sequence at consecutive positions (speculation's
        guesses: StepInputs.guess_index), each writing its K/V line and then attending up to its own position."""
        return False

    @property
    def guesses_refusal(self) -> str | None:
        """Why this backend's step does not score guesses (scores_guesses), in a few words; None where it does."""
        return None if self.scores_guesses else "its step takes one row a sequence"

    @abc.abstractmethod
    def allocate_slots(self, num_slots: int, num_blocks: int = 0, block_size: int = 0) -> int:
        """Allocates the decode KV cache once, for num_slots sequences at a time: num_blocks
        blocks of block_size positions (pages_kv only), or 0: a slot per sequence. Returns bytes."""

    @abc.abstractmethod
    def write_kv(self, table: list[int], layer: int, kind: KvKind, token_start: int, tensor: torch.Tensor) -> None:
        """Writes a token range of one layer's K or V, [kv_heads, tokens, head_dim], through a
        sequence's block table (the slot layout: [slot])."""

    def set_block_table(self, slot: int, table: list[int]) -> None:
        """Where a slot's sequence lies in the blocks, before its first step (pages_kv only)."""
        raise NotImplementedError(f"{type(self).__name__} keeps one KV slot per sequence")

    @abc.abstractmethod
    def start_sequence(self, slot: int, prompt_ids: list[int], generated_ids: list[int]) -> None:
        """Sets a slot's token counts as it joins the batch (penalties read them), and whatever else the backend keeps
        of a sequence beside its KV (starts_every_sequence)."""

    @property
    def starts_every_sequence(self) -> bool:
        """Whether every sequence needs start_sequence before its first step, not only a penalized one."""
        return False

    @property
    def tokens_per_step(self) -> int:
        """The most tokens a decode step returns a row. Above 1 (speculation inside the step): token_ids is
        [rows, tokens_per_step], each row's kept tokens first, then -1."""
        return 1

    @property
    def signals_launch(self) -> bool:
        """Whether decode_step calls inputs.on_launch where the rest of its step no longer holds the GIL (else the
        decode loop takes the step as launched when it starts)."""
        return False

    @abc.abstractmethod
    def decode_step(self, inputs: StepInputs) -> SampleOutput:
        """Runs one token-generation step; returns the sampled ids [n] (on the device), and logprobs when asked."""

"""NeuronBackend: the Backend interface on an NxDI model compiled for continuous batching.

- prefill: forward over one prompt with seq_ids=[the spare line]; on-device
  sampling returns token ids; then only the spare line's first prompt-length
  positions are read from the model's device state (per rank) and converted to
  the canonical layout.
- decode: the received K/V lines are written into a free slot of the device
  state (apply_seq_ids_mask keeps running steps off it), from host memory one
  contiguous run at a time; a step runs the active slots with rows sorted by
  seq_id, the sampling rows mapped to what NxDI accepts, position_ids = current
  length - 1 and an attention mask over the positions before it.

Written against NxDI's API (models/config.py, models/model_base.py,
models/application_base.py, utils/hf_adapter.py); run here only through the
stand-in in tests/.
"""

from __future__ import annotations

import logging

import torch

from disagg.kv.codec import KvKind
from ...model_files import eos_token_ids
from ...requests import Sampling
from ...sampler import SampleOutput, params_tensor
from ..base import Backend, LayerKvCallback, ModelInfo, PrefillResult, StepInputs
from .compile import compile_or_load
from .config import DTYPES, NeuronOptions, compiled_lines, prefill_line
from .layout import KvLayout, UnsupportedLayout, sort_rows
from .sampling import nxdi_sampling_params

log = logging.getLogger(__name__)

KV_STATE_KEY = "kv_mgr.past_key_values.{}"  # 2*layer: K, 2*layer+1: V, per rank


def refuse_unconvertible_layout(neuron_config, text_config, seq_len: int) -> None:
    """What the loaded model's own config says about its KV cache, refused where the
    hand-off (canonical [kv_heads, tokens, head_dim] lines per slot) cannot carry it.
    Pass-through settings (NeuronOptions.extra) can set any of these."""
    reasons = []
    if getattr(neuron_config, "k_cache_transposed", False):
        reasons.append("k_cache_transposed (K stored [head_dim, tokens])")
    if getattr(neuron_config, "kv_cache_tiling", False):
        reasons.append("kv_cache_tiling (positions tiled by 128)")
    if getattr(neuron_config, "attention_dp_degree", 1) > 1:
        reasons.append(f"attention_dp_degree {neuron_config.attention_dp_degree} (slots split across data-parallel groups)")
    if getattr(neuron_config, "kv_cache_quant", False) or getattr(neuron_config, "kv_quant_config", None):
        reasons.append("a quantized KV cache")
    attention_dtype = getattr(neuron_config, "attention_dtype", None)
    if attention_dtype is not None and str(attention_dtype).removeprefix("torch.") != str(neuron_config.torch_dtype).removeprefix("torch."):
        reasons.append(f"attention_dtype {attention_dtype} (KV not in the model dtype)")
    window = getattr(text_config, "sliding_window", None)
    if window and window < seq_len:
        reasons.append(f"sliding_window {window} below seq_len {seq_len} (NxDI keeps a rolling cache of {window} positions)")
    if reasons:
        raise UnsupportedLayout("the neuron backend cannot hand off this model's KV cache: " + "; ".join(reasons))


class NeuronBackend(Backend):
    def __init__(self, options: NeuronOptions):
        self.options = options
        self.model, hf_config = compile_or_load(options)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        neuron_config = self.model.config.neuron_config  # what NxDI built, not what we asked for
        refuse_unconvertible_layout(neuron_config, text, options.seq_len)
        heads = text.num_attention_heads
        self.layout = KvLayout(neuron_config.tp_degree, getattr(text, "num_key_value_heads", heads) or heads, heads)
        self.info = ModelInfo(
            name=options.model.rstrip("/").rsplit("/", 1)[-1],
            backend="neuron",
            dtype=options.dtype,
            num_layers=text.num_hidden_layers,
            kv_heads=self.layout.kv_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            vocab_size=text.vocab_size,
            eos_token_ids=eos_token_ids(options.model, text),
            max_seq_len=options.seq_len,
        )
        self._check_state()

    # -- the device state (the KV cache NxDI holds per rank) ---------------------
    def _state(self) -> list[dict]:
        return self.model.context_encoding_model.model.nxd_model.state

    def _caches(self, layer: int, kind: KvKind) -> list[torch.Tensor]:
        key = KV_STATE_KEY.format(2 * layer + (0 if kind is KvKind.KEY else 1))
        return [rank_state[key] for rank_state in self._state()]

    def _check_state(self) -> None:
        """Every rank's K and V for every layer is exactly [lines, heads_per_rank, seq_len,
        head_dim] in the model dtype: the layout the KV conversion assumes."""
        state = self._state()
        if len(state) != self.layout.tp_degree:
            raise UnsupportedLayout(f"NxDI holds {len(state)} ranks of KV state, expected tp_degree {self.layout.tp_degree}")
        expected = (compiled_lines(self.options), self.layout.heads_per_rank, self.options.seq_len, self.info.head_dim)
        dtype = getattr(torch, DTYPES[self.options.dtype])
        for rank, rank_state in enumerate(state):
            for index in range(2 * self.info.num_layers):
                key = KV_STATE_KEY.format(index)
                if key not in rank_state:
                    raise UnsupportedLayout(f"NxDI device state of rank {rank} has no {key!r}; keys: {sorted(rank_state)[:6]}")
                cache = rank_state[key]
                if tuple(cache.shape) != expected or cache.dtype != dtype:
                    raise UnsupportedLayout(f"NxDI's {key} on rank {rank} is {tuple(cache.shape)} {cache.dtype}; the KV hand-off expects {expected} {dtype}")

    # -- Backend ---------------------------------------------------------------
    def prefill(self, token_ids: list[int], sampling: Sampling, on_layer: LayerKvCallback | None = None, first_step: int = 0) -> PrefillResult:
        # NxDI samples with its own device RNG: seeds and first_step do not apply here.
        length, line = len(token_ids), prefill_line(self.options)
        if length > self.options.context_limit:
            raise ValueError(f"a prompt of {length} tokens is over max_context_length {self.options.context_limit}")
        out = self.model.forward(
            input_ids=torch.tensor([token_ids], dtype=torch.int32),
            attention_mask=torch.ones(1, length, dtype=torch.int32),
            position_ids=torch.arange(length, dtype=torch.int32)[None],
            seq_ids=torch.tensor([line], dtype=torch.int32),
            sampling_params=self._sampling_rows(params_tensor([sampling])),  # [1, 3] once mapped
        )
        first = int(out.tokens.reshape(-1)[0])
        layers = []
        for layer in range(self.info.num_layers):
            keys = self.layout.read_line(self._caches(layer, KvKind.KEY), line, length)
            values = self.layout.read_line(self._caches(layer, KvKind.VALUE), line, length)
            layers.append((keys, values))
            if on_layer is not None:
                on_layer(layer, keys, values)
        return PrefillResult(first_token=first, layers=layers)

    def allocate_slots(self, num_slots: int) -> int:
        if num_slots != self.options.batch_size:
            raise ValueError(f"the compiled model has {self.options.batch_size} slots, not {num_slots}")
        return sum(c.numel() * c.element_size() for layer in range(self.info.num_layers) for kind in KvKind for c in self._caches(layer, kind))

    def write_kv(self, slot: int, layer: int, kind: KvKind, token_start: int, tensor: torch.Tensor) -> None:
        self.layout.write_line(self._caches(layer, kind), slot, token_start, tensor)

    def unsupported(self, sampling: Sampling) -> list[str]:
        # NxDI's dynamic on-device sampler takes (top_k, top_p, temperature) per row
        # and returns token ids only: see docs/neuron.md.
        return sampling.features_used()

    def start_sequence(self, slot: int, prompt_ids: list[int], generated_ids: list[int]) -> None:
        """Nothing to keep: no penalty reaches this backend (unsupported refuses them)."""

    def decode_step(self, inputs: StepInputs) -> SampleOutput:
        order, inverse = sort_rows(inputs.slots.tolist())  # the batcher sorts already; NxDI requires it
        slots, positions = inputs.slots[order], inputs.positions[order]
        out = self.model.forward(
            input_ids=inputs.input_ids[order][:, None].to(torch.int32),
            attention_mask=decode_attention_mask(positions, inputs.kv_len),
            position_ids=positions[:, None].to(torch.int32),
            seq_ids=slots.to(torch.int32),
            sampling_params=self._sampling_rows(inputs.params[order]),
        )
        return SampleOutput(out.tokens.reshape(-1).to(torch.long)[inverse])

    def _sampling_rows(self, params: torch.Tensor) -> torch.Tensor:
        return nxdi_sampling_params(params, self.options.global_topk)


def decode_attention_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[n, kv_len - 1]: row i attends the cached positions before positions[i]. NxDI's
    token generation attends the current token on its own (compute_for_token_gen);
    a mask over position p itself would attend that line's stale contents."""
    span = torch.arange(kv_len - 1)
    return (span[None, :] < positions[:, None]).to(torch.int32)


def load_neuron_backend(model: str, dtype: str = "bfloat16", max_seq_len: int = 0, global_topk: int = 0, batch_size: int = 1, **neuron) -> NeuronBackend:
    """Entry point of `--backend neuron` (the options the torch backend takes, plus NeuronOptions')."""
    neuron.pop("device", None)
    options = NeuronOptions(model=model, dtype=dtype, seq_len=max_seq_len or 2048, global_topk=global_topk or 256, batch_size=batch_size, **neuron)
    return NeuronBackend(options)

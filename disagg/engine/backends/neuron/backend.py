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

from disagg.kv_transport.chunk_codec import KvKind

from ...model_files import eos_token_ids
from ...requests import Sampling
from ...sampler import SampleOutput, params_tensor
from ..base import Backend, LayerKvCallback, ModelInfo, PrefillResult, StepInputs
from .compile import build_config, compile_or_load, model_class
from .config import DTYPES, NeuronOptions, compiled_lines, prefill_line
from .faults import classify, device_errors
from .layout import KvLayout, UnsupportedLayout, sort_rows
from .packages import check_nxdi_release, check_seq_ids_mask, check_transformers_for_nxdi
from .sampling import nxdi_sampling_params

log = logging.getLogger(__name__)

KV_STATE_KEY = "kv_mgr.past_key_values.{}"  # 2*layer: K, 2*layer+1: V, per rank
# The fused speculation model (NeuronFusedSpecModel) holds the draft's and the target's models as submodules
# draft_model and target_model (the prefixes application_base.checkpoint_loader_fn gives their weights, _FUSED_PREFIX):
# the target's KV, the one handed off, is under target_model.
FUSED_TARGET_PREFIX = "target_model."
# kv_cache_manager.KV_CACHE_PAD_FOR_SEQ_IDS_MASKING (NxDI 0.7-0.9): with apply_seq_ids_mask,
# KVCacheManager._init_kv_shape adds this many positions, where padded rows write.
SEQ_IDS_MASK_PAD = 128
def refuse_unconvertible_layout(neuron_config, window: int | None, fp8_kv: bool = False) -> None:
    """What the loaded model's own config says about its KV cache, refused where the
    hand-off (canonical [kv_heads, tokens, head_dim] lines per slot) cannot carry it.
    Pass-through settings (NeuronOptions.extra) can set any of these. fp8_kv: --kv-cache-dtype
    fp8 asked for NxDI's fp8 KV cache, a direct cast (lines read back exactly in the model's dtype)."""
    reasons = []
    if getattr(neuron_config, "k_cache_transposed", False):
        reasons.append("k_cache_transposed (K stored [head_dim, tokens])")
    if getattr(neuron_config, "kv_cache_tiling", False):
        reasons.append("kv_cache_tiling (positions tiled by 128)")
    if getattr(neuron_config, "attention_dp_degree", 1) > 1:
        reasons.append(f"attention_dp_degree {neuron_config.attention_dp_degree} (slots split across data-parallel groups)")
    quantized_kv = getattr(neuron_config, "kv_quant_config", None)
    if not fp8_kv and (getattr(neuron_config, "kv_cache_quant", False) or quantized_kv):
        reasons.append("a quantized KV cache not asked for with --kv-cache-dtype fp8")
    elif quantized_kv is not None and (not getattr(quantized_kv, "direct_cast", True)
                                       or getattr(quantized_kv, "quant_dtype", torch.float8_e4m3fn) != torch.float8_e4m3fn):
        # A static scale per tensor, key head or channel (KVCacheManager's k_scales / v_scales) lives in the state, not in the lines.
        reasons.append(f"a quantized KV cache of {getattr(quantized_kv, 'quant_dtype', '?')} with scales (direct_cast "
                       f"{getattr(quantized_kv, 'direct_cast', '?')}): only e4m3 lines cast directly are carried")
    attention_dtype = getattr(neuron_config, "attention_dtype", None)
    if attention_dtype is not None and str(attention_dtype).removeprefix("torch.") != str(neuron_config.torch_dtype).removeprefix("torch."):
        reasons.append(f"attention_dtype {attention_dtype} (KV not in the model dtype)")
    if window:  # config.full_attention_window drops every window that never masks, and refuses the rest
        reasons.append(f"sliding_window {window} (NxDI's windowed cache rolls at position {window - 1})")
    if reasons:
        raise UnsupportedLayout("the neuron backend cannot hand off this model's KV cache: " + "; ".join(reasons))


# -- where the KV cache lives: the one seam between the device and NxDI's CPU mode ----------


class DeviceState:
    """The compiled model on NeuronCores: KV in the NxD model's state, one dict of device
    tensors per rank, shared by the context-encoding and token-generation graphs."""

    def __init__(self, model, num_layers: int):
        # nxd_model.state is a TorchScript attribute: each read builds the list anew, so the
        # handles are taken once (the runtime updates these tensors in place).
        ranks = model.context_encoding_model.model.nxd_model.state
        self.ranks = len(ranks)
        prefix = FUSED_TARGET_PREFIX if getattr(model.config.neuron_config, "enable_fused_speculation", False) else ""
        self._tensors = [[state_tensor(rank_state, rank, index, prefix) for rank, rank_state in enumerate(ranks)] for index in range(2 * num_layers)]

    @staticmethod
    def load(options: NeuronOptions):
        return compile_or_load(options)

    def caches(self, layer: int, kind: KvKind) -> list[torch.Tensor]:
        return self._tensors[2 * layer + (0 if kind is KvKind.KEY else 1)]


class CpuModeState:
    """NxDI's CPU mode (NeuronConfig(on_cpu=True), to_cpu()): the eager model, tp 1 in this
    process. KV lives in each graph's kv_mgr.past_key_values, whose .data NxDI replaces after
    every step (_copy_past_key_values), and the context-encoding and token-generation models
    hold separate parameters until their first step: they are made to share storage here."""

    def __init__(self, model, num_layers: int):
        if model.config.neuron_config.tp_degree != 1:
            raise UnsupportedLayout("NxDI's CPU mode runs here at tp_degree 1 only (higher degrees need one process per rank under torchrun)")
        self.ranks = 1
        context = model.context_encoding_model.model.kv_mgr.past_key_values
        generation = model.token_generation_model.model.kv_mgr.past_key_values
        for shared, other in zip(context, generation):
            other.data = shared.data
        self._parameters = list(context)  # the handles; .data is read per access (replaced every step)
        if len(self._parameters) != 2 * num_layers:
            raise UnsupportedLayout(f"NxDI's CPU model holds {len(self._parameters)} KV tensors, expected {2 * num_layers}")

    @staticmethod
    def load(options: NeuronOptions):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(options.model)
        cls = model_class((hf_config.architectures or ["?"])[0])
        model = cls(options.model, build_config(cls, options))
        model.to_cpu()
        return model, hf_config

    def caches(self, layer: int, kind: KvKind) -> list[torch.Tensor]:
        return [self._parameters[2 * layer + (0 if kind is KvKind.KEY else 1)].data]


def state_tensor(rank_state: dict, rank: int, index: int, prefix: str = "") -> torch.Tensor:
    key = prefix + KV_STATE_KEY.format(index)
    if key not in rank_state:
        raise UnsupportedLayout(f"NxDI device state of rank {rank} has no {key!r}; keys: {sorted(rank_state)[:6]}")
    return rank_state[key]


def kv_state_kind(options: NeuronOptions):
    """NxDI's own on_cpu flag (passed through NeuronOptions.extra) picks its CPU mode."""
    return CpuModeState if options.extra.get("on_cpu") else DeviceState


class NeuronBackend(Backend):
    def __init__(self, options: NeuronOptions):
        self.options = options
        check_transformers_for_nxdi()
        log.info("NxD Inference %s", check_nxdi_release())
        state_kind = kv_state_kind(options)
        self.model, hf_config = state_kind.load(options)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        neuron_config = self.model.config.neuron_config  # what NxDI built, not what we asked for
        check_seq_ids_mask(neuron_config)
        refuse_unconvertible_layout(neuron_config, getattr(self.model.config, "sliding_window", None), fp8_kv=options.kv_cache_dtype == "fp8")
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
            device_kv_dtype=options.kv_cache_dtype or "",
        )
        self.context_buckets = context_buckets(self.model, options.context_limit)
        self.pad_token_id = getattr(self.model.config, "pad_token_id", None) or 0
        self.state = state_kind(self.model, self.info.num_layers)
        self._check_state(neuron_config)

    # -- the device state (the KV cache NxDI holds per rank) ---------------------
    def _caches(self, layer: int, kind: KvKind) -> list[torch.Tensor]:
        return self.state.caches(layer, kind)

    def cache_positions(self, neuron_config) -> int:
        """Positions per line as KVCacheManager._init_kv_shape builds them with no window:
        max_length, plus the seq_ids mask's pad."""
        return (getattr(neuron_config, "max_length", None) or self.options.seq_len) + SEQ_IDS_MASK_PAD

    def _cache_dtype(self) -> torch.dtype:
        """The device state's KV dtype: e4m3 for NxDI's fp8 KV cache, else the model's."""
        return torch.float8_e4m3fn if self.options.kv_cache_dtype == "fp8" else getattr(torch, DTYPES[self.options.dtype])

    def read_line(self, layer: int, kind: KvKind, line: int, length: int) -> torch.Tensor:
        """A line's first `length` positions, canonical, in the model's dtype: an fp8 cache's e4m3 values widened
        (exactly: every e4m3 value is a bf16 and a float32), so the hand-off carries what the cache holds; the
        receiving worker's write_line casts them back to its cache's dtype, the same values."""
        return self.layout.read_line(self._caches(layer, kind), line, length).to(getattr(torch, DTYPES[self.options.dtype]))

    def _check_state(self, neuron_config) -> None:
        """Every rank's K and V for every layer is exactly [lines, heads_per_rank, positions,
        head_dim] in the model dtype (e4m3 for an fp8 KV cache), as NxDI builds it: the layout the KV conversion assumes."""
        if self.state.ranks != self.layout.tp_degree:
            raise UnsupportedLayout(f"NxDI holds {self.state.ranks} ranks of KV state, expected tp_degree {self.layout.tp_degree}")
        expected = (compiled_lines(self.options), self.layout.heads_per_rank, self.cache_positions(neuron_config), self.info.head_dim)
        dtype = self._cache_dtype()
        for layer in range(self.info.num_layers):
            for kind in KvKind:
                for rank, cache in enumerate(self._caches(layer, kind)):
                    if tuple(cache.shape) != expected or cache.dtype != dtype:
                        raise UnsupportedLayout(
                            f"NxDI's layer {layer} {kind.name} cache on rank {rank} is {tuple(cache.shape)} {cache.dtype}; "
                            f"the KV hand-off expects {expected} {dtype}"
                        )

    # -- Backend ---------------------------------------------------------------
    @device_errors()  # a fatal Neuron runtime status raises DeviceLost: the worker drains and exits (faults.py)
    def prefill(self, token_ids: list[int], sampling: Sampling, on_layer: LayerKvCallback | None = None, first_step: int = 0,
                prefix_kv=None) -> PrefillResult:
        if prefix_kv is not None:  # NxDI's context encoding runs whole prompts: prefix caching is off on this backend
            raise ValueError("prefix_kv: the neuron backend prefills whole prompts (NxDI's context encoding takes no cached prefix)")
        # NxDI samples with its own device RNG: seeds and first_step do not apply here.
        length, line = len(token_ids), prefill_line(self.options)
        first = self._encode_context(token_ids, line, sampling)
        layers = []
        for layer in range(self.info.num_layers):
            keys = self.read_line(layer, KvKind.KEY, line, length)
            values = self.read_line(layer, KvKind.VALUE, line, length)
            layers.append((keys, values))
            if on_layer is not None:
                on_layer(layer, keys, values)
        return PrefillResult(first_token=first, layers=layers)

    def _encode_context(self, token_ids: list[int], line: int, sampling: Sampling) -> int:
        """NxDI's context encoding of token_ids into KV line `line` (with fused speculation the draft's line too);
        the token it samples."""
        length = len(token_ids)
        if length > self.options.context_limit:
            raise ValueError(f"a prompt of {length} tokens is over max_context_length {self.options.context_limit}")
        input_ids, attention_mask, position_ids = bucket_padded_prompt(token_ids, self.context_bucket(length), self.pad_token_id)
        out = self.model.forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            seq_ids=torch.tensor([line], dtype=torch.int32),
            sampling_params=self._sampling_rows(params_tensor([sampling])),  # [1, 3] once mapped
        )
        return int(step_tokens(out)[0, 0])

    def context_bucket(self, length: int) -> int:
        """The context-encoding bucket NxDI's ModelWrapper.get_target_bucket picks ("first_fit")."""
        fitting = [bucket for bucket in self.context_buckets if bucket >= length]
        if not fitting:
            raise ValueError(f"a prompt of {length} tokens is over the last context-encoding bucket {self.context_buckets[-1]}")
        return fitting[0]

    def allocate_slots(self, num_slots: int, num_blocks: int = 0, block_size: int = 0) -> int:
        # NxDI's block KV layout (is_block_kv_layout) is not wired through this backend yet: one slot per sequence.
        if num_blocks:
            raise ValueError("the neuron backend keeps one KV slot per sequence (no block tables)")
        if num_slots != self.options.batch_size:
            raise ValueError(f"the compiled model has {self.options.batch_size} slots, not {num_slots}")
        return sum(c.numel() * c.element_size() for layer in range(self.info.num_layers) for kind in KvKind for c in self._caches(layer, kind))

    def device_error(self, exc: BaseException) -> BaseException:
        """A fatal Neuron runtime status is DeviceLost (faults.py), wherever it surfaced."""
        return classify(exc)

    @device_errors()
    def write_kv(self, table: list[int], layer: int, kind: KvKind, token_start: int, tensor: torch.Tensor) -> None:
        (slot,) = table  # the slot layout: a sequence's table is its slot
        self.layout.write_line(self._caches(layer, kind), slot, token_start, tensor)

    def unsupported(self, sampling: Sampling) -> list[str]:
        # NxDI's dynamic on-device sampler takes (top_k, top_p, temperature) per row
        # and returns token ids only: see docs/neuron.md.
        return sampling.features_used()

    @property
    def starts_every_sequence(self) -> bool:
        return self.options.speculates

    @device_errors()
    def start_sequence(self, slot: int, prompt_ids: list[int], generated_ids: list[int]) -> None:
        """No penalty reaches this backend (unsupported refuses them). With fused speculation the draft needs its K/V
        of the sequence, which the hand-off does not carry (it carries the target's layers, as ModelInfo describes
        them): NxDI's fused context encoding recomputes it into the slot's own line, the draft's and the target's
        together (the target's from the same tokens as the prefill worker's). Its token is dropped: the sequence
        goes on from the prefill worker's. The context is the tokens behind the KV: the prompt, then those
        generated before the newest (the first decode step's input)."""
        if self.options.speculates:
            self._encode_context([*prompt_ids, *generated_ids[:-1]], slot, Sampling())

    @device_errors()
    def decode_step(self, inputs: StepInputs) -> SampleOutput:
        order, inverse = sort_rows(inputs.slots.tolist())  # the decode loop sorts already; NxDI requires it
        slots, positions = inputs.slots[order], inputs.positions[order]
        out = self.model.forward(
            input_ids=inputs.input_ids[order][:, None].to(torch.int32),
            attention_mask=decode_attention_mask(positions, inputs.kv_len),
            position_ids=positions[:, None].to(torch.int32),
            seq_ids=slots.to(torch.int32),
            sampling_params=self._sampling_rows(inputs.params[order]),
        )
        tokens = step_tokens(out)[inverse]
        # One token a row; a fused speculation step's rows keep their accepted tokens, then NxDI's padding (-1).
        return SampleOutput(tokens if self.options.speculates else tokens[:, 0])

    @property
    def tokens_per_step(self) -> int:
        """The most tokens a decode step returns a row: 1, or NxDI's speculation_length with fused speculation
        (SampleOutput.token_ids then [rows, speculation_length], docs/neuron.md#speculation)."""
        return self.options.speculation_length if self.options.speculates else 1

    def _sampling_rows(self, params: torch.Tensor) -> torch.Tensor:
        return nxdi_sampling_params(params, self.options.global_topk)


def step_tokens(out) -> torch.Tensor:
    """[rows, k] int64 token ids of a step: out.tokens ([rows] or [rows, 1]) with k = 1; with fused speculation
    NxDI's out.fused_outputs[0] (NeuronFusedSpecModel._cte_postprocessor / _tkg_postprocessor): each row's accepted
    tokens, the target's, first, then acceptance_padding_token (-1), k = speculation_length. The number a row keeps is
    its count of tokens before the first -1 (fused_outputs[3], next_pos_ids, minus the step's position_ids, says the same)."""
    fused = getattr(out, "fused_outputs", None)
    tokens = out.tokens.reshape(-1, 1) if fused is None else fused[0]
    return tokens.to(torch.long)


def context_buckets(model, context_limit: int) -> list[int]:
    """The context-encoding buckets NxDI built (enable_context_encoding: generate_buckets_for_cte)."""
    buckets = getattr(model.context_encoding_model.neuron_config, "buckets", None) or [context_limit]
    return sorted(int(bucket) for bucket in buckets)


def bucket_padded_prompt(token_ids: list[int], bucket: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[1, bucket] input_ids, attention_mask and position_ids, padded here rather than by NxDI.

    NxDI's ModelWrapper.pad_inputs pads position_ids with 1, and the context-encoding model
    takes the hidden state at torch.max(position_ids, dim=1).indices (NeuronBaseModel.forward):
    for a one-token prompt that is the first pad. Pads at position 0 keep the maximum on the
    last real token, alone for two tokens or more, and for one token tied with the pads, where
    torch.max gives the first index (as NxDI's own two-token prompts rely on). The minimum
    stays 0, so the step is still a prefill (_is_prefill); the causal mask keeps the pads out
    of the real rows, and their KV lands past the prompt, where nothing reads it."""
    length, pad = len(token_ids), bucket - len(token_ids)
    input_ids = torch.tensor([list(token_ids) + [pad_token_id] * pad], dtype=torch.int32)
    attention_mask = torch.tensor([[1] * length + [0] * pad], dtype=torch.int32)
    position_ids = torch.tensor([list(range(length)) + [0] * pad], dtype=torch.int32)
    return input_ids, attention_mask, position_ids


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

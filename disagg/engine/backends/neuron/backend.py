"""NeuronBackend: the Backend interface on an NxDI model compiled for continuous batching.

- prefill: forward over one prompt with seq_ids=[slot]; on-device sampling
  returns token ids; then the slot's K/V lines are read from the model's
  device state (per rank) and converted to the canonical layout.
- decode: the received K/V lines are written into a free slot of the device
  state (apply_seq_ids_mask keeps running steps off it); a step runs the active
  slots with rows sorted by seq_id, the [batch, 3] sampling parameters and
  position_ids = current length - 1.

Written against NxDI's API (models/config.py, models/model_base.py,
utils/hf_adapter.py); run here only through the stand-in in tests/.
"""

from __future__ import annotations

import logging

import torch

from ...kv_wire import KvKind
from ...model_files import eos_token_ids
from ...requests import Sampling
from ...sampler import params_tensor
from ..base import Backend, ModelInfo, PrefillResult, StepInputs
from ..slot_attention import LayerKvCallback
from .config import MODEL_CLASSES, NeuronOptions, compiled_path, neuron_config_kwargs
from .layout import KvLayout, sort_rows
from .packages import import_nxdi

log = logging.getLogger(__name__)

KV_STATE_KEY = "kv_mgr.past_key_values.{}"  # 2*layer: K, 2*layer+1: V, per rank


def model_class(architecture: str):
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"the neuron backend has no NxDI model class for {architecture}; supported: {', '.join(sorted(MODEL_CLASSES))}")
    module, name = MODEL_CLASSES[architecture]
    return getattr(import_nxdi(module), name)


def compile_or_load(options: NeuronOptions):
    """The loaded NxDI model: compiled once into its own directory, loaded from it after."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(options.model)
    cls = model_class((hf_config.architectures or ["?"])[0])
    nxdi_config = import_nxdi("neuronx_distributed_inference.models.config")
    hf_adapter = import_nxdi("neuronx_distributed_inference.utils.hf_adapter")
    sampling = nxdi_config.OnDeviceSamplingConfig(dynamic=True, do_sample=True, global_topk=options.global_topk)
    neuron_config = nxdi_config.NeuronConfig(**neuron_config_kwargs(options, sampling))
    config = cls.get_config_cls()(neuron_config, load_config=hf_adapter.load_pretrained_config(options.model))
    path = compiled_path(options)
    if not (path / "neuron_config.json").exists():
        log.info("compiling %s for Neuron into %s (once per configuration)", options.model, path)
        cls(options.model, config).compile(str(path))
    model = cls(options.model, config)
    model.load(str(path))
    return model, hf_config


class NeuronBackend(Backend):
    def __init__(self, options: NeuronOptions):
        self.options = options
        self.model, hf_config = compile_or_load(options)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = text.num_attention_heads
        self.layout = KvLayout(options.tp_degree, getattr(text, "num_key_value_heads", heads) or heads, heads, options.k_cache_transposed)
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
        state = self._state()
        if len(state) != self.options.tp_degree:
            raise RuntimeError(f"NxDI holds {len(state)} ranks of KV state, expected tp_degree {self.options.tp_degree}")
        first = KV_STATE_KEY.format(0)
        if first not in state[0]:
            raise RuntimeError(f"NxDI device state has no {first!r}; keys: {sorted(state[0])[:6]}")
        heads = state[0][first].shape[1]
        if heads != self.layout.heads_per_rank:
            raise RuntimeError(f"NxDI cache holds {heads} KV heads per rank; the layout expects {self.layout.heads_per_rank}")

    # -- Backend ---------------------------------------------------------------
    def prefill(self, token_ids: list[int], sampling: Sampling, on_layer: LayerKvCallback | None = None, first_step: int = 0) -> PrefillResult:
        # NxDI samples with its own device RNG: seeds and first_step do not apply here.
        slot, length = 0, len(token_ids)
        out = self.model.forward(
            input_ids=torch.tensor([token_ids], dtype=torch.int32),
            attention_mask=torch.ones(1, length, dtype=torch.int32),
            position_ids=torch.arange(length, dtype=torch.int32)[None],
            seq_ids=torch.tensor([slot], dtype=torch.int32),
            sampling_params=params_tensor([sampling]),  # [1, 3]: top_k, top_p, temperature
        )
        first = int(out.tokens.reshape(-1)[0])
        layers = []
        for layer in range(self.info.num_layers):
            keys = self.layout.read_line([c.to("cpu") for c in self._caches(layer, KvKind.KEY)], slot, length, is_key=True)
            values = self.layout.read_line([c.to("cpu") for c in self._caches(layer, KvKind.VALUE)], slot, length, is_key=False)
            layers.append((keys, values))
            if on_layer is not None:
                on_layer(layer, keys, values)
        return PrefillResult(first_token=first, layers=layers)

    def allocate_slots(self, num_slots: int) -> int:
        if num_slots != self.options.batch_size:
            raise ValueError(f"the compiled model has {self.options.batch_size} slots, not {num_slots}")
        return sum(c.numel() * c.element_size() for layer in range(self.info.num_layers) for kind in KvKind for c in self._caches(layer, kind))

    def write_kv(self, slot: int, layer: int, kind: KvKind, token_start: int, tensor: torch.Tensor) -> None:
        self.layout.write_line(self._caches(layer, kind), slot, token_start, tensor, is_key=kind is KvKind.KEY)

    def decode_step(self, inputs: StepInputs) -> torch.Tensor:
        order, inverse = sort_rows(inputs.slots.tolist())  # the batcher sorts already; NxDI requires it
        slots, positions = inputs.slots[order], inputs.positions[order]
        span = torch.arange(inputs.kv_len)
        out = self.model.forward(
            input_ids=inputs.input_ids[order][:, None].to(torch.int32),
            attention_mask=(span[None, :] <= positions[:, None]).to(torch.int32),
            position_ids=positions[:, None].to(torch.int32),
            seq_ids=slots.to(torch.int32),
            sampling_params=inputs.params[order],
        )
        return out.tokens.reshape(-1).to(torch.long)[inverse]


def load_neuron_backend(model: str, dtype: str = "bfloat16", max_seq_len: int = 0, global_topk: int = 0, batch_size: int = 1, **neuron) -> NeuronBackend:
    """Entry point of `--backend neuron` (the options the torch backend takes, plus NeuronOptions')."""
    neuron.pop("device", None)
    options = NeuronOptions(model=model, dtype=dtype, seq_len=max_seq_len or 2048, global_topk=global_topk or 256, batch_size=batch_size, **neuron)
    return NeuronBackend(options)

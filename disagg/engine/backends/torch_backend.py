"""The portable backend: any transformers decoder-only checkpoint, on CPU or CUDA.

The model itself is untouched; `slot_attention` owns its KV cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..kv_wire import KvKind, dtype_name
from ..model_files import eos_token_ids
from ..requests import Sampling
from ..sampler import params_tensor, sample
from .base import Backend, ModelInfo, PrefillResult, StepInputs
from .slot_attention import ATTN_IMPLEMENTATION, DecodeContext, LayerKvCallback, PrefillContext, SlotKvCache

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class TorchBackendConfig:
    model: str
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_seq_len: int = 0  # 0: the model's max_position_embeddings, capped at 4096
    global_topk: int = 0  # 0: sample over the whole vocabulary

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


def describe(model_path: str, config, backend: str, dtype: torch.dtype, max_seq_len: int) -> ModelInfo:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text_config.num_attention_heads
    limit = getattr(text_config, "max_position_embeddings", None) or 4096
    return ModelInfo(
        name=model_path.rstrip("/").rsplit("/", 1)[-1] if "/" in model_path else model_path,
        backend=backend,
        dtype=dtype_name(dtype),
        num_layers=text_config.num_hidden_layers,
        kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
        vocab_size=text_config.vocab_size,
        eos_token_ids=eos_token_ids(model_path, text_config),
        max_seq_len=min(max_seq_len or min(limit, 4096), limit),
    )


class TorchBackend(Backend):
    def __init__(self, config: TorchBackendConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        hf_config = AutoConfig.from_pretrained(config.model)
        self.info = describe(config.model, hf_config, "torch", self.dtype, config.max_seq_len)
        self.model = AutoModelForCausalLM.from_pretrained(config.model, dtype=self.dtype, attn_implementation=ATTN_IMPLEMENTATION)
        self.model.to(self.device).eval()
        self.cache: SlotKvCache | None = None

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], sampling: Sampling, on_layer: LayerKvCallback | None = None, first_step: int = 0) -> PrefillResult:
        layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep_layer(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            layers[layer] = (keys, values)
            if on_layer is not None:
                on_layer(layer, keys, values)

        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, L]
        positions = torch.arange(len(token_ids), device=self.device)[None]  # [1, L]
        out = self.model(input_ids, position_ids=positions, use_cache=False, logits_to_keep=1, slot_attention=PrefillContext(keep_layer))
        first = sample(
            out.logits[:, -1],  # [1, vocab]
            params_tensor([sampling], self.device),
            torch.tensor([sampling.seed], device=self.device),
            torch.full((1,), first_step, dtype=torch.long, device=self.device),
            self.config.global_topk,
        )
        return PrefillResult(first_token=int(first[0]), layers=[layers[i] for i in range(self.info.num_layers)])

    def allocate_slots(self, num_slots: int) -> int:
        info = self.info
        self.cache = SlotKvCache.allocate(info.num_layers, num_slots, info.kv_heads, info.max_seq_len, info.head_dim, self.dtype, self.device)
        return self.cache.nbytes

    def write_kv(self, slot: int, layer: int, kind: KvKind, token_start: int, tensor: torch.Tensor) -> None:
        target = (self.cache.keys if kind is KvKind.KEY else self.cache.values)[layer]
        target[slot, :, token_start : token_start + tensor.shape[1]].copy_(tensor)

    @torch.inference_mode()
    def decode_step(self, inputs: StepInputs) -> torch.Tensor:
        ctx = DecodeContext(self.cache, inputs.slots, inputs.positions, inputs.kv_len, inputs.contiguous_from)
        out = self.model(inputs.input_ids[:, None], position_ids=inputs.positions[:, None], use_cache=False, slot_attention=ctx)
        return sample(out.logits[:, -1], inputs.params, inputs.seeds, inputs.steps, self.config.global_topk)

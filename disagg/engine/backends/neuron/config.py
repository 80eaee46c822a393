"""Our worker configuration -> NxDI's NeuronConfig, and where the compiled artifacts live."""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import asdict, dataclass, field

# Checkpoint architecture -> NxDI model class (module, class).
MODEL_CLASSES = {
    "LlamaForCausalLM": ("neuronx_distributed_inference.models.llama.modeling_llama", "NeuronLlamaForCausalLM"),
    "MistralForCausalLM": ("neuronx_distributed_inference.models.mistral.modeling_mistral", "NeuronMistralForCausalLM"),
    "Qwen2ForCausalLM": ("neuronx_distributed_inference.models.qwen2.modeling_qwen2", "NeuronQwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("neuronx_distributed_inference.models.qwen3.modeling_qwen3", "NeuronQwen3ForCausalLM"),
    "MixtralForCausalLM": ("neuronx_distributed_inference.models.mixtral.modeling_mixtral", "NeuronMixtralForCausalLM"),
}

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "float32": "float32", "fp32": "float32"}


@dataclass(frozen=True)
class NeuronOptions:
    """What a worker asks of NxDI; every field here goes into the compiled artifacts' key."""

    model: str
    tp_degree: int = 1
    batch_size: int = 1  # decode slots (a prefill worker uses 1)
    seq_len: int = 2048  # prompt + generated tokens
    max_context_length: int = 0  # longest prompt; 0: seq_len
    dtype: str = "bfloat16"
    context_buckets: tuple[int, ...] = ()  # () with bucketing: NxDI's powers of two
    token_buckets: tuple[int, ...] = ()
    enable_bucketing: bool = True
    async_mode: bool = True
    global_topk: int = 256
    k_cache_transposed: bool = False
    compiled_root: str = ""  # default: ~/.cache/disagg/neuron
    extra: dict = field(default_factory=dict)  # other NeuronConfig keyword arguments, passed through

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.tp_degree < 1 or self.batch_size < 1:
            raise ValueError("tp_degree and batch_size must be at least 1")
        if self.max_context_length > self.seq_len:
            raise ValueError(f"max_context_length {self.max_context_length} is over seq_len {self.seq_len}")
        for name, buckets in (("context", self.context_buckets), ("token-generation", self.token_buckets)):
            if buckets and (list(buckets) != sorted(buckets) or buckets[-1] > self.seq_len):
                raise ValueError(f"{name} buckets {list(buckets)} must be ascending and at most seq_len {self.seq_len}")


def neuron_config_kwargs(options: NeuronOptions, on_device_sampling) -> dict:
    """Keyword arguments for NeuronConfig: continuous batching, one prompt per context
    encoding, dynamic on-device sampling, the seq_ids mask, async mode."""
    kwargs = dict(
        tp_degree=options.tp_degree,
        batch_size=options.batch_size,
        ctx_batch_size=1,
        tkg_batch_size=options.batch_size,
        max_batch_size=options.batch_size,
        seq_len=options.seq_len,
        max_context_length=options.max_context_length or options.seq_len,
        torch_dtype=DTYPES[options.dtype],
        is_continuous_batching=True,
        # A slot receiving KV must not be written by the decode steps running beside it.
        apply_seq_ids_mask=True,
        on_device_sampling_config=on_device_sampling,
        async_mode=options.async_mode,
        enable_bucketing=options.enable_bucketing,
        k_cache_transposed=options.k_cache_transposed,
    )
    if options.context_buckets:
        kwargs["context_encoding_buckets"] = list(options.context_buckets)
    if options.token_buckets:
        kwargs["token_generation_buckets"] = list(options.token_buckets)
    kwargs.update(options.extra)
    return kwargs


def compiled_path(options: NeuronOptions) -> pathlib.Path:
    """A directory per distinct configuration: a changed config compiles into a new
    directory and never over a stale one."""
    key = hashlib.sha256(json.dumps(asdict(options), sort_keys=True, default=str).encode()).hexdigest()[:16]
    root = pathlib.Path(options.compiled_root) if options.compiled_root else pathlib.Path.home() / ".cache" / "disagg" / "neuron"
    name = pathlib.Path(options.model.rstrip("/")).name or "model"
    return root / f"{name}-tp{options.tp_degree}-b{options.batch_size}-s{options.seq_len}-{key}"

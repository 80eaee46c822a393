"""Stand-in for neuronx_distributed_inference.models.config (see the package docstring).

Only the fields the adapter sets or the KV layout depends on; each default and
each assert below is the one NeuronConfig.__init__ in NxDI's models/config.py has.
"""

from __future__ import annotations

import json
import pathlib

CONFIG_FILE = "neuron_config.json"  # NxDI models/config.py CONFIG_FILE


class OnDeviceSamplingConfig:
    def __init__(self, **kwargs):
        self.do_sample = kwargs.pop("do_sample", False)
        self.dynamic = kwargs.pop("dynamic", False)
        self.global_topk = kwargs.pop("global_topk", 256)
        self.deterministic = kwargs.pop("deterministic", False)


class NeuronConfig:
    def __init__(self, **kwargs):
        self.kwargs = dict(kwargs)  # what the caller asked for, for the tests to read
        self.tp_degree = kwargs.pop("tp_degree", 1)
        self.batch_size = kwargs.pop("batch_size", 1)
        self.ctx_batch_size = kwargs.pop("ctx_batch_size", self.batch_size)
        self.tkg_batch_size = kwargs.pop("tkg_batch_size", self.batch_size)
        self.max_batch_size = kwargs.pop("max_batch_size", self.batch_size)
        self.seq_len = kwargs.pop("seq_len", 128)
        self.max_length = kwargs.pop("max_length", self.seq_len)
        self.max_context_length = kwargs.pop("max_context_length", self.seq_len)
        # NeuronConfig.__init__: "max_context_length cannot be more than max_length"
        assert self.max_context_length <= self.max_length, "max_context_length cannot be more than max_length"
        self.torch_dtype = kwargs.pop("torch_dtype", "bfloat16")
        self.attention_dtype = kwargs.pop("attention_dtype", None)
        self.is_continuous_batching = kwargs.pop("is_continuous_batching", False)
        self.apply_seq_ids_mask = kwargs.pop("apply_seq_ids_mask", False)
        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", None)
        self.async_mode = kwargs.pop("async_mode", False)
        self.save_sharded_checkpoint = kwargs.pop("save_sharded_checkpoint", False)
        # KV cache (NeuronConfig.__init__; KVCacheManager._init_kv_shape reads these)
        self.kv_cache_batch_size = kwargs.pop("kv_cache_batch_size", self.batch_size)
        self.kv_cache_padding_size = kwargs.pop("kv_cache_padding_size", 0)
        self.kv_cache_quant = kwargs.pop("kv_cache_quant", False)
        self.kv_quant_config = kwargs.pop("kv_quant_config", None)
        self.attention_dp_degree = kwargs.pop("attention_dp_degree", 1)
        self.kv_cache_tiling = kwargs.pop("kv_cache_tiling", False)
        self.k_cache_transposed = kwargs.pop("k_cache_transposed", False)
        if self.attention_dp_degree > 1:  # NeuronConfig: one KV batch per data-parallel attention group
            self.kv_cache_batch_size = self.tkg_batch_size // self.attention_dp_degree
        # Bucketing: NeuronConfig.__init__ sorts the lists and asserts their ends.
        self.enable_bucketing = kwargs.pop("enable_bucketing", False)
        self.context_encoding_buckets = kwargs.pop("context_encoding_buckets", None)
        self.token_generation_buckets = kwargs.pop("token_generation_buckets", None)
        if self.context_encoding_buckets is not None:
            self.context_encoding_buckets.sort()
            assert self.context_encoding_buckets[-1] <= self.max_context_length, (
                f"Context bucket {self.context_encoding_buckets[-1]} should be <= {self.max_context_length}")
        if self.token_generation_buckets is not None:
            self.token_generation_buckets.sort()
            assert self.token_generation_buckets[-1] <= self.max_length, (
                f"Token generation bucket {self.token_generation_buckets[-1]} should be <= {self.max_length}")
        for key, value in kwargs.items():  # everything else passes through untouched
            setattr(self, key, value)


class MoENeuronConfig(NeuronConfig):
    """NxDI models/config.py MoENeuronConfig: the fields NxDI's MoE modules read."""

    def __init__(self, capacity_factor=None, glu_mlp=True, **kwargs):
        self.capacity_factor = float(capacity_factor) if capacity_factor is not None else None
        self.glu_mlp = glu_mlp
        self.glu_type = kwargs.pop("glu_type", "glu")
        self.moe_mask_padded_tokens = kwargs.pop("moe_mask_padded_tokens", False)
        super().__init__(**kwargs)


class InferenceConfig:
    def __init__(self, neuron_config, load_config=None, **kwargs):
        self.neuron_config = neuron_config
        if load_config is not None:
            load_config(self)
        for key, value in kwargs.items():
            setattr(self, key, value)

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig

    def save(self, model_path):
        """InferenceConfig.save: neuron_config.json in the compiled directory."""
        path = pathlib.Path(model_path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.neuron_config.kwargs, default=str))

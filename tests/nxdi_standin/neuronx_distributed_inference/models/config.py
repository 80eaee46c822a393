"""Stand-in for neuronx_distributed_inference.models.config (see the package docstring).

Only the fields the adapter sets or the KV layout depends on are modelled; each
default and each check below is the one NxDI 0.9.0's models/config.py has:

- NeuronConfig.__init__ pops the keyword arguments it knows and drops the rest with
  one log line ("NeuronConfig init: Unexpected keyword arguments: ..."), in every
  release from 0.3 to 0.9. apply_seq_ids_mask is known from 0.4 (release 2.22) on:
  before, it is one of the dropped arguments and the config has no such attribute.
- Weight quantization (NeuronConfig.__init__ and _verify_quantized_config): quantized=True
  asserts a quantized_checkpoints_path (its existence is checked only when the weights are
  read: application_base.checkpoint_loader_fn); quantization_dtype must name a member of NxD's
  QuantizedDtype (upper-cased); quantization_type is read later (QuantizationType, when the
  model is converted or the state dict quantized); no modules_to_not_convert warns that
  every module will be quantized. Same in 0.7.0 and 0.8.0.
- InferenceConfig.__init__ runs load_config, then the keyword overrides, then
  add_derived_config, then validate_config, which asserts every attribute of the
  model's get_required_attributes() is set ("Config must define [...]").
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
import warnings

import torch

CONFIG_FILE = "neuron_config.json"  # NxDI models/config.py CONFIG_FILE

# The NeuronConfig keyword arguments NxDI 0.9.0 knows but the stand-in does not model:
# set as attributes (NxDI reads each of them somewhere), never dropped.
KNOWN_UNMODELLED = frozenset("""
    activation_quantization_type allow_input_truncation attn_block_cte_nki_kernel_enabled attn_block_tkg_nki_kernel_cache_update
    attn_block_tkg_nki_kernel_cascaded_attention attn_block_tkg_nki_kernel_disable_gpsimd_sb2sb attn_block_tkg_nki_kernel_enabled
    attn_block_tkg_nki_kernel_use_online_softmax attn_cls attn_kernel_enabled attn_tkg_builtin_kernel_enabled attn_tkg_nki_kernel_enabled
    bucket_n_active_tokens buckets cast_type cc_pipeline_tiling_factor chunked_prefill_config cp_degree disable_argmax_kernel
    disable_kv_cache_tiling disable_numeric_cc_token dma_order_config eagle_rolling_buffer_kernel_enabled
    enable_cte_modular_flow enable_eagle_draft_input_norm enable_eagle_speculation enable_fused_speculation enable_output_completion_notifications
    enable_spill_reload_dge enable_ve_data_parallel ep_degree ep_dispatch_cc_option expert_mlp_nki_kernel_enabled flash_decoding_enabled
    fused_qkv fused_rmsnorm_skip_gamma is_block_kv_layout is_eagle3 is_eagle_draft is_full_model_shuffled is_medusa is_mxfp4_compute
    is_prefix_caching layer_boundary_markers lm_head_pad lm_head_pad_alignment_size local_ranks_size logical_nc_config logical_neuron_cores
    lora_config max_new_tokens medusa_speculation_length medusa_tree mlp_cp_degree mlp_kernel_enabled mlp_kernel_fuse_residual_add
    mlp_tkg_nki_kernel_enabled moe_fused_nki_kernel_enabled n_active_tokens n_positions num_medusa_heads on_cpu
    out_proj_kernel_enabled output_logits pa_block_size pa_num_blocks padded_hidden_size padded_intermediate_size padding_side pp_degree
    pre_rope_rmsnorm prefix_buckets qk_layernorm qkv_cte_nki_kernel_fuse_rope qkv_kernel_enabled qkv_kernel_fuse_residual_add
    qkv_kernel_nbsd_layout qkv_nki_kernel_enabled quantize_clamp_bound quantized_mlp_kernel_enabled rmsnorm_quantize_kernel_enabled
    router_topk_nki_kernel_enabled rpl_reduce_dtype scratchpad_page_size seq_len_threshold_for_cc_tiling sequence_parallel_enabled
    shared_mlp_nki_kernel_enabled skip_sharding skip_warmup spec_batch_size speculation_length start_rank_id strided_context_parallel_kernel_enabled
    switch_cc target tensor_capture_config tensor_replacement_config token_generation_batches token_tree_config vocab_parallel
    weight_gather_seq_len_threshold weights_to_skip_layout_optimization windowed_context_encoding_size world_size
""".split())
# neuronx_distributed.quantization.quantization_config.QuantizedDtype.__members__ (NxD 2.29, torch >= 2.1;
# the aliases F8E4M3FN and F8E5M2_X4 included): what has_dtype accepts, upper-cased.
QUANTIZED_DTYPES = frozenset({"INT8", "F8E4M3", "F8E4M3FN", "F8E5M2", "F4E2M1FN_X4", "F8E4M3FN_X4", "F8E5M2_X4"})
SEQ_IDS_MASK_SINCE = (0, 4)  # NeuronConfig pops apply_seq_ids_mask from 0.4.7422 (release 2.22) on; 0.3.5591 does not


def release() -> tuple[int, int]:
    """(major, minor) of the stand-in's NxDI version, read when a config is built so a
    test can set neuronx_distributed_inference.__version__ to an older release."""
    import neuronx_distributed_inference as package

    major, minor = re.match(r"(\d+)\.(\d+)", package.__version__).groups()
    return int(major), int(minor)


class KVQuantizationConfig:
    """NxD's quantization_config.KVQuantizationConfig (0.8 on): per tensor, e4m3, a direct cast by default; a direct
    cast asserts per-tensor keys and values (no scales to apply)."""

    def __init__(self, **kwargs):
        self.k_quant_method = kwargs.pop("k_quant_method", "per_tensor_symmetric")
        self.v_quant_method = kwargs.pop("v_quant_method", "per_tensor_symmetric")
        self.quant_dtype = kwargs.pop("quant_dtype", torch.float8_e4m3fn)
        self.direct_cast = kwargs.pop("direct_cast", True)
        if self.direct_cast:
            assert self.k_quant_method == "per_tensor_symmetric" and self.v_quant_method == "per_tensor_symmetric", (
                "When using direct cast both K and V quantization strategies must be PER_TENSOR_SYMMETRIC")


def to_torch_dtype(name) -> torch.dtype:
    """NxDI's to_torch_dtype: "bfloat16" / "torch.bfloat16" -> torch.bfloat16."""
    return name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."))


class OnDeviceSamplingConfig:
    def __init__(self, **kwargs):
        self.do_sample = kwargs.pop("do_sample", False)
        self.top_k = kwargs.pop("top_k", 1)
        self.top_p = kwargs.pop("top_p", 1.0)
        self.temperature = kwargs.pop("temperature", 1.0)
        self.dynamic = kwargs.pop("dynamic", False)
        self.deterministic = kwargs.pop("deterministic", False)
        self.global_topk = kwargs.pop("global_topk", 256)


class NeuronConfig:
    def __init__(self, **kwargs):
        self.kwargs = dict(kwargs)  # stand-in only: what the caller asked for, for the tests to read
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
        self._pop_dtypes(kwargs)
        self.is_continuous_batching = kwargs.pop("is_continuous_batching", False)
        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", None)
        self.async_mode = kwargs.pop("async_mode", False)
        self.save_sharded_checkpoint = kwargs.pop("save_sharded_checkpoint", False)
        self._pop_kv_cache(kwargs)
        self._pop_buckets(kwargs)
        self._pop_quantization(kwargs)
        self._pop_speculation(kwargs)
        if release() >= SEQ_IDS_MASK_SINCE:
            self.apply_seq_ids_mask = kwargs.pop("apply_seq_ids_mask", False)
        for key in [k for k in kwargs if k in KNOWN_UNMODELLED]:
            setattr(self, key, kwargs.pop(key))
        self._check_batch_bucketing()
        self._check_quantization()
        if kwargs:  # NeuronConfig.__init__, end: dropped, with a log line only
            logging.warning(f"NeuronConfig init: Unexpected keyword arguments: {kwargs}")

    def _pop_dtypes(self, kwargs):
        # NeuronConfig.__init__: a given torch_dtype (a string converted) overrides the checkpoint's.
        if "torch_dtype" in kwargs:
            self.torch_dtype = to_torch_dtype(kwargs.pop("torch_dtype"))
            self.overrides_torch_dtype = kwargs.pop("overrides_torch_dtype", True)
        else:
            self.torch_dtype = torch.bfloat16
            self.overrides_torch_dtype = False
        self.attention_dtype = kwargs.pop("attention_dtype", None)

    def _pop_kv_cache(self, kwargs):
        # NeuronConfig.__init__; KVCacheManager._init_kv_shape reads these.
        self.kv_cache_batch_size = kwargs.pop("kv_cache_batch_size", self.batch_size)
        self.kv_cache_padding_size = kwargs.pop("kv_cache_padding_size", 0)
        self.kv_cache_quant = kwargs.pop("kv_cache_quant", False)
        self.kv_quant_config = kwargs.pop("kv_quant_config", None)
        if type(self.kv_quant_config) is dict:  # NeuronConfig.__init__, "# KV Quantization" (0.8 on)
            self.kv_quant_config = KVQuantizationConfig(**self.kv_quant_config)
        self.attention_dp_degree = kwargs.pop("attention_dp_degree", 1)
        self.kv_cache_tiling = kwargs.pop("kv_cache_tiling", False)
        self.k_cache_transposed = kwargs.pop("k_cache_transposed", False)
        if self.attention_dp_degree > 1:  # NeuronConfig: one KV batch per data-parallel attention group
            self.kv_cache_batch_size = self.tkg_batch_size // self.attention_dp_degree

    def _pop_quantization(self, kwargs):
        # NeuronConfig.__init__, "# Quantization".
        self.quantized = kwargs.pop("quantized", False)
        self.quantized_checkpoints_path = kwargs.pop("quantized_checkpoints_path", None)
        if self.quantized is True:
            assert self.quantized_checkpoints_path is not None, "quantized_checkpoints_path is required"
        self.quantization_type = kwargs.pop("quantization_type", "per_tensor_symmetric")
        self.quantization_dtype = kwargs.pop("quantization_dtype", "int8")
        self.quantization_block_size = kwargs.pop("quantization_block_size", None)
        self.quantization_block_axis = kwargs.pop("quantization_block_axis", None)
        self.quantization_scale_dtype = kwargs.pop("quantization_scale_dtype", "f32")
        self.modules_to_not_convert = kwargs.pop("modules_to_not_convert", None)
        self.draft_model_modules_to_not_convert = kwargs.pop("draft_model_modules_to_not_convert", None)

    def _pop_speculation(self, kwargs):
        # NeuronConfig.__init__, "# Speculative decoding", and the KV cache tiling it implies: with fused
        # speculation the positions are tiled by 128 whenever max_length is a multiple of 128 above it, unless
        # disable_kv_cache_tiling (the flag pops before the rule).
        self.speculation_length = kwargs.pop("speculation_length", 0)
        self.spec_batch_size = kwargs.pop("spec_batch_size", self.batch_size)
        self.enable_fused_speculation = kwargs.pop("enable_fused_speculation", False)
        self.enable_eagle_speculation = kwargs.pop("enable_eagle_speculation", False)
        self.is_eagle_draft = kwargs.pop("is_eagle_draft", False)
        if self.enable_eagle_speculation:
            self.enable_fused_speculation = True
        self.disable_kv_cache_tiling = kwargs.pop("disable_kv_cache_tiling", False)
        if not self.disable_kv_cache_tiling and self.enable_fused_speculation and self.max_length > 128 and self.max_length % 128 == 0:
            self.kv_cache_tiling = True

    def _check_batch_bucketing(self):
        """_validate_batch_bucketing_compatibility (NxDI's main branch; stricter than a release without it is safe):
        token_generation_batches with speculation raises."""
        batches = getattr(self, "token_generation_batches", None)
        if batches is not None and (self.speculation_length > 0 or self.enable_fused_speculation):
            raise ValueError(f"Batch bucketing (token_generation_batches={batches}) is not currently supported with the following "
                             "features: speculative decoding. Please disable batch bucketing or the incompatible features.")

    def is_mlp_quantized(self):
        return getattr(self, "quantized_mlp_kernel_enabled", False) or getattr(self, "activation_quantization_type", None)

    def _check_quantization(self):
        """NeuronConfig.__init__ after the kernels' settings are read, then _verify_quantized_config."""
        if self.quantized or self.is_mlp_quantized():
            if getattr(self, "qkv_kernel_enabled", False) or getattr(self, "qkv_nki_kernel_enabled", False):
                assert self.modules_to_not_convert, "Could not find modules_to_not_convert for quantized model."
            elif not self.modules_to_not_convert:
                warnings.warn("modules_to_not_convert is not provided. Assuming all modules will be quantized.", UserWarning)
        if self.is_mlp_quantized():
            self.quantization_type = "per_channel_symmetric"
            self.quantization_dtype = "f8e4m3"
        if not self.quantized:
            return
        assert self.quantized_checkpoints_path is not None, "quantized_checkpoints_path is required"
        # QuantizedDtype.has_dtype
        assert self.quantization_dtype.upper() in QUANTIZED_DTYPES, f"{self.quantization_dtype} is not a valid QuantizedDtype."
        if self.is_mlp_quantized():
            assert self.quantization_dtype == "f8e4m3"

    def _pop_buckets(self, kwargs):
        # NeuronConfig.__init__ sorts the lists and asserts their ends.
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


class MoENeuronConfig(NeuronConfig):
    """NxDI models/config.py MoENeuronConfig: the fields NxDI's MoE modules read."""

    def __init__(self, capacity_factor=None, glu_mlp=True, **kwargs):
        self.capacity_factor = float(capacity_factor) if capacity_factor is not None else None
        self.glu_mlp = glu_mlp
        self.glu_type = kwargs.pop("glu_type", "glu")
        self.moe_mask_padded_tokens = kwargs.pop("moe_mask_padded_tokens", False)
        super().__init__(**kwargs)


class FusedSpecNeuronConfig:
    """FusedSpecNeuronConfig (models/config.py, 0.7.0 to 0.9.0): what NeuronFusedSpecModel builds its draft from."""

    def __init__(self, worker_cls, draft_config=None, draft_model_path=None, draft_model_cls=None):
        self.worker_cls = worker_cls
        self.draft_model_cls = draft_model_cls
        self.draft_config = draft_config
        self.draft_model_path = draft_model_path


class InferenceConfig:
    attribute_map: dict = {}

    def __init__(self, neuron_config, fused_spec_config=None, load_config=None, metadata=None, **kwargs):
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        self.metadata = metadata
        for key, value in kwargs.items():  # InferenceConfig.__init__: overrides after load_config
            setattr(self, key, value)
        self.add_derived_config()
        self.validate_config()

    def add_derived_config(self):
        self.num_cores_per_group = 1

    def get_required_attributes(self) -> list[str]:
        return []

    def validate_config(self):
        """InferenceConfig.validate_config: every required attribute present, else an AssertionError.
        (Under transformers 5 a checkpoint's rope_theta lives in rope_parameters: Llama, Mistral,
        Qwen2/3 and Mixtral then fail here, as NxDI does.)"""
        missing = [name for name in self.get_required_attributes() if not hasattr(self, name)]
        assert len(missing) == 0, f"Config must define {missing}"

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig

    def get_text_config(self):
        return getattr(self, "text_config", None) or self

    def save(self, model_path):
        """InferenceConfig.save: neuron_config.json in the compiled directory."""
        path = pathlib.Path(model_path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.neuron_config.kwargs, default=str))


# get_required_attributes of each model's InferenceConfig, NxDI 0.9.0 (models/<name>/modeling_<name>.py).
LLAMA_REQUIRED = ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id", "vocab_size",
                  "max_position_embeddings", "rope_theta", "rms_norm_eps", "hidden_act"]

"""The stand-in model: NxDI's continuous-batching calls, computed by a transformers model.

Its KV cache lives in per-rank tensors laid out as NxDI 0.9.0 lays them out
(KVCacheManager._init_kv_shape: [kv_cache_batch_size + kv_cache_padding_size,
heads_per_rank, cache length, head_dim]), with the model's KV heads sharded across
ranks when they divide by tp, else replicated one per rank. The sharding here is
written independently of disagg's layout module, so the tests compare two
implementations. Each strictness rule names the NxDI function it stands for; the
rules read at 0.9.0 hold at 0.7.0 and 0.8.0 too unless a docstring says otherwise.

Fused speculation (enable_fused_speculation, NeuronFusedSpecModel in models/model_base.py): both
graphs hold the draft's and the target's KV, under draft_model. and target_model. in the state; a
context encoding fills both models' lines and returns _cte_postprocessor's outputs; a token-generation
step runs the greedy draft speculation_length times, the target over the input and the first
speculation_length - 1 draft tokens, and returns _tkg_postprocessor's (accepted tokens padded with -1).
With enable_eagle_speculation the graphs are NxDI's EAGLE flow instead (standin_eagle.py).

Weight quantization: save_quantized_state_dict writes where NxDI writes and in its format
(safetensors in a directory, 8-bit weights with their scales); a quantized compile reads it
where NxDI does (shard_weights). The stand-in still computes with the checkpoint's own
weights: what it checks is the settings and the files, not 8-bit numerics.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from ..device import device_view
from ..modules.autobucketing import generate_buckets_for_cte, generate_buckets_for_fused_spec, generate_buckets_for_tkg
from ..modules.generation.sampling import Sampler, infer_sampling_params, validate_sampling_params
from .config import InferenceConfig
from .model_wrapper import (
    CONTEXT_ENCODING_MODEL_TAG,
    FUSED_SPECULATION_MODEL_TAG,
    TOKEN_GENERATION_MODEL_TAG,
    ModelWrapper,
    get_target_bucket,
    pad_context_inputs,
    pad_token_generation_mask,
    padded_batch,
    submodel_config,
)
from .standin_eagle import EagleFusedSpec

COMPILE_LOG = "standin_compiles.txt"
COMPILED_MODEL_FILE_NAME = "model.pt"  # application_base.COMPILED_MODEL_FILE_NAME
SHARDED_WEIGHTS = "weights/tp{}_sharded_checkpoint.safetensors"  # application_base.shard_weights / load_weights
QUANTIZE_LOG = "standin_quantized.txt"  # stand-in only: one line per save_quantized_state_dict into that directory
DEFAULT_COMPILE_WORK_DIR = "/tmp/nxd_model/"  # application_base.get_builder's default; tests point it elsewhere
KV_CACHE_PAD_FOR_SEQ_IDS_MASKING = 128  # modules/kvcache/kv_cache_manager.py, 0.7.0 to 0.9.0
TRACING_MARK = "tracing-"
ACCEPTANCE_PADDING_TOKEN = -1  # NeuronFusedSpecModel.acceptance_padding_token
PADDED_ROW_KV_SCALE = 4.0  # what a padded row writes: garbage, loud enough to change any token it reaches
fail_next_trace = False  # tests set it: a compile interrupted while tracing
fail_next_shard = False  # tests set it: a compile interrupted while sharding the weights, model.pt already written


def head_of(rank: int, slot_in_rank: int, kv_heads: int, tp: int) -> int:
    if kv_heads % tp == 0:
        return rank * (kv_heads // tp) + slot_in_rank
    return rank * kv_heads // tp  # replicated: tp/kv_heads ranks per head


def infer_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """NeuronBaseForCausalLM._infer_attention_mask for one-token steps: positions < p."""
    length = int(position_ids.max())
    return (torch.arange(length)[None, :] < position_ids).to(position_ids.dtype)


def rolled_window_positions(last_position: int, window: int) -> list[int]:
    """get_last_kv_window (modules/attention/utils.py): the w-1 token positions a windowed
    context encoding leaves in cache slots 0..w-2, position t in slot t % (w-1); last_position
    is the max of the padded position_ids. Slots past a short prompt hold the pad tokens."""
    size = window - 1
    end = max(last_position + 1, size)
    start = max(end - size, 0)
    by_slot = [0] * size
    for position in range(start, start + size):
        by_slot[position % size] = position
    return by_slot


# neuronx_distributed.quantization.quantization_config: QuantizationType values, and the
# bounds (DtypeBound) its quantize functions scale to.
QUANTIZATION_TYPES = ("per_tensor_symmetric", "per_channel_symmetric", "per_key_symmetric", "blockwise_symmetric", "expert_wise_per_channel_symmetric")
QUANTIZED_TORCH_DTYPES = {"INT8": (torch.int8, 127.0), "F8E4M3": (torch.float8_e4m3fn, 240.0), "F8E4M3FN": (torch.float8_e4m3fn, 240.0),
                          "F8E5M2": (torch.float8_e5m2, torch.finfo(torch.float8_e5m2).max)}


def quantization_type(name: str) -> str:
    """QuantizationType(name): ValueError for a value it does not have."""
    if name not in QUANTIZATION_TYPES:
        raise ValueError(f"{name!r} is not a valid QuantizationType")
    return name


def quantize_linear(weight: torch.Tensor, dtype_name: str, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric abs-max quantization of one linear's weight: (8-bit weight, fp32 scale), the scale
    per output channel ([out, 1]) or per tensor ([1])."""
    if dtype_name.upper() not in QUANTIZED_TORCH_DTYPES:
        raise ValueError(f"dtype: {dtype_name} is not supported to quantize model on CPU")  # quantize_pytorch_model_*
    dtype, bound = QUANTIZED_TORCH_DTYPES[dtype_name.upper()]
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max().reshape(1)
    scale = (absmax / bound).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale).round().clamp(-128, 127).to(dtype) if dtype == torch.int8 else (w / scale).clamp(-bound, bound).to(dtype)
    return q, scale


class _NxdModel:
    def __init__(self, state):
        self.state = state


class StandInDecoder:
    """The model class's _model_cls (NeuronLlamaModel and the like, a NeuronBaseModel): what FusedSpecNeuronConfig's
    worker_cls names and NeuronFusedSpecModel builds the draft and the target from. The stand-in computes with
    transformers, so it is only a name here."""


class KvLines:
    """One model's KV in the per-rank state: its layers' K and V under prefix ("" for a plain model; draft_model.
    and target_model. in a fused speculation model), laid out as KVCacheManager lays them."""

    def __init__(self, hf, prefix: str, tp: int):
        cfg = hf.config
        self.hf, self.prefix, self.tp = hf, prefix, tp
        self.layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.per_rank = self.kv_heads // tp if self.kv_heads % tp == 0 else 1

    def key(self, index: int) -> str:
        return f"{self.prefix}kv_mgr.past_key_values.{index}"


class StandInCausalLM(EagleFusedSpec):
    config_cls = InferenceConfig
    _model_cls = StandInDecoder
    uses_sliding_window = False  # NeuronBaseModel.sliding_window is None unless the model's setup_attr_for_model sets it

    @classmethod
    def get_config_cls(cls):
        return cls.config_cls

    def __init__(self, model_path, config=None):
        self.model_path = model_path
        self.config = config
        self.neuron_config = nc = config.neuron_config
        self._check_config()
        self.context_encoding_model = ModelWrapper(submodel_config(config, nc.ctx_batch_size, generate_buckets_for_cte(nc)), CONTEXT_ENCODING_MODEL_TAG)
        self.token_generation_model = ModelWrapper(submodel_config(config, nc.tkg_batch_size, generate_buckets_for_tkg(nc)), TOKEN_GENERATION_MODEL_TAG)
        self.fused = bool(getattr(nc, "enable_fused_speculation", False))
        if self.fused:  # NeuronBaseForCausalLM.enable_fused_spec: the fused model's graph, its own buckets
            fused_config = submodel_config(config, nc.tkg_batch_size, generate_buckets_for_fused_spec(config))
            self.fused_spec_model = ModelWrapper(fused_config, FUSED_SPECULATION_MODEL_TAG)

    def _check_config(self):
        pass

    # -- weight quantization (application_base) ------------------------------------------
    @staticmethod
    def load_hf_model(model_path, **kwargs):
        """Each NxDI model class's load_hf_model: <Architecture>ForCausalLM.from_pretrained (float32)."""
        return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)

    @classmethod
    def save_quantized_state_dict(cls, model_path: str, config: InferenceConfig):
        """application_base.save_quantized_state_dict: the state dict quantized, None values pruned,
        then saved to neuron_config.quantized_checkpoints_path: as safetensors shards
        (save_state_dict_safetensors: huggingface_hub.save_torch_state_dict, model{suffix}.safetensors)
        where that path is an existing directory, else torch.save to that file."""
        from huggingface_hub import save_torch_state_dict

        path = config.neuron_config.quantized_checkpoints_path
        state_dict = {k: v for k, v in cls.generate_quantized_state_dict(model_path, config).items() if v is not None}
        if os.path.isdir(path):
            save_torch_state_dict(state_dict, save_directory=path, filename_pattern="model{suffix}.safetensors", max_shard_size="10GB")
            with open(pathlib.Path(path) / QUANTIZE_LOG, "a") as log:
                log.write(f"quantized {model_path} ({config.neuron_config.quantization_dtype} {config.neuron_config.quantization_type})\n")
        else:
            torch.save(state_dict, path)

    @classmethod
    def generate_quantized_state_dict(cls, model_path: str, config: InferenceConfig) -> dict:
        """application_base.generate_quantized_state_dict: every nn.Linear of the Hugging Face model
        quantized per tensor (NxD's quantize_pytorch_model_per_tensor_symmetric: modules_to_not_convert
        NOT applied) or per channel (quantize_pytorch_model_per_channel_symmetric: a module whose
        name contains an entry of modules_to_not_convert stays in full precision); any other
        QuantizationType raises RuntimeError. NeuronBaseForCausalLM.prepare_quantized_state_dict:
        the decoder's state dict (no "model." prefix) and lm_head's under "lm_head."."""
        nc = config.neuron_config
        kind = quantization_type(nc.quantization_type)
        if kind not in ("per_tensor_symmetric", "per_channel_symmetric"):
            raise RuntimeError(f"{nc.quantization_type} not supported")
        if nc.quantization_dtype.upper() not in QUANTIZED_TORCH_DTYPES and nc.quantization_dtype.upper() not in ("F4E2M1FN_X4", "F8E4M3FN_X4", "F8E5M2_X4"):
            raise AssertionError(f"{nc.quantization_dtype} is not a valid QuantizedDtype.")  # QuantizedDtype.get_dtype
        hf = cls.load_hf_model(model_path)
        skip = (nc.modules_to_not_convert or []) if kind == "per_channel_symmetric" else []
        quantized = {}
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and not any(entry in name for entry in skip):
                quantized[name] = quantize_linear(module.weight, nc.quantization_dtype, kind == "per_channel_symmetric")
        state_dict = {}
        for prefix, part in (("model.", hf.model), ("lm_head.", hf.lm_head)):
            for key, value in part.state_dict().items():
                full = prefix + key
                owner, _, leaf = full.rpartition(".")
                out = full.removeprefix("model.")
                if owner in quantized and leaf == "weight":
                    state_dict[out], state_dict[out.removesuffix("weight") + "scale"] = quantized[owner]
                else:
                    state_dict[out] = value
        return state_dict

    def checkpoint_loader_fn(self):
        """application_base.checkpoint_loader_fn, quantized: the state dict at quantized_checkpoints_path
        (FileNotFoundError when missing), read by get_state_dict (a directory: load_state_dict)."""
        from safetensors.torch import load_file

        path = self.neuron_config.quantized_checkpoints_path
        if not os.path.exists(path):
            raise FileNotFoundError(f"Quantized checkpoint file not found: {path}")
        if not os.path.isdir(path):
            return torch.load(path)
        files = sorted(pathlib.Path(path).glob("model*.safetensors"))
        if not (pathlib.Path(path) / "model.safetensors").is_file() and not (pathlib.Path(path) / "model.safetensors.index.json").is_file():
            raise FileNotFoundError(f"Can not find model.safetensors or pytorch_model.bin in {path}")  # modules/checkpoint.load_state_dict
        state_dict = {}
        for file in files:
            state_dict.update(load_file(str(file)))
        return state_dict

    # -- compile and load -----------------------------------------------------------
    def compile(self, compiled_model_path):
        """application_base.compile: the config saved, the model traced, model.pt written,
        THEN the weights sharded (shard_weights): an interruption while sharding leaves
        model.pt beside missing weights. Same order in 0.7.0 and 0.8.0."""
        path = pathlib.Path(compiled_model_path)
        self.config.save(path)
        work = self._trace()
        (path / COMPILED_MODEL_FILE_NAME).write_text("traced (stand-in)")
        quantized = self._shard_weights(path)
        with open(path / COMPILE_LOG, "a") as log:
            log.write(f"compiled in {work}\n")
            if quantized:
                log.write(f"{quantized}\n")

    def _trace(self):
        # get_builder reads BASE_COMPILE_WORK_DIR when compile runs; ModelBuilder.trace
        # works in that directory and deletes it when done, so two compiles sharing it
        # delete each other's files. The stand-in refuses to trace beside another.
        global fail_next_trace
        work = pathlib.Path(os.environ.get("BASE_COMPILE_WORK_DIR", DEFAULT_COMPILE_WORK_DIR))
        work.mkdir(parents=True, exist_ok=True)
        others = sorted(p.name for p in work.glob(TRACING_MARK + "*"))
        if others:
            raise RuntimeError(f"another compile is tracing in {work} ({others}); ModelBuilder.trace deletes that directory when it ends")
        if fail_next_trace:
            fail_next_trace = False
            raise KeyboardInterrupt("compile interrupted while tracing (stand-in)")
        if self.neuron_config.quantized:  # ModelWrapper.input_generator / get_trace_callable: convert() with NxD's qconfig
            kind = quantization_type(self.neuron_config.quantization_type)
            if kind not in ("per_channel_symmetric", "per_tensor_symmetric"):
                raise RuntimeError(f"{self.neuron_config.quantization_type} is not supported")
        (work / f"{TRACING_MARK}{os.getpid()}-{id(self)}").write_text("")
        shutil.rmtree(work)
        return work

    def _shard_weights(self, path: pathlib.Path):
        """shard_weights: with save_sharded_checkpoint, one safetensors file per rank under weights/."""
        from safetensors.torch import save_file

        global fail_next_shard
        if not self.neuron_config.save_sharded_checkpoint:
            return None  # "SKIPPING pre-sharding the checkpoints": load() shards them
        quantized = None
        if self.neuron_config.quantized:  # the weights sharded are the quantized state dict's
            state_dict = self.checkpoint_loader_fn()
            eight_bit = sum(1 for v in state_dict.values() if v.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2))
            quantized = f"weights from {self.neuron_config.quantized_checkpoints_path}: {eight_bit} 8-bit tensors"
        (path / "weights").mkdir(exist_ok=True)
        for rank in range(self.neuron_config.tp_degree):
            if fail_next_shard and rank == self.neuron_config.tp_degree - 1:
                fail_next_shard = False
                raise KeyboardInterrupt(f"compile interrupted while sharding the weights of rank {rank} (stand-in)")
            save_file({"standin.rank": torch.tensor([rank])}, str(path / SHARDED_WEIGHTS.format(rank)))
        return quantized

    def load(self, compiled_model_path):
        """application_base.load: torch.jit.load(model.pt), then load_weights, which reads every
        rank's pre-sharded file when save_sharded_checkpoint is set."""
        from safetensors.torch import load_file

        path = pathlib.Path(compiled_model_path)
        if not (path / COMPILED_MODEL_FILE_NAME).exists():
            raise ValueError(f"The provided filename {path / COMPILED_MODEL_FILE_NAME} does not exist")  # torch.jit.load's message
        if self.neuron_config.save_sharded_checkpoint:
            for rank in range(self.neuron_config.tp_degree):
                load_file(str(path / SHARDED_WEIGHTS.format(rank)))  # FileNotFoundError where sharding never finished
        nc = self.neuron_config
        self.tp = nc.tp_degree
        self.dtype = getattr(torch, str(nc.torch_dtype).removeprefix("torch."))
        self.hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).eval()
        self.target = KvLines(self.hf, "target_model." if self.fused else "", self.tp)
        self.parts = [self.target]
        self.eagle = self.fused and bool(getattr(nc, "enable_eagle_speculation", False))
        if self.eagle:
            self._load_eagle()  # the EAGLE draft (standin_eagle.EagleDraft) and the hidden states' rolling buffer
        elif self.fused:  # NeuronFusedSpecModel: draft_model and target_model, the draft's weights from draft_model_path
            self.draft_hf = AutoModelForCausalLM.from_pretrained(self._draft_checkpoint(), dtype=self.dtype).eval()
        if self.fused:
            self.draft = KvLines(self.draft_hf, "draft_model.", self.tp)
            self.parts.append(self.draft)
        self.layers, self.kv_heads, self.head_dim, self.per_rank = self.target.layers, self.target.kv_heads, self.target.head_dim, self.target.per_rank
        self.window = getattr(self.config, "sliding_window", None) if self.uses_sliding_window else None
        self.sampler = Sampler(nc.on_device_sampling_config, torch.Generator().manual_seed(0))
        self._garbage = torch.Generator().manual_seed(1)
        self._plain = [{part.key(i): torch.zeros(self._kv_shape(part, i % 2 == 0), dtype=self._kv_dtype())
                        for part in self.parts for i in range(2 * part.layers)}
                       for _ in range(self.tp)]
        traced = type("Traced", (), {"nxd_model": _NxdModel([{k: device_view(v) for k, v in rank.items()} for rank in self._plain])})()
        self.context_encoding_model.model = self.token_generation_model.model = traced  # application_base.load
        if self.fused:
            self.fused_spec_model.model = traced
            self.fused_buckets = self.fused_spec_model.neuron_config.buckets
        self.prior_seq_ids = None  # causal_lm_async_execution's state
        self._pending = None  # a launched hidden step: runs before the next call's work
        self._prior_tokens = None
        self.cte_buckets = self.context_encoding_model.neuron_config.buckets
        self.tkg_buckets = self.token_generation_model.neuron_config.buckets

    def _draft_checkpoint(self) -> str:
        """The checkpoint the draft computes with. Quantized, NxDI converts the fused model's draft to quantized linears
        too (ModelWrapper: draft_model and target_model) and reads its weights from draft_model_path, which must then be
        a quantized state dict (8-bit weights and their scales, as save_quantized_state_dict writes); the stand-in checks
        that, then computes with the draft's own checkpoint (its config's _name_or_path), as it does for the target."""
        fused = self.config.fused_spec_config
        if not getattr(fused.draft_config.neuron_config, "quantized", False):
            return fused.draft_model_path
        from .standin_eagle import load_state_dict

        state = load_state_dict(fused.draft_model_path)
        weights = [name for name in state if name.endswith("proj.weight")]
        unscaled = [name for name in weights if name.removesuffix("weight") + "scale" not in state]
        if not weights or unscaled:
            raise RuntimeError(f"the quantized draft's weights at {fused.draft_model_path} have no scale for {(unscaled or ['any linear'])[0]}: "
                               "NxDI converts a fused model's draft with the target's quantization")
        if getattr(self.neuron_config, "enable_eagle_speculation", False) and (state.get("fc.weight") is None or state["fc.weight"].dtype == torch.int8):
            raise RuntimeError(f"the quantized EAGLE draft's weights at {fused.draft_model_path} have no full-precision fc.weight "
                               "(NxD's conversion leaves the EAGLE draft's fc unconverted)")
        return fused.draft_config._name_or_path

    @property
    def seq_ids_masked(self) -> bool:
        # Releases before 0.4 have no such attribute (NeuronConfig dropped the argument).
        return getattr(self.neuron_config, "apply_seq_ids_mask", False)

    def cache_length(self) -> int:
        """KVCacheManager._init_kv_shape: the window whenever the model passes one (not only when
        it is below max_length), else max_length; plus KV_CACHE_PAD_FOR_SEQ_IDS_MASKING with
        apply_seq_ids_mask (0.7.0 on)."""
        length = self.window or self.neuron_config.max_length
        return length + (KV_CACHE_PAD_FOR_SEQ_IDS_MASKING if self.seq_ids_masked else 0)

    def _kv_shape(self, part: KvLines, is_key):
        nc = self.neuron_config
        lines = nc.kv_cache_batch_size + nc.kv_cache_padding_size
        length = self.cache_length()
        if nc.kv_cache_tiling:
            return (lines, part.per_rank, 128, length // 128, part.head_dim)
        if is_key and nc.k_cache_transposed:
            return (lines, part.per_rank, part.head_dim, length)
        return (lines, part.per_rank, length, part.head_dim)

    def _kv_dtype(self):
        nc = self.neuron_config
        if nc.kv_cache_quant or nc.kv_quant_config:
            return torch.float8_e4m3fn
        return getattr(torch, str(nc.attention_dtype).removeprefix("torch.")) if nc.attention_dtype else self.dtype

    # -- the slot's K/V in the model's own head order ----------------------------
    def _cache(self, layer, is_key, rank, part: KvLines | None = None):
        return self._plain[rank][(part or self.target).key(2 * layer + (0 if is_key else 1))]

    def _check_plain_layout(self):
        nc = self.neuron_config
        if nc.kv_cache_tiling or nc.attention_dp_degree > 1 or nc.k_cache_transposed:
            raise NotImplementedError("the stand-in computes only NxDI's default KV layout")
        if nc.kv_quant_config is not None and not nc.kv_quant_config.direct_cast:
            raise NotImplementedError("the stand-in computes NxDI's fp8 KV cache cast directly only, not with static scales")

    def _gather(self, layer, is_key, slot, positions, part: KvLines | None = None):
        part = part or self.target
        out = torch.zeros(part.kv_heads, len(positions), part.head_dim, dtype=self.dtype)
        for rank in range(self.tp):
            for j in range(part.per_rank):
                # KVCacheManager._dequantize_cache (a direct cast): an fp8 cache's lines widened to the model's dtype
                out[head_of(rank, j, part.kv_heads, self.tp)] = self._cache(layer, is_key, rank, part)[slot, j, positions].to(self.dtype)
        return out

    def _scatter(self, layer, is_key, slot, positions, lines, part: KvLines | None = None):
        # lines: [kv_heads, len(positions), head_dim], written to every rank holding each head
        part = part or self.target
        for rank in range(self.tp):
            for j in range(part.per_rank):
                cache = self._cache(layer, is_key, rank, part)
                # KVCacheManager._quantize_cache before update_cache: the new lines cast to the cache's dtype (e4m3 for kv_cache_quant)
                cache[slot, j, positions] = lines[head_of(rank, j, part.kv_heads, self.tp)].to(cache.dtype)

    def _check_seq_ids(self, seq):
        # ModelWrapper._forward_with_pad pads seq_ids with range(max_batch_size): an id
        # outside it has no line.
        bad = [s for s in seq if not 0 <= s < self.neuron_config.max_batch_size]
        if bad:
            raise ValueError(f"seq_ids {bad} are outside the compiled batch of {self.neuron_config.max_batch_size}")

    # -- forward ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids, seq_ids=None, attention_mask=None, position_ids=None, sampling_params=None):
        self._finish_pending()  # the device runs in order: a launched step lands before this call's work
        self._check_plain_layout()
        seq = seq_ids.tolist()
        self._check_seq_ids(seq)
        validate_sampling_params(sampling_params, self.neuron_config.on_device_sampling_config)  # preprocess_inputs
        params = infer_sampling_params(sampling_params)
        if attention_mask is None:
            attention_mask = infer_attention_mask(position_ids)
        result = type("Output", (), {})()
        if self.fused:  # _construct_output: a fused model's outputs are fused_outputs, no tokens
            result.fused_outputs = self._fused_forward(input_ids, attention_mask, position_ids, seq, params)
            return result
        if int(position_ids.min()) == 0:  # NeuronBaseForCausalLM._is_prefill
            tokens = self._context_encoding(input_ids, attention_mask, position_ids, seq, params)
            self.prior_seq_ids, self._prior_tokens = None, None
        elif self.neuron_config.async_mode:
            tokens = self._async_token_generation(input_ids, attention_mask, position_ids, seq_ids, params)
        else:
            tokens = self._token_generation(input_ids, attention_mask, position_ids, seq, params)
        result.tokens = tokens.to(torch.int32)[:, None]
        return result

    def _context_encoding(self, input_ids, attention_mask, position_ids, seq, params):
        return self.sampler(self._encode_context(self.target, input_ids, attention_mask, position_ids, seq), params)

    def _encode_context(self, part: KvLines, input_ids, attention_mask, position_ids, seq) -> torch.Tensor:
        """The context-encoding model: the prompt padded to its bucket (ModelWrapper.pad_inputs),
        the whole padded prompt written into line seq_ids[0] (KVCacheManager.update_cache,
        update_cache_const_indices), and the token sampled from the hidden state at
        torch.max(position_ids, dim=1).indices (NeuronBaseModel.forward): for a one-token
        prompt, positions [0, 1, 1, ...], that is the first pad."""
        assert len(seq) == 1, "only supports single seq_id"  # KVCacheManager.update_kv_by_layer_id, continuous batching
        bucket = get_target_bucket(self.cte_buckets, attention_mask, CONTEXT_ENCODING_MODEL_TAG)
        ids, _, positions = pad_context_inputs(input_ids.long(), attention_mask, position_ids.long(), bucket, self.context_encoding_model.config.pad_token_id)
        cache = DynamicCache()
        out = part.hf(ids, position_ids=positions, past_key_values=cache, use_cache=True)  # right padding: causal mask only
        index = int(torch.max(positions, dim=1, keepdim=True).indices[0, 0])
        written = self._context_positions_written(int(positions.max()), bucket)
        for layer in range(part.layers):
            keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]
            self._scatter(layer, True, seq[0], list(range(len(written))), keys[:, written], part)
            self._scatter(layer, False, seq[0], list(range(len(written))), values[:, written], part)
        return out.logits[:, index]

    # -- fused speculation (NeuronFusedSpecModel) -------------------------------------------
    def _fused_forward(self, input_ids, attention_mask, position_ids, seq, params) -> list[torch.Tensor]:
        if self.window or self.neuron_config.async_mode or self.neuron_config.kv_cache_tiling:
            raise NotImplementedError("the stand-in runs fused speculation without a window, NxDI's async mode or KV tiling")
        if int(position_ids.min()) == 0:  # _is_prefill: the context-encoding graph (a NeuronFusedSpecModel too)
            width = get_target_bucket(self.cte_buckets, attention_mask, CONTEXT_ENCODING_MODEL_TAG)
            if width == self.neuron_config.speculation_length:  # NeuronFusedSpecModel.forward goes by the padded input's width
                raise NotImplementedError(f"a prompt padded to {width} positions, speculation_length: NxDI runs it as a speculation step")
            if self.eagle:
                return self._eagle_context_encoding(input_ids, attention_mask, position_ids, seq, params)
            return self._fused_context_encoding(input_ids, attention_mask, position_ids, seq, params)
        if self.eagle:
            return self._eagle_token_generation(input_ids, attention_mask, position_ids, seq, params)
        return self._fused_token_generation(input_ids, attention_mask, position_ids, seq, params)

    def _fused_context_encoding(self, input_ids, attention_mask, position_ids, seq, params) -> list[torch.Tensor]:
        """_context_encoding_forward: the target's and then the draft's context encoding into line seq_ids[0], each
        sampling its token (the draft's is dropped); then _cte_postprocessor: [the target's token followed by
        speculation_length - 1 paddings, next input ids, next attention mask over seq_len, next position ids]."""
        k = self.neuron_config.speculation_length
        token = self.sampler(self._encode_context(self.target, input_ids, attention_mask, position_ids, seq), params)
        self._encode_context(self.draft, input_ids, attention_mask, position_ids, seq)
        padded = torch.cat([token.reshape(1, 1), torch.full((1, k - 1), ACCEPTANCE_PADDING_TOKEN)], dim=1).to(torch.int32)
        next_positions = attention_mask.sum(dim=1, keepdim=True).to(torch.int32)
        next_mask = (torch.arange(self.neuron_config.seq_len)[None, :] <= next_positions - 1).to(position_ids.dtype)
        return [padded, padded[:, :1], next_mask, next_positions]

    def _fused_token_generation(self, input_ids, attention_mask, position_ids, seq, params) -> list[torch.Tensor]:
        """_token_gen_forward, then _tkg_postprocessor, over the padded batch (padded_batch):

        1. the draft runs speculation_length times, greedy (NeuronFusedSpecModel forces do_sample off for it), each
           run one token a row at the row's position plus i, writing its KV there; after each run its attention mask
           gains the column of every row's position of that run (index_fill_ over dim 1 with all rows' positions, so
           a row also attends those columns of its own line where another row is at them);
        2. the target scores the input token and the first speculation_length - 1 draft tokens at the row's positions
           on, attending its mask's positions and the new tokens causally, writing its KV at each, sampling each
           position with the row's parameters;
        3. a row keeps the target's tokens up to the first draft token that differs from the target's (contiguous
           matches, plus one), the rest padded with -1; next position ids = position ids + kept."""
        nc = self.neuron_config
        k = nc.speculation_length
        bucket = get_target_bucket(self.fused_buckets, attention_mask, FUSED_SPECULATION_MODEL_TAG, k)
        mask = pad_token_generation_mask(attention_mask, bucket)
        batch = padded_batch(seq, nc.max_batch_size, self.seq_ids_masked)
        start = {line: int(position_ids[row, 0]) for line, (row, _, _) in enumerate(batch)}
        candidates = {line: [int(input_ids[row, 0])] for line, (row, _, _) in enumerate(batch)}
        draft_mask = mask.clone()
        for i in range(k):
            for line, (row, seq_id, real) in enumerate(batch):
                position = start[line] + i
                if real:
                    logits = self._run_tokens(self.draft, line, candidates[line][-1:], position, draft_mask[row])
                    candidates[line].append(int(logits[-1].argmax()))
                else:
                    self._write_padded_row(line, seq_id, position, self.draft)
            filled = sorted({start[line] + i for line in start if start[line] + i < bucket})
            draft_mask[:, filled] = 1
        logits = {}
        for line, (row, seq_id, real) in enumerate(batch):
            if real:
                logits[line] = self._run_tokens(self.target, line, candidates[line][:k], start[line], mask[row])
            else:
                for j in range(k):
                    self._write_padded_row(line, seq_id, start[line] + j, self.target)
        rows = len(seq)
        target_tokens = self.sampler(torch.cat([logits[line] for line in seq]), params.repeat_interleave(k, dim=0)).reshape(rows, k)
        draft_tokens = torch.tensor([candidates[line][1:] for line in seq])
        return self._tkg_postprocess(draft_tokens[:, :-1], target_tokens, position_ids, bucket)

    @staticmethod
    def _tkg_postprocess(guesses, target_tokens, position_ids, bucket: int) -> list[torch.Tensor]:
        """_tkg_postprocessor over the step's speculation_length - 1 guesses (candidate_tokens[:, :-1] of the draft's
        tokens; with EAGLE [:, 1:] of the input and the guesses): [accepted tokens, next input ids, next attention
        mask, next position ids]."""
        rows, k = target_tokens.shape
        matches = ((guesses != target_tokens[:, :-1]).cumsum(dim=-1) < 1).sum(dim=-1, keepdim=True) + 1
        accepted = torch.where(torch.arange(k)[None, :] < matches, target_tokens, ACCEPTANCE_PADDING_TOKEN).to(torch.int32)
        next_positions = (position_ids + matches).to(torch.int32)
        next_mask = (torch.arange(bucket)[None, :] <= next_positions - 1).to(position_ids.dtype)
        last = ((accepted != ACCEPTANCE_PADDING_TOKEN).sum(dim=1) + k - 1) % k
        return [accepted, accepted[torch.arange(rows), last].reshape(rows, 1), next_mask, next_positions]

    def _run_tokens(self, part: KvLines, line: int, tokens: list[int], position: int, mask_row: torch.Tensor) -> torch.Tensor:
        """A row's tokens at position on: the cached positions its mask marks, then the tokens causally (a
        multi-token token-generation step: compute_for_token_gen over the active tokens); each token's KV written
        at its position. [len(tokens), vocab] logits."""
        attended = mask_row.nonzero().flatten().tolist()
        cache = DynamicCache()
        for layer in range(part.layers):
            cache.update(self._gather(layer, True, line, attended, part)[None], self._gather(layer, False, line, attended, part)[None], layer)
        count = len(tokens)
        out = part.hf(torch.tensor([tokens]), position_ids=torch.arange(position, position + count)[None], past_key_values=cache, use_cache=True)
        where = [self._write_position(position + j, line) for j in range(count)]
        for layer in range(part.layers):
            self._scatter(layer, True, line, where, cache.layers[layer].keys[0, :, -count:], part)
            self._scatter(layer, False, line, where, cache.layers[layer].values[0, :, -count:], part)
        return out.logits[0]

    def _context_positions_written(self, last_position: int, bucket: int) -> list[int]:
        """Which of the padded prompt's positions land in cache slots 0, 1, ...: all of them, or with
        a window the rolled last w-1 (get_last_kv_window). Its gather reads past a bucket shorter
        than w-1: torch.gather raises there on the CPU; Neuron's XLA gather clamps the index, so
        those slots get the bucket's last (pad) position, which no step attends before it
        writes the slot itself. The stand-in follows the device."""
        if not self.window:
            return list(range(bucket))
        return [min(position, bucket - 1) for position in rolled_window_positions(last_position, self.window)]

    def _token_generation(self, input_ids, attention_mask, position_ids, seq, params):
        """The token-generation model over the padded batch (padded_batch): every compiled row
        runs on its own line; a real row attends what its mask marks (positions < p; with a
        window, _create_windowed_attn_mask_tkg) and its own token
        (NeuronAttentionBase.compute_for_token_gen), and writes its KV where
        _get_index_to_update_new_position says."""
        bucket = get_target_bucket(self.tkg_buckets, attention_mask, TOKEN_GENERATION_MODEL_TAG)
        mask = pad_token_generation_mask(attention_mask, bucket)
        logits = {}
        for line, (row, seq_id, real) in enumerate(padded_batch(seq, self.neuron_config.max_batch_size, self.seq_ids_masked)):
            position = int(position_ids[row, 0])
            if real:
                logits[line] = self._run_row(line, int(input_ids[row, 0]), position, mask[row])
            else:
                self._write_padded_row(line, seq_id, position)
        return self.sampler(torch.stack([logits[line] for line in seq]), params)

    def _write_position(self, position: int, seq_id: int) -> int:
        """KVCacheManager._get_index_to_update_new_position: with a window, position % (window - 1)
        for every row, the seq_ids mask NOT applied; otherwise, with apply_seq_ids_mask, a row
        whose seq_id is -1 writes at max_length, in the pad region (apply_seq_id_mask)."""
        if self.window:
            return position % (self.window - 1)
        if self.seq_ids_masked and seq_id < 0:
            return self.neuron_config.max_length
        return position

    def _attended(self, position: int, mask_row: torch.Tensor) -> list[int]:
        if self.window:  # NeuronBaseModel._create_windowed_attn_mask_tkg: slots < p, at most the first w-1
            return list(range(min(position, self.window - 1)))
        return mask_row.nonzero().flatten().tolist()

    def _run_row(self, line: int, token: int, position: int, mask_row: torch.Tensor) -> torch.Tensor:
        attended = self._attended(position, mask_row)
        cache = DynamicCache()
        for layer in range(self.layers):
            cache.update(self._gather(layer, True, line, attended)[None], self._gather(layer, False, line, attended)[None], layer)
        out = self.hf(torch.tensor([[token]]), position_ids=torch.tensor([[position]]), past_key_values=cache, use_cache=True)
        where = [self._write_position(position, line)]
        for layer in range(self.layers):
            self._scatter(layer, True, line, where, cache.layers[layer].keys[0, :, -1:])
            self._scatter(layer, False, line, where, cache.layers[layer].values[0, :, -1:])
        return out.logits[0, -1]

    def _write_padded_row(self, line: int, seq_id: int, position: int, part: KvLines | None = None) -> None:
        """A padded row computes the caller's first row over this line and writes the result
        like any row (torch.scatter over the whole batch): where _write_position says."""
        part = part or self.target
        where = [self._write_position(position, seq_id)]
        shape = (part.kv_heads, 1, part.head_dim)
        for layer in range(part.layers):
            for is_key in (True, False):
                garbage = PADDED_ROW_KV_SCALE * torch.randn(shape, generator=self._garbage)
                self._scatter(layer, is_key, line, where, garbage.to(self.dtype), part)

    def _async_token_generation(self, input_ids, attention_mask, position_ids, seq_ids, params):
        """async_execution.causal_lm_async_execution: while seq_ids stay the same, each call
        launches a hidden step fed with its own output (input_ids ignored) and returns the
        step launched before; a changed seq_ids discards the hidden step, which has run anyway."""
        if self.prior_seq_ids is None:
            self.prior_seq_ids = seq_ids  # preprocess_inputs
        seq = seq_ids.tolist()
        if not torch.equal(self.prior_seq_ids, seq_ids):  # stay_in_sync_mode
            self._prior_tokens, self.prior_seq_ids = None, None
            return self._token_generation(input_ids, attention_mask, position_ids, seq, params)
        if self._prior_tokens is None:  # start_async
            current = self._token_generation(input_ids, attention_mask, position_ids, seq, params)
        else:  # continue_async: the hidden step launched by the last call is this call's result
            current = self._prior_tokens
        self._prior_tokens = None
        if self.neuron_config.seq_len - int(position_ids.max()) > 2:  # within_bounds
            nxt = position_ids + 1
            self._pending = lambda: self._token_generation(current[:, None], infer_attention_mask(nxt), nxt, seq, params)
        self.prior_seq_ids = seq_ids
        return current

    def _finish_pending(self):
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._prior_tokens = pending()

"""Our worker configuration -> NxDI's NeuronConfig, and where the compiled artifacts live."""

from __future__ import annotations

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

# --quantization -> NeuronConfig.quantization_dtype (a QuantizedDtype member name of NxD's
# quantization_config, which NeuronConfig._verify_quantized_config checks).
QUANTIZATION_DTYPES = {"int8": "int8", "fp8": "f8e4m3"}
# --quantization-type -> NeuronConfig.quantization_type (NxD's QuantizationType values; the two that
# both NxDI's generate_quantized_state_dict and its model conversion take).
QUANTIZATION_TYPES = {"per_channel": "per_channel_symmetric", "per_tensor": "per_tensor_symmetric"}
# The fields that mean nothing without `quantization`: left out of the compiled key then, so an
# unquantized configuration keeps the directory it compiled into before they existed.
QUANTIZATION_FIELDS = ("quantization", "quantization_type", "quantization_skip")
# NeuronConfig's own quantization arguments: set from `quantization`, never also through `extra`.
NXDI_QUANTIZATION_KWARGS = ("quantized", "quantized_checkpoints_path", "quantization_dtype", "quantization_type", "modules_to_not_convert")
# NxDI's fp8 activation quantization ("native quantization", its quantized MLP kernels): with any of these set,
# NeuronConfig.is_mlp_quantized() forces quantization_dtype f8e4m3 per channel, and the MLPs take fp8 weights and
# quantize their rows. Not mapped: the weights this backend prepares (full precision, or --quantization's own
# quantized state dict) are not that, so they are refused in the pass-through settings rather than loaded wrong.
NXDI_ACTIVATION_QUANTIZATION_KWARGS = ("activation_quantization_type", "quantized_mlp_kernel_enabled", "rmsnorm_quantize_kernel_enabled")
# --kv-cache-dtype fp8 -> NxDI's fp8 KV cache: each K/V line cast to e4m3 as it is written, and back to the model's dtype
# as it is read (KVCacheManager._quantize_cache / _dequantize_cache with a direct cast: no scales). kv_cache_quant is
# NxDI 0.7's switch (and 0.8+'s for the compiler's fp8 option, ModelWrapper); kv_quant_config 0.8+'s (KVQuantizationConfig:
# quant_dtype float8_e4m3fn, per tensor, direct_cast by default). 0.7 takes the second as an unexpected argument, logged.
NXDI_FP8_KV = {"kv_cache_quant": True, "kv_quant_config": {"direct_cast": True}}
KV_CACHE_DTYPES = ("fp8",)

# --speculative-method -> NeuronConfig's speculation switches. Both run the draft inside the target's
# compiled step (NxDI's fused speculation, NeuronFusedSpecModel); eagle's draft is an EAGLE head
# checkpoint (FusedSpecNeuronConfig's draft with is_eagle_draft). NxDI has no prompt lookup (ngram).
NXDI_SPECULATION = {"draft": {"enable_fused_speculation": True}, "eagle": {"enable_fused_speculation": True, "enable_eagle_speculation": True}}
# The fields that mean nothing without `speculation`: left out of the compiled key then (as QUANTIZATION_FIELDS).
SPECULATION_FIELDS = ("speculation", "speculation_length", "draft_model")
# NeuronConfig's own speculation arguments: set from `speculation`, never also through `extra`.
NXDI_SPECULATION_KWARGS = ("speculation_length", "enable_fused_speculation", "enable_eagle_speculation", "is_eagle_draft", "is_eagle3",
                           "enable_eagle_draft_input_norm", "medusa_speculation_length", "is_medusa", "token_tree_config", "spec_batch_size")


@dataclass(frozen=True)
class NeuronOptions:
    """What a worker asks of NxDI; every field here goes into the compiled artifacts' key (the
    quantization settings where quantization is on: compiled_key_options)."""

    model: str
    tp_degree: int = 1
    batch_size: int = 1  # decode slots (a prefill worker uses 1)
    seq_len: int = 2048  # prompt + generated tokens
    max_context_length: int = 0  # longest prompt; 0: seq_len
    dtype: str = "bfloat16"
    context_buckets: tuple[int, ...] = ()  # () with bucketing: NxDI's powers of two; see context_encoding_buckets
    token_buckets: tuple[int, ...] = ()
    enable_bucketing: bool = True
    async_mode: bool = True  # our decode loop's overlap of host and device work (decode_worker/decode_loop.py), not NxDI's
    nxdi_async_mode: bool = False  # NxDI's own async_mode: off, see neuron_config_kwargs
    global_topk: int = 256
    k_cache_transposed: bool = False  # refused: a transposed K splits every KV write into head_dim copies
    compiled_root: str = ""  # default: ~/.cache/disagg/neuron
    quantization: str | None = None  # int8 or fp8 weights (NxDI's quantized=True), quantized once before the compile
    quantization_type: str = "per_channel"  # per_channel or per_tensor (symmetric)
    quantization_skip: tuple[str, ...] = ("lm_head",)  # module-name substrings kept in full precision (modules_to_not_convert)
    speculation: str | None = None  # NxDI's fused speculation with a draft checkpoint: draft or eagle (NXDI_SPECULATION); None: off
    speculation_length: int = 0  # NeuronConfig.speculation_length: the positions a fused step scores a row, guesses + 1
    draft_model: str = ""  # the draft checkpoint (FusedSpecNeuronConfig.draft_model_path), the target's architecture
    kv_cache_dtype: str | None = None  # fp8: NxDI's fp8 KV cache (NXDI_FP8_KV); None: in dtype
    extra: dict = field(default_factory=dict)  # other NeuronConfig keyword arguments, passed through

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.tp_degree < 1 or self.batch_size < 1:
            raise ValueError("tp_degree and batch_size must be at least 1")
        if self.max_context_length > self.seq_len:
            raise ValueError(f"max_context_length {self.max_context_length} is over seq_len {self.seq_len}")
        if self.k_cache_transposed:
            raise ValueError("k_cache_transposed is not supported: each KV write would become head_dim copies of a few bytes (docs/neuron.md)")
        self._check_buckets()
        self._check_quantization()
        self._check_speculation()
        self._check_kv_cache()

    def _check_kv_cache(self) -> None:
        if self.kv_cache_dtype is None:
            return
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype}: NxDI's KV cache quantization is fp8 (e4m3, a cast of each line); "
                             "int8 KV is served by the torch backend")
        both = sorted(key for key in NXDI_FP8_KV if key in self.extra)
        if both:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} sets NeuronConfig's {', '.join(both)}: leave them out of the pass-through settings")

    def _check_quantization(self) -> None:
        object.__setattr__(self, "quantization_skip", tuple(self.quantization_skip))  # a JSON list -> a hashable, keyed tuple
        activations = sorted(key for key in NXDI_ACTIVATION_QUANTIZATION_KWARGS if self.extra.get(key))
        if activations:
            raise ValueError(f"NeuronConfig's {', '.join(activations)} (NxDI's fp8 activation quantization) is not served: its MLPs would "
                             "take weights this backend does not prepare; --quantization fp8 serves NxDI's fp8 weights, rows in --dtype")
        if self.quantization is None:
            return
        if self.quantization == "w8a8_int8":  # mapped here: NxDI's weight quantization (quantized=True), rows in the model's dtype
            raise ValueError("quantization w8a8_int8 (int8 activations) is served by the CPU kernels only; "
                             "on Neuron use int8 or fp8 (NxDI's weight quantization)")
        if self.quantization not in QUANTIZATION_DTYPES:
            raise ValueError(f"quantization must be one of {sorted(QUANTIZATION_DTYPES)} or None, got {self.quantization!r}")
        if self.quantization_type not in QUANTIZATION_TYPES:
            raise ValueError(f"quantization_type must be one of {sorted(QUANTIZATION_TYPES)}, got {self.quantization_type!r}")
        both = sorted(key for key in NXDI_QUANTIZATION_KWARGS if key in self.extra)
        if both:
            raise ValueError(f"quantization {self.quantization!r} sets NeuronConfig's {', '.join(both)}: leave them out of the pass-through settings")
        if self.extra.get("on_cpu"):
            # application_base.to_cpu builds the float model and loads the state dict into it
            # without NxD's convert(): the 8-bit weights would be read as plain numbers.
            raise ValueError("quantization is not supported in NxDI's CPU mode (on_cpu): to_cpu() never converts the linears to quantized ones")
        if self.quantization_type == "per_tensor" and self.quantization_skip:
            # NxDI's generate_quantized_state_dict quantizes every linear per tensor (NxD's
            # quantize_pytorch_model_per_tensor_symmetric takes no modules_to_not_convert), while
            # the compiled model keeps the skipped ones in full precision: their weights would
            # load as unscaled 8-bit numbers.
            raise ValueError(
                f"quantization_type per_tensor quantizes every linear in NxDI's quantized state dict, so quantization_skip "
                f"{list(self.quantization_skip)} cannot be kept in full precision: use per_channel, or an empty --quantization-skip ''"
            )

    def _check_speculation(self) -> None:
        """What NxDI's fused speculation cannot run, or this backend cannot carry, each refused in one line."""
        if self.speculation is None:
            if self.speculation_length or self.draft_model:
                raise ValueError("speculation_length and draft_model need speculation (draft or eagle)")
            return
        if self.speculation not in NXDI_SPECULATION:
            raise ValueError(f"--speculative-method {self.speculation}: NxDI speculates with a draft checkpoint inside the compiled step "
                             f"({' or '.join(NXDI_SPECULATION)}); {self.speculation} is served by the torch backend only")
        if not self.draft_model:
            raise ValueError(f"--speculative-method {self.speculation} on the neuron backend needs --draft-model (FusedSpecNeuronConfig.draft_model_path)")
        if self.speculation_length < 2:
            raise ValueError(f"speculation_length {self.speculation_length}: NxDI's fused step scores the input token and at least one guess (2 or more)")
        both = sorted(key for key in NXDI_SPECULATION_KWARGS if key in self.extra)
        if both:
            raise ValueError(f"speculation {self.speculation!r} sets NeuronConfig's {', '.join(both)}: leave them out of the pass-through settings")
        if self.extra.get("on_cpu"):
            # application_base.to_cpu, 0.4 to 0.9: "Speculation is not yet supported for CPU inference."
            raise ValueError("speculation is not supported in NxDI's CPU mode (on_cpu): to_cpu() raises for any speculation_length")
        if self.nxdi_async_mode:
            raise ValueError("NxDI's async_mode with fused speculation is not served: each fused step's tokens decide the next step's positions")
        # NeuronFusedSpecModel.forward tells a context encoding from a fused step by the input's width: more than one
        # position and not speculation_length. A prompt padded to a bucket of that width would run as a fused step.
        misread = sorted(b for b in {*self.context_buckets, self.context_limit} if b == self.speculation_length)
        if misread:
            raise ValueError(f"a context-encoding bucket of {misread[0]} positions equals speculation_length: NxDI's fused model would run "
                             "a prompt padded to it as a speculation step; choose other --context-buckets or --num-speculative-tokens")

    @property
    def speculates(self) -> bool:
        """Whether NxDI's fused speculation runs in the decode step (its steps return several tokens a row)."""
        return self.speculation is not None

    @property
    def context_limit(self) -> int:
        """NxDI's max_context_length: the longest prompt one context encoding takes."""
        return self.max_context_length or self.seq_len

    @property
    def context_encoding_buckets(self) -> list[int]:
        """The context buckets NxDI compiles: the given ones, ending at context_limit.

        ModelWrapper.get_target_bucket (_get_seq_bucket) raises "exceeds largest bucket" for a
        prompt longer than the last bucket, on that request. LMI's context_length_estimate
        (512,1024,2048 with n_positions 4096) ends below the context limit, so the limit is added
        as the last bucket, as NxDI's own generate_buckets always ends at max_context_length:
        every prompt the worker admits has a bucket, at the price of one more compiled graph.
        (Lowering the limit to the last bucket instead would refuse prompts the user's settings
        allow, and would make the same options mean a different limit on each engine.)"""
        buckets = list(self.context_buckets)
        if buckets and buckets[-1] < self.context_limit:
            buckets.append(self.context_limit)
        return buckets

    def _check_buckets(self) -> None:
        for name, buckets in (("context", self.context_buckets), ("token-generation", self.token_buckets)):
            if buckets and list(buckets) != sorted(buckets):
                raise ValueError(f"{name} buckets {list(buckets)} must be ascending")
        # NeuronConfig.__init__ asserts this; failing here says which flag to change.
        if self.context_buckets and self.context_buckets[-1] > self.context_limit:
            raise ValueError(f"the last context bucket {self.context_buckets[-1]} is over max_context_length {self.context_limit}")
        # ModelWrapper.get_target_bucket raises "exceeds largest bucket" for a decode step whose
        # attention mask is longer than the last bucket: mid-generation, for every running request.
        if self.token_buckets and self.token_buckets[-1] != self.seq_len:
            raise ValueError(f"the last token-generation bucket {self.token_buckets[-1]} must be seq_len {self.seq_len}, or decoding fails past it")


def compiled_lines(options: NeuronOptions) -> int:
    """KV lines compiled: the decode slots and one spare line that prefill writes (see prefill_line)."""
    return options.batch_size + 1


def compiled_seq_len(options: NeuronOptions) -> int:
    """NeuronConfig.seq_len: ours, plus speculation_length where a fused step scores that many positions past a row's
    input. ModelWrapper.get_target_bucket wants a token-generation bucket of the mask's length + speculation_length
    (else "exceeds largest bucket", for the whole step): a row at our last position still fits."""
    return options.seq_len + (options.speculation_length if options.speculation else 0)


def prefill_line(options: NeuronOptions) -> int:
    """The line every context encoding writes: NxDI's context encoding fills the whole
    padded prompt into line seq_ids[0], so it must be a line no request owns (a
    colocated worker prefills while its slots decode)."""
    return options.batch_size


def neuron_config_kwargs(options: NeuronOptions, on_device_sampling) -> dict:
    """Keyword arguments for NeuronConfig: continuous batching, one prompt per context
    encoding, dynamic on-device sampling, the seq_ids mask, NxDI's async mode off."""
    lines = compiled_lines(options)
    kwargs = dict(
        tp_degree=options.tp_degree,
        batch_size=lines,
        ctx_batch_size=1,
        tkg_batch_size=lines,
        max_batch_size=lines,
        seq_len=compiled_seq_len(options),
        max_context_length=options.context_limit,
        torch_dtype=DTYPES[options.dtype],
        is_continuous_batching=True,
        # A slot receiving KV must not be written by the decode steps running beside it.
        apply_seq_ids_mask=True,
        on_device_sampling_config=on_device_sampling,
        # NxDI's async mode (causal_lm_async_execution) launches a hidden step fed with its
        # own output while seq_ids stay the same, returns the step before, and discards the
        # hidden one when the batch changes, after it wrote position p+1 of every row, a
        # retired slot being refilled included. forward() still waits for the host copy.
        # Our decode loop overlaps host and device work itself; NxDI's is off.
        async_mode=options.nxdi_async_mode,
        enable_bucketing=options.enable_bucketing,
        # Weights sharded once at compile; a load does not re-shard them.
        save_sharded_checkpoint=True,
    )
    if options.context_buckets:
        kwargs["context_encoding_buckets"] = options.context_encoding_buckets
    if options.token_buckets:  # the last is seq_len (_check_buckets): with speculation, the longer compiled length
        kwargs["token_generation_buckets"] = [*options.token_buckets[:-1], compiled_seq_len(options)]
    kwargs.update(quantization_kwargs(options))
    kwargs.update(speculation_kwargs(options))
    if options.kv_cache_dtype == "fp8":
        kwargs.update(NXDI_FP8_KV)
    kwargs.update(options.extra)
    return kwargs


def speculation_options(method: str | None, num_tokens: int, draft_model: str | None) -> dict:
    """Our flags (--speculative-method, --num-speculative-tokens, --draft-model) -> NeuronOptions' speculation fields.

    --num-speculative-tokens counts a row's guesses; NxDI's speculation_length counts the positions a fused step
    scores: the input token and speculation_length - 1 draft tokens (NeuronFusedSpecModel._token_gen_forward runs the
    draft speculation_length times and feeds candidate_input_ids[:, :-1] to the target), so it is one more. (vLLM's
    Neuron worker passes num_speculative_tokens as speculation_length unchanged: one guess fewer than asked.)"""
    if method is None:
        return {}
    return dict(speculation=method, speculation_length=num_tokens + 1, draft_model=draft_model or "")


def speculation_kwargs(options: NeuronOptions) -> dict:
    """NeuronConfig's fused speculation: speculation_length positions scored per row and step (the input token and
    speculation_length - 1 draft tokens, NeuronFusedSpecModel._token_gen_forward). disable_kv_cache_tiling: with fused
    speculation NeuronConfig tiles the KV positions by 128 whenever max_length is a multiple of 128 above it, a layout the
    KV hand-off does not convert (refuse_unconvertible_layout); NxDI's own flag keeps the plain one."""
    if options.speculation is None:
        return {}
    return dict(speculation_length=options.speculation_length, disable_kv_cache_tiling=True, **NXDI_SPECULATION[options.speculation])


def draft_neuron_config(neuron_config, speculation: str, eagle_input_norm: bool = False, quantized_draft: str = ""):
    """The draft's NeuronConfig as NxDI's inference_demo derives it from the target's: a copy with speculation off,
    except EAGLE's draft, which keeps speculation_length (its last draft run) and is marked is_eagle_draft, its
    layers norming their input where the head's checkpoint has those norms (inference_demo's
    --enable-eagle-draft-input-norm). With quantization the draft is quantized as the target is (NxDI converts both
    of a fused model's models), its own quantized state dict at quantized_draft."""
    import copy

    draft = copy.deepcopy(neuron_config)
    if getattr(draft, "quantized", False):
        draft.quantized_checkpoints_path = quantized_draft
    if speculation != "eagle":
        draft.speculation_length = 0
    draft.enable_fused_speculation = False
    if speculation == "eagle":
        draft.is_eagle_draft = True
        draft.enable_eagle_draft_input_norm = eagle_input_norm
    return draft


def quantization_kwargs(options: NeuronOptions) -> dict:
    """NeuronConfig's weight quantization: NxDI converts the linears (NxD's convert) at trace time
    and reads their 8-bit weights and scales from quantized_checkpoints_path, a state dict made
    before the compile by the model class's save_quantized_state_dict (compile.ensure_quantized).
    modules_to_not_convert: NxD matches each entry as a substring of the module's name, as ours;
    a list, since NxDI's Llama extends it in place. None (quantize everything) when empty."""
    if options.quantization is None:
        return {}
    return dict(
        quantized=True,
        quantization_dtype=QUANTIZATION_DTYPES[options.quantization],
        quantization_type=QUANTIZATION_TYPES[options.quantization_type],
        modules_to_not_convert=list(options.quantization_skip) or None,
        quantized_checkpoints_path=str(quantized_path(options)),
    )


def compiled_root(options: NeuronOptions) -> pathlib.Path:
    return pathlib.Path(options.compiled_root) if options.compiled_root else pathlib.Path.home() / ".cache" / "disagg" / "neuron"


def compiled_key_options(options: NeuronOptions) -> dict:
    """The options a compile depends on: not the decode loop's async_mode, and the quantization
    settings only where quantization is on (unquantized keys stay as they were before them)."""
    skipped = {"async_mode"} | (set(QUANTIZATION_FIELDS) if options.quantization is None else set())
    skipped |= set(SPECULATION_FIELDS) if options.speculation is None else set()
    skipped |= {"kv_cache_dtype"} if options.kv_cache_dtype is None else set()
    return {k: v for k, v in asdict(options).items() if k not in skipped}


def quantized_path(options: NeuronOptions) -> pathlib.Path:
    """The quantized state dict's directory, shared by every compile of the same checkpoint and
    quantization settings (tp degree, batch and buckets do not change it): under the compiled
    root, keyed by the checkpoint's files, the settings and the NxDI and NxD releases that
    quantize (artifacts.quantizer)."""
    from .artifacts import checkpoint_fingerprint, digest, quantizer

    settings = {k: getattr(options, k) for k in QUANTIZATION_FIELDS}
    key = digest({"quantization": settings, "checkpoint": checkpoint_fingerprint(options.model), "quantizer": quantizer()})
    name = pathlib.Path(options.model.rstrip("/")).name or "model"
    return compiled_root(options) / "quantized" / f"{name}-{options.quantization}-{options.quantization_type}-{key}"


def draft_quantized_path(options: NeuronOptions, checkpoint: str) -> pathlib.Path:
    """The draft's quantized state dict (quantized_path of the draft's checkpoint, for EAGLE the draft directory
    written from the head and the target, with the same settings): NxDI reads a quantized fused model's draft
    weights from draft_model_path, so that is where it points."""
    import dataclasses

    return quantized_path(dataclasses.replace(options, model=checkpoint))


def compiled_path(options: NeuronOptions, nxdi_version: str | None = None) -> pathlib.Path:
    """A directory per distinct compile: our options, the checkpoint's files, NxDI's release
    (default: the installed one) and the compiler's with its flags (artifacts.toolchain). A
    change in any compiles into a new directory and never loads a stale one."""
    from .artifacts import checkpoint_fingerprint, digest, toolchain

    tools = toolchain(nxdi_version)
    parts = {"options": compiled_key_options(options), "checkpoint": checkpoint_fingerprint(options.model), "toolchain": tools}
    if options.speculation is not None:  # the draft's weights are sharded into the same directory
        parts["draft_checkpoint"] = checkpoint_fingerprint(options.draft_model)
    key = digest(parts)
    name = pathlib.Path(options.model.rstrip("/")).name or "model"
    quantized = f"-{options.quantization}" if options.quantization else ""
    speculated = f"-{options.speculation}{options.speculation_length}" if options.speculation else ""
    return compiled_root(options) / f"{name}-nxdi{tools['nxdi']}-tp{options.tp_degree}-b{options.batch_size}-s{options.seq_len}{quantized}{speculated}-{key}"


def full_attention_window(inference_config, seq_len: int) -> None:
    """The checkpoint's sliding window, as NxDI must see it: none, or refused at start-up.

    NxDI cannot hand off a windowed cache: Llama and Mistral pass the window to their KV
    manager, which sizes the cache to it and writes at position % (window - 1) with no
    seq_ids mask (KVCacheManager._get_index_to_update_new_position), and whose windowed
    prefill gathers window - 1 positions out of the prompt's bucket (get_last_kv_window:
    out of range for any bucket shorter than the window); Qwen2, Qwen3 and Mixtral ignore
    it and attend the whole context. A window of seq_len or more never masks anything
    (transformers masks a key once the query is `window` positions past it, and no position
    reaches seq_len), so it is dropped and NxDI builds full attention: exact. Below seq_len
    the checkpoint's attention differs from what NxDI would run: refused."""
    from .layout import UnsupportedLayout

    window = getattr(inference_config, "sliding_window", None)
    if not window:
        return
    if window < seq_len:
        raise UnsupportedLayout(
            f"sliding_window {window} is below seq_len {seq_len}: NxDI's windowed cache rolls (Llama, Mistral) or attends the whole "
            f"context (Qwen2, Qwen3, Mixtral), which the KV hand-off cannot carry exactly; serve with --max-seq-len {window} or less"
        )
    inference_config.sliding_window = None

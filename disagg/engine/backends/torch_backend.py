"""The portable backend: transformers decoder-only checkpoints, on CPU or CUDA.

The model code is untouched: it runs its own attention and builds its own
masks, while `slot_cache` hands it the engine's slot KV cache as a transformers
`Cache`. Architectures the engine cannot serve exactly are refused at start-up
(`architectures`).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from disagg.kv_transport.chunk_codec import KvKind, dtype_name
from disagg.rpc import startup

from .. import memory, shared_weights, weight_storage
from ..cpu_kernels import native_step, prefill_attention, slot_attention, small_gemm
from ..cpu_kernels.packed_linear import SMALL_ROWS, PackedLinear, can_prepack, group_shared_inputs, prepack_linears
from ..faults import DeviceLost
from ..kv_blocks import DEFAULT_BLOCK_SIZE
from ..model_files import eos_token_ids
from ..quantization import QuantizationSettings, kv_cache
from ..quantization.kv_cache import dequantized
from ..quantization.loading import LoadedWeights, load_weights
from ..quantization.model import DEFAULT_SKIP
from ..requests import Sampling, TokenLogprobs
from ..sampler import SampleOutput, SlotTokenCounts, params_tensor, sample, token_rows
from ..threads import on_the_teams_cpu
from . import architectures, row_masks
from .base import Backend, ModelInfo, PrefillResult, PrefixKv, StepInputs
from .compiled import CompiledDecode
from .slot_kv_cache import DecodeCache, DecodeStep, KvQuantization, LayerKvCallback, PagedKvCache, PrefillCache, layer_plans

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class TorchBackendConfig:
    model: str
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_seq_len: int = 0  # 0: the model's max_position_embeddings, capped at 4096
    global_topk: int = 0  # 0: sample over the whole vocabulary
    # The decode step as one compiled graph over buckets (`compiled`). None: on CUDA only
    # (a CUDA graph per bucket: 12.6x faster there; on CPU compiling every bucket takes many minutes).
    compile: bool | None = False
    batch_buckets: tuple[int, ...] = ()  # () with compile: powers of two up to the slot count
    token_buckets: tuple[int, ...] = ()  # KV-length buckets; (): powers of two from 128 up to max_seq_len
    # With compile: the most rows a verify step (speculation's guesses as rows of their own) has, its graph's last rows
    # bucket; 0: no verify graph, and the compiled step scores no guesses.
    verify_rows: int = 0
    # With compile: the graphs also return each row's final hidden states (EAGLE's head reads them: keep_hidden).
    step_hidden: bool = False
    # Linear weights laid out for few-row products (`packed_linear`). None: on CPU.
    prepack: bool | None = None
    # Eager decode steps and prefills of up to native_step.prefill_max_rows rows as one call into native_step.c.
    # None: wherever it serves the model (and a start-up step agrees).
    native_step: bool | None = None
    # Prepacked weights in one file per box, mapped by every worker that serves the same checkpoint (`shared_weights`).
    share_weights: bool = True
    # Linear weights in 8 bits, quantized at load (disagg/engine/quantization): "int8", "fp8" (weight-only),
    # "w8a8_int8" (int8 weights, each linear's input rows quantized per row at run time), or None.
    quantization: str | None = None
    quantization_type: str = "per_channel"
    quantization_skip: tuple[str, ...] = DEFAULT_SKIP
    # The KV cache in 8 bits ("int8", "fp8"; None: in `dtype`), a scale per block of kv_block_size positions and head.
    kv_cache_dtype: str | None = None
    kv_block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.quantization_settings()  # a bad method or type fails here, before the model loads
        if self.kv_cache_dtype is not None:
            kv_cache.code_dtype(self.kv_cache_dtype)
            if self.kv_block_size < 1:
                raise ValueError(f"kv_block_size must be at least 1, got {self.kv_block_size}")
            if self.compile:
                raise ValueError("--kv-cache-dtype needs the paged KV cache, and the compiled decode step keeps a slot per sequence: run with --no-compile")

    def kv_quantization(self) -> KvQuantization | None:
        if self.kv_cache_dtype is None:
            return None
        return KvQuantization(kv_cache.code_dtype(self.kv_cache_dtype), self.kv_block_size)

    def quantization_settings(self) -> QuantizationSettings:
        return QuantizationSettings(self.quantization, self.quantization_type, tuple(self.quantization_skip))


def guesses_before(input_ids: torch.Tensor, guess_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab]: for each row, how often each token is among its sequence's guesses up to its own
    (a guess row's input is a guess; they precede the row's token as generated tokens)."""
    guessed = torch.zeros(len(input_ids), vocab, dtype=torch.int32, device=input_ids.device)
    is_guess = guess_index > 0
    guessed[is_guess.nonzero()[:, 0], input_ids[is_guess]] = 1
    running = guessed.cumsum(0)
    first_row = torch.arange(len(input_ids), device=input_ids.device) - guess_index  # each row's sequence's input row
    return running - running[first_row]  # the input row holds no guess: the sum over guesses 1..j


def kept_rows(input_ids: torch.Tensor, guess_index: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[n] bool: the rows whose tokens their sequence keeps (speculation/acceptance.py, on the device):
    a row after every guess before it, its own included, equalled the token produced before it."""
    missed = torch.zeros(len(input_ids), dtype=torch.int32, device=input_ids.device)
    missed[1:] = ((guess_index[1:] > 0) & (input_ids[1:] != token_ids[:-1])).to(torch.int32)
    running = missed.cumsum(0)
    first_row = torch.arange(len(input_ids), device=input_ids.device) - guess_index
    return running == running[first_row]


def describe(model_path: str, config, backend: str, dtype: torch.dtype, max_seq_len: int, kv_shape: tuple[int, int], eos: tuple[int, ...]) -> ModelInfo:
    text_config = config.get_text_config(decoder=True)
    limit = architectures.context_limit(text_config)
    return ModelInfo(
        name=model_path.rstrip("/").rsplit("/", 1)[-1] if "/" in model_path else model_path,
        backend=backend,
        dtype=dtype_name(dtype),
        num_layers=text_config.num_hidden_layers,
        kv_heads=kv_shape[0],
        head_dim=kv_shape[1],
        vocab_size=text_config.vocab_size,
        eos_token_ids=eos,
        max_seq_len=min(max_seq_len or min(limit, 4096), limit),
    )


def load_model(path: str, dtype: torch.dtype, device: torch.device):
    """The checkpoint with transformers' own choice of attention (TorchBackend has checked its verdict)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def close(reference: torch.Tensor, other: torch.Tensor) -> bool:
    """The same arithmetic with sums in another order (the kernels' checks at start-up):
    within 1e-4 of the reference's scale, far tighter than far_apart."""
    return bool((reference - other).abs().max() <= 1e-4 * reference.abs().max() + 1e-5)


# How far a bf16 native step or prefill may be from transformers' bf16 modules, in the
# logits' (or K/V's) scale. Both round, differently: transformers every intermediate to bf16,
# the native path only the weights, the K/V lines and (bf16-dot) the products' input rows. On
# Llama-3.2-1B's shape with seeded weights, against float32 arithmetic over the same weights,
# transformers' step is 2.9% of the scale off and the native one 1.5%, so the two are 3.2%
# apart; a wrong position, mask or product moves the logits by their whole scale.
BF16_AGREEMENT = 0.1
# The same for W8A8 (`--quantization w8a8_int8`), either dtype: each product's input rows are quantized
# per row, so an input that differs by a rounding (transformers' bf16 intermediates, the native path's
# float32 ones) can land on the next int8 step, 1/127 of its row's largest value. On Llama-3.2-1B's shape
# with seeded weights the native step and prefill sat 2-12% of the scale from the modules (int8
# weight-only: 0.5-3%); a wrong position, mask or product still moves the logits by their whole scale.
W8A8_AGREEMENT = 0.25


def agrees(reference: torch.Tensor, other: torch.Tensor, dtype: torch.dtype, int8_rows: bool = False) -> bool:
    """A native kernel's output against transformers' in the model's dtype: float32 the
    same arithmetic in another order (`close`); bf16 within BF16_AGREEMENT; W8A8 (int8_rows)
    within W8A8_AGREEMENT."""
    if dtype == torch.float32 and not int8_rows:
        return close(reference, other)
    reference, other = reference.float(), other.float()
    bound = W8A8_AGREEMENT if int8_rows else BF16_AGREEMENT
    return bool((reference - other).abs().max() <= bound * reference.abs().max() + 1e-3)


def far_apart(reference: torch.Tensor, other: torch.Tensor, dtype: torch.dtype = torch.float32, int8_rows: bool = False) -> bool:
    """Logits that differ by more than rounding: a wrong mask, position or product
    moves them by their own scale; rounding by far less. In bf16 the bound is
    BF16_AGREEMENT's: over 30 untrained SmolLM-135M layers, packed products (float32
    sums, one rounding) sit 1.8% of the scale from transformers' bf16 linears, and
    8-bit weights 2.4% from their dequantized values rounded to bf16 (the kernel
    multiplies the exact values * scale; the reference model holds them rounded)."""
    reference, other = reference.float(), other.float()
    bound = W8A8_AGREEMENT if int8_rows else BF16_AGREEMENT if dtype == torch.bfloat16 else 2e-2
    return bool((reference - other).abs().max() > bound * reference.abs().max() + 1e-3)


class TorchBackend(Backend):
    def __init__(self, config: TorchBackendConfig, model=None):
        """model: an already-built model (the model-support sweep), used as it is."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.loaded_here = model is None  # a model handed in is used as it is: its weights are not shared
        self.weights_note = "not shared"  # what became of the box's packed weights file (shared_weights.share)
        self.weight_storage: torch.dtype | None = None  # bf16 panels for a float32 model of bf16 numbers (weight_storage), once packed
        # The model, its linears set to their dequantized values where they are 8-bit (`quantized`: those weights, by name).
        if model is None:  # before either loader (load_model, or a pre-quantized checkpoint's built from its config)
            architectures.check_verdict(AutoConfig.from_pretrained(config.model))
        self._check_w8a8_kernel()
        self.int8_rows = bool(config.quantization_settings().activations)  # W8A8: the start-up checks' wider agreement
        if model is not None:
            loaded = LoadedWeights(model, {}, "")
        else:
            loaded = load_weights(config.model, self.dtype, self.device, config.quantization_settings(), load_model)
        self.model, self.quantized, self.quantization_note = loaded.model, loaded.quantized, loaded.note
        del loaded  # its 8-bit weights are dropped once packed (below): nothing else may hold them
        if self.quantization_note:
            log.info("%s", self.quantization_note)
        architectures.check_structure(self.model)
        row_masks.install()
        self.plans = layer_plans(self.model.config)
        kv_shape = architectures.check_kv_shapes(self.model.config, self._probe(), len(self.plans))
        eos = eos_token_ids(config.model, self.model.config) if model is None else architectures.config_eos(self.model.config)
        self.info = describe(config.model, self.model.config, "torch", self.dtype, config.max_seq_len, kv_shape, eos)
        if config.kv_cache_dtype is not None:
            self.info = dataclasses.replace(self.info, kv_cache_dtype=config.kv_cache_dtype, kv_block_size=config.kv_block_size)
        # Set once the start-up checks below have run (they compare kernels over unquantized KV): prefills then hand on codes and scales.
        self.kv_quantization: KvQuantization | None = None
        self.cache: PagedKvCache | None = None
        self.paged = False  # KV in blocks with a table per sequence (else a slot per sequence), once allocated
        self.compile = config.compile if config.compile is not None else self.device.type == "cuda"
        self.compiled: CompiledDecode | None = None  # when compiling, once the slots exist
        self.reads_in_place = False  # eager steps read scattered slots in place (slot_attention), once checked
        self.native: native_step.NativeModel | None = None  # eager decode steps in one C call, once checked
        self.native_prefill: native_step.NativeModel | None = None  # prompts in one C call, once checked
        if config.prepack is not False and can_prepack(self.device, self.dtype):
            self._prepack()
        elif config.prepack is not False and self.device.type == "cpu":
            log.info("linear layers not prepacked: oneDNN does not pack %s on this CPU", config.dtype)
        if self.quantized and not any(isinstance(m, PackedLinear) and m.panels is not None and m.panels.dtype in small_gemm.QUANTIZED_DTYPES
                                      for m in self.model.modules()):
            log.warning("8-bit weights held dequantized in %s: no 8-bit kernel runs here (served exactly, in full precision's memory)", config.dtype)
        # The 8-bit values now live in the panels (or the box's file): the loader's copies would double them (0.91 GiB for Llama-3.2-1B).
        self.quantized = {}
        # native_step.c over the prepacked weights, where it serves the model: prompts now, decode steps with the slots.
        self.native_model = self._native_model() if config.native_step is not False else None
        if self.native_model is not None:
            self.native_prefill = self._check_native_prefill()
        self.prefill_attention = self._check_prefill_attention()  # long bf16 prompts' attention in prefill_attention.c
        self.token_counts: SlotTokenCounts | None = None  # with the slots: what penalties read
        # EAGLE (speculation/eagle.py) reads each decode step's final hidden states [n, hidden]: kept only where asked.
        self.keep_hidden = False
        self.step_hidden: torch.Tensor | None = None
        self.kv_quantization = config.kv_quantization()
        if self.kv_quantization is not None:
            if self.compile:
                raise ValueError("--kv-cache-dtype needs the paged KV cache, and the compiled decode step keeps a slot per sequence: run with --no-compile")
            self.native_prefill = None  # native_step.c attends over the prompt's own K/V, not the values its codes stand for
            log.info("KV cache in %s: a float32 scale per block of %d positions and head", config.kv_cache_dtype, config.kv_block_size)
        if self.loaded_here:  # a model handed in (the sweep, ~200 of them) was loaded by its caller, and a full gc.collect costs 0.2 s each
            memory.return_freed_memory()  # what loading and the checks freed, given back (1.35 GiB for Llama-3.2-1B quantized at load)

    def _check_w8a8_kernel(self) -> None:
        """W8A8 on a CPU is served by its kernel (VPDPBUSD, or AVX2's VPMADDUBSW): refused at start-up where it does
        not run (no AVX2, no C compiler), rather than served through full precision's products at full precision's memory."""
        settings = self.config.quantization_settings()
        if settings.activations and self.device.type == "cpu" and self.config.prepack is not False:
            if small_gemm.quantized_kernel(torch.int8, self.dtype, settings.activations) is None:
                raise ValueError(f"--quantization {settings.method}: its kernel needs a CPU with AVX2 and a C compiler, and does not "
                                 "run here; serve --quantization int8 (weight-only) on this host")

    def _prepack(self) -> None:
        """Prepacks the linears; refuses a model whose logits they change (one that
        uses a linear's weight in some way `PackedLinear` does not serve)."""
        # Each product path: one row, a few (the decode step's), and more than SMALL_ROWS (a prefill's:
        # the kernel's shared blocks, or oneDNN, as this thread may use one core or more).
        prompts = ([0], [0, 1, 2, 3], [0] * min(SMALL_ROWS + 1, self.info.max_seq_len))
        plain = [self.prefill_logits(prompt, lambda *kv: None) for prompt in prompts]
        values = tuple(q.values.dtype for q in self.quantized.values())
        self.weight_storage, why = weight_storage.narrower_storage(self.model, self.dtype, self.device, set(self.quantized))
        if why:
            log.info("%s", why)
        key = (shared_weights.key_for(self.config.model, self.dtype, self.quantization_note, values, self.weight_storage)
               if self.config.share_weights and self.loaded_here else None)
        if key is None:
            self._pack_and_group(None)
        else:
            waited = []

            def on_wait() -> None:
                waited.append(True)
                startup.report(startup.Phase.WAITING_FOR_COMPILE, "waiting for another worker writing this model's packed weights file")

            self.weights_note = shared_weights.share(self.model, key, self._pack_and_group, on_wait, str(pathlib.Path(self.config.model).resolve()))
            log.info("%s", self.weights_note)
            if waited:
                startup.report(startup.Phase.LOADING, "packed weights ready; checking them")
        if any(far_apart(before, self.prefill_logits(prompt, lambda *kv: None), self.dtype, self.int8_rows) for before, prompt in zip(plain, prompts)):
            architectures.refuse(self.model.config, "its logits change with prepacked linear layers (run with --no-prepack)")

    def _pack_and_group(self, panels: dict[str, torch.Tensor] | None) -> None:
        log.info("prepacked %d linear layers for the CPU", prepack_linears(self.model, panels, self.quantized, self.weight_storage))
        groups = group_shared_inputs(self.model, lambda: self.prefill_logits([0], lambda *kv: None))
        if groups:
            log.info("%d groups of linear layers read the same input: each group is one product", groups)

    @torch.inference_mode()
    def _probe(self) -> dict[int, tuple]:
        """Two 2-token prompts that differ in their second token: refuses a model whose
        first position sees the second (an encoder's LM head not set up as a decoder);
        returns, per layer that writes KV, (keys shape, values shape)."""
        shapes: dict[int, tuple] = {}
        first_logits = []
        for second in (0, 1):
            cache = PrefillCache(self.plans, lambda layer, k, v: shapes.setdefault(layer, (tuple(k.shape), tuple(v.shape))))
            ids = torch.tensor([[0, second]], dtype=torch.long, device=self.device)
            out = self.model(ids, position_ids=torch.arange(2, device=self.device)[None], past_key_values=cache, use_cache=True)
            first_logits.append(out.logits[0, 0])
        # Not bitwise: a mixture of experts groups tokens per expert, so the first
        # row's rounding may follow the second token; seeing it moves the logits by far more.
        first, other = (t.float() for t in first_logits)
        if (first - other).abs().max() > 1e-2 * first.abs().max() + 1e-3:
            architectures.refuse(self.model.config, "attention is not causal: the first position sees the next token (set is_decoder for an encoder's LM head)")
        return shapes

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], sampling: Sampling, on_layer: LayerKvCallback | None = None, first_step: int = 0,
                prefix_kv: PrefixKv | None = None, bitmask: torch.Tensor | None = None) -> PrefillResult:
        layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep_layer(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            layers[layer] = (keys, values)
            if on_layer is not None:
                on_layer(layer, keys, values)

        logits = self.prefill_logits(token_ids, keep_layer, prefix_kv)
        counts = in_prompt = None
        if sampling.penalized:
            split = len(token_ids) - first_step  # the tokens after it were generated earlier
            counts, in_prompt = token_rows(token_ids[:split], token_ids[split:], self.info.vocab_size, self.device)
        out = sample(
            logits,  # [1, vocab]
            params_tensor([sampling], self.device),
            torch.tensor([sampling.seed], device=self.device),
            torch.full((1,), first_step, dtype=torch.long, device=self.device),
            self.config.global_topk,
            counts,
            in_prompt,
            sampling.logprobs,
            bitmask,
        )
        first = int(out.token_ids[0])
        logprobs = out.rows([sampling.logprobs])[0]
        return PrefillResult(
            first_token=first,
            layers=[layers[i] for i in range(self.info.num_layers)],
            logprobs=None if logprobs is None else TokenLogprobs(first, logprobs[0], tuple(logprobs[1])),
        )

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int], on_layer: LayerKvCallback, prefix_kv: PrefixKv | None = None) -> torch.Tensor:
        """[1, vocab]: the logits after the prompt; each layer's K/V goes to on_layer. With
        prefix_kv (the KV of token_ids[:P]), only tokens P.. run, and on_layer gets theirs."""
        start = 0
        if prefix_kv is not None:
            prefix_kv = self._checked_prefix(prefix_kv, len(token_ids))
            start = prefix_kv[0][0].shape[1]
        if self.native_prefill is not None and len(token_ids) - start <= self._native_prefill_rows():
            return self.native_prefill.prefill_logits(token_ids, on_layer, prefix_kv)
        with on_the_teams_cpu():  # oneDNN's even split: the caller too on a CPU of its own
            return self._modules_prefill(token_ids, on_layer, prefix_kv, start)

    def _modules_prefill(self, token_ids: list[int], on_layer: LayerKvCallback, prefix_kv: PrefixKv | None, start: int) -> torch.Tensor:
        input_ids = torch.tensor([token_ids[start:]], dtype=torch.long, device=self.device)  # [1, L - P]
        positions = torch.arange(start, len(token_ids), device=self.device)[None]  # [1, L - P]: P.. L-1
        cache = PrefillCache(self.plans, on_layer, prefix_kv, self.kv_quantization)
        out = self.model(input_ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _checked_prefix(self, prefix_kv: PrefixKv, prompt_len: int) -> PrefixKv:
        """prefix_kv on this backend's device and dtype, once its shape is known to fit: a
        prefix of P < prompt_len tokens, [kv_heads, P, head_dim] in every layer."""
        info = self.info
        prefix_len = prefix_kv[0][0].shape[1] if len(prefix_kv) else -1
        expected = (info.kv_heads, prefix_len, info.head_dim)
        if len(prefix_kv) != info.num_layers or not 0 < prefix_len < prompt_len or any(
            tuple(t.shape) != expected for pair in prefix_kv for t in pair
        ):
            shapes = sorted({tuple(t.shape) for pair in prefix_kv for t in pair})
            raise ValueError(
                f"prefix_kv: {len(prefix_kv)} layers of {shapes}; expected {info.num_layers} of [{info.kv_heads}, P, {info.head_dim}] with 0 < P < {prompt_len}"
            )
        if self.kv_quantization is not None:  # the prompt attends over the values the codes stand for
            return [(dequantized(k.to(self.device), self.dtype), dequantized(v.to(self.device), self.dtype)) for k, v in prefix_kv]
        return [(k.to(self.device, self.dtype), v.to(self.device, self.dtype)) for k, v in prefix_kv]

    @property
    def pages_kv(self) -> bool:
        """Eager steps read block tables; the compiled step keeps one slot of every position per sequence."""
        return not self.compile

    @property
    def scores_guesses(self) -> bool:
        """The eager steps (native, in-place attention, transformers' modules) do; the compiled step does where it has
        a verify graph (verify_rows). Over an 8-bit KV cache only the native step does: its verify rows write and
        attend in turn, and a rejected guess's append is undone (a scale it grew would change the kept lines' codes);
        before the slots exist, where it may run."""
        if self.compile:
            return self.config.verify_rows > 0
        if self.kv_quantization is None:
            return True
        return self.native is not None if self.cache is not None else self.native_model is not None

    @property
    def guesses_refusal(self) -> str | None:
        if self.scores_guesses:
            return None
        if self.compile:
            return "its compiled step was built without a verify graph (verify_rows 0)"
        return (f"over its {self.config.kv_cache_dtype} KV cache only the native step (native_step.c) scores guesses, "
                "and it does not serve this model here")

    def allocate_slots(self, num_slots: int, num_blocks: int = 0, block_size: int = 0) -> int:
        """The KV cache for num_slots sequences: num_blocks blocks of block_size positions
        (pages_kv), or else a slot of every position per sequence; compiled, also every
        decode bucket (before the worker serves)."""
        info = self.info
        self.paged = bool(num_blocks)
        quantization = self.kv_quantization
        if quantization is not None and (not num_blocks or block_size != quantization.block_size):
            raise ValueError(
                f"an 8-bit KV cache is paged in blocks of its scales' {quantization.block_size} positions, not {num_blocks} blocks of {block_size}"
            )
        if num_blocks:
            if not self.pages_kv:
                raise ValueError("the compiled decode step keeps one slot per sequence: allocate without blocks")
            self.cache = PagedKvCache.allocate(
                info.num_layers, num_blocks, info.kv_heads, block_size, info.head_dim, self.dtype, self.device, heads_outermost=True,
                code_dtype=None if quantization is None else quantization.code_dtype,
            )
            self.row_tables = torch.zeros(num_slots, -(-info.max_seq_len // block_size), dtype=torch.long, device=self.device)
        else:
            # Compiled: a scratch slot, where the padding rows write, and a scratch position,
            # never written or read: it keeps every KV-length bucket's view of the cache
            # non-contiguous, the last bucket too, so all buckets share one graph (a view
            # spanning a whole dimension takes other guards in Dynamo and compiled anew).
            scratch = 1 if self.compile else 0
            self.cache = PagedKvCache.allocate(
                info.num_layers, num_slots + scratch, info.kv_heads, info.max_seq_len + scratch, info.head_dim, self.dtype, self.device
            )
            self.row_tables = torch.arange(num_slots, device=self.device)[:, None]  # slot i is block i
        self.token_counts = SlotTokenCounts(num_slots, info.vocab_size, self.device)  # penalties: 5 bytes per slot and vocabulary entry
        if self.compile:
            self.compiled = CompiledDecode(
                self.model, self.plans, self.cache, num_slots, self.config.batch_buckets, self.config.token_buckets, info.max_seq_len,
                self.config.verify_rows, self.config.step_hidden,
            )
            log.info("compiling the decode step: batch buckets %s, KV-length buckets %s, verify rows buckets %s", list(self.compiled.batch_buckets),
                     list(self.compiled.token_buckets), list(self.compiled.verify_buckets))
            seconds = self.compiled.warm_up()
            log.info("decode step compiled in %.1fs", seconds)
            self._check_compiled_equals_eager(num_slots)
        else:
            self.reads_in_place = self._check_reads_in_place(num_slots)
            if self.native_model is not None:  # over an 8-bit cache too: its build appends codes as the eager step does
                self.native = self._check_native_step(num_slots)
            if num_blocks:
                self.row_tables.zero_()  # the checks' tables; a sequence's own comes with start_sequence
        return self.cache.nbytes

    def device_error(self, exc: BaseException) -> BaseException:
        """On CUDA, an error the CUDA runtime reports (torch.AcceleratorError: an illegal address, a
        device-side assert, a launch failure) is DeviceLost: most such errors are sticky, every later
        call on the context fails the same way, so the worker restarts rather than sort them. Out of
        memory (torch.OutOfMemoryError, not an AcceleratorError) fails only its step, as on CPU."""
        if self.device.type == "cuda" and isinstance(exc, torch.AcceleratorError) and not isinstance(exc, DeviceLost):
            lost = DeviceLost(f"CUDA: {exc}")
            lost.__cause__ = exc
            return lost
        return exc

    def write_kv(self, table: list[int], layer: int, kind: KvKind, token_start: int, tensor: torch.Tensor) -> None:
        self.cache.write(table, layer, kind is KvKind.KEY, token_start, tensor)

    @torch.inference_mode()
    def _check_compiled_equals_eager(self, num_slots: int) -> None:
        """Refuses a model whose compiled step disagrees with its eager one: the
        model-support sweep verified the eager slot cache, not the bucketed graph."""
        inputs = self._probe_step(list(range(min(num_slots, 2))))
        eager, eager_hidden = self._eager_logits_and_hidden(inputs)
        # The verify graph over the same rows (one a slot: its gather reads what the plain graph's view does).
        graphs = [self.compiled.logits] + ([self.compiled.verify_logits] if self.compiled.verify_buckets else [])
        for graph in graphs:
            compiled = graph(inputs.slots, inputs.positions, inputs.input_ids, inputs.kv_len)
            compiled, compiled_hidden = compiled if self.compiled.hidden else (compiled, None)
            if far_apart(eager, compiled) or (compiled_hidden is not None and far_apart(eager_hidden, compiled_hidden.float())):
                architectures.refuse(self.model.config, "its compiled decode step does not equal the eager one (run with --no-compile)")

    def _eager_logits_and_hidden(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager step's logits and final hidden states (the final norm's output: what the LM head multiplies)."""
        kept = []
        # transformers' decoder models end in `norm` before the LM head: its output is the final hidden state.
        hook = self.model.model.norm.register_forward_hook(lambda module, args, out: kept.append(out))
        try:
            logits = self._eager_logits(inputs)
        finally:
            hook.remove()
        return logits, kept[-1][:, -1].float()

    def _probe_step(self, slots: list[int]) -> StepInputs:
        """A start-up check's step (every slot free): random KV in the slots up to the
        last of `slots`, which stand at different positions, past a 16-token sliding
        window where the slots are that long."""
        generator = torch.Generator().manual_seed(0)
        used = self._probe_tables(slots)
        for cache in (*self.cache.keys, *self.cache.values):
            values = torch.randn(cache[:used].shape, generator=generator)
            # 8-bit codes: spread over the format's range (scales below bring them back near one).
            cache[:used].copy_(values if self.cache.key_scales is None else (values * 40).clamp(-127, 127).round())
        if self.cache.quantized:
            for scales in (*self.cache.key_scales, *self.cache.value_scales):
                scales[:used].copy_(torch.rand(scales[:used].shape, generator=generator) / 40)
        last = self.info.max_seq_len - 1
        rows = len(slots)
        positions = torch.tensor([min(40, last), min(23, last)][:rows])
        contiguous = slots == list(range(slots[0], slots[0] + rows))
        return StepInputs(
            slots=torch.tensor(slots), positions=positions, input_ids=torch.tensor([1, 2][:rows]), params=torch.zeros(rows, 7),
            seeds=torch.zeros(rows, dtype=torch.long), steps=torch.zeros(rows, dtype=torch.long),
            kv_len=int(positions.max()) + 1, contiguous_from=slots[0] if contiguous else None, min_position=int(positions.min()),
        )

    def _probe_tables(self, slots: list[int]) -> int:
        """Block tables for a check's rows (paged: the rows' blocks interleaved, from block 1, wrapping
        round a small cache); returns how many leading blocks the rows read. Only those are filled:
        filling every block of a 2 GiB cache with random numbers took minutes of a worker's start."""
        blocks, width = self.cache.keys[0].shape[0], self.row_tables.shape[1]
        if not self.paged:  # the slot layout: slot i is block i
            return slots[-1] + 1
        stride = max(slots) + 1
        for slot in slots:
            self.row_tables[slot] = (torch.arange(width) * stride + slot) % (blocks - 1) + 1
        read = -(-(min(40, self.info.max_seq_len - 1) + 1) // self.cache.block_size)  # the blocks holding a probe row's positions
        return int(self.row_tables[slots, :read].max()) + 1

    @torch.inference_mode()
    def _check_reads_in_place(self, num_slots: int) -> bool:
        """Whether eager steps read the slots in place (`slot_attention`): where the
        kernel serves this model's attention and a step over slots 0 and 2 gives the
        gathered step's logits."""
        if num_slots < 3 or self.dtype != torch.float32 or self.device.type != "cpu" or self.model.config._attn_implementation != "sdpa":
            return False
        if slot_attention.kernel(self.cache.keys[0].dtype) is None:
            return False
        slot_attention.install()
        inputs = self._probe_step([0, 2])
        gathered = self._eager_logits(inputs, read_in_place=False)
        try:
            in_place = self._eager_logits(inputs, read_in_place=True)
        except (RuntimeError, ValueError) as exc:
            log.info("decode attention gathers scattered slots: reading them in place fails for this model: %s", exc)
            return False
        if not close(gathered, in_place):
            log.info("decode attention gathers scattered slots: reading them in place changes this model's logits")
            return False
        log.info("decode attention reads scattered slots in place")
        return True

    def _native_model(self) -> native_step.NativeModel | None:
        """The model laid out for native_step.c, where it serves this model (else None, logged)."""
        reason = "it runs on CUDA" if self.device.type != "cpu" else native_step.unserved(self.model, self.plans)
        if reason is None:
            try:
                return native_step.NativeModel(self.model, self.plans)
            except ValueError as exc:
                reason = str(exc)
        log.info("decode steps and prefills run through transformers' modules: the native step does not serve this model: %s", reason)
        return None

    @torch.inference_mode()
    def _check_native_prefill(self) -> native_step.NativeModel | None:
        """The native model for prompts, where a one-token prompt and one past a 16-token
        sliding window give transformers' logits and K/V."""
        for length in (1, min(40, self.info.max_seq_len)):
            prompt = [(7 * i + 1) % self.info.vocab_size for i in range(length)]
            reference_kv, native_kv = [], []  # (keys, values) per layer, in the order handed on
            reference = self.prefill_logits(prompt, lambda layer, k, v: reference_kv.append((layer, k.clone(), v.clone())))
            logits = self.native_model.prefill_logits(prompt, lambda layer, k, v: native_kv.append((layer, k, v)))
            same_layers = [row[0] for row in reference_kv] == [row[0] for row in native_kv]
            pairs = [(reference, logits), *((a, b) for theirs, ours in zip(reference_kv, native_kv) for a, b in zip(theirs[1:], ours[1:]))]
            if not same_layers or not all(a.shape == b.shape and agrees(a, b, self.dtype, self.int8_rows) for a, b in pairs):
                log.info("prefills run through transformers' modules: the native prefill changes this model's logits or K/V")
                return None
        log.info("prefills of up to %d new tokens run natively (native_step.c; %s at %d torch threads%s)",
                 native_step.prefill_max_rows(self.dtype, torch.get_num_threads(), self.native_model.blocks_prompts), self.dtype,
                 torch.get_num_threads(), "; their attention blocked, in prefill_attention.c" if self.native_model.blocks_prompts else "")
        return self.native_model

    def _native_prefill_rows(self) -> int:
        """The most rows past a cached prefix a prompt runs through native_prefill with."""
        return native_step.prefill_max_rows(self.dtype, torch.get_num_threads(), self.native_prefill.blocks_prompts)

    @torch.inference_mode()
    def _check_prefill_attention(self) -> bool:
        """Whether long bf16 prompts' attention runs in prefill_attention.c: where it builds here
        and a whole prompt and one past a cached prefix give SDPA's logits and K/V."""
        uses_sdpa = getattr(self.model.config, "_attn_implementation", None) == "sdpa"
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not uses_sdpa or prefill_attention.kernel() is None:
            return False
        length = 2 * prefill_attention.MIN_ROWS + 8  # a whole prompt, and its last MIN_ROWS + 8 rows past a cached prefix
        if length > self.info.max_seq_len:
            return False  # no prompt here is long enough to reach the kernel
        prompt = [(5 * i + 3) % self.info.vocab_size for i in range(length)]
        prefix_len = prefill_attention.MIN_ROWS
        layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._modules_prefill(prompt[:prefix_len], lambda layer, k, v: layers.setdefault(layer, (k.clone(), v.clone())), None, 0)
        prefix = [layers[i] for i in range(self.info.num_layers)]
        runs = []
        calls = prefill_attention.kernel().calls
        prefill_attention.install()
        for served in (False, True):
            prefill_attention.serve(self.model.modules(), served)
            for cached in (None, prefix):
                kv: list[torch.Tensor] = []
                start = 0 if cached is None else prefix_len
                logits = self._modules_prefill(prompt, lambda layer, k, v: kv.extend((k.clone(), v.clone())), cached, start)
                runs.append([logits, *kv])
        sdpa, ours = runs[:2], runs[2:]
        if prefill_attention.kernel().calls == calls:  # no call it serves (heads of another size, eager attention, a window, ...)
            prefill_attention.serve(self.model.modules(), False)
            log.info("long prompts' attention runs in SDPA: prefill_attention.c does not serve this model's attention (heads of %d)", self.info.head_dim)
            return False
        if not all(a.shape == b.shape and agrees(a, b, self.dtype, self.int8_rows) for theirs, mine in zip(sdpa, ours) for a, b in zip(theirs, mine)):
            prefill_attention.serve(self.model.modules(), False)
            log.info("long prompts' attention runs in SDPA: prefill_attention.c changes this model's logits or K/V")
            return False
        log.info("bf16 prefills of %d rows or more attend in prefill_attention.c (AVX512_BF16), not SDPA", prefill_attention.MIN_ROWS)
        return True

    @torch.inference_mode()
    def _check_native_step(self, num_slots: int) -> native_step.NativeModel | None:
        """The native model for decode steps, where a step over two slots (scattered
        where there are three) gives transformers' logits."""
        try:
            self.native_model.attach(self.cache)
        except ValueError as exc:
            log.info("decode steps run through transformers' modules: %s", exc)
            return None
        slots = [0, 2] if num_slots >= 3 else list(range(min(num_slots, 2)))
        reference = self._eager_logits(self._probe_step(slots), read_in_place=False)
        # The probe filled again: an 8-bit cache's eager step grew scales and coded blocks again, so the native step starts where it did.
        inputs = self._probe_step(slots)
        logits = self.native_model.decode_logits(self._tables(inputs), inputs.positions, inputs.input_ids, inputs.kv_len)
        if not agrees(reference, logits, self.dtype, self.int8_rows):
            log.info("decode steps run through transformers' modules: the native step changes this model's logits")
            return None
        log.info("decode steps run natively (native_step.c): one call per step")
        return self.native_model

    @property
    def signals_launch(self) -> bool:
        return self.native is not None and self.compiled is None  # the native step's one call releases the GIL

    def decode_logits(self, inputs: StepInputs) -> torch.Tensor:
        """[n, vocab]: the next-token logits of one step over the active slots (with keep_hidden, the rows'
        final hidden states in step_hidden)."""
        if self.compiled is not None:
            verify = inputs.guess_index is not None  # a sequence's guesses as rows of their own
            out = (self.compiled.verify_logits if verify else self.compiled.logits)(inputs.slots, inputs.positions, inputs.input_ids, inputs.kv_len)
            if not self.compiled.hidden:
                return out
            logits, hidden = out
            self.step_hidden = hidden.float() if self.keep_hidden else None
            return logits
        if self.native is not None:
            hidden = [] if self.keep_hidden else None
            guesses = None if inputs.guess_index is None else inputs.guess_index > 0
            logits = self.native.decode_logits(self._tables(inputs), inputs.positions, inputs.input_ids, inputs.kv_len, hidden, guesses,
                                               inputs.on_launch)
            self.step_hidden = hidden[0] if hidden else None
            return logits
        if not self.keep_hidden:
            return self._eager_logits(inputs)
        logits, self.step_hidden = self._eager_logits_and_hidden(inputs)
        return logits

    def _tables(self, inputs: StepInputs) -> torch.Tensor:
        """[n, w]: the rows' block tables, as many blocks as cover the step's KV length."""
        width = -(-inputs.kv_len // self.cache.block_size)
        return self.row_tables[:, :width].index_select(0, inputs.slots.to(self.device))  # contiguous: the native step reads it as it is

    def _eager_logits(self, inputs: StepInputs, read_in_place: bool | None = None) -> torch.Tensor:
        min_position = inputs.min_position if inputs.min_position is not None else int(inputs.positions.min())
        positions = inputs.positions.to(self.device)
        read_in_place = self.reads_in_place if read_in_place is None else read_in_place
        contiguous_from = None if self.paged else inputs.contiguous_from  # a view of slots needs the slot layout
        step = DecodeStep(inputs.slots.to(self.device), positions, inputs.kv_len, min_position, self._tables(inputs), contiguous_from, read_in_place)
        cache = DecodeCache(self.plans, self.cache, step)
        out = self.model(inputs.input_ids.to(self.device)[:, None], position_ids=positions[:, None], past_key_values=cache, use_cache=True)
        return out.logits[:, -1]

    def set_block_table(self, slot: int, table: list[int]) -> None:
        if not self.paged:
            raise ValueError("the KV cache keeps one slot per sequence: no block tables")
        if not 0 < len(table) <= self.row_tables.shape[1]:
            raise ValueError(f"a block table of {len(table)} blocks for a slot of at most {self.row_tables.shape[1]}")
        row = torch.zeros(self.row_tables.shape[1], dtype=torch.long)  # past the sequence's own blocks: the null block
        row[: len(table)] = torch.tensor(table, dtype=torch.long)
        self.row_tables[slot].copy_(row)

    def start_sequence(self, slot: int, prompt_ids: list[int], generated_ids: list[int]) -> None:
        self.token_counts.start(slot, prompt_ids, generated_ids)

    @torch.inference_mode()
    def decode_step(self, inputs: StepInputs) -> SampleOutput:
        logits = self.decode_logits(inputs)
        slots = inputs.slots.to(self.device)
        counts, in_prompt = self.token_counts.rows(slots) if inputs.penalized else (None, None)
        if counts is not None and inputs.guess_index is not None:
            counts = counts + guesses_before(inputs.input_ids.to(self.device), inputs.guess_index.to(self.device), counts.shape[1]).to(counts.dtype)
        params = inputs.params.to(self.device)
        bitmask = inputs.token_bitmask() if inputs.token_bitmask is not None else None
        out = sample(logits, params, inputs.seeds, inputs.steps, self.config.global_topk, counts, in_prompt, inputs.top_logprobs, bitmask, inputs.greedy)
        undo = self.native is not None and self.native.undo is not None  # a verify step over an 8-bit cache
        kept = None  # every row; else the rows whose tokens their sequences keep
        if inputs.guess_index is not None and (inputs.penalized or undo):
            kept = kept_rows(inputs.input_ids.to(self.device), inputs.guess_index.to(self.device), out.token_ids)
        if undo:
            self.native.roll_back(~kept)  # blocks whose scale a rejected guess grew, as before it
        if inputs.penalized:
            self.token_counts.add(slots if kept is None else slots[kept], out.token_ids if kept is None else out.token_ids[kept])
        return out

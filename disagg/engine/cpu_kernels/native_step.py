"""A Llama-shaped model's decode step, or prefill, in one C call (`native_step.c`).

Profiled at one row on this project's CPU (float32, SmolLM-135M's shape), the
eager step through transformers' modules took ~34 ms, of which the products
(`small_gemm`) took ~18: the other ~16 were hundreds of small aten calls (norms,
rotary, KV writes, masks) and the Python between them. `native_step.c` runs
the whole step (every layer, the final norm, the LM head) in one call over the
same prepacked weights, the same slot cache and the same kernels (the products
shared with small_gemm's helper thread, the attention read in place by
slot_attention), so what is left besides the products is a few loops per layer.
A prompt of up to `prefill_max_rows` new rows runs the same way (its rows in one slot of
a K/V buffer of its own, each attending over the rows before it), handing each
layer's K/V on as soon as it is written; longer prompts keep transformers'
modules, whose attention (SDPA) and products (oneDNN) are blocked, faster there.

Served: transformers' Llama, Mistral and Qwen2 (the decoder-layer classes of
`SERVED`: pre-norm RMSNorm, rotary q and k, SiLU-gated MLP, no logit scaling;
sliding windows and biases included) in float32 or bfloat16 on an AVX2 CPU with
a C compiler, every linear packed for the kernel. A bf16 model's weights,
embedding and K/V stay bf16 in memory (half the bytes a step reads) and are
widened to float32 as they are read: the step itself computes in float32 and
rounds only the K/V lines it writes. An 8-bit KV cache (`--kv-cache-dtype int8|fp8`) is
served by the decode step's builds over codes (`KV_FLAGS`): each new line is appended as
`QuantizedBlocks.append_lines` appends it, and slot_attention's 8-bit build reads the blocks;
prompts keep transformers' modules there (they attend over the values the codes stand for).
Anything else keeps the modules. `TorchBackend` also checks at start-up that a native step and a native
prefill give the logits (and K/V) of transformers' own, and keeps the modules
for whichever does not.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2

from ..backends.slot_kv_cache import LayerKvCallback, LayerPlan, PagedKvCache
from . import prefill_attention, slot_attention, small_gemm
from .packed_linear import PackedLinear, SharedInput

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("native_step.c")
# No fused multiply-adds outside the kernels: a * b + c rounds twice, as PyTorch computes it.
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-shared", "-fPIC")
LIBRARIES = ("-lmvec", "-lm")  # glibc's vector expf (silu)
# The model's dtype (its embedding and K/V lines) -> the flags of its build.
MODEL_FLAGS = {torch.float32: (), torch.bfloat16: ("-DMODEL_BF16",)}
# The KV cache's codes -> the flags of the decode step's build over them (None: a cache in the model's dtype).
KV_FLAGS = {None: (), torch.int8: ("-DKV_INT8",), torch.float8_e4m3fn: ("-DKV_FP8",)}

# Decoder layers whose arithmetic native_step.c follows, with their norm class.
SERVED = {
    modeling_llama.LlamaDecoderLayer: modeling_llama.LlamaRMSNorm,
    modeling_mistral.MistralDecoderLayer: modeling_mistral.MistralRMSNorm,
    modeling_qwen2.Qwen2DecoderLayer: modeling_qwen2.Qwen2RMSNorm,
}
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
# A prefill of more rows (past its cached prefix) goes through transformers' modules: the C
# attention here computes each row alone over the rows before it (dots, not blocked products),
# and the products, blocks of 64 rows through small_gemm on two cores, lose to oneDNN's blocked
# products once oneDNN has every core too. SmolLM-135M's shape, native / modules speed
# (`bench/prefill_step.py`; docs/benchmarks.md, A prompt's prefill): float32 1.44x at 512 rows,
# 0.94x at 1,024 (on one torch thread or two); bf16 (the modules' attention in
# prefill_attention.c) on one torch thread 1.30x at 256, 1.05x at 512, 0.86x at 1,024; on two
# 1.63x at 64, 0.86x at 128, 0.56x at 512.
PREFILL_MAX_ROWS = 512
PREFILL_MAX_ROWS_BF16_THREADED = 256  # two torch threads: see below
# A bf16 prompt whose attention is prefill_attention.c's blocked one (NativeModel.blocks_prompts) rather
# than row by row, on one torch thread: native / modules on a Zen 5 EPYC (SmolLM-135M's shape,
# `bench/prefill_step.py --dtype bfloat16`) 1.24x at 512 rows, 1.11x at 1,024, 1.02x at 2,048. On two
# threads, alone, it was faster still (2.79x at 64 rows, 1.60x at 256, 1.07-1.13x at 1,024; row by row
# 1,197 ms at 1,024 rows against 684), but not beside running streams, where a prefill worker's second
# core is the few-row kernel's helper, at the lowest priority, and the decode worker takes it: in
# `bench/long_prompts.py` (4 streams, a 900-token prompt every 3 s), native to 1,024 rows gave the
# prompts' TTFT 786-799 ms and the streams' ITL p99 69-77 ms, against 652-661 and 46-49 ms with
# oneDNN's two threads past 64 rows (two runs each, alternately). So on two threads long prompts go to
# oneDNN, and short ones, whose prefill holds the cores a few tens of milliseconds, natively up to
# PREFILL_MAX_ROWS_BF16_THREADED (256; it was 64): on a Zen 4 EPYC, alone, 1.79x at 128 rows and 1.74x at 256
# (SmolLM-135M's shape, `bench/prefill_step.py --dtype bfloat16 --threads 2`, after the bf16 kernel's paired panels).
PREFILL_MAX_ROWS_BLOCKED = 1024


def prefill_max_rows(dtype: torch.dtype, threads: int, blocked: bool = False) -> int:
    """The most rows a native prefill computes for this dtype at this many torch threads (blocked:
    its attention is prefill_attention.c's)."""
    if dtype == torch.bfloat16 and threads > 1:
        return PREFILL_MAX_ROWS_BF16_THREADED
    return PREFILL_MAX_ROWS_BLOCKED if blocked else PREFILL_MAX_ROWS


class _Weights(ctypes.Structure):
    _fields_ = [("panels", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_long), ("shared", ctypes.c_int),
                ("product", ctypes.c_void_p), ("split_product", ctypes.c_void_p), ("warm", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
        ("qkv", _Weights), ("q_col", ctypes.c_long), ("k_col", ctypes.c_long), ("v_col", ctypes.c_long),
        ("o", _Weights),
        ("gate_up", _Weights), ("gate_col", ctypes.c_long), ("up_col", ctypes.c_long),
        ("down", _Weights), ("window", ctypes.c_long),
    ]


class _KvCache(ctypes.Structure):
    _fields_ = [
        ("keys", ctypes.POINTER(ctypes.c_void_p)), ("values", ctypes.POINTER(ctypes.c_void_p)),
        ("block_stride", ctypes.c_long), ("head_stride", ctypes.c_long), ("pos_stride", ctypes.c_long), ("block_size", ctypes.c_long),
        ("key_scales", ctypes.POINTER(ctypes.c_void_p)), ("value_scales", ctypes.POINTER(ctypes.c_void_p)), ("scale_block_stride", ctypes.c_long),
        ("undo", ctypes.c_void_p),
    ]


class _UndoLog(ctypes.Structure):
    """native_step.c's struct undo_log: a verify step's saved blocks over an 8-bit cache."""

    _fields_ = [("guess", ctypes.c_void_p), ("saved", ctypes.c_void_p), ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p)]


@dataclass
class UndoLog:
    """One verify step's undo log over an 8-bit cache (native_step.c, struct undo_log): its rows' tables and
    positions, which rows are guesses, and the blocks their appends changed, saved before."""

    tables: torch.Tensor
    positions: torch.Tensor
    guess: torch.Tensor  # [rows] uint8
    saved: torch.Tensor  # [rows, layers, 2, kv_heads] uint8
    codes: torch.Tensor  # [rows, layers, 2, kv_heads, block_size * head_dim] of the codes' dtype
    scales: torch.Tensor  # [rows, layers, 2, kv_heads] float32

    def struct(self) -> _UndoLog:
        return _UndoLog(*(t.data_ptr() for t in (self.guess, self.saved, self.codes, self.scales)))


_LAYER_DONE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_long)


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.c_long), ("hidden", ctypes.c_long), ("q_heads", ctypes.c_long), ("kv_heads", ctypes.c_long),
        ("head_dim", ctypes.c_long), ("intermediate", ctypes.c_long), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("embed", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("lm_head", _Weights),
        ("product", ctypes.c_void_p), ("split_product", ctypes.c_void_p), ("attention", ctypes.c_void_p),
        ("layer", ctypes.POINTER(_Layer)),
        ("blocked_attention", ctypes.c_void_p), ("blocked_packed_size", ctypes.c_void_p), ("blocked_min_rows", ctypes.c_long),
        ("blocked_work_per_thread", ctypes.c_long), ("blocked_threads", ctypes.c_int), ("blocked_calls", ctypes.c_long),
        ("split_rows", ctypes.c_void_p), ("split_attention_bytes", ctypes.c_long), ("split_attention_calls", ctypes.c_long),
        ("split_heads_bytes", ctypes.c_long), ("warm", ctypes.c_void_p),
    ]


# A step's rows share their attention with the products' helper (4 rows or more) where they read at least
# this much K and V a layer: SmolLM-135M's shape reads 3 MB at 32 rows of 128 positions (its step 31 -> 25
# ms, docs/benchmarks.md), the tests' tiny models a few KB, where handing rows over costs what reading them
# does (as small products: small_gemm.SPLIT_MIN_BYTES).
SPLIT_ATTENTION_MIN_BYTES = 256 << 10
# A step of fewer rows shares its attention a KV head of a row a unit (a model of several KV heads) where its rows
# read at least this much K and V a layer: SmolLM-135M's shape reads 96 KB at one row of 128 positions.
SPLIT_HEADS_MIN_BYTES = 32 << 10


@functools.cache
def _library(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> ctypes.CDLL | None:
    """The build for a model of `dtype` over a cache of its dtype (kv_dtype None) or of 8-bit codes."""
    if dtype not in MODEL_FLAGS or kv_dtype not in KV_FLAGS:
        return None
    unused = f"{dtype} decode steps and prefills run through transformers' modules" if kv_dtype is None else (
        f"{dtype} decode steps over a {kv_dtype} KV cache run through transformers' modules")
    library = small_gemm.load_library(SOURCE, FLAGS + MODEL_FLAGS[dtype] + KV_FLAGS[kv_dtype], LIBRARIES, unused)
    if library is None:
        return None
    if kv_dtype is not None:
        _declare_8_bit(library)
    library.native_step_workspace.argtypes, library.native_step_workspace.restype = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long], ctypes.c_long
    pointer, long = ctypes.c_void_p, ctypes.c_long
    library.native_step.argtypes = [
        pointer, pointer, long, pointer, pointer, long, pointer, pointer, pointer, ctypes.c_int, ctypes.c_int, _LAYER_DONE, long, pointer, pointer,
    ]
    library.native_step.restype = ctypes.c_int
    library.native_rows_check.argtypes = [long, pointer, long, pointer, long, long, long, pointer, long]
    library.native_rows_check.restype = long
    return library


def _declare_8_bit(library: ctypes.CDLL) -> None:
    """An 8-bit build's own entry points: a verify step's roll-back, a line appended to one block and head, and
    codes of scaled values (its tests read them)."""
    pointer, long = ctypes.c_void_p, ctypes.c_long
    library.native_roll_back.argtypes, library.native_roll_back.restype = [pointer, pointer, long, pointer, long, pointer, pointer], None
    library.native_append_line.argtypes, library.native_append_line.restype = [pointer, pointer, long, long, long, pointer], None
    library.native_codes.argtypes, library.native_codes.restype = [pointer, long, pointer], None


def codes(scaled: torch.Tensor, code_dtype: torch.dtype, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 values already divided by their scale -> the codes the C step writes for them (as
    quantization.kv_cache.to_codes does); dtype: the model's, whose build converts them."""
    library = _library(dtype, code_dtype)
    scaled = scaled.to(torch.float32).contiguous()
    out = torch.empty(scaled.shape, dtype=code_dtype)
    library.native_codes(scaled.data_ptr(), scaled.numel(), out.data_ptr())
    return out


def append_line(codes: torch.Tensor, scale: torch.Tensor, offset: int, line: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """The C step's append of one line [head_dim] (float32) at `offset` of one block and head: codes
    [block_size, head_dim] (contiguous int8 or float8_e4m3fn) and scale (a one-element float32 tensor)
    change in place; dtype: the model's (the line rounds to it first)."""
    if codes.dim() != 2 or not codes.is_contiguous() or scale.numel() != 1 or scale.dtype != torch.float32 or line.shape != codes.shape[1:]:
        raise ValueError(f"append_line: codes {tuple(codes.shape)}, scale {tuple(scale.shape)} {scale.dtype}, line {tuple(line.shape)}")
    if not 0 <= offset < codes.shape[0]:
        raise ValueError(f"append_line: offset {offset} outside a block of {codes.shape[0]}")
    line = line.to(torch.float32).contiguous()
    _library(dtype, codes.dtype).native_append_line(codes.data_ptr(), scale.data_ptr(), codes.shape[0], codes.shape[1], offset, line.data_ptr())


# transformers' rotary types whose angles depend on the sequence's length (its dynamic_rope_update): computed each call.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class _Angles:
    """Each position's rotary angles, cos and sin [positions, head_dim] float32, from the model's rotary
    module over every position up to the largest asked for (grown by doubling): a step reads its rows'
    by position (native_step's angles_by_position) rather than calling the module, a dozen torch calls
    that cost ~0.3 ms a step once the step's weights have pushed torch's dispatch out of the caches.
    The module multiplies each position by each frequency once (its product has one term) and takes
    cos and sin elementwise, so a position's angles do not depend on which positions a call holds."""

    def __init__(self, rotary, embed: torch.Tensor, max_positions: int):
        self.rotary, self.probe, self.max_positions = rotary, embed[:1].float(), max_positions
        self.cos = self.sin = torch.empty(0)

    def covering(self, positions_below: int) -> tuple[torch.Tensor, torch.Tensor]:
        if positions_below > self.cos.shape[0]:  # doubled, but not past the model's positions: 2 x 4 bytes a dimension each
            count = max(positions_below, min(max(2 * self.cos.shape[0], 256), self.max_positions))
            cos, sin = self.rotary(self.probe, torch.arange(count)[None])
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        return self.cos, self.sin


def angles_table(rotary, embed: torch.Tensor, max_positions: int) -> _Angles | None:
    """The table a step reads its rotary angles from, or None where they depend on the sequence's length (computed each call)."""
    return None if getattr(rotary, "rope_type", "default") in LENGTH_DEPENDENT_ROPE else _Angles(rotary, embed, max_positions)


def _longs(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int64, itself where it is already (no torch call: each costs microseconds once the step has run)."""
    return t if t.dtype == torch.long and t.is_contiguous() else t.to(torch.long).contiguous()


def unserved(model, plans: list[LayerPlan]) -> str | None:
    """Why native_step.c cannot run this model's decode steps and prefills, or None if it can."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(type(layer) in SERVED for layer in layers):
        return f"{type(model).__name__}'s decoder layers are not Llama's, Mistral's or Qwen2's"
    if type(inner.norm) is not SERVED[type(layers[0])] or not all(
        type(layer.input_layernorm) is type(layer.post_attention_layernorm) is SERVED[type(layer)] for layer in layers
    ):
        return "its norms are not the RMSNorm of its decoder layers"
    if getattr(model.config, "hidden_act", None) != "silu":
        return f"its MLP's activation is {getattr(model.config, 'hidden_act', None)!r}, not silu"
    if any(
        {name for name, _ in layer.self_attn.named_children()} != ATTENTION_PARTS or {name for name, _ in layer.mlp.named_children()} != MLP_PARTS
        for layer in layers
    ):
        return "its attention or MLP holds parts other than Llama's"
    linears = [model.lm_head] + [
        getattr(part, name)
        for layer in layers
        for part, names in ((layer.self_attn, ATTENTION_PARTS), (layer.mlp, MLP_PARTS - {"act_fn"}))
        for name in names
    ]
    dtype = inner.embed_tokens.weight.dtype
    if dtype not in MODEL_FLAGS:
        return f"it runs in {dtype}, not float32 or bfloat16"
    # A float32 model's panels may hold bf16 (weight_storage): its widen build multiplies float32 rows by them.
    narrower = (torch.bfloat16,) if dtype == torch.float32 else ()
    if not all(isinstance(linear, PackedLinear) and linear.panels is not None and linear.panels.dtype in (dtype, *narrower, *small_gemm.QUANTIZED_DTYPES)
               for linear in linears):
        return f"its linears are not packed for the few-row kernel ({dtype} or 8-bit panels; {small_gemm.host_note(dtype)})"
    if any(plan.layer_type not in ("full_attention", "sliding_attention") for plan in plans):
        return "it has layers that are neither full nor sliding-window attention"
    if len({layer.self_attn.scaling for layer in layers}) != 1 or len(
        {norm.variance_epsilon for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)} | {inner.norm.variance_epsilon}
    ) != 1:
        return "its layers differ in attention scale or norm epsilon"
    if small_gemm.kernel(dtype) is None or slot_attention.kernel(dtype) is None or _library(dtype) is None:
        return "its kernels cannot be built here"
    return None


def _grouped(members: list[PackedLinear]) -> SharedInput:
    """The members' panels end to end, as one product: their group, made if the start-up pass did not."""
    group = members[0].shared
    if group is None and all(member.shared is None for member in members):
        group = SharedInput(members)
    if group is None or group.members != frozenset(members):
        raise ValueError("linears grouped otherwise")
    return group


def _weights(panels: torch.Tensor, bias: torch.Tensor | None, n: int, keep: list, model_dtype: torch.dtype) -> _Weights:
    """A product's panels, with its bias as float32 (kept alive in `keep`): the kernel adds it to float32 sums."""
    if bias is not None:
        bias = bias.float().contiguous()
        keep.append(bias)
    shared = int(small_gemm.worth_sharing(panels))
    functions = (None, None, None)
    if panels.dtype != model_dtype:  # an 8-bit build's products, or bf16 panels' in a float32 model (the model's are its own dtype's)
        kernel = small_gemm.kernel(panels.dtype)
        functions = tuple(ctypes.cast(function, ctypes.c_void_p).value for function in (kernel._call, kernel._split, kernel._warm))
    return _Weights(panels.data_ptr(), None if bias is None else bias.data_ptr(), n, shared, *functions)


def _kv_cache(keys: list[torch.Tensor], values: list[torch.Tensor], dtype: torch.dtype,
              key_scales: list[torch.Tensor] | None = None, value_scales: list[torch.Tensor] | None = None) -> _KvCache:
    """Per layer [blocks, kv_heads, block_size, head_dim] tensors of the model's dtype, contiguous,
    all of one shape (the slot layout: a block per slot, of every position); or an 8-bit cache's
    codes (dtype int8 or float8_e4m3fn) with their scales, per layer [blocks, kv_heads] float32."""
    shape, strides = keys[0].shape, keys[0].stride()
    # Any order of blocks and heads in memory (C reads both strides); positions and head_dim packed.
    if any(t.shape != shape or t.stride() != strides or strides[3] != 1 or strides[2] != shape[3] or t.dtype != dtype for t in (*keys, *values)):
        raise ValueError(f"native step: a K/V cache that is not [blocks, kv_heads, block_size, head_dim] contiguous {dtype} in every layer ({tuple(shape)})")
    scales = _checked_scales(key_scales, value_scales, len(keys), shape[0], shape[1])
    pointers = [(ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors]) for tensors in (keys, values, *scales)]
    arrays = [ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p)) for array in pointers]
    cache = _KvCache(*arrays[:2], *keys[0].stride()[:3], shape[2], *(arrays[2:] if scales else (None, None)), shape[1])
    cache._keep = (pointers, keys, values, scales)  # what the C side points at lives as long as the struct
    return cache


def _checked_scales(key_scales, value_scales, layers: int, blocks: int, kv_heads: int) -> tuple:
    """() for a cache in the model's dtype; else (key_scales, value_scales), each per layer [blocks, kv_heads]
    float32 contiguous (the C side reads block b's scale of head h at b * kv_heads + h)."""
    if key_scales is None and value_scales is None:
        return ()
    tensors = (*(key_scales or ()), *(value_scales or ()))
    if key_scales is None or value_scales is None or len(key_scales) != layers or len(value_scales) != layers or any(
        t.shape != (blocks, kv_heads) or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors
    ):
        raise ValueError(f"native step: an 8-bit cache's scales must be float32 [{blocks}, {kv_heads}] contiguous in each of {layers} layers")
    return key_scales, value_scales


class NativeModel:
    """A served model's weights (see `unserved`) laid out for native_step.c: its decode
    steps over the slot cache (`attach` it first), and its prompts' prefills."""

    def __init__(self, model, plans: list[LayerPlan]):
        inner, config = model.model, model.config
        self.dtype = inner.embed_tokens.weight.dtype
        self.library, self.rotary, self.kernel = _library(self.dtype), inner.rotary_emb, small_gemm.kernel(self.dtype)
        self.embed = inner.embed_tokens.weight.detach().contiguous()
        self.angles = angles_table(self.rotary, self.embed, getattr(config, "max_position_embeddings", None) or 1 << 20)
        self.work = torch.empty(0)  # the decode steps' workspace, grown as a step needs (a prefill's is its own)
        first_attention = inner.layers[0].self_attn
        self.head_dim = first_attention.head_dim
        q_heads = first_attention.q_proj.out_features // self.head_dim
        self.kv_heads = first_attention.k_proj.out_features // self.head_dim
        cos, _ = self.rotary(self.embed[:1].float(), torch.zeros(1, 1, dtype=torch.long))
        if cos.shape[-1] != self.head_dim:  # a partial rotation: the C side rotates whole heads, reading head_dim angles a row
            raise ValueError(f"native step: the rotary angles cover {cos.shape[-1]} of the head's {self.head_dim} dimensions")
        layers = (_Layer * len(inner.layers))()
        self._keep = [self.embed]  # everything the C side points at lives as long as this object
        for i, (layer, plan) in enumerate(zip(inner.layers, plans)):
            attention, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = _grouped([attention.q_proj, attention.k_proj, attention.v_proj]), _grouped([mlp.gate_proj, mlp.up_proj])
            norms = [norm.weight.detach().float().contiguous() for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
            self._keep += [qkv, gate_up, *norms]
            layers[i] = _Layer(
                norms[0].data_ptr(), norms[1].data_ptr(),
                _weights(qkv.panels, qkv.bias, qkv.width, self._keep, self.dtype),
                attention.q_proj.shared_start, attention.k_proj.shared_start, attention.v_proj.shared_start,
                _weights(attention.o_proj.panels, attention.o_proj.bias, attention.o_proj.out_features, self._keep, self.dtype),
                _weights(gate_up.panels, gate_up.bias, gate_up.width, self._keep, self.dtype), mlp.gate_proj.shared_start, mlp.up_proj.shared_start,
                _weights(mlp.down_proj.panels, mlp.down_proj.bias, mlp.down_proj.out_features, self._keep, self.dtype),
                (plan.window or 0) if plan.is_sliding else 0,
            )
        final_norm, lm_head = inner.norm.weight.detach().float().contiguous(), model.lm_head
        self._keep += [final_norm, layers]
        self.layers, self.vocab = len(inner.layers), lm_head.out_features
        kernels = self.kernel._call, self.kernel._split, slot_attention.kernel(self.dtype)._call
        pointers = [ctypes.cast(function, ctypes.c_void_p).value for function in kernels]
        self.model = _Model(
            self.layers, config.hidden_size, q_heads, self.kv_heads, self.head_dim, mlp.gate_proj.out_features,
            inner.norm.variance_epsilon, first_attention.scaling,
            self.embed.data_ptr(), final_norm.data_ptr(), _weights(lm_head.panels, lm_head.bias, self.vocab, self._keep, self.dtype),
            *pointers, layers,
        )
        self._blocked_prompts(q_heads, plans)
        # A step shares its attention (native_step.c, split_attention) with the helper thread its layers' products wake:
        # an 8-bit model's build's, not the model dtype's, whose helper would take the same core from it.
        layers_kernel = small_gemm.kernel(inner.layers[0].mlp.down_proj.panels.dtype)
        self.model.split_rows = ctypes.cast(layers_kernel._split_rows, ctypes.c_void_p).value
        self.model.split_attention_bytes = SPLIT_ATTENTION_MIN_BYTES
        self.model.split_heads_bytes = SPLIT_HEADS_MIN_BYTES
        self.model.warm = ctypes.cast(self.kernel._warm, ctypes.c_void_p).value  # the helper warms the next product's weights
        self.slot_cache: _KvCache | None = None
        self.code_dtype: torch.dtype | None = None  # the attached cache's 8-bit codes, or None: in the model's dtype
        self.undo: UndoLog | None = None  # the last verify step's over an 8-bit cache, until roll_back
        # The decode steps' build and model struct: the prefill's, or an 8-bit cache's (see attach).
        self.step_library, self.step_model = self.library, self.model

    def _blocked_prompts(self, q_heads: int, plans: list[LayerPlan]) -> None:
        """A bf16 prompt's attention through prefill_attention.c (blocked, VDPBF16PS, on every torch
        thread) where it serves this model's heads and layers (full attention only: its mask is causal,
        no window), rather than row by row: the row-by-row attention's dots made native prefills of
        SmolLM-135M's shape slower than the modules' past 512 rows."""
        kernel = prefill_attention.kernel() if self.dtype == torch.bfloat16 else None
        if kernel is None or self.head_dim % 64 or q_heads % self.kv_heads or any(plan.is_sliding for plan in plans):
            return
        self.model.blocked_attention, self.model.blocked_packed_size, self.model.blocked_work_per_thread = kernel.entry_points(self.head_dim)
        self.model.blocked_min_rows = prefill_attention.MIN_ROWS

    @property
    def blocks_prompts(self) -> bool:
        """Whether a prompt of prefill_attention.MIN_ROWS rows or more attends through prefill_attention.c."""
        return bool(self.model.blocked_attention)

    def attach(self, cache: PagedKvCache) -> None:
        """The decode worker's cache of blocks, where decode steps write and read: in the model's
        dtype, or 8-bit codes with their scales (the build over codes, and slot_attention's)."""
        if cache.keys[0].shape[1:2] != (self.kv_heads,) or cache.keys[0].shape[3] != self.head_dim:
            raise ValueError(f"native step: KV cache {tuple(cache.keys[0].shape)} is not [blocks, {self.kv_heads}, block_size, {self.head_dim}]")
        code_dtype = cache.keys[0].dtype if cache.quantized else None
        library, model = self.library, self.model
        if code_dtype is not None:
            library, attention = _library(self.dtype, code_dtype), slot_attention.kernel(code_dtype)
            if library is None or attention is None:
                raise ValueError(f"native step: its build over a {code_dtype} KV cache cannot be built here")
            model = _Model.from_buffer_copy(self.model)  # the same weights (pointers), the 8-bit cache's attention
            model.attention = ctypes.cast(attention._call, ctypes.c_void_p).value
        slot_cache = _kv_cache(cache.keys, cache.values, code_dtype or self.dtype, cache.key_scales, cache.value_scales)
        self.slot_cache, self.slot_shape, self.step_library, self.step_model = slot_cache, cache.keys[0].shape, library, model
        self.code_dtype = code_dtype
        self.undo = None

    def decode_logits(self, tables: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor, kv_len: int, hidden: list | None = None,
                      guesses: torch.Tensor | None = None, on_launch: Callable[[], None] | None = None) -> torch.Tensor:
        """[n, vocab]: the next-token logits of one step; row i is token input_ids[i] at
        positions[i] of the sequence whose block table is tables[i] ([n, blocks]; [n]: slots,
        one block each), its K/V line written there; its earlier positions hold its K/V.
        hidden: where given, gets the rows' final hidden states [n, hidden] (float32, after the final norm).
        guesses: [n] bool, a verify step's guess rows (a sequence's rows consecutive, in order): over an
        8-bit cache their appends are logged, to be undone by roll_back where not kept.
        on_launch: called just before the step's one call into native_step.c, which runs without the GIL."""
        tables, positions, input_ids = (_longs(t) for t in (tables, positions, input_ids))
        table_width = tables.shape[1] if tables.dim() == 2 else 1
        positions_below = self._check_rows(tables, positions, input_ids, self.slot_shape[0], min(kv_len, table_width * self.slot_shape[2]))
        logged = guesses is not None and self.code_dtype is not None and bool(guesses.any())
        self.undo = self._undo_log(tables, positions, guesses) if logged else None
        log_struct = self.undo.struct() if logged else None  # alive for the call: the C side points at it
        self.slot_cache.undo = ctypes.addressof(log_struct) if logged else None
        try:
            return self._run(self.slot_cache, tables, positions, input_ids, positions_below, 0, None, self.step_library, self.step_model, hidden,
                             on_launch)
        finally:
            self.slot_cache.undo = None

    def _undo_log(self, tables: torch.Tensor, positions: torch.Tensor, guesses: torch.Tensor) -> UndoLog:
        rows, block_lines = len(positions), self.slot_shape[2] * self.head_dim
        index = (rows, self.layers, 2, self.kv_heads)
        return UndoLog(
            tables, positions, guesses.to(torch.uint8).contiguous(), torch.zeros(index, dtype=torch.uint8),
            torch.empty(*index, block_lines, dtype=self.code_dtype), torch.empty(index, dtype=torch.float32),
        )

    def roll_back(self, rejected: torch.Tensor) -> None:
        """After a verify step over an 8-bit cache: the blocks whose scale the rows `rejected` marks ([n] bool: guesses
        not kept) changed get back their codes and scales, as steps of one row a sequence would have left them."""
        undo, self.undo = self.undo, None
        if undo is None:
            return
        if rejected.shape != undo.guess.shape:
            raise ValueError(f"roll_back: {tuple(rejected.shape)} rows for a step of {tuple(undo.guess.shape)}")
        if not bool((rejected.to(torch.bool) & undo.guess.bool()).any()):
            return
        rejected = rejected.to(torch.uint8).contiguous()
        log_struct = undo.struct()
        self.slot_cache.undo = ctypes.addressof(log_struct)
        try:
            table_stride = undo.tables.stride(0) if undo.tables.dim() == 2 else 1
            self.step_library.native_roll_back(ctypes.byref(self.step_model), ctypes.byref(self.slot_cache), len(undo.positions),
                                               undo.tables.data_ptr(), table_stride, undo.positions.data_ptr(), rejected.data_ptr())
        finally:
            self.slot_cache.undo = None

    def prefill_logits(self, token_ids: list[int], on_layer: LayerKvCallback, prefix_kv=None) -> torch.Tensor:
        """[1, vocab]: the logits after the prompt; each layer's K/V [kv_heads, tokens,
        head_dim] goes to on_layer as soon as it is written (before the layer's attention).
        prefix_kv: per layer (keys, values) [kv_heads, P, head_dim], the KV of token_ids[:P]
        (the model's dtype): they fill the buffer's first P lines, only rows P.. run, and on_layer
        gets the new rows' K/V (views of the buffer)."""
        n = len(token_ids)
        start = 0 if prefix_kv is None else prefix_kv[0][0].shape[1]
        shape = (1, self.kv_heads, n, self.head_dim)
        keys = [torch.empty(shape, dtype=self.dtype) for _ in range(self.layers)]
        values = [torch.empty(shape, dtype=self.dtype) for _ in range(self.layers)]
        if prefix_kv is not None:
            if len(prefix_kv) != self.layers or not 0 < start < n or any(t.shape != (self.kv_heads, start, self.head_dim) for pair in prefix_kv for t in pair):
                raise ValueError(f"native prefill: prefix_kv of {len(prefix_kv)} layers, {start} tokens, for a prompt of {n}")
            for layer, (prefix_keys, prefix_values) in enumerate(prefix_kv):
                keys[layer][0, :, :start].copy_(prefix_keys)
                values[layer][0, :, :start].copy_(prefix_values)
        rows = n - start
        input_ids, positions = torch.tensor(token_ids[start:], dtype=torch.long), torch.arange(start, n)
        self._check_rows(torch.zeros(rows, dtype=torch.long), positions, input_ids, 1, n)
        failure: list[BaseException] = []

        def layer_done(layer: int) -> int:
            # Called from C with the GIL taken back; an exception cannot cross ctypes, so it stops the step and is raised below.
            try:
                on_layer(layer, keys[layer][0, :, start:], values[layer][0, :, start:])
                return 0
            except BaseException as exc:
                failure.append(exc)
                return 1

        # Rows P.. of one slot, each attending over the lines before it: the prefix's, then the rows' own.
        logits = self._run(_kv_cache(keys, values, self.dtype), torch.zeros(rows, dtype=torch.long), positions, input_ids, n, rows - 1, _LAYER_DONE(layer_done))
        if failure:
            raise failure[0]
        return logits

    def _check_rows(self, tables: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor, blocks: int, positions_below: int) -> int:
        """The rows' largest position + 1; ValueError where a row is out of range (native_rows_check), or the
        tensors are not the step's shapes: the C side reads raw pointers, and would read past the buffers."""
        n = tables.shape[0]  # tables: [n] one block each (slots), or [n, blocks] block tables, int64
        width, stride = (tables.shape[1], tables.stride(0)) if tables.dim() == 2 else (1, 1)
        shaped = positions.shape == (n,) and input_ids.shape == (n,) and (tables.dim() == 1 or tables.stride(1) == 1)
        top = self.library.native_rows_check(
            n, input_ids.data_ptr(), self.embed.shape[0], tables.data_ptr(), stride, width, blocks, positions.data_ptr(), positions_below,
        ) if shaped and all(t.dtype == torch.long and t.is_contiguous() for t in (positions, input_ids)) and tables.dtype == torch.long else -1
        if top < 0:
            raise ValueError(f"native step: slots {tuple(tables.shape)}, positions {tuple(positions.shape)}, ids {tuple(input_ids.shape)}, "
                             f"positions below {positions_below}, blocks {blocks}, vocabulary {self.embed.shape[0]}")
        return top

    def _workspace(self, floats: int, reused: bool) -> torch.Tensor:
        """A step's workspace: a decode step's the one kept for them (nothing outlives the call), grown as needed;
        otherwise (a prefill, or a step whose hidden states are views of it) its own."""
        if not reused:
            return torch.empty(floats, dtype=torch.float32)
        if self.work.numel() < floats:
            self.work = torch.empty(floats, dtype=torch.float32)
        return self.work

    def _run(self, cache: _KvCache, slots, positions, input_ids, kv_len: int, logit_from: int, layer_done, library=None, model=None,
             hidden: list | None = None, on_launch: Callable[[], None] | None = None) -> torch.Tensor:
        """slots: [n] (each row's one block) or [n, blocks] block tables. library, model: the build and model struct
        that run it (default: over a cache in the model's dtype; a decode step's: its cache's). hidden: where given,
        gets the final-normed rows the LM head multiplied: native_step leaves them in its workspace, after x."""
        library, model = library or self.library, model or self.model
        n = slots.shape[0]
        table_stride = slots.stride(0) if slots.dim() == 2 else 1
        if self.angles is not None:  # a table of every position's angles, read by position
            cos, sin = self.angles.covering(kv_len)
        else:
            cos, sin = self.rotary(self.embed[:1].float(), positions[None])  # [1, n, head_dim] each, float32
            cos, sin = cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous()
        logits = torch.empty(n - logit_from, self.vocab, dtype=torch.float32)
        work = self._workspace(library.native_step_workspace(ctypes.byref(model), n, kv_len), layer_done is None and hidden is None)
        model.blocked_threads = max(1, torch.get_num_threads())  # a blocked prompt's attention runs on torch's threads
        if on_launch is not None:
            on_launch()
        library.native_step(
            ctypes.byref(model), ctypes.byref(cache), n, input_ids.data_ptr(), slots.data_ptr(), table_stride,
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), int(self.angles is not None),
            int(self.kernel.splits_here()), layer_done or _LAYER_DONE(), logit_from, logits.data_ptr(), work.data_ptr(),
        )
        if hidden is not None:
            width = self.embed.shape[1]
            hidden.append(work[n * width : (2 * n - logit_from) * width].view(n - logit_from, width))
        return logits

"""The stand-in model: NxDI's continuous-batching calls, computed by a transformers model.

Its KV cache lives in per-rank tensors laid out as NxDI lays them out
(KVCacheManager._init_kv_shape: [kv_cache_batch_size + kv_cache_padding_size,
heads_per_rank, max_length, head_dim]), with the model's KV heads sharded across
ranks when they divide by tp, else replicated one per rank. The sharding here is
written independently of disagg's layout module, so the tests compare two
implementations. Each strictness rule names the NxDI function it stands for.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from ..device import device_view
from ..modules.generation.sampling import Sampler, infer_sampling_params, validate_sampling_params
from .config import InferenceConfig

COMPILE_LOG = "standin_compiles.txt"
COMPILED_MODEL_FILE_NAME = "model.pt"  # application_base.COMPILED_MODEL_FILE_NAME
DEFAULT_COMPILE_WORK_DIR = "/tmp/nxd_model/"  # application_base.get_builder's default; tests point it elsewhere
TRACING_MARK = "tracing-"
fail_next_trace = False  # tests set it: a compile interrupted while tracing


def head_of(rank: int, slot_in_rank: int, kv_heads: int, tp: int) -> int:
    if kv_heads % tp == 0:
        return rank * (kv_heads // tp) + slot_in_rank
    return rank * kv_heads // tp  # replicated: tp/kv_heads ranks per head


def powers_of_two_buckets(largest: int) -> list[int]:
    """autobucketing.generate_buckets(128, largest): 128, 256, ... then largest."""
    buckets, b = [], 128
    while b < largest:
        buckets.append(b)
        b *= 2
    return buckets + [largest]


def infer_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """NeuronBaseForCausalLM._infer_attention_mask for one-token steps: positions < p."""
    length = int(position_ids.max())
    return (torch.arange(length)[None, :] < position_ids).to(position_ids.dtype)


class _NxdModel:
    def __init__(self, state):
        self.state = state


class _Wrapper:
    def __init__(self, nxd_model):
        self.model = type("Traced", (), {"nxd_model": nxd_model})()


class StandInCausalLM:
    config_cls = InferenceConfig

    @classmethod
    def get_config_cls(cls):
        return cls.config_cls

    def __init__(self, model_path, config=None):
        self.model_path = model_path
        self.config = config
        self.neuron_config = config.neuron_config
        self._check_config()

    def _check_config(self):
        pass

    # -- compile and load -----------------------------------------------------------
    def compile(self, compiled_model_path):
        """application_base.compile: the config is saved first, then traced, then model.pt."""
        path = pathlib.Path(compiled_model_path)
        self.config.save(path)
        work = self._trace()
        (path / COMPILED_MODEL_FILE_NAME).write_text("traced (stand-in)")
        with open(path / COMPILE_LOG, "a") as log:
            log.write(f"compiled in {work}\n")

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
        (work / f"{TRACING_MARK}{os.getpid()}-{id(self)}").write_text("")
        shutil.rmtree(work)
        return work

    def load(self, compiled_model_path):
        path = pathlib.Path(compiled_model_path)
        if not (path / COMPILED_MODEL_FILE_NAME).exists():  # application_base.load -> torch.jit.load(model.pt)
            raise FileNotFoundError(f"{path / COMPILED_MODEL_FILE_NAME} not found: the model was never traced")
        nc = self.neuron_config
        self.tp = nc.tp_degree
        self.dtype = getattr(torch, str(nc.torch_dtype).removeprefix("torch."))
        self.hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).eval()
        cfg = self.hf.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.per_rank = self.kv_heads // self.tp if self.kv_heads % self.tp == 0 else 1
        self.sampler = Sampler(nc.on_device_sampling_config, torch.Generator().manual_seed(0))
        self._plain = [{f"kv_mgr.past_key_values.{i}": torch.zeros(self._kv_shape(i % 2 == 0), dtype=self._kv_dtype()) for i in range(2 * self.layers)} for _ in range(self.tp)]
        self.context_encoding_model = _Wrapper(_NxdModel([{k: device_view(v) for k, v in rank.items()} for rank in self._plain]))
        self.prior_seq_ids = None  # causal_lm_async_execution's state
        self._pending = None  # a launched hidden step: runs before the next call's work
        self._prior_tokens = None
        self.cte_buckets = nc.context_encoding_buckets or (powers_of_two_buckets(nc.max_context_length) if nc.enable_bucketing else [nc.max_context_length])
        self.tkg_buckets = nc.token_generation_buckets or (powers_of_two_buckets(nc.max_length) if nc.enable_bucketing else [nc.max_length])

    def _kv_shape(self, is_key):
        """KVCacheManager._init_kv_shape, with the settings that change it."""
        nc = self.neuron_config
        lines = nc.kv_cache_batch_size + nc.kv_cache_padding_size
        window = getattr(self.hf.config, "sliding_window", None)
        length = window if window and window < nc.max_length else nc.max_length  # rolling cache
        if nc.kv_cache_tiling:
            return (lines, self.per_rank, 128, length // 128, self.head_dim)
        if is_key and nc.k_cache_transposed:
            return (lines, self.per_rank, self.head_dim, length)
        return (lines, self.per_rank, length, self.head_dim)

    def _kv_dtype(self):
        nc = self.neuron_config
        if nc.kv_cache_quant or nc.kv_quant_config:
            return torch.float8_e4m3fn
        return getattr(torch, str(nc.attention_dtype).removeprefix("torch.")) if nc.attention_dtype else self.dtype

    # -- the slot's K/V in the model's own head order ----------------------------
    def _cache(self, layer, is_key, rank):
        return self._plain[rank][f"kv_mgr.past_key_values.{2 * layer + (0 if is_key else 1)}"]

    def _check_plain_layout(self):
        nc = self.neuron_config
        if nc.kv_cache_tiling or nc.kv_cache_quant or nc.kv_quant_config or nc.attention_dp_degree > 1 or nc.k_cache_transposed:
            raise NotImplementedError("the stand-in computes only NxDI's default KV layout")

    def _gather(self, layer, is_key, slot, positions):
        out = torch.zeros(self.kv_heads, len(positions), self.head_dim, dtype=self.dtype)
        for rank in range(self.tp):
            for j in range(self.per_rank):
                out[head_of(rank, j, self.kv_heads, self.tp)] = self._cache(layer, is_key, rank)[slot, j, positions]
        return out

    def _scatter(self, layer, is_key, slot, start, lines):
        # lines: [kv_heads, tokens, head_dim], written to every rank holding each head
        end = start + lines.shape[1]
        for rank in range(self.tp):
            for j in range(self.per_rank):
                self._cache(layer, is_key, rank)[slot, j, start:end] = lines[head_of(rank, j, self.kv_heads, self.tp)]

    def _check_seq_ids(self, seq):
        # ModelWrapper._forward_with_pad pads seq_ids with range(max_batch_size) and, with
        # apply_seq_ids_mask, marks any other id invalid: its KV write goes nowhere.
        bad = [s for s in seq if not 0 <= s < self.neuron_config.max_batch_size]
        if bad:
            raise ValueError(f"seq_ids {bad} are outside the compiled batch of {self.neuron_config.max_batch_size}")
        assert seq == sorted(seq), "NxDI needs rows sorted by seq_id"

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
        if int(position_ids.min()) == 0:  # NeuronBaseForCausalLM._is_prefill
            tokens = self._context_encoding(input_ids, position_ids, seq, params)
            self.prior_seq_ids, self._prior_tokens = None, None
        elif self.neuron_config.async_mode:
            tokens = self._async_token_generation(input_ids, attention_mask, position_ids, seq_ids, params)
        else:
            tokens = self._token_generation(input_ids, attention_mask, position_ids, seq, params)
        result = type("Output", (), {})()
        result.tokens = tokens.to(torch.int32)[:, None]
        return result

    def _context_encoding(self, input_ids, position_ids, seq, params):
        """The context-encoding model: pads the prompt to its bucket (ModelWrapper.pad_inputs:
        pad_token_id, position 1) and writes the whole padded prompt into line seq_ids[0]
        (KVCacheManager.update_cache, fill_prefix)."""
        length = input_ids.shape[1]
        bucket = next((b for b in self.cte_buckets if length < b), None) or (length if length == self.cte_buckets[-1] else None)
        if bucket is None:  # ModelWrapper.get_target_bucket
            raise ValueError(f"Input len {length} exceeds largest bucket ({self.cte_buckets[-1]}) for context_encoding_model")
        pad = bucket - length
        ids = torch.cat([input_ids.long(), torch.full((1, pad), self.hf.config.pad_token_id or 0)], dim=1)
        positions = torch.cat([position_ids.long(), torch.ones(1, pad, dtype=torch.long)], dim=1)
        cache = DynamicCache()
        out = self.hf(ids, position_ids=positions, past_key_values=cache, use_cache=True)
        for layer in range(self.layers):
            self._scatter(layer, True, seq[0], 0, cache.layers[layer].keys[0])
            self._scatter(layer, False, seq[0], 0, cache.layers[layer].values[0])
        return self.sampler(out.logits[:, length - 1], params)

    def _token_generation(self, input_ids, attention_mask, position_ids, seq, params):
        """The token-generation model: each row attends the cache positions its mask marks
        (the mask covers positions < p) and its current token separately
        (NeuronAttentionBase.compute_for_token_gen), then writes line p."""
        if attention_mask.shape[1] > self.tkg_buckets[-1]:  # ModelWrapper.get_target_bucket
            raise ValueError(f"Input len {attention_mask.shape[1]} exceeds largest bucket ({self.tkg_buckets[-1]}) for token_generation_model")
        logits = []
        for row, slot in enumerate(seq):
            p = int(position_ids[row, 0])
            attended = attention_mask[row].nonzero().flatten().tolist()
            cache = DynamicCache()
            for layer in range(self.layers):
                cache.update(self._gather(layer, True, slot, attended)[None], self._gather(layer, False, slot, attended)[None], layer)
            out = self.hf(input_ids[row : row + 1].long(), position_ids=torch.tensor([[p]]), past_key_values=cache, use_cache=True)
            for layer in range(self.layers):
                self._scatter(layer, True, slot, p, cache.layers[layer].keys[0, :, -1:])
                self._scatter(layer, False, slot, p, cache.layers[layer].values[0, :, -1:])
            logits.append(out.logits[0, -1])
        return self.sampler(torch.stack(logits), params)

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

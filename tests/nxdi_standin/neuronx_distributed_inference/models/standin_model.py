"""The stand-in model: NxDI's continuous-batching calls, computed by a transformers model.

Its KV cache lives in per-rank tensors laid out as NxDI lays them out
([batch, heads_per_rank, seq_len, head_dim], K as [batch, heads, head_dim,
seq_len] when k_cache_transposed), with the model's KV heads sharded across
ranks when they divide by tp, else replicated one per rank. The sharding here
is written independently of disagg's layout module, so the tests compare two
implementations.
"""

from __future__ import annotations

import json
import pathlib

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from .config import InferenceConfig

COMPILE_LOG = "standin_compiles.txt"


def head_of(rank: int, slot_in_rank: int, kv_heads: int, tp: int) -> int:
    if kv_heads % tp == 0:
        return rank * (kv_heads // tp) + slot_in_rank
    return rank * kv_heads // tp  # replicated: tp/kv_heads ranks per head


class _NxdModel:
    def __init__(self, state):
        self.state = state


class _Wrapper:
    def __init__(self, nxd_model):
        self.model = type("Traced", (), {"nxd_model": nxd_model})()


class StandInCausalLM:
    @classmethod
    def get_config_cls(cls):
        return InferenceConfig

    def __init__(self, model_path, config=None):
        self.model_path = model_path
        self.config = config

    def compile(self, compiled_model_path):
        path = pathlib.Path(compiled_model_path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "neuron_config.json").write_text(json.dumps(self.config.neuron_config.kwargs, default=str))
        with open(path / COMPILE_LOG, "a") as log:
            log.write("compiled\n")

    def load(self, compiled_model_path):
        nc = self.config.neuron_config
        self.tp = nc.tp_degree
        self.dtype = getattr(torch, str(nc.torch_dtype).removeprefix("torch."))
        self.hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).eval()
        cfg = self.hf.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_rank = self.kv_heads // self.tp if self.kv_heads % self.tp == 0 else 1
        self.transposed = bool(getattr(nc, "k_cache_transposed", False))
        state = []
        for _ in range(self.tp):
            rank = {}
            for i in range(2 * self.layers):
                is_key = i % 2 == 0
                shape = (nc.batch_size, per_rank, self.head_dim, nc.seq_len) if is_key and self.transposed else (nc.batch_size, per_rank, nc.seq_len, self.head_dim)
                rank[f"kv_mgr.past_key_values.{i}"] = torch.zeros(shape, dtype=self.dtype)
            state.append(rank)
        self.per_rank = per_rank
        self.context_encoding_model = _Wrapper(_NxdModel(state))
        self.generator = torch.Generator().manual_seed(0)

    # -- the slot's K/V in the model's own head order ----------------------------
    def _cache(self, layer, is_key, rank):
        return self.context_encoding_model.model.nxd_model.state[rank][f"kv_mgr.past_key_values.{2 * layer + (0 if is_key else 1)}"]

    def _gather(self, layer, is_key, slot, length):
        out = torch.zeros(self.kv_heads, length, self.head_dim, dtype=self.dtype)
        for rank in range(self.tp):
            for j in range(self.per_rank):
                line = self._cache(layer, is_key, rank)[slot, j]
                out[head_of(rank, j, self.kv_heads, self.tp)] = (line[:, :length].T if is_key and self.transposed else line[:length])
        return out

    def _scatter(self, layer, is_key, slot, start, lines):
        # lines: [kv_heads, tokens, head_dim], written to every rank holding each head
        end = start + lines.shape[1]
        for rank in range(self.tp):
            for j in range(self.per_rank):
                head = lines[head_of(rank, j, self.kv_heads, self.tp)]
                cache = self._cache(layer, is_key, rank)
                if is_key and self.transposed:
                    cache[slot, j, :, start:end] = head.T
                else:
                    cache[slot, j, start:end] = head

    def _sample(self, logits, params):
        top_k, top_p, temperature = params.tolist()
        if temperature <= 0 or int(top_k) == 1:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    @torch.inference_mode()
    def forward(self, input_ids, attention_mask, position_ids, seq_ids, sampling_params):
        seq = seq_ids.tolist()
        assert seq == sorted(seq), "NxDI needs rows sorted by seq_id"
        tokens = []
        for row, slot in enumerate(seq):
            ids, positions = input_ids[row : row + 1].long(), position_ids[row : row + 1].long()
            start = int(positions[0, 0])
            cache = DynamicCache()
            if start:
                for layer in range(self.layers):
                    cache.update(self._gather(layer, True, slot, start)[None], self._gather(layer, False, slot, start)[None], layer)
            out = self.hf(ids, position_ids=positions, past_key_values=cache, use_cache=True)
            for layer in range(self.layers):
                keys, values = cache.layers[layer].keys, cache.layers[layer].values
                self._scatter(layer, True, slot, start, keys[0, :, start:])
                self._scatter(layer, False, slot, start, values[0, :, start:])
            tokens.append(self._sample(out.logits[0, -1], sampling_params[row]))
        result = type("Output", (), {})()
        result.tokens = torch.tensor(tokens, dtype=torch.int32)[:, None]
        return result

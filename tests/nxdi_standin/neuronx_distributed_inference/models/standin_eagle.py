"""NxDI 0.9.0's fused EAGLE speculation (NeuronFusedSpecModel with enable_eagle_speculation, models/model_base.py),
on the stand-in's KV lines, written from reading that file:

- the draft (EagleDraft) is the target's model class built with is_eagle_draft: fc over [embed(ids), prev_hidden]
  (process_eagle_draft_hidden_states), decoder layers without input_layernorm unless enable_eagle_draft_input_norm
  (models/llama/modeling_llama.py), no final norm, and its own embed_tokens and lm_head, read from
  draft_model_path like any checkpoint (application_base.get_state_dict: "model." dropped, the tied head copied);
- _eagle_context_encoding_forward: the target over the prompt, then the draft a position behind (ids shifted left
  by one, the last real position's id 0) over the target's final hidden states; the hidden state of the prompt's
  last position stored in the rolling buffer at the next position (HiddenStateRollingBuffer);
- _eagle_token_gen_forward: speculation_length - 1 greedy draft runs from the buffer's hidden state (each row's
  mask without its own last position, gaining each run's position), the target over the input and the guesses,
  a last draft run over the same tokens a position behind with the target's hidden states, then acceptance:
  greedy by contiguous matches, or with do_sample rejection sampling over the target sampler's top-k
  probabilities (_adjust_target_probs, _speculative_token_selection; the greedy draft's probabilities are 1);
  _tkg_postprocessor over the guesses; the accepted position's target hidden state stored at the next position.
"""

from __future__ import annotations

import pathlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from ..modules.eagle.hidden_state import HiddenStateRollingBuffer
from .model_wrapper import (
    CONTEXT_ENCODING_MODEL_TAG,
    FUSED_SPECULATION_MODEL_TAG,
    get_target_bucket,
    pad_context_inputs,
    pad_token_generation_mask,
    padded_batch,
)


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """modules/checkpoint.load_state_dict over a directory: model.safetensors (or its index's shards)."""
    from safetensors.torch import load_file

    root = pathlib.Path(path)
    if not (root / "model.safetensors").is_file() and not (root / "model.safetensors.index.json").is_file():
        raise FileNotFoundError(f"Can not find model.safetensors or pytorch_model.bin in {path}")
    state = {}
    for file in sorted(root.glob("model*.safetensors")):
        state.update(load_file(str(file)))
    return state


class EagleDraft(torch.nn.Module):
    """The EAGLE draft model; config is its checkpoint's (KvLines reads the layers and heads from it)."""

    def __init__(self, path: str, input_norm: bool, dtype: torch.dtype):
        super().__init__()
        self.config = AutoConfig.from_pretrained(path)
        lm = AutoModelForCausalLM.from_config(self.config)
        for layer in lm.model.layers:
            if not input_norm:
                layer.input_layernorm = torch.nn.Identity()
        lm.model.norm = torch.nn.Identity()
        width = self.config.hidden_size
        self.fc = torch.nn.Linear(2 * width, width, bias=bool(getattr(self.config, "fc_bias", False)))
        self.lm = lm
        state = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in load_state_dict(path).items()}
        if getattr(self.config, "tie_word_embeddings", False):  # update_state_dict_for_tied_weights
            state["lm_head.weight"] = state["embed_tokens.weight"].clone()
        names = {ours.removeprefix("lm.").removeprefix("model."): ours for ours in self.state_dict()}  # the checkpoint's -> ours
        missing = sorted(name for name in names if name not in state)
        if missing:
            raise KeyError(f"the EAGLE draft's state dict at {path} has no {missing[0]} (the draft model has that parameter)")
        self.load_state_dict({ours: state[name] for name, ours in names.items()})
        self.to(dtype)

    def forward(self, ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden states) of ids [1, n] at positions [1, n] beside prev_hidden [1, n, hidden]."""
        embeds = self.lm.model.embed_tokens(ids)
        x = self.fc(torch.cat([embeds, prev_hidden.to(embeds.dtype)], dim=-1))
        hidden = self.lm.model(inputs_embeds=x, position_ids=positions, past_key_values=cache, use_cache=True).last_hidden_state
        return self.lm.lm_head(hidden), hidden


def select_from(to_indices: torch.Tensor, from_indices: torch.Tensor, from_values: torch.Tensor) -> torch.Tensor:
    """NeuronFusedSpecModel._select_from."""
    if to_indices.ndim > from_indices.ndim:
        from_indices = from_indices[:, :, None].expand(to_indices.shape)
        from_values = from_values[:, :, None].expand(to_indices.shape)
        return from_values * torch.eq(to_indices, from_indices).to(from_values.dtype)
    to_indices = to_indices[:, :, None].expand(from_indices.shape)
    return torch.where(torch.eq(to_indices, from_indices), from_values, 0).sum(dim=2)


def adjust_target_probs(draft_probs, draft_indices, target_probs, target_indices, k: int) -> torch.Tensor:
    """NeuronFusedSpecModel._adjust_target_probs: max(target - draft, 0) renormalised at the guesses' positions
    (all ones where nothing is left), the last position's probabilities as they are."""
    adjusted = torch.clamp(target_probs[:, :k, :] - select_from(target_indices[:, :k, :], draft_indices, draft_probs), min=0)
    total = adjusted.sum(dim=2, keepdim=True)
    is_zero = torch.lt(total, 1e-30)
    adjusted = torch.where(is_zero, 1.0, adjusted / torch.where(is_zero, 1.0, total))
    return torch.cat([adjusted, target_probs[:, k : k + 1, :]], dim=1)


def speculative_token_selection(draft_ids, target_ids, draft_probs, target_indices, target_probs, uniform, pad_token_id: int):
    """NeuronFusedSpecModel._speculative_mask and _speculative_token_selection: guess i is kept while a uniform draw
    stays below target_prob / draft_prob for every guess up to it; the first rejected position takes the target's
    resampled token and the rest pad_token_id. (tokens [rows, k], index [rows, 1]: the guesses kept)."""
    ratio = torch.clamp(select_from(draft_ids, target_indices, target_probs) / draft_probs, max=1.0).float()
    accepted = torch.lt(uniform, ratio).to(torch.int).cumsum(dim=1)
    accepted = torch.eq(accepted, torch.arange(1, ratio.shape[1] + 1)[None, :])
    accepted = torch.nn.functional.pad(accepted, (0, 1), value=False)
    tokens = torch.where(accepted, torch.nn.functional.pad(draft_ids, (0, 1), value=0).long(), target_ids.long())
    index = accepted.to(torch.int).sum(dim=1, keepdim=True)
    tokens = torch.where(index >= torch.arange(tokens.shape[1])[None, :], tokens, pad_token_id)
    return tokens, index


class EagleFusedSpec:
    """StandInCausalLM's fused EAGLE graphs (a mixin: the KV lines, buckets and sampler are the model's)."""

    def _load_eagle(self) -> None:
        nc = self.neuron_config
        draft_nc = self.config.fused_spec_config.draft_config.neuron_config
        if not getattr(draft_nc, "is_eagle_draft", False) or getattr(nc, "is_eagle3", False) or getattr(nc, "enable_token_tree", False):
            raise NotImplementedError("the stand-in runs EAGLE v1 (flat) with a draft config marked is_eagle_draft")
        self.draft_hf = EagleDraft(self._draft_checkpoint(), bool(getattr(draft_nc, "enable_eagle_draft_input_norm", False)), self.dtype).eval()
        if self.draft_hf.config.hidden_size != self.hf.config.hidden_size:
            raise ValueError(f"the EAGLE draft is {self.draft_hf.config.hidden_size} wide, the target {self.hf.config.hidden_size}")
        self.hidden_buffer = HiddenStateRollingBuffer(nc.max_batch_size, nc.speculation_length * 2, self.hf.config.hidden_size, self.dtype,
                                                      self.seq_ids_masked)

    def _eagle_run(self, part, line: int, tokens: list[int], position: int, mask_row: torch.Tensor, prev_hidden: torch.Tensor | None):
        """A token-generation run of one row (the target, or the draft beside prev_hidden [n, hidden]): the cached
        positions its mask marks, then the tokens causally, each token's KV written at its position.
        (logits [n, vocab], hidden states [n, hidden])."""
        attended = mask_row.nonzero().flatten().tolist()
        cache = DynamicCache()
        for layer in range(part.layers):
            cache.update(self._gather(layer, True, line, attended, part)[None], self._gather(layer, False, line, attended, part)[None], layer)
        count = len(tokens)
        logits, hidden = self._eagle_forward(part, torch.tensor([tokens]), torch.arange(position, position + count)[None], cache, prev_hidden)
        where = [self._write_position(position + j, line) for j in range(count)]
        for layer in range(part.layers):
            self._scatter(layer, True, line, where, cache.layers[layer].keys[0, :, -count:], part)
            self._scatter(layer, False, line, where, cache.layers[layer].values[0, :, -count:], part)
        return logits[0], hidden[0]

    def _eagle_forward(self, part, ids, positions, cache, prev_hidden):
        if part is self.draft:
            return self.draft_hf(ids, prev_hidden[None] if prev_hidden.dim() == 2 else prev_hidden, positions, cache)
        hidden = self.hf.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).last_hidden_state  # after the norm
        return self.hf.lm_head(hidden), hidden

    def _eagle_encode(self, part, ids, positions, line: int, prev_hidden):
        """A context encoding of the padded ids into line, every position of the bucket written (as _encode_context)."""
        cache = DynamicCache()
        logits, hidden = self._eagle_forward(part, ids, positions, cache, prev_hidden)
        written = self._context_positions_written(int(positions.max()), ids.shape[1])
        for layer in range(part.layers):
            self._scatter(layer, True, line, list(range(len(written))), cache.layers[layer].keys[0][:, written], part)
            self._scatter(layer, False, line, list(range(len(written))), cache.layers[layer].values[0][:, written], part)
        return logits, hidden

    def _eagle_context_encoding(self, input_ids, attention_mask, position_ids, seq, params) -> list[torch.Tensor]:
        assert len(seq) == 1, "only supports single seq_id"
        k = self.neuron_config.speculation_length
        bucket = get_target_bucket(self.cte_buckets, attention_mask, CONTEXT_ENCODING_MODEL_TAG)
        pad = self.context_encoding_model.config.pad_token_id
        ids, mask, positions = pad_context_inputs(input_ids.long(), attention_mask, position_ids.long(), bucket, pad)
        logits, hidden = self._eagle_encode(self.target, ids, positions, seq[0], None)
        index = int(torch.max(positions, dim=1, keepdim=True).indices[0, 0])
        token = self.sampler(logits[:, index], params)
        shifted = torch.arange(ids.shape[1]) + 1
        shifted[-1] = 0
        draft_positions = positions.clone()
        draft_positions[0, int(mask.sum()) - 1] = 0
        self._eagle_encode(self.draft, ids[:, shifted], draft_positions, seq[0], hidden)
        padded = torch.cat([token.reshape(1, 1), torch.full((1, k - 1), -1)], dim=1).to(torch.int32)
        next_positions = attention_mask.sum(dim=1, keepdim=True).to(torch.int32)
        next_mask = (torch.arange(self.neuron_config.seq_len)[None, :] <= next_positions - 1).to(position_ids.dtype)
        self.hidden_buffer.set_state(torch.tensor(seq), next_positions, hidden[:, index : index + 1])
        return [padded, padded[:, :1], next_mask, next_positions]

    def _eagle_token_generation(self, input_ids, attention_mask, position_ids, seq, params) -> list[torch.Tensor]:
        nc = self.neuron_config
        k = nc.speculation_length
        bucket = get_target_bucket(self.fused_buckets, attention_mask, FUSED_SPECULATION_MODEL_TAG, k)
        mask = pad_token_generation_mask(attention_mask, bucket)
        position_ids = torch.clamp(position_ids, min=0, max=bucket - k)
        candidates, target_logits, target_hidden = {}, {}, {}
        for line, (row, seq_id, real) in enumerate(padded_batch(seq, nc.max_batch_size, self.seq_ids_masked)):
            start = int(position_ids[row, 0])
            if not real:
                for position in [*range(start - 1, start + k - 2), *range(start - 1, start + k - 1)]:
                    self._write_padded_row(line, seq_id, position, self.draft)
                for position in range(start, start + k):
                    self._write_padded_row(line, seq_id, position, self.target)
                continue
            first_hidden = self.hidden_buffer.get_state(torch.tensor([line]), torch.tensor([[start]]))[0]
            candidates[line], hidden = [int(input_ids[row, 0])], first_hidden
            draft_mask = mask[row].clone()
            draft_mask[int(draft_mask.sum()) - 1] = 0
            for i in range(k - 1):
                logits, hidden = self._eagle_run(self.draft, line, candidates[line][-1:], start - 1 + i, draft_mask, hidden)
                draft_mask[start - 1 + i] = 1
                candidates[line].append(int(logits[-1].argmax()))
            target_logits[line], target_hidden[line] = self._eagle_run(self.target, line, candidates[line], start, mask[row], None)
            self._eagle_run(self.draft, line, candidates[line], start - 1, mask[row], torch.cat([first_hidden, target_hidden[line][: k - 1]]))
        rows = len(seq)
        guesses = torch.tensor([candidates[line][1:] for line in seq])
        logits = torch.stack([target_logits[line] for line in seq])
        if not nc.on_device_sampling_config.do_sample:
            target_tokens = logits.argmax(dim=-1)
            index = ((guesses != target_tokens[:, :-1]).cumsum(dim=-1) < 1).sum(dim=-1, keepdim=True)
        else:
            target_tokens, index = self._eagle_rejection_sampling(guesses, logits, params)
        outputs = self._tkg_postprocess(guesses, target_tokens, position_ids, bucket)
        kept_hidden = torch.stack([target_hidden[line][int(index[r, 0])] for r, line in enumerate(seq)])[:, None]
        self.hidden_buffer.set_state(torch.tensor(seq), outputs[3], kept_hidden)
        assert outputs[0].shape == (rows, k)
        return outputs

    def _eagle_rejection_sampling(self, guesses, logits, params):
        rows, k, vocab = logits.shape
        indices, probs = self.sampler.probabilities(logits.reshape(rows * k, vocab), params.repeat_interleave(k, dim=0))
        indices, probs = indices.reshape(rows, k, -1), probs.reshape(rows, k, -1)
        draft_probs = torch.ones(guesses.shape, dtype=probs.dtype)  # the greedy draft sampler's values (_argmax_sample)
        adjusted = adjust_target_probs(draft_probs, guesses, probs, indices, k - 1)
        cdf = adjusted.cumsum(dim=2)
        cdf = cdf / cdf[..., -1:]
        cdf[..., -1:] = 1
        draw = self.sampler.uniform((rows, 1, 1))  # _rand_selector: one draw a row for all its positions
        target_ids = indices.gather(2, (draw > cdf).sum(dim=2, keepdim=True)).squeeze(2)
        pad = self.context_encoding_model.config.pad_token_id
        return speculative_token_selection(guesses, target_ids, draft_probs, indices[:, : k - 1], probs[:, : k - 1], self.sampler.uniform((rows, k - 1)), pad)

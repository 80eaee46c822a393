"""Stand-in for the parts of NxDI 0.9.0 models/model_wrapper.py (ModelWrapper) that decide
what the compiled graphs see: the bucket, the padding of a prompt, the padding of a batch.
0.7 (get_target_bucket inline) and 0.8 (_get_seq_bucket) pick buckets the same way."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"
FUSED_SPECULATION_MODEL_TAG = "fused_speculation_model"


def get_target_bucket(buckets: list[int], attention_mask: torch.Tensor, tag: str, speculation_length: int = 0) -> int:
    """ModelWrapper.get_target_bucket -> _get_seq_bucket, strategy first_fit, allow_input_truncation off: the
    first bucket strictly longer than the attention mask's length plus speculation_length (the fused speculation
    model's; 0 for the others), or the last bucket when that sum is exactly its length; anything else raises."""
    input_len = attention_mask.shape[1]
    required = input_len + speculation_length
    for bucket in buckets:
        if required < bucket:
            return bucket
    if required == buckets[-1]:
        return buckets[-1]
    raise ValueError(f"Input len {input_len} exceeds largest bucket ({buckets[-1]}) for {tag}")


def pad_context_inputs(input_ids, attention_mask, position_ids, bucket: int, pad_token_id):
    """ModelWrapper.pad_inputs for the context-encoding model: right-padded to the bucket,
    input_ids with pad_token_id, attention_mask with 0, position_ids with 1."""
    pad = bucket - input_ids.shape[1]
    return (F.pad(input_ids, (0, pad), "constant", pad_token_id), F.pad(attention_mask, (0, pad), "constant", 0),
            F.pad(position_ids, (0, pad), "constant", 1))


def pad_token_generation_mask(attention_mask, bucket: int):
    """ModelWrapper.pad_inputs for the token-generation model: the mask right-padded with 0."""
    return F.pad(attention_mask, (0, bucket - attention_mask.shape[1]), "constant", 0)


def padded_batch(seq_ids: list[int], max_batch_size: int, apply_seq_ids_mask: bool) -> list[tuple[int, int, bool]]:
    """ModelWrapper.forward / _forward_with_pad for a batch of token-generation rows: per
    compiled row (= KV line) in order, (the caller's row it takes its inputs from, the
    seq_id the graph sees, whether it is a real row).

    A full batch runs as given: row i writes line i, so seq_ids must be 0..B-1 in order.
    A smaller batch is padded with the missing lines and sorted; each padded row repeats
    the caller's first row (pad_with_first_batchline), and with apply_seq_ids_mask its
    seq_id is -1 (its KV write then goes to the cache's pad region, see standin_model)."""
    if len(seq_ids) == max_batch_size:
        if seq_ids != list(range(max_batch_size)):
            raise ValueError(f"a full batch runs unsorted and unpadded: row i writes KV line i, so seq_ids {seq_ids} would write other lines")
        return [(row, row, True) for row in range(max_batch_size)]
    rows = []
    for line in range(max_batch_size):
        if line in seq_ids:
            rows.append((seq_ids.index(line), line, True))
        else:
            rows.append((0, -1 if apply_seq_ids_mask else line, False))
    return rows


class ModelWrapper:
    """ModelWrapper's attributes the adapter reads: config and neuron_config (the submodel's own
    copy: enable_context_encoding / enable_token_generation set batch_size and buckets on it),
    tag, and model (the traced model, set by application_base.load; None before)."""

    def __init__(self, config, tag: str):
        self.config = config
        self.neuron_config = config.neuron_config
        if getattr(config, "pad_token_id", None) is None:  # ModelWrapper.__init__
            config.pad_token_id = 0
        self.tag = tag
        self.model = None


def submodel_config(config, batch_size: int, buckets: list[int]):
    """NeuronBaseForCausalLM.enable_context_encoding / enable_token_generation: a deep copy of
    the config whose neuron_config has the submodel's batch size and buckets."""
    import copy

    copied = copy.deepcopy(config)
    copied.neuron_config.batch_size = batch_size
    copied.neuron_config.buckets = buckets
    return copied

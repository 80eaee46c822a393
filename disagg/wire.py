"""Conversions between the internal worker protos and engine types: the only
place the workers touch protobuf messages' fields."""

from __future__ import annotations

from disagg.engine.requests import FinishReason, Sampling, Stopping
from disagg.v1 import worker_pb2 as wpb


def sampling_from_pb(msg: wpb.WorkerSampling) -> Sampling:
    return Sampling(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0, seed=msg.seed)


def sampling_to_pb(sampling: Sampling) -> wpb.WorkerSampling:
    return wpb.WorkerSampling(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed)


def stopping_from_pb(msg: wpb.WorkerStopping) -> Stopping:
    return Stopping(max_new_tokens=msg.max_new_tokens, stop_token_ids=frozenset(msg.stop_token_ids))


def stopping_to_pb(stopping: Stopping) -> wpb.WorkerStopping:
    return wpb.WorkerStopping(max_new_tokens=stopping.max_new_tokens, stop_token_ids=sorted(stopping.stop_token_ids))


def finish_from_pb(value: int) -> FinishReason:
    return FinishReason(value)


def worker_load(role: str, info, **counts) -> wpb.WorkerLoad:
    """GetLoad's answer: the model this worker serves, and what it holds now."""
    return wpb.WorkerLoad(role=role, model_name=info.name, max_seq_len=info.max_seq_len, backend=info.backend, vocab_size=info.vocab_size, dtype=info.dtype, **counts)

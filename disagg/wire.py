"""Conversions between the internal worker protos and engine types: the only
place the workers touch protobuf messages' fields."""

from __future__ import annotations

from disagg.engine.requests import FinishReason, Sampling, Stopping, TokenLogprobs
from disagg.rpc import RequestError
from disagg.v1 import worker_pb2 as wpb


def sampling_from_pb(msg: wpb.WorkerSampling) -> Sampling:
    return Sampling(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p or 1.0,
        seed=msg.seed,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        logprobs=msg.top_logprobs if msg.logprobs else -1,
    )


def sampling_to_pb(sampling: Sampling) -> wpb.WorkerSampling:
    return wpb.WorkerSampling(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed,
        min_p=sampling.min_p,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logprobs=sampling.logprobs >= 0,
        top_logprobs=max(sampling.logprobs, 0),
    )


def check_sampling(backend, sampling: Sampling) -> None:
    """Refuses a request's sampling that the worker's backend cannot serve, naming the field.
    (The router refuses it first; a worker does not trust that.)"""
    unsupported = backend.unsupported(sampling)
    if unsupported:
        field = f"sampling.{unsupported[0]}"
        raise RequestError(f"{field} is not supported by the {backend.info.backend} backend (see docs/neuron.md)", field=field)


def logprobs_to_pb(logprobs: TokenLogprobs) -> wpb.WorkerLogprobs:
    return wpb.WorkerLogprobs(logprob=logprobs.logprob, top_token_ids=[t for t, _ in logprobs.top], top_logprobs=[v for _, v in logprobs.top])


def logprobs_from_pb(token_id: int, msg: wpb.WorkerLogprobs) -> TokenLogprobs:
    return TokenLogprobs(token_id, msg.logprob, tuple(zip(msg.top_token_ids, msg.top_logprobs)))


def stopping_from_pb(msg: wpb.WorkerStopping) -> Stopping:
    return Stopping(max_new_tokens=msg.max_new_tokens, stop_token_ids=frozenset(msg.stop_token_ids))


def stopping_to_pb(stopping: Stopping) -> wpb.WorkerStopping:
    return wpb.WorkerStopping(max_new_tokens=stopping.max_new_tokens, stop_token_ids=sorted(stopping.stop_token_ids))


def finish_from_pb(value: int) -> FinishReason:
    return FinishReason(value)


def worker_load(role: str, info, **counts) -> wpb.WorkerLoad:
    """GetLoad's answer: the model this worker serves, and what it holds now."""
    return wpb.WorkerLoad(role=role, model_name=info.name, max_seq_len=info.max_seq_len, backend=info.backend, vocab_size=info.vocab_size, dtype=info.dtype, **counts)

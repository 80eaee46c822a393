"""Conversions between the internal worker protos and engine types: the only
place the workers touch protobuf messages' fields.

Whatever reaches a worker's port can call it, so every request a worker takes is
checked here, on the way in, by the engine's rules (disagg.engine.requests, the
ones the router checks its public APIs with), before any slot or device work: a
refusal is INVALID_ARGUMENT naming the worker API's field.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from disagg.engine.constraints import Constraint, ConstraintKind
from disagg.engine.memory import sampled_process_memory
from disagg.engine.requests import (
    MAX_REQUEST_ID_CHARS,
    FinishReason,
    InvalidField,
    Sampling,
    Stopping,
    TokenLogprobs,
    check_first_step,
    check_logprobs,
    check_prompt_len,
    check_request_id,
    check_token_ids,
    stop_token_bound,
)
from disagg.rpc.server import RequestError
from disagg.v1 import worker_pb2 as wpb

# The worker API's names for the engine's fields (the rest are named alike).
WORKER_FIELDS = {
    **{name: f"sampling.{name}" for name in ("temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")},
    "top_logprobs": "sampling.top_logprobs",
    **{f"constraint.{name}": "sampling.constraint.text" for name in ("json_object", "json_schema", "regex", "choice", "grammar")},
    "constraint": "sampling.constraint",
    "constraint.kind": "sampling.constraint.kind",
    "max_new_tokens": "stopping.max_new_tokens",
    "stop_token_ids": "stopping.stop_token_ids",
}
MAX_ADDRESS_CHARS = 261  # a DNS name (253) and a port
MAX_AGENT_NAME_CHARS = 256
MAX_AGENT_METADATA_BYTES = 1 << 20  # a NIXL agent's metadata is a few KiB


@contextlib.contextmanager
def worker_names():
    """The engine's rules, refusing by the worker API's field names."""
    try:
        yield
    except InvalidField as exc:
        field = WORKER_FIELDS.get(exc.field, exc.field)
        raise RequestError(f"{field} {exc.rule}", field=field) from None


def refuse(field: str, rule: str) -> RequestError:
    return RequestError(f"{field} {rule}", field=field)


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
        constraint=constraint_from_pb(msg.constraint) if msg.HasField("constraint") else None,
    )


def constraint_from_pb(msg: wpb.WorkerConstraint) -> Constraint | None:
    if msg.kind == wpb.CONSTRAINT_KIND_UNSPECIFIED:
        return None
    if msg.kind not in ConstraintKind.__members__.values():
        raise InvalidField("constraint.kind", f"is {msg.kind}, not a known ConstraintKind")
    return Constraint(ConstraintKind(msg.kind), msg.text)


def constraint_to_pb(constraint: Constraint | None) -> wpb.WorkerConstraint | None:
    return None if constraint is None else wpb.WorkerConstraint(kind=int(constraint.kind), text=constraint.text)


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
        constraint=constraint_to_pb(sampling.constraint),
    )


def checked_sampling(msg: wpb.WorkerSampling) -> Sampling:
    """The request's sampling, refused where the public edges would refuse it."""
    with worker_names():
        check_logprobs(msg.logprobs, msg.top_logprobs)
        sampling = sampling_from_pb(msg)
        sampling.check()
    return sampling


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

def kv_format(info) -> str:
    """How a worker holds its KV, for the router's view of the pool: an 8-bit cache's dtype, a backend's
    device-side dtype ("fp8 in the device state"), or "" (the model's dtype)."""
    kv = getattr(info, "kv_cache_dtype", "")
    device = getattr(info, "device_kv_dtype", "")
    return kv or (f"{device} in the device state" if device else "")


def worker_load(role: str, info, config, **counts) -> wpb.WorkerLoad:
    """GetLoad's answer: the model this worker serves and how (config: its WorkerConfig), and what it holds now (its memory included)."""
    memory = sampled_process_memory()
    return wpb.WorkerLoad(
        role=role, model_name=info.name, max_seq_len=info.max_seq_len, backend=info.backend, vocab_size=info.vocab_size, dtype=info.dtype,
        kv_cache_dtype=kv_format(info), speculation=speculation_to_pb(config),
        resident_bytes=memory.resident_bytes, proportional_bytes=memory.proportional_bytes, shared_bytes=memory.shared_bytes, **counts,
    )


def speculation_to_pb(config) -> wpb.WorkerSpeculation | None:
    """The worker's speculation settings as the router compares them (None: off). A draft is named as a
    model is (its directory's name or hub id), so workers that mount one checkpoint at different paths agree."""
    settings = config.speculation()
    if settings is None:
        return None
    draft = (config.draft_model or "").rstrip("/").rsplit("/", 1)[-1]
    return wpb.WorkerSpeculation(method=settings.method, num_tokens=settings.num_tokens, draft_model=draft)


# -- the requests a worker takes, checked whole --------------------------------


@dataclass(frozen=True)
class DecodeOrder:
    """A checked DecodeRequest."""

    request_id: str
    prompt_len: int
    sampling: Sampling
    stopping: Stopping
    first_step: int
    context_ids: tuple[int, ...]


def decode_order_from_pb(msg: wpb.DecodeRequest, info) -> DecodeOrder:
    """info: the worker's ModelInfo (vocabulary, context and EOS ids)."""
    stop_bound = stop_token_bound(len(info.eos_token_ids))
    with worker_names():
        check_request_id(msg.request_id)
        check_prompt_len("prompt_len", msg.prompt_len, info.max_seq_len)
        sampling = checked_sampling(msg.sampling)
        # Counted before a set of them is built: the message may hold millions.
        check_token_ids("stop_token_ids", msg.stopping.stop_token_ids, info.vocab_size, stop_bound)
        stopping = stopping_from_pb(msg.stopping)
        stopping.check(msg.prompt_len, info.vocab_size, info.max_seq_len, stop_bound)
        check_first_step(msg.first_step, msg.prompt_len)
        context_ids = checked_context(msg.context_token_ids, msg.prompt_len, sampling.needs_history, info.vocab_size)
    return DecodeOrder(msg.request_id, msg.prompt_len, sampling, stopping, msg.first_step, context_ids)


def checked_context(context_ids, prompt_len: int, needed: bool, vocab_size: int) -> tuple[int, ...]:
    """The ids a penalty counts and a constraint's matcher replays: none, or all prompt_len of them
    (a penalized or constrained request needs them)."""
    if (needed or len(context_ids)) and len(context_ids) != prompt_len:
        need = "a penalized or constrained request needs" if needed else "when given, it must hold"
        raise InvalidField("context_token_ids", f"has {len(context_ids)} ids; {need} its prompt_len {prompt_len}")
    check_token_ids("context_token_ids", context_ids, vocab_size)
    return tuple(context_ids)


@dataclass(frozen=True)
class PrefillOrder:
    """A checked PrefillRequest; target is (address, reservation_id, token_start) or None."""

    request_id: str
    token_ids: list[int]
    sampling: Sampling
    target: tuple[str, str, int] | None
    first_step: int


def check_token_start(token_start: int, prompt_len: int) -> None:
    """kv_target.token_start: the decode worker holds the prompt's tokens before it (its
    cached_tokens), all of them at most; the KV of [token_start, prompt_len) is sent."""
    if not 0 <= token_start <= prompt_len:
        raise refuse("kv_target.token_start", f"must be in [0, {prompt_len}] for a prompt of {prompt_len} tokens, got {token_start}")


def prefill_order_from_pb(msg: wpb.PrefillRequest, info) -> PrefillOrder:
    with worker_names():
        check_request_id(msg.request_id)
        check_prompt_len("token_ids", len(msg.token_ids), info.max_seq_len)
        token_ids = list(msg.token_ids)
        check_token_ids("token_ids", token_ids, info.vocab_size)
        sampling = checked_sampling(msg.sampling)
        check_first_step(msg.first_step, len(token_ids))
    target = None
    if msg.HasField("kv_target"):
        check_text("kv_target.address", msg.kv_target.address, MAX_ADDRESS_CHARS)
        check_text("kv_target.reservation_id", msg.kv_target.reservation_id, MAX_REQUEST_ID_CHARS)
        check_token_start(msg.kv_target.token_start, len(token_ids))
        target = (msg.kv_target.address, msg.kv_target.reservation_id, msg.kv_target.token_start)
    return PrefillOrder(msg.request_id, token_ids, sampling, target, msg.first_step)


def check_text(field: str, value: str | bytes, max_len: int) -> None:
    """A required identifier: set, and short enough to keep or log."""
    if not value:
        raise refuse(field, "is empty")
    if len(value) > max_len:
        raise refuse(field, f"has {len(value)} characters; at most {max_len} are allowed")


def check_pull(msg: wpb.PullKvRequest, info) -> None:
    """A PullKvRequest's fields, before the reservation is looked up or anything is read."""
    check_text("reservation_id", msg.reservation_id, MAX_REQUEST_ID_CHARS)
    check_text("agent_name", msg.agent_name, MAX_AGENT_NAME_CHARS)
    check_text("agent_metadata", msg.agent_metadata, MAX_AGENT_METADATA_BYTES)
    if msg.address == 0:
        raise refuse("address", "is 0: the staging buffer's address must be set")
    with worker_names():
        check_prompt_len("prompt_len", msg.prompt_len, info.max_seq_len)
    if not 0 <= msg.first_token < info.vocab_size:
        raise refuse("first_token", f"is {msg.first_token}, outside the vocabulary [0, {info.vocab_size})")
    if msg.num_layers != info.num_layers:
        raise refuse("num_layers", f"is {msg.num_layers}; this model has {info.num_layers} layers")


MAX_DTYPE_CHARS = 32
KV_PIECE_DIMS = 3  # [kv_heads, tokens, head_dim]


def check_chunk_header(msg: wpb.KvChunk) -> None:
    """A KvChunk's small fields, bounded before the worker checks them against the reservation
    (whose refusals quote them): later chunks may leave reservation_id empty, none may make it long."""
    if len(msg.reservation_id) > MAX_REQUEST_ID_CHARS:
        raise refuse("reservation_id", f"has {len(msg.reservation_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed")
    if len(msg.dtype) > MAX_DTYPE_CHARS:
        raise refuse("dtype", f"has {len(msg.dtype)} characters; at most {MAX_DTYPE_CHARS} are allowed")
    if len(msg.shape) > KV_PIECE_DIMS:
        raise refuse("shape", f"has {len(msg.shape)} dimensions; a KV piece has {KV_PIECE_DIMS} (kv_heads, tokens, head_dim)")

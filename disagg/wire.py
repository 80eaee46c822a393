"""Conversions between the internal worker protos and engine types: the only
place the workers touch protobuf messages' fields."""

from __future__ import annotations

from disagg.engine.kv_wire import KvCommit, KvKind, KvPiece
from disagg.engine.requests import FinishReason, Sampling, Stopping, TokenLogprobs
from disagg.rpc import LENGTH_DELIMITED, RequestError, WireField, wire_fields
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


def piece_to_pb(piece: KvPiece, reservation_id: str = "") -> wpb.KvChunk:
    return wpb.KvChunk(
        reservation_id=reservation_id,
        layer=piece.layer,
        kind=int(piece.kind),
        token_start=piece.token_start,
        dtype=piece.dtype,
        shape=list(piece.shape),
        data=piece.data,
    )


def commit_to_pb(commit: KvCommit, reservation_id: str = "") -> wpb.KvChunk:
    return wpb.KvChunk(
        reservation_id=reservation_id,
        commit=wpb.KvCommit(first_token=commit.first_token, prompt_len=commit.prompt_len, num_layers=commit.num_layers),
    )


def chunk_from_pb(msg: wpb.KvChunk, data: bytes | memoryview | None = None) -> tuple[str, KvPiece | KvCommit]:
    """Raises ValueError for a chunk whose kind is not KEY or VALUE. data: the
    tensor bytes when they were split off the message (see kv_chunk_from_bytes)."""
    if msg.HasField("commit"):
        c = msg.commit
        return msg.reservation_id, KvCommit(first_token=c.first_token, prompt_len=c.prompt_len, num_layers=c.num_layers)
    if msg.kind not in (KvKind.KEY, KvKind.VALUE):
        raise ValueError(f"kind {msg.kind} is not KEY or VALUE")
    piece = KvPiece(msg.layer, KvKind(msg.kind), msg.token_start, msg.dtype, tuple(msg.shape), msg.data if data is None else data)
    return msg.reservation_id, piece


# -- KvChunk framing without copying the tensor bytes ---------------------------
# A KvChunk is a few small fields and one large `data` field. Building it as a
# protobuf message copies the bytes into the message, again when serialized, and
# on receipt twice more (parse, then field access). These two functions write
# and read the same protobuf wire format with the tensor bytes copied once on
# each side: any protobuf KvChunk parses here, and what is written here parses
# as a KvChunk anywhere (tests check both ways).
PUSH_KV = f"/{wpb.DESCRIPTOR.services_by_name['DecodeService'].full_name}/PushKv"
PULL_KV = f"/{wpb.DESCRIPTOR.services_by_name['DecodeService'].full_name}/PullKv"
_DATA_FIELD = wpb.KvChunk.DESCRIPTOR.fields_by_name["data"].number


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_DATA_TAG = _varint_bytes(_DATA_FIELD << 3 | LENGTH_DELIMITED)


def piece_bytes(piece: KvPiece, reservation_id: str = "") -> bytes:
    """The serialized KvChunk of piece: its small fields, then the tensor bytes."""
    header = wpb.KvChunk(reservation_id=reservation_id, layer=piece.layer, kind=int(piece.kind), token_start=piece.token_start, dtype=piece.dtype, shape=list(piece.shape))
    return b"".join((header.SerializeToString(), _DATA_TAG, _varint_bytes(len(piece.data)), piece.data))


def push_kv_call(channel):
    """PushKv taking serialized KvChunks (piece_bytes, commit_bytes) rather than messages."""
    return channel.stream_unary(PUSH_KV, request_serializer=None, response_deserializer=wpb.KvAck.FromString)


def commit_bytes(commit: KvCommit, reservation_id: str = "") -> bytes:
    return commit_to_pb(commit, reservation_id).SerializeToString()


def _data_span(raw: bytes) -> WireField | None:
    """The last top-level `data` field (protobuf keeps the last of a repeated scalar)."""
    spans = [f for f in wire_fields(raw) if f.number == _DATA_FIELD and f.wire_type == LENGTH_DELIMITED]
    return spans[-1] if spans else None


def split_kv_chunk(raw: bytes) -> tuple[bytes, memoryview | None]:
    """A serialized KvChunk as (the bytes of its other fields, a view of its data).

    The first parses as a KvChunk without data. Raises ValueError for bytes
    that are not a protobuf message.
    """
    data = _data_span(raw)
    if data is None:
        return raw, None
    return raw[: data.start] + raw[data.end :], memoryview(raw)[data.value_start : data.end]

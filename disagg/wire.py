"""Conversions between the internal worker protos and engine types: the only
place the workers touch protobuf messages' fields."""

from __future__ import annotations

from disagg.engine.kv_wire import KvCommit, KvKind, KvPiece
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


def chunk_from_pb(msg: wpb.KvChunk) -> tuple[str, KvPiece | KvCommit]:
    """Raises ValueError for a chunk whose kind is not KEY or VALUE."""
    if msg.HasField("commit"):
        c = msg.commit
        return msg.reservation_id, KvCommit(first_token=c.first_token, prompt_len=c.prompt_len, num_layers=c.num_layers)
    if msg.kind not in (KvKind.KEY, KvKind.VALUE):
        raise ValueError(f"kind {msg.kind} is not KEY or VALUE")
    piece = KvPiece(msg.layer, KvKind(msg.kind), msg.token_start, msg.dtype, tuple(msg.shape), msg.data)
    return msg.reservation_id, piece

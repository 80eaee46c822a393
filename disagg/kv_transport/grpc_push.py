"""The gRPC KV transport (push): the prefill worker streams KvChunk pieces to
the decode worker's PushKv, which copies each into the reserved slot.

The portable fallback: it needs nothing but gRPC, so it serves a decode worker
without NIXL and any pair of machines that can reach each other.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from disagg.rpc.server import LENGTH_DELIMITED, ProtoField, RequestError, proto_fields
from disagg.v1 import worker_pb2 as wpb

from .chunk_codec import KvCommit, KvKind, KvPiece

TRANSPORT = "grpc"
_SERVICE = wpb.DESCRIPTOR.services_by_name["DecodeService"].full_name
PUSH_KV = f"/{_SERVICE}/PushKv"
PULL_KV = f"/{_SERVICE}/PullKv"


class GrpcPushSender:
    """Prefill side: sends one prompt's pieces, from an outbox filled layer by layer, then the commit."""

    def __init__(self, channel_for, metrics, send_timeout: float, hold_after_first_piece=None):
        self._channel_for = channel_for  # address -> grpc.aio.Channel
        self.metrics = metrics
        self.send_timeout = send_timeout
        self._hold = hold_after_first_piece  # test-only (faults.TEST_HOLD_KV_SEND): an async wait

    async def send(self, address: str, reservation_id: str, outbox: asyncio.Queue, timeout: float | None) -> int:
        """Bytes the decode worker acknowledged. The outbox holds lists of pieces, then one KvCommit."""
        push_kv = push_kv_call(self._channel_for(address))

        async def chunks():
            first = True
            while True:
                item = await outbox.get()
                if isinstance(item, KvCommit):
                    yield commit_bytes(item, reservation_id)
                    return
                for piece in item:
                    yield piece_bytes(piece, reservation_id if first else "")
                    if first and self._hold is not None:
                        await self._hold()
                    first = False

        limit = self.send_timeout if timeout is None else min(timeout, self.send_timeout)
        started = time.perf_counter()
        try:
            ack = await push_kv(chunks(), timeout=limit)
        except grpc.aio.AioRpcError as exc:
            self.metrics.kv_failures.labels(TRANSPORT).inc()
            # ABORTED tells the router this worker is fine: the hand-off failed
            # (the decode worker refused it or went away), so it re-plans the decode side.
            raise RequestError(f"KV transfer to {address} failed: {exc.code().name}: {exc.details()}", grpc.StatusCode.ABORTED) from exc
        self.metrics.kv_seconds.labels(TRANSPORT).observe(time.perf_counter() - started)
        self.metrics.kv_bytes.labels(TRANSPORT).inc(ack.bytes_received)
        return ack.bytes_received


def piece_to_pb(piece: KvPiece, reservation_id: str = "") -> wpb.KvChunk:
    return wpb.KvChunk(
        reservation_id=reservation_id,
        layer=piece.layer,
        kind=int(piece.kind),
        token_start=piece.token_start,
        dtype=piece.dtype,
        shape=list(piece.shape),
        data=piece.data,
        scales=piece.scales,
        scale_block=piece.scale_block,
    )


def commit_to_pb(commit: KvCommit, reservation_id: str = "") -> wpb.KvChunk:
    return wpb.KvChunk(
        reservation_id=reservation_id,
        commit=wpb.KvCommit(first_token=commit.first_token, prompt_len=commit.prompt_len, num_layers=commit.num_layers),
    )


def chunk_from_pb(msg: wpb.KvChunk, data: bytes | memoryview | None = None) -> tuple[str, KvPiece | KvCommit]:
    """Raises ValueError for a chunk whose kind is not KEY or VALUE. data: the
    tensor bytes when they were split off the message (see split_kv_chunk)."""
    if msg.HasField("commit"):
        c = msg.commit
        return msg.reservation_id, KvCommit(first_token=c.first_token, prompt_len=c.prompt_len, num_layers=c.num_layers)
    if msg.kind not in (KvKind.KEY, KvKind.VALUE):
        raise ValueError(f"kind {msg.kind} is not KEY or VALUE")
    data = msg.data if data is None else data
    piece = KvPiece(msg.layer, KvKind(msg.kind), msg.token_start, msg.dtype, tuple(msg.shape), data, msg.scales, msg.scale_block)
    return msg.reservation_id, piece


# -- KvChunk framing without copying the tensor bytes ---------------------------
# A KvChunk is a few small fields and one large `data` field (an 8-bit piece's
# scales are small ones: 4 bytes a block and head, 1/256 of its codes for blocks
# of 16 positions of 64, so they go the ordinary protobuf way). Building it as a
# protobuf message copies the bytes into the message, again when serialized, and
# on receipt twice more (parse, then field access). These two functions write
# and read the same protobuf wire format with the tensor bytes copied once on
# each side: any protobuf KvChunk parses here, and what is written here parses
# as a KvChunk anywhere (tests check both ways).
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
    """The serialized KvChunk of piece: its small fields (the scales too), then the tensor bytes."""
    header = wpb.KvChunk(
        reservation_id=reservation_id, layer=piece.layer, kind=int(piece.kind), token_start=piece.token_start, dtype=piece.dtype, shape=list(piece.shape),
        scales=piece.scales, scale_block=piece.scale_block,
    )
    return b"".join((header.SerializeToString(), _DATA_TAG, _varint_bytes(len(piece.data)), piece.data))


def push_kv_call(channel):
    """PushKv taking serialized KvChunks (piece_bytes, commit_bytes) rather than messages."""
    return channel.stream_unary(PUSH_KV, request_serializer=None, response_deserializer=wpb.KvAck.FromString)


def commit_bytes(commit: KvCommit, reservation_id: str = "") -> bytes:
    return commit_to_pb(commit, reservation_id).SerializeToString()


def _data_span(raw: bytes) -> ProtoField | None:
    """The last top-level `data` field (protobuf keeps the last of a repeated scalar)."""
    spans = [f for f in proto_fields(raw) if f.number == _DATA_FIELD and f.wire_type == LENGTH_DELIMITED]
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

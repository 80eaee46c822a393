import pytest
import torch

from decode_worker.grpc_edge import parse_kv_chunk
from disagg.kv_transport import grpc_push
from disagg.kv_transport.chunk_codec import KvChunkError, KvCommit, KvCoverage, KvKind, KvPiece, decode, encode
from disagg.rpc.server import UnparsableMessage
from disagg.v1 import worker_pb2 as wpb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roundtrip_is_byte_exact_and_respects_the_size_limit(dtype):
    tensor = torch.randn(3, 37, 16).to(dtype)
    limit = 3 * 16 * tensor.element_size() * 5  # five tokens per piece
    pieces = encode(2, KvKind.VALUE, tensor, limit)
    assert len(pieces) == 8 and all(len(p.data) <= limit for p in pieces)
    rebuilt = torch.cat([decode(p) for p in pieces], dim=1)
    assert rebuilt.dtype == dtype
    assert rebuilt.view(torch.uint8).equal(tensor.view(torch.uint8))
    assert [p.token_start for p in pieces] == list(range(0, 37, 5))


def test_decode_refuses_mismatched_bytes_dtype_and_shape():
    good = encode(0, KvKind.KEY, torch.zeros(2, 4, 8), 1 << 20)[0]
    with pytest.raises(KvChunkError, match="bytes do not match"):
        decode(KvPiece(0, KvKind.KEY, 0, "float32", (2, 5, 8), good.data))
    with pytest.raises(KvChunkError, match="dtype"):
        decode(KvPiece(0, KvKind.KEY, 0, "int8", (2, 4, 8), good.data))
    with pytest.raises(KvChunkError, match="shape"):
        decode(KvPiece(0, KvKind.KEY, 0, "float32", (64,), good.data))


def test_coverage_finds_duplicates_and_gaps():
    coverage = KvCoverage(num_layers=2, prompt_len=10)
    for layer in range(2):
        for kind in KvKind:
            coverage.add(KvPiece(layer, kind, 0, "float32", (1, 6, 1), b""))
    with pytest.raises(KvChunkError, match="twice"):
        coverage.add(KvPiece(1, KvKind.KEY, 5, "float32", (1, 2, 1), b""))
    assert len(coverage.missing()) == 4
    for layer in range(2):
        for kind in KvKind:
            coverage.add(KvPiece(layer, kind, 6, "float32", (1, 4, 1), b""))
    assert coverage.missing() == []


# -- KvChunk framing: the same protobuf wire format, the tensor bytes copied once --


def a_piece() -> KvPiece:
    return encode(3, KvKind.VALUE, torch.arange(2 * 5 * 4, dtype=torch.bfloat16).view(2, 5, 4), 1 << 20)[0]


def test_framed_pieces_parse_as_protobuf_kv_chunks_and_back():
    piece = a_piece()
    framed = grpc_push.piece_bytes(piece, "res-1")
    assert wpb.KvChunk.FromString(framed) == grpc_push.piece_to_pb(piece, "res-1")
    header, data = parse_kv_chunk(framed)
    assert grpc_push.chunk_from_pb(header, data) == ("res-1", piece)
    assert torch.equal(decode(grpc_push.chunk_from_pb(header, data)[1]), decode(piece))


def test_protobuf_serialized_chunks_parse_with_the_data_anywhere():
    piece = a_piece()
    message = grpc_push.piece_to_pb(piece, "res-2")
    assert grpc_push.chunk_from_pb(*parse_kv_chunk(message.SerializeToString())) == ("res-2", piece)
    data_first = (
        wpb.KvChunk(data=piece.data).SerializeToString()
        + wpb.KvChunk(reservation_id="res-2", layer=3, kind=2, dtype="bfloat16", shape=[2, 5, 4]).SerializeToString()
    )
    assert grpc_push.chunk_from_pb(*parse_kv_chunk(data_first)) == ("res-2", piece)
    commit = KvCommit(first_token=9, prompt_len=5, num_layers=4)
    assert grpc_push.chunk_from_pb(*parse_kv_chunk(grpc_push.commit_bytes(commit, "res-2"))) == ("res-2", commit)


@pytest.mark.parametrize(
    "raw",
    [b"\x3a\x10abc", b"\x3a", b"\x0f\x01", b"\x0a\x02\xff\xfe", b"\x80\x80\x80"],
    ids=["data runs past the end", "no length", "wire type 7", "invalid UTF-8 in reservation_id", "truncated varint"],
)
def test_bytes_that_are_not_a_kv_chunk_are_refused_not_raised(raw):
    parsed = parse_kv_chunk(raw)
    assert isinstance(parsed, UnparsableMessage) and parsed.type_name == "disagg.v1.KvChunk"

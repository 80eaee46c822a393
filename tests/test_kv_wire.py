import pytest
import torch

from disagg.engine.kv_wire import KvCoverage, KvKind, KvPiece, KvWireError, decode, encode


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
    with pytest.raises(KvWireError, match="bytes do not match"):
        decode(KvPiece(0, KvKind.KEY, 0, "float32", (2, 5, 8), good.data))
    with pytest.raises(KvWireError, match="dtype"):
        decode(KvPiece(0, KvKind.KEY, 0, "int8", (2, 4, 8), good.data))
    with pytest.raises(KvWireError, match="shape"):
        decode(KvPiece(0, KvKind.KEY, 0, "float32", (64,), good.data))


def test_coverage_finds_duplicates_and_gaps():
    coverage = KvCoverage(num_layers=2, prompt_len=10)
    for layer in range(2):
        for kind in KvKind:
            coverage.add(KvPiece(layer, kind, 0, "float32", (1, 6, 1), b""))
    with pytest.raises(KvWireError, match="twice"):
        coverage.add(KvPiece(1, KvKind.KEY, 5, "float32", (1, 2, 1), b""))
    assert len(coverage.missing()) == 4
    for layer in range(2):
        for kind in KvKind:
            coverage.add(KvPiece(layer, kind, 6, "float32", (1, 4, 1), b""))
    assert coverage.missing() == []

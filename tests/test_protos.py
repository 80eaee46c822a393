"""The committed stubs in disagg/v1 must be what protoc makes of protos/."""

import importlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_stubs_match_the_proto_files(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        gen = importlib.import_module("gen_protos")
    finally:
        sys.path.pop(0)
    gen.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "disagg" / "v1").glob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is not committed; run python scripts/gen_protos.py"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} drifted from the .proto files; run python scripts/gen_protos.py"


def test_stubs_import_and_name_the_public_contract():
    from disagg.v1 import generation_pb2, generation_pb2_grpc  # noqa: F401

    service = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
    assert service.full_name == "disagg.v1.GenerationService"
    assert {m.name for m in service.methods} == {"Generate", "Tokenize", "GetModelInfo"}
    assert service.methods_by_name["Generate"].server_streaming

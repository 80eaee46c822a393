"""An 8-bit KV cache's codes and scales over both KV transports.

The codec in process; the gRPC push between a real GrpcPushSender and a real
DecodeWorker behind its gRPC edge (in process, over a stand-in backend whose
write_kv records what lands); the NIXL pull between a real NixlPullSender and the
same decode worker with a real NixlHostStagingSink, in a process of its own (NIXL's
agent stays out of pytest's process, see tests/queued_prefill_probe.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import grpc
import pytest
import torch
from conftest import tiny_model
from prometheus_client import CollectorRegistry

from decode_worker.config import DecodeWorkerConfig
from decode_worker.grpc_edge import SERVICE, DecodeServicer, parse_kv_chunk
from decode_worker.worker import DecodeWorker
from disagg.engine.backends.base import ModelInfo
from disagg.engine.quantization.kv_cache import QuantizedKv, code_dtype, concatenated
from disagg.engine.requests import Sampling, Stopping
from disagg.kv_transport import grpc_push, nixl_transport
from disagg.kv_transport.chunk_codec import KvChunkError, KvCommit, KvKind, KvPiece, decode, encode
from disagg.kv_transport.grpc_push import PUSH_KV, GrpcPushSender
from disagg.kv_transport.layout import KvGeometry
from disagg.kv_transport.spans import KvSpan
from disagg.rpc.metrics import DecodeMetrics, PrefillMetrics
from disagg.rpc.server import INTERNAL_MESSAGE_BYTES, RequestError, start_server
from disagg.v1 import worker_pb2 as wpb

HEADS, HEAD_DIM, BLOCK, LAYERS = 2, 64, 16, 2
PREFIX, COMPUTED = 16, 29  # a span of two parts (a cached prefix, then computed tokens); 45 tokens end inside a block
PROMPT_LEN = PREFIX + COMPUTED


def quantized(tokens: int, kv_cache_dtype: str, seed: int, block: int = BLOCK, heads: int = HEADS, head_dim: int = HEAD_DIM) -> QuantizedKv:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(heads, tokens, head_dim, generator=generator) * (1 + torch.arange(tokens)[None, :, None] % 5)  # blocks of unlike scales
    return QuantizedKv.quantize(values, block, code_dtype(kv_cache_dtype))


def raw(kv: QuantizedKv) -> tuple[bytes, bytes]:
    return kv.codes.contiguous().view(torch.uint8).numpy().tobytes(), kv.scales.contiguous().numpy().tobytes()


# -- the codec ---------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_8bit_kv_round_trips_in_whole_block_pieces_with_their_scales(kv_cache_dtype):
    block, token_start = 4, 8
    kv = quantized(37, kv_cache_dtype, seed=1, block=block, heads=3, head_dim=8)  # 10 blocks, the last of 1 token
    block_bytes = 3 * (block * 8 + 4)
    pieces = encode(2, KvKind.VALUE, kv, max_piece_bytes=3 * block_bytes - 1, token_start=token_start)  # two blocks a piece
    assert [p.token_start for p in pieces] == [8, 16, 24, 32, 40]
    assert [p.shape[1] for p in pieces] == [8, 8, 8, 8, 5]
    assert all(p.nbytes <= 2 * block_bytes and p.scale_block == block for p in pieces)
    assert sum(p.nbytes for p in pieces) == kv.nbytes
    for piece in pieces:  # the hand-rolled framing and protobuf agree, scales and all
        framed = grpc_push.piece_bytes(piece, "r")
        assert wpb.KvChunk.FromString(framed) == grpc_push.piece_to_pb(piece, "r")
        assert grpc_push.chunk_from_pb(*parse_kv_chunk(framed)) == ("r", piece)
    rebuilt = concatenated([decode(p) for p in pieces])
    assert rebuilt.dtype == code_dtype(kv_cache_dtype) and rebuilt.block_size == block
    assert raw(rebuilt) == raw(kv)
    one_block_each = encode(0, KvKind.KEY, kv, max_piece_bytes=1)  # a limit under one block still moves a block a piece
    assert [p.shape[1] for p in one_block_each] == [4] * 9 + [1]


def test_a_span_of_8bit_parts_cuts_at_block_starts():
    prefix, keys = quantized(2 * BLOCK, "int8", 2), quantized(13, "int8", 3)
    span = KvSpan.of(BLOCK, (prefix, prefix), keys, keys)  # the decode side holds the first block of the two cached
    assert span.start == BLOCK and span.tokens == BLOCK + 13
    assert [raw(part) for part in span.keys] == [raw(prefix[:, BLOCK:]), raw(keys)]
    pieces = span.pieces(0, max_piece_bytes=1 << 20)
    assert [(p.kind, p.token_start, p.shape[1]) for p in pieces] == [(kind, start, n) for kind in KvKind for start, n in ((BLOCK, BLOCK), (2 * BLOCK, 13))]


def good_piece() -> KvPiece:
    return encode(0, KvKind.KEY, quantized(6, "int8", 4, block=4, heads=2, head_dim=4), 1 << 20, token_start=4)[0]


def with_scales(piece: KvPiece, *values: float) -> KvPiece:
    return replaced(piece, scales=torch.tensor(values).numpy().tobytes())


def replaced(piece: KvPiece, **fields) -> KvPiece:
    return dataclasses.replace(piece, **fields)


MALFORMED = {
    "bfloat16 codes with scales": (lambda p: replaced(p, dtype="bfloat16"), "dtype"),
    "int8 without scales": (lambda p: replaced(p, scales=b"", scale_block=0), "dtype"),
    "scales without a scale_block": (lambda p: replaced(p, scale_block=0), "scale_block"),
    "a negative scale_block": (lambda p: replaced(p, scale_block=-4), "scale_block"),
    "token_start inside a block": (lambda p: replaced(p, token_start=6), "token_start"),
    "scales for another shape": (lambda p: replaced(p, scales=p.scales[:-4]), "scales"),
    "codes for another shape": (lambda p: replaced(p, data=p.data[:-1]), "bytes do not match"),
    "a NaN scale": (lambda p: with_scales(p, 0.1, math.nan, 0.1, 0.1), "scales"),
    "an infinite scale": (lambda p: with_scales(p, 0.1, 0.1, math.inf, 0.1), "scales"),
    "a negative scale": (lambda p: with_scales(p, 0.1, 0.1, 0.1, -0.1), "scales"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_8bit_piece_is_refused_naming_the_field(case):
    piece = good_piece()
    assert isinstance(decode(piece), QuantizedKv)
    spoil, field = MALFORMED[case]
    with pytest.raises(KvChunkError, match=field):
        decode(spoil(piece))


# -- a decode worker over a stand-in backend, behind its real gRPC edge ------------------


def model_info(kv_cache_dtype: str = "int8", kv_block_size: int = BLOCK, dtype: str = "bfloat16") -> ModelInfo:
    return ModelInfo("stand-in", "torch", dtype, LAYERS, HEADS, HEAD_DIM, 100, (0,), 128, kv_cache_dtype, kv_block_size if kv_cache_dtype else 0)


class RecordingBackend:
    """What DecodeWorker asks of a backend to receive KV; write_kv keeps copies of what lands
    (the NIXL staging buffer is reused)."""

    tokens_per_step = 1  # Backend's defaults: one token a row a step, no start but a penalized sequence's
    starts_every_sequence = False

    def __init__(self, info: ModelInfo):
        self.info = info
        self.writes: list[tuple[int, KvKind, int, QuantizedKv]] = []  # layer, kind, token_start, a copy of what was written

    def write_kv(self, table, layer: int, kind: KvKind, token_start: int, kv) -> None:
        assert isinstance(kv, QuantizedKv) and kv.block_size == self.info.kv_block_size
        self.writes.append((layer, KvKind(kind), token_start, QuantizedKv(kv.codes.clone(), kv.scales.clone(), kv.block_size)))

    def landed(self, layer: int, kind: KvKind) -> tuple[bytes, bytes]:
        """Codes and scales written for one layer and kind, laid end to end in token order."""
        ours = sorted((w for w in self.writes if w[:2] == (layer, kind)), key=lambda w: w[2])
        return raw(concatenated([w[3] for w in ours]))

    def decode_step(self, inputs):
        raise AssertionError("no step runs here")

    def device_error(self, exc):
        return exc

    def unsupported(self, sampling) -> list[str]:
        return []


class DecodeSide:
    """A real DecodeWorker (never started: no steps run) serving PushKv and PullKv on a real server."""

    def __init__(self, info: ModelInfo, kv_transport: str = "grpc"):
        self.backend = RecordingBackend(info)
        config = DecodeWorkerConfig(model=tiny_model("llama"), batch_size=2, kv_transport=kv_transport)
        self.worker = DecodeWorker(self.backend, config, DecodeMetrics(CollectorRegistry()))

    async def __aenter__(self) -> DecodeSide:
        self.worker._loop = asyncio.get_running_loop()  # what start() sets; start() would also run the decode loop
        if self.worker.config.kv_transport == "nixl":
            from decode_worker.worker import open_nixl_sink

            self.worker.nixl = open_nixl_sink(self.backend, self.worker._write_kv)
        servicer = DecodeServicer()
        servicer.worker = self.worker
        self.server = await start_server("127.0.0.1:0", [(servicer, SERVICE)], INTERNAL_MESSAGE_BYTES, deserializers={PUSH_KV: parse_kv_chunk})
        self.address = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.aio.insecure_channel(self.address)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.server.stop(None)
        self.worker._kv_writer.shutdown(wait=True)
        self.worker.constraints.close()

    def reserve(self, request_id: str = "r") -> str:
        return self.worker.open_stream(request_id, PROMPT_LEN, Sampling(), Stopping(max_new_tokens=4)).key

    def reserved(self, key: str) -> bool:
        return self.worker.slots.is_reserved(key)


def spans(kv_cache_dtype: str) -> list[KvSpan]:
    """Per layer, a cached prefix's KV then the computed tokens' (two parts, as a prefix hit sends)."""
    out = []
    for layer in range(LAYERS):
        prefix = (quantized(PREFIX, kv_cache_dtype, 10 * layer), quantized(PREFIX, kv_cache_dtype, 10 * layer + 1))
        out.append(KvSpan.of(0, prefix, quantized(COMPUTED, kv_cache_dtype, 10 * layer + 2), quantized(COMPUTED, kv_cache_dtype, 10 * layer + 3)))
    return out


def sent(span: KvSpan, kind: KvKind) -> tuple[bytes, bytes]:
    return raw(concatenated(list(span.keys if kind is KvKind.KEY else span.values)))


def expected_bytes() -> int:
    """Codes (one byte a value) and float32 scales (one a block and head) of every layer's K and V."""
    return 2 * LAYERS * HEADS * (PROMPT_LEN * HEAD_DIM + math.ceil(PROMPT_LEN / BLOCK) * 4)


def bf16_bytes() -> int:
    return 2 * LAYERS * HEADS * PROMPT_LEN * HEAD_DIM * 2


def assert_landed_as_sent(backend: RecordingBackend, layers: list[KvSpan]) -> None:
    for layer, span in enumerate(layers):
        for kind in KvKind:
            assert backend.landed(layer, kind) == sent(span, kind), (layer, kind)


async def push(side: DecodeSide, reservation_id: str, layers: list[KvSpan], max_piece_bytes: int) -> int:
    sender = GrpcPushSender(lambda address: side.channel, PrefillMetrics(CollectorRegistry()), send_timeout=30)
    outbox: asyncio.Queue = asyncio.Queue()
    for layer, span in enumerate(layers):
        outbox.put_nowait(span.pieces(layer, max_piece_bytes))
    outbox.put_nowait(KvCommit(first_token=5, prompt_len=PROMPT_LEN, num_layers=LAYERS))
    return await sender.send(side.address, reservation_id, outbox, timeout=30)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_grpc_push_lands_the_codes_and_scales_as_sent(kv_cache_dtype):
    layers = spans(kv_cache_dtype)

    async def main():
        async with DecodeSide(model_info(kv_cache_dtype)) as side:
            key = side.reserve()
            acknowledged = await push(side, key, layers, max_piece_bytes=3000)  # pieces of one block each: several a part
            assert not side.reserved(key)  # committed: the sequence was admitted
            return acknowledged, side.backend

    acknowledged, backend = asyncio.run(main())
    assert len(backend.writes) > 4 * LAYERS
    assert_landed_as_sent(backend, layers)
    assert acknowledged == expected_bytes() == 23136
    assert acknowledged <= 0.55 * bf16_bytes()  # 46080 in bfloat16: 0.502x


MISMATCHES = {
    "fp8 into int8": ("fp8", model_info("int8"), "piece of dtype 'float8_e4m3fn' with scale_block 16; this worker holds an 8-bit KV cache (int8"),
    "another scale block": ("int8", model_info("int8", kv_block_size=32), "piece of dtype 'int8' with scale_block 16; this worker holds an 8-bit KV cache"),
    "8-bit into unquantized": ("int8", model_info(""), "codes with scales (scale_block 16); this worker holds an unquantized bfloat16 KV cache"),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_grpc_push_of_another_kv_dtype_is_refused_and_the_reservation_waits(case):
    sender_dtype, info, message = MISMATCHES[case]

    async def main():
        async with DecodeSide(info) as side:
            key = side.reserve()
            with pytest.raises(RequestError) as error:
                await push(side, key, spans(sender_dtype), max_piece_bytes=1 << 20)
            assert side.reserved(key) and side.backend.writes == []  # nothing written; the reservation waits for KV
            return error.value

    error = asyncio.run(main())
    assert error.code == grpc.StatusCode.ABORTED and "INVALID_ARGUMENT" in str(error) and message in str(error), str(error)


# -- NIXL: a real pull, in a process of its own ----------------------------------------

PULL = r"""
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
from prometheus_client import CollectorRegistry
import test_kv_transport_quantized as t
from disagg.kv_transport.layout import KvGeometry
from disagg.kv_transport.nixl_control import NixlPullSender
from disagg.kv_transport.nixl_transport import NixlSource
from disagg.rpc.metrics import PrefillMetrics
from disagg.rpc.server import RequestError

def sender(side, kv_cache_dtype):
    info = t.model_info(kv_cache_dtype)
    source = NixlSource(KvGeometry.of(info, info.max_seq_len), max_tokens=info.max_seq_len, buffers=1)
    return NixlPullSender(source, lambda address: side.channel, PrefillMetrics(CollectorRegistry()), 30.0)

async def main(kv_cache_dtype):
    layers = t.spans(kv_cache_dtype)
    async with t.DecodeSide(t.model_info(kv_cache_dtype), kv_transport="nixl") as side:
        key = side.reserve("pulled")
        received = await sender(side, kv_cache_dtype).send(side.address, key, layers, first_token=5, timeout=30)
        t.assert_landed_as_sent(side.backend, layers)
        assert not side.reserved(key)
        refused = side.reserve("refused")
        other = "fp8" if kv_cache_dtype == "int8" else "int8"
        try:
            await sender(side, other).send(side.address, refused, t.spans(other), first_token=5, timeout=30)
            error = None
        except RequestError as exc:
            error = f"{exc.code.name}: {exc}"
        return {"received": received, "refused": error, "waits": side.reserved(refused), "writes": len(side.backend.writes)}

print(json.dumps(asyncio.run(main(sys.argv[2]))), flush=True)
"""


@pytest.mark.skipif(not nixl_transport.available(), reason="NIXL is not installed (pip install nixl-cu12)")
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_nixl_pull_lands_the_codes_and_scales_as_staged_and_refuses_another_kv_dtype(kv_cache_dtype):
    tests = pathlib.Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", PULL, str(tests), kv_cache_dtype], cwd=tests.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    assert result["received"] == expected_bytes() == KvGeometry.of(model_info(kv_cache_dtype), 128).prompt_bytes(PROMPT_LEN)
    assert result["received"] <= 0.55 * bf16_bytes()
    other = "int8" if kv_cache_dtype == "fp8" else "float8_e4m3fn"
    assert result["refused"] and "ABORTED" in result["refused"] and "INVALID_ARGUMENT" in result["refused"], result
    assert f"staged KV (kv_dtype '{other}', scale_block {BLOCK})" in result["refused"] and "this worker holds an 8-bit KV cache" in result["refused"]
    assert result["waits"] and result["writes"] == 2 * LAYERS  # the refused pull wrote nothing

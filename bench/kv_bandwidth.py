"""KV hand-off bandwidth against a plain byte stream over the same transport.

    python bench/kv_bandwidth.py [--tokens 2048] [--repeats 5]

Sends the KV of one prompt (SmolLM-135M's shape, bf16: 30 layers x K/V x
[3, tokens, 64]) into a reserved slot of a real decode worker process through
PushKv, and the same number of bytes in the same piece sizes to a sink
process that only counts them; both over gRPC on loopback, in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import time

import grpc
import torch

from disagg.engine.kv_wire import KvCommit, KvKind, encode
from disagg.launcher import ClusterSpec, LocalCluster
from disagg.rpc import channel_options
from disagg.tinymodel import SMOLLM_135M_SHAPE, ensure_tiny_model
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc
from disagg.wire import commit_bytes, piece_bytes, push_kv_call

SINK = """
import asyncio, grpc, sys
async def main():
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    async def sink(requests, context):
        total = 0
        async for chunk in requests:
            total += len(chunk)
        return total.to_bytes(8, "little")
    handler = grpc.method_handlers_generic_handler("Sink", {"Push": grpc.stream_unary_rpc_method_handler(sink)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


def kv_pieces(tokens: int, piece_bytes: int):
    spec = SMOLLM_135M_SHAPE
    head_dim = spec.hidden_size // spec.num_heads
    pieces = []
    for layer in range(spec.num_layers):
        for kind in KvKind:
            pieces += encode(layer, kind, torch.zeros(spec.num_kv_heads, tokens, head_dim, dtype=torch.bfloat16), piece_bytes)
    return pieces


async def push_kv(address: str, pieces, tokens: int) -> float:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = wgrpc.DecodeServiceStub(channel)
        push_kv = push_kv_call(channel)
        call = stub.Decode(wpb.DecodeRequest(request_id="bw", prompt_len=tokens, sampling=wpb.WorkerSampling(top_p=1.0), stopping=wpb.WorkerStopping(max_new_tokens=1)))
        reservation = (await call.read()).reserved.reservation_id
        commit = KvCommit(first_token=5, prompt_len=tokens, num_layers=SMOLLM_135M_SHAPE.num_layers)
        started = time.perf_counter()
        # Framed on the way, as the prefill worker's are.
        await push_kv(itertools.chain((piece_bytes(p, reservation) for p in pieces), [commit_bytes(commit, reservation)]))
        elapsed = time.perf_counter() - started
        call.cancel()
        return elapsed


async def push_plain(address: str, pieces) -> float:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        push = channel.stream_unary("/Sink/Push", request_serializer=None, response_deserializer=None)
        payloads = [p.data for p in pieces]
        started = time.perf_counter()
        await push(iter(payloads))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2040, help="prompt tokens (SmolLM-135M holds 2,048 in all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--piece-bytes", type=int, default=4 << 20)
    args = parser.parse_args()
    pieces = kv_pieces(args.tokens, args.piece_bytes)
    total = sum(len(p.data) for p in pieces)
    # Sender (this process) on core 0, receivers on core 1: both transfers cross
    # the same two cores, so the ratio does not hang on where the scheduler put them.
    os.sched_setaffinity(0, {0})
    sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {1}))
    sink_address = f"127.0.0.1:{sink.stdout.readline().strip()}"
    spec = ClusterSpec(model=str(ensure_tiny_model(SMOLLM_135M_SHAPE)), dtype="bfloat16", log_dir="/tmp/disagg-kvbw-logs", cpus={"decode": [1]})
    cluster = LocalCluster(spec)
    try:
        worker = cluster.add_worker("decode", ["--batch-size", "1", "--max-seq-len", str(args.tokens + 16)])
        cluster.wait_serving(300, worker.address)
        kv, plain = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine
            kv.append(asyncio.run(push_kv(worker.address, pieces, args.tokens)))
            plain.append(asyncio.run(push_plain(sink_address, pieces)))
    finally:
        cluster.stop()
        sink.kill()
    kv_rate, plain_rate = total / statistics.median(kv) / 1e6, total / statistics.median(plain) / 1e6
    print(f"KV of a {args.tokens}-token prompt: {total / 1e6:.1f} MB in {len(pieces)} pieces")
    print(f"PushKv into a decode slot: {kv_rate:8.1f} MB/s (median of {args.repeats})")
    print(f"plain byte stream:         {plain_rate:8.1f} MB/s")
    print(f"ratio: {kv_rate / plain_rate:.2f}")


if __name__ == "__main__":
    main()

"""KV hand-off bandwidth against the raw transport underneath, in one run.

    python bench/kv_bandwidth.py [--transport grpc|nixl] [--tokens 2040] [--repeats 5] [--ucx-tls tcp]
    python bench/kv_bandwidth.py --handoff-gap [--tokens 2040]

The KV of one prompt (SmolLM-135M's shape, bf16: 30 layers x K/V x
[3, tokens, 64]) goes into a reserved slot of a real decode worker process.

- grpc: through PushKv, against the same bytes in the same piece sizes sent
  to a sink process that only counts them.
- nixl: this process stages the KV as a prefill worker does (NixlSource) and
  calls PullKv; the decode worker reads it into the slot. Against NIXL's own
  raw read of one buffer of the same size by another process, and memcpy.
  --ucx-tls tcp forces UCX onto TCP over loopback (the cross-machine proxy)
  for the worker, the raw reader and this process alike.
- --handoff-gap: what a client sees, time between the first and the second
  token of that prompt, through `disagg serve`-like clusters on each transport.
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

from disagg.kv_transport.chunk_codec import KvCommit, KvKind, encode
from disagg.kv_transport.grpc_push import commit_bytes, piece_bytes, push_kv_call
from disagg.rpc.server import channel_options
from disagg.tools.local_cluster import ClusterSpec, LocalCluster
from disagg.tools.tinymodel import SMOLLM_135M_SHAPE, ensure_tiny_model
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

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
        call = stub.Decode(wpb.DecodeRequest(
            request_id="bw", prompt_len=tokens, sampling=wpb.WorkerSampling(top_p=1.0), stopping=wpb.WorkerStopping(max_new_tokens=1)
        ))
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
    parser.add_argument("--transport", choices=("grpc", "nixl"), default="grpc")
    parser.add_argument("--tokens", type=int, default=2040, help="prompt tokens (SmolLM-135M holds 2,048 in all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--piece-bytes", type=int, default=4 << 20)
    parser.add_argument("--ucx-tls", default=None, help="nixl: UCX_TLS for every process (tcp: UCX over loopback TCP)")
    parser.add_argument("--handoff-gap", action="store_true", help="client-seen first-to-second token gap, gRPC against NIXL")
    args = parser.parse_args()
    if args.handoff_gap:
        return handoff_gap(args)
    if args.transport == "nixl":
        return nixl_bandwidth(args)
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


# -- NIXL -------------------------------------------------------------------------
RAW_READER = """
import sys, time
import torch
from disagg.kv_transport.nixl_transport import MEMORY, POLL_SECONDS, new_agent
metadata_file, address, nbytes, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
agent = new_agent("raw-reader")
buffer = torch.empty(nbytes, dtype=torch.uint8)
agent.register_memory([buffer], MEMORY)
peer = agent.add_remote_agent(open(metadata_file, "rb").read())
agent.make_connection(peer)
local = agent.get_xfer_descs([(buffer.data_ptr(), nbytes, 0)], MEMORY)
remote = agent.get_xfer_descs([(address, nbytes, 0)], MEMORY)
for _ in range(repeats + 1):  # the first read warms the connection up
    handle = agent.initialize_xfer("READ", local, remote, peer)
    started = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC":
        time.sleep(POLL_SECONDS)  # polls as the decode worker's reader does
        state = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - started
    assert state == "DONE", state
    agent.release_xfer_handle(handle)
    print("elapsed", elapsed, flush=True)
"""


def kv_layers(tokens: int):
    spec = SMOLLM_135M_SHAPE
    head_dim = spec.hidden_size // spec.num_heads
    generator = torch.Generator().manual_seed(0)
    return [tuple(torch.randn(spec.num_kv_heads, tokens, head_dim, generator=generator).to(torch.bfloat16) for _ in KvKind) for _ in range(spec.num_layers)]


async def pull_kv(address: str, source, buffer, generation: int, tokens: int) -> float:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = wgrpc.DecodeServiceStub(channel)
        call = stub.Decode(wpb.DecodeRequest(
            request_id="bw", prompt_len=tokens, sampling=wpb.WorkerSampling(top_p=1.0), stopping=wpb.WorkerStopping(max_new_tokens=1)
        ))
        reservation = (await call.read()).reserved.reservation_id
        request = wpb.PullKvRequest(
            reservation_id=reservation, agent_name=source.name, agent_metadata=source.metadata, address=buffer.address,
            prompt_len=tokens, num_layers=SMOLLM_135M_SHAPE.num_layers, first_token=5, generation=generation,
        )
        started = time.perf_counter()
        with source.reading():  # as the prefill worker's NixlPullSender does
            ack = await stub.PullKv(request)
        elapsed = time.perf_counter() - started
        assert ack.bytes_received == source.geometry.prompt_bytes(tokens), ack
        call.cancel()
        return elapsed


def nixl_bandwidth(args) -> None:
    import tempfile

    from disagg.kv_transport.layout import KvGeometry
    from disagg.kv_transport.nixl_transport import NixlSource

    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # inherited by the worker and the raw reader
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    spec = SMOLLM_135M_SHAPE
    head_dim = spec.hidden_size // spec.num_heads
    geometry = KvGeometry(spec.num_layers, spec.num_kv_heads, head_dim, 2, args.tokens + 16)
    total = geometry.prompt_bytes(args.tokens)
    os.sched_setaffinity(0, {0})  # the staging side here; the readers on core 1
    source = NixlSource(geometry, max_tokens=args.tokens, buffers=1)
    buffer = source.buffers[0]
    generation = buffer.next_generation()
    for layer, (keys, values) in enumerate(kv_layers(args.tokens)):
        source.stage_layer(buffer, layer, keys, values)
    cluster = LocalCluster(ClusterSpec(
        model=str(ensure_tiny_model(SMOLLM_135M_SHAPE)), dtype="bfloat16", log_dir="/tmp/disagg-kvbw-logs", cpus={"decode": [1]}
    ))
    try:
        worker = cluster.add_worker("decode", ["--batch-size", "1", "--max-seq-len", str(args.tokens + 16), "--kv-transport", "nixl"])
        cluster.wait_serving(300, worker.address)
        asyncio.run(pull_kv(worker.address, source, buffer, generation, args.tokens))  # connects the agents
        with tempfile.NamedTemporaryFile(suffix=".md") as metadata, source.reading():  # the raw read is progressed as a pull is
            metadata.write(source.metadata)
            metadata.flush()
            command = [sys.executable, "-c", RAW_READER, metadata.name, str(buffer.address), str(total), str(args.repeats)]
            raw_reader = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {1}))
            raw = [float(line.split()[1]) for line in raw_reader.stdout if line.startswith("elapsed ")][1:]
            assert raw_reader.wait() == 0 and len(raw) == args.repeats
        slot = [asyncio.run(pull_kv(worker.address, source, buffer, generation, args.tokens)) for _ in range(args.repeats)]
    finally:
        cluster.stop()
    staged = torch.empty(total, dtype=torch.uint8)
    copies = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        staged.copy_(buffer.tensor[64 : 64 + total])
        copies.append(time.perf_counter() - started)
    rate = {name: total / statistics.median(times) / 1e9 for name, times in (("slot", slot), ("raw", raw), ("memcpy", copies))}
    print(f"KV of a {args.tokens}-token prompt: {total / 1e6:.1f} MB, UCX_TLS={os.environ.get('UCX_TLS', '(UCX default)')}")
    print(
        f"PullKv into a decode slot (gRPC control + NIXL read + commit): {rate['slot']:6.2f} GB/s"
        f"  ({statistics.median(slot) * 1e3:.2f} ms, median of {args.repeats})"
    )
    print(f"NIXL raw read of one {total / 1e6:.1f} MB buffer:                  {rate['raw']:6.2f} GB/s  ({statistics.median(raw) * 1e3:.2f} ms)")
    print(f"memcpy of the same bytes:                                  {rate['memcpy']:6.2f} GB/s")
    print(f"ratio to NIXL raw: {rate['slot'] / rate['raw']:.2f}")


def handoff_gap(args) -> None:
    """Client-seen gap between the first and second token of a long prompt, per transport."""
    from disagg.clients.grpc_client import Client

    prompt = list(range(100, 100 + args.tokens))
    gaps = {}
    for transport in ("grpc", "nixl"):
        # float32: this host has no fast bf16 matmul (AVX2 only), and a 2k-token bf16 prefill here can outlast a lease.
        worker_args = ["--kv-transport", transport, "--max-seq-len", str(args.tokens + 16)]
        spec = ClusterSpec(
            model=str(ensure_tiny_model(SMOLLM_135M_SHAPE)), dtype="float32", log_dir=f"/tmp/disagg-kvbw-{transport}",
            worker_args=worker_args, decode_args=["--lease-seconds", "300"], batch_size=1,
        )
        cluster = LocalCluster(spec).start()
        try:
            times = []
            with Client(cluster.router_address, timeout=300) as client:
                for _ in range(args.repeats + 1):  # the first warms up
                    arrivals = []
                    for chunk in client.generate(prompt_token_ids=prompt, max_new_tokens=2, ignore_eos=True):
                        arrivals += [time.perf_counter()] * len(chunk.token_ids)
                    times.append(arrivals[1] - arrivals[0])
            gaps[transport] = statistics.median(times[1:])
        finally:
            cluster.stop()
    print(f"first-to-second token gap, {args.tokens}-token prompt (one decode step + the KV hand-off), median of {args.repeats}:")
    for transport, gap in gaps.items():
        print(f"  {transport:5s} {gap * 1e3:8.1f} ms")
    print(f"nixl / grpc: {gaps['nixl'] / gaps['grpc']:.2f}")


if __name__ == "__main__":
    main()

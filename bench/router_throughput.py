"""How many streamed tokens per second one router process sustains.

    python bench/router_throughput.py [--decode-workers 3] [--streams 96] [--tokens 400]

A very small model on several decode workers feeds one router with many
concurrent streams; client processes read them (through the generated stubs,
as a user's program would). Two phases: clients that read as fast as they can,
and clients that read slower than tokens arrive (--read-delay per message), when
the router coalesces what a client has not taken yet into fewer, bigger messages.

Baseline, same run, same client processes: a bare grpc.aio server that streams
one GenerateResponse per token with nothing else to do: the ceiling of one
Python gRPC process. Reported: tokens/s the clients received, messages per
token, and CPU time of the serving process per token (from /proc, so it holds
however busy the shared cores are).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time

import grpc

from disagg.tools.local_cluster import ClusterSpec, LocalCluster
from disagg.tools.tinymodel import DEFAULT_SPEC, ensure_tiny_model
from disagg.v1 import generation_pb2 as pb
from disagg.v1 import generation_pb2_grpc as gen_grpc

BARE_STREAMER = """
import asyncio, grpc, sys
from disagg.v1 import generation_pb2 as pb, generation_pb2_grpc as gen_grpc
class Bare(gen_grpc.GenerationServiceServicer):
    async def Generate(self, request, context):
        for i in range(request.stopping.max_new_tokens):
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[i % 1000], text=" word")
async def main():
    server = grpc.aio.server()
    gen_grpc.add_GenerationServiceServicer_to_server(Bare(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# A slow client as the server sees it: a link whose small HTTP/2 window fills
# (by default gRPC's window is large and grows, so a few hundred tokens of a
# slow reader would sit in its own receive buffer and the server never notice).
SLOW_LINK = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


async def read_streams(address: str, streams: int, tokens: int, read_delay: float, tag: str) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(address, options=SLOW_LINK if read_delay else None) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)

        async def one(i: int) -> tuple[int, int]:
            request = pb.GenerateRequest(
                request_id=f"{tag}-{i}", prompt="The lighthouse keeper climbed", stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True)
            )
            received = messages = 0
            async for response in stub.Generate(request, timeout=600):
                received += len(response.token_ids)
                messages += 1
                if read_delay:
                    await asyncio.sleep(read_delay)
            return received, messages

        results = await asyncio.gather(*(one(i) for i in range(streams)))
    return sum(r for r, _ in results), sum(m for _, m in results)


def client_process(args: tuple) -> tuple[int, int]:
    return asyncio.run(read_streams(*args))


def drive(address: str, pid: int, streams: int, tokens: int, read_delay: float, clients: int, tag: str) -> dict:
    """All streams at once from `clients` processes; the server's CPU time over the run."""
    per_client = [streams // clients + (i < streams % clients) for i in range(clients)]
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        cpu_before, started = cpu_seconds(pid), time.perf_counter()
        results = pool.map(client_process, [(address, n, tokens, read_delay, f"{tag}-{i}") for i, n in enumerate(per_client)])
        elapsed, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu_before
    received, messages = sum(r for r, _ in results), sum(m for _, m in results)
    assert received == streams * tokens, f"{received} tokens received of {streams * tokens}"
    return {
        "tokens": received,
        "tokens_per_s": received / elapsed,
        "messages_per_token": messages / received,
        "cpu_us_per_token": cpu / received * 1e6,
        "cpu_share": cpu / elapsed,
        "seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-workers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="slots per decode worker")
    parser.add_argument("--streams", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=400, help="new tokens per stream")
    parser.add_argument("--read-delay", type=float, default=0.05, help="seconds a slow client waits after each message")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--json", default="bench/results/router_throughput.json")
    args = parser.parse_args()

    bare = subprocess.Popen([sys.executable, "-c", BARE_STREAMER], stdout=subprocess.PIPE, text=True)
    bare_address = f"127.0.0.1:{bare.stdout.readline().strip()}"
    spec = ClusterSpec(
        model=str(ensure_tiny_model(DEFAULT_SPEC)), decode_workers=args.decode_workers, batch_size=args.batch_size,
        threads_per_worker=1, log_dir="/tmp/disagg-router-bench-logs",
    )
    cluster = LocalCluster(spec).start()
    router_pid = cluster.process("router").popen.pid
    results = {}
    try:
        drive(cluster.router_address, router_pid, args.clients * 2, 16, 0.0, args.clients, "warm")  # compile paths, fill caches
        drive(bare_address, bare.pid, args.clients * 2, 16, 0.0, args.clients, "warm")
        for name, delay in (("fast readers", 0.0), ("slow readers", args.read_delay)):
            results[f"router, {name}"] = drive(cluster.router_address, router_pid, args.streams, args.tokens, delay, args.clients, name)
            results[f"bare gRPC streamer, {name}"] = drive(bare_address, bare.pid, args.streams, args.tokens, delay, args.clients, name)
    finally:
        cluster.stop()
        bare.kill()

    print(f"{args.streams} streams x {args.tokens} tokens, {args.decode_workers} decode workers x {args.batch_size} slots, {args.clients} client processes")
    print(f"{'':34} {'tok/s':>9} {'msgs/token':>11} {'CPU us/token':>13} {'CPU share':>10}")
    for name, r in results.items():
        print(f"{name:34} {r['tokens_per_s']:9.0f} {r['messages_per_token']:11.3f} {r['cpu_us_per_token']:13.1f} {r['cpu_share']:10.2f}")
    for phase in ("fast readers", "slow readers"):
        router, bare_run = results[f"router, {phase}"], results[f"bare gRPC streamer, {phase}"]
        print(f"{phase}: router CPU per token = {router['cpu_us_per_token'] / bare_run['cpu_us_per_token']:.2f}x the bare streamer's")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

"""Overload: far more concurrent requests than decode slots. Counts what was
accepted and refused, checks accepted greedy requests against generate(),
and samples every process's memory while the queue is full.

    python bench/overload.py [--slots 2] [--max-queue 200] [--clients 400]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import threading
import time

import grpc

from disagg.clients.grpc_client import AsyncClient
from disagg.tools.local_cluster import ClusterSpec, LocalCluster
from disagg.tools.soak import Reference, rss_mib
from disagg.tools.tinymodel import TinyModelSpec, ensure_tiny_model, paragraphs


def sample_memory(cluster: LocalCluster, peaks: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        for p in cluster.processes:
            peaks[p.name] = max(peaks.get(p.name, 0.0), rss_mib(p.popen.pid))
        time.sleep(0.05)


async def flood(address: str, prompts: list[str], new_tokens: int):
    async def one(client, prompt):
        try:
            return await client.complete(prompt, max_new_tokens=new_tokens)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name

    async with AsyncClient(address, timeout=600) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--max-queue", type=int, default=200)
    parser.add_argument("--clients", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    model = str(ensure_tiny_model(TinyModelSpec()))
    texts = paragraphs()
    prompts = [" ".join(texts[i % len(texts)].split()[: 3 + i % 9]) for i in range(args.clients)]
    ref = Reference(model)
    spec = ClusterSpec(
        model=model, dtype="float32", batch_size=args.slots, router_args=["--max-queue", str(args.max_queue)], log_dir="/tmp/disagg-overload-logs"
    )
    with LocalCluster(spec) as cluster:
        idle = {p.name: round(rss_mib(p.popen.pid), 1) for p in cluster.processes}
        peaks: dict = {}
        stop = threading.Event()
        sampler = threading.Thread(target=sample_memory, args=(cluster, peaks, stop), daemon=True)
        sampler.start()
        started = time.perf_counter()
        results = asyncio.run(flood(cluster.router_address, prompts, args.new_tokens))
        elapsed = time.perf_counter() - started
        stop.set()
        sampler.join()
    outcomes = collections.Counter("OK" if not isinstance(r, str) else r for r in results)
    wrong = sum(1 for p, r in zip(prompts, results) if not isinstance(r, str) and r.token_ids != ref.greedy(p, args.new_tokens, args.new_tokens))
    print(f"{args.clients} concurrent requests, {args.slots} decode slots, queue bound {args.max_queue}: {dict(outcomes)}, wrong {wrong}, {elapsed:.1f}s")
    for name in idle:
        print(f"  {name:10s} RSS idle {idle[name]:7.1f} MiB   peak under load {peaks[name]:7.1f} MiB")


if __name__ == "__main__":
    main()

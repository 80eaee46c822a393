"""Service overhead: time to first token and inter-token latency through the
whole gRPC path, against the same backend's prefill and decode step run in
this process (the floor). Both in one run, on the same model and threads.

    python bench/service_overhead.py [--model DIR] [--requests 20] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from decode_worker.decode_loop import DecodeLoop, Sequence
from disagg.clients.grpc_client import Client
from disagg.engine.backends import load_backend
from disagg.engine.requests import Sampling, Stopping
from disagg.kv_transport.chunk_codec import KvKind
from disagg.tools.local_cluster import ClusterSpec, LocalCluster
from disagg.tools.tinymodel import ensure_tiny_model

PROMPT = "The lighthouse keeper climbed the stairs every evening at dusk. He lit the lamp,"


def in_process(model: str, prompt_ids: list[int], new_tokens: int, repeats: int, dtype: str) -> tuple[float, float]:
    """(median prefill seconds, median decode step seconds at batch 1), through the decode loop."""
    backend = load_backend("torch", model=model, dtype=dtype)
    backend.allocate_slots(1)
    prefills, steps = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        result = backend.prefill(prompt_ids, Sampling())
        prefills.append(time.perf_counter() - start)
    for layer, (k, v) in enumerate(result.layers):
        backend.write_kv([0], layer, KvKind.KEY, 0, k)
        backend.write_kv([0], layer, KvKind.VALUE, 0, v)
    for _ in range(max(1, repeats // 4)):
        done = threading.Event()
        decode_loop = DecodeLoop(backend, lambda events: None, lambda keys: done.set())
        decode_loop.start()
        decode_loop.admit(Sequence("x", 0, len(prompt_ids), result.first_token, Sampling(), Stopping(new_tokens, frozenset())))
        done.wait(120)
        decode_loop.stop()
        steps += decode_loop.stats.step_seconds[2:]  # skip warm-up steps
    return statistics.median(prefills), statistics.median(steps)


def through_service(address: str, new_tokens: int, requests: int) -> tuple[list[float], list[float]]:
    ttfts, itls = [], []
    with Client(address, timeout=120) as client:
        for i in range(requests + 2):
            start = time.perf_counter()
            stamps = []
            for chunk in client.generate(PROMPT, max_new_tokens=new_tokens, ignore_eos=True):
                stamps.append(time.perf_counter())
            if i < 2:
                continue  # warm-up
            ttfts.append(stamps[0] - start)
            itls.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return ttfts, itls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    model = args.model or str(ensure_tiny_model())
    torch.set_num_threads(1)  # each worker of the cluster gets one of the two cores

    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]
    prefill_before, step_before = in_process(model, prompt_ids, args.new_tokens, args.requests, args.dtype)
    with LocalCluster(ClusterSpec(model=model, dtype=args.dtype, batch_size=8, log_dir="/tmp/disagg-bench-logs")) as cluster:
        ttfts, itls = through_service(cluster.router_address, args.new_tokens, args.requests)
    prefill_after, step_after = in_process(model, prompt_ids, args.new_tokens, args.requests, args.dtype)

    prefill = (prefill_before + prefill_after) / 2
    step = (step_before + step_after) / 2
    ttft, itl = statistics.median(ttfts), statistics.mean(itls)
    print(f"model {model} ({args.dtype}), prompt {len(prompt_ids)} tokens, {args.new_tokens} new tokens, {args.requests} requests, batch 1")
    print(f"in-process prefill (median)      {prefill * 1e3:8.2f} ms   (before {prefill_before * 1e3:.2f}, after {prefill_after * 1e3:.2f})")
    print(f"service time to first token (p50) {ttft * 1e3:8.2f} ms   -> +{(ttft - prefill) * 1e3:.2f} ms over prefill")
    print(f"in-process decode step (median)   {step * 1e3:8.2f} ms   (before {step_before * 1e3:.2f}, after {step_after * 1e3:.2f})")
    print(f"service inter-token latency (mean){itl * 1e3:8.2f} ms   -> {itl / step:.3f}x the step")


if __name__ == "__main__":
    main()

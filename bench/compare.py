"""Disaggregated vs colocated vs transformers continuous batching, in one run:
same model (SmolLM-135M's shape, seeded weights, bf16), same prompts and output
lengths, same two cores. The disaggregated service pins its prefill worker to
core 0 and its decode worker to core 1; the colocated worker and transformers
get both cores.

    python bench/compare.py [--streams 8,16,32] [--output-len 32] [--long-prompt 1024] [--json out.json]

Measures: decode throughput at each stream count (closed loop) for all three;
the in-process decode step and prefill (the floor) against the service's
inter-token latency and time to first token; the decode worker's host gap
between device steps with async mode on and off; and interference: the
inter-token latency of running streams while long prompts arrive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from disagg.client import AsyncClient
from disagg.engine.backends import load_backend
from disagg.engine.kv_wire import KvKind
from disagg.engine.requests import Sampling, Stopping
from disagg.launcher import ClusterSpec, LocalCluster
from disagg.loadgen import RequestSpec, closed_loop, percentiles, run_one, summarize
from disagg.tinymodel import SMOLLM_135M_SHAPE, ensure_tiny_model


class _NoBar:
    def update(self, _):
        pass


def specs(count: int, prompt_len: int, output_len: int, vocab: int, rng: random.Random) -> list[RequestSpec]:
    return [RequestSpec([rng.randrange(3, min(vocab, 1000)) for _ in range(prompt_len)], output_len) for _ in range(count)]


def scrape(address: str) -> dict:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels or "le" not in s.labels}


# -- the service ------------------------------------------------------------------------
async def throughput(address: str, streams: int, workload: list[RequestSpec]) -> dict:
    async with AsyncClient(address, timeout=900) as client:
        await closed_loop(client, workload[:streams], streams, _NoBar())  # warm-up
        started = time.perf_counter()
        results = await closed_loop(client, workload, streams, _NoBar())
        return summarize(results, time.perf_counter() - started, 1e9, 1e9)


async def interference(address: str, streams: int, output_len: int, long_prompts: list[RequestSpec], rng: random.Random) -> dict:
    """ITL of `streams` running requests with no prompts arriving, then with long prompts arriving."""
    async with AsyncClient(address, timeout=900) as client:
        quiet = await asyncio.gather(*(run_one(client, s) for s in specs(streams, 32, output_len, 1000, rng)))
        running = [asyncio.ensure_future(run_one(client, s)) for s in specs(streams, 32, output_len, 1000, rng)]
        await asyncio.sleep(0.5)
        for spec in long_prompts:  # arrive one after another while the streams decode
            await run_one(client, spec)
        busy = await asyncio.gather(*running)
    quiet_itl = percentiles([g for r in quiet for g in r.token_gaps])
    busy_itl = percentiles([g for r in busy for g in r.token_gaps])
    return {"quiet_itl": quiet_itl, "busy_itl": busy_itl, "p99_busy_over_p50_quiet": busy_itl["p99"] / quiet_itl["p50"]}


def run_service(name: str, spec: ClusterSpec, streams: list[int], workload_for, args, rng) -> dict:
    out = {"name": name}
    with LocalCluster(spec) as cluster:
        out["throughput"] = {n: asyncio.run(throughput(cluster.router_address, n, workload_for(n))) for n in streams}
        decode = cluster.process("decode-0").metrics_address
        metrics = scrape(decode)
        out["step_seconds_mean"] = metrics["disagg_decode_step_seconds_sum"] / max(1, metrics["disagg_decode_step_seconds_count"])
        out["host_gap_seconds_mean"] = metrics["disagg_decode_host_gap_seconds_sum"] / max(1, metrics["disagg_decode_host_gap_seconds_count"])
        if args.long_prompt:
            longs = specs(args.long_prompts, args.long_prompt, 1, 1000, rng)
            out["interference"] = asyncio.run(interference(cluster.router_address, min(streams), 48, longs, rng))
    return out


# -- transformers continuous batching, in this process -----------------------------------
def run_transformers(model_path: str, streams: list[int], workload_for) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    out = {"name": "transformers generate_batch", "throughput": {}}
    for n in streams:
        workload = workload_for(n)
        config = GenerationConfig(max_new_tokens=workload[0].output_len, do_sample=False, eos_token_id=None, pad_token_id=0, max_batch_tokens=max(256, n * 8))
        model.generate_batch([s.prompt_ids for s in workload[:n]], generation_config=config, progress_bar=False)  # warm-up
        started = time.perf_counter()
        results = model.generate_batch([s.prompt_ids for s in workload], generation_config=config, progress_bar=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(r.generated_tokens) for r in results.values())
        out["throughput"][n] = {"output_tokens_per_second": tokens / elapsed, "seconds": elapsed, "requests": len(workload)}
    return out


# -- the floor: the same backend without the service ------------------------------------------
def in_process(model_path: str, prompt_len: int, streams: list[int], rng: random.Random) -> dict:
    from decode_worker.batcher import Batcher, Sequence

    torch.set_num_threads(1)
    backend = load_backend("torch", model=model_path, dtype="bfloat16", max_seq_len=2048)
    backend.allocate_slots(max(streams))
    ids = [rng.randrange(3, 1000) for _ in range(prompt_len)]
    prefills = []
    for _ in range(5):
        started = time.perf_counter()
        result = backend.prefill(ids, Sampling())
        prefills.append(time.perf_counter() - started)
    steps = {}
    for n in streams:
        for slot in range(n):
            for layer, (k, v) in enumerate(result.layers):
                backend.write_kv(slot, layer, KvKind.KEY, 0, k)
                backend.write_kv(slot, layer, KvKind.VALUE, 0, v)
        done = []
        batcher = Batcher(backend, lambda events: None, lambda keys: done.extend(keys))
        batcher.start()
        for slot in range(n):
            batcher.admit(Sequence(str(slot), slot, prompt_len, result.first_token, Sampling(), Stopping(24, frozenset())))
        while len(done) < n:
            time.sleep(0.01)
        batcher.stop()
        steps[n] = statistics.median(batcher.stats.step_seconds[3:])
    torch.set_num_threads(2)
    return {"prefill_seconds": statistics.median(prefills[1:]), "step_seconds": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="8,16,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream in a throughput run")
    parser.add_argument("--long-prompt", type=int, default=1024, help="interference: prompt length arriving during decode (0: skip)")
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--json", default="bench/results/compare.json")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    model = str(ensure_tiny_model(SMOLLM_135M_SHAPE))
    rng = random.Random(0)
    workloads = {n: specs(n * args.rounds, args.prompt_len, args.output_len, 1000, random.Random(n)) for n in streams}
    common = dict(model=model, dtype="bfloat16", batch_size=max(streams), worker_args=["--max-seq-len", "2048"], log_dir="/tmp/disagg-compare-logs")
    results = {"model": "SmolLM-135M shape, seeded weights, bf16", "streams": streams, "prompt_len": args.prompt_len, "output_len": args.output_len}
    results["in_process"] = in_process(model, args.prompt_len, streams, rng)
    results["disaggregated"] = run_service("disaggregated", ClusterSpec(**common, threads_per_worker=1, cpus={"prefill": [0], "decode": [1]}), streams, workloads.get, args, rng)
    results["disaggregated_sync"] = run_service("disaggregated, async off", ClusterSpec(**{**common, "decode_args": ["--no-async"]}, threads_per_worker=1, cpus={"prefill": [0], "decode": [1]}), streams[:1], workloads.get, argparse.Namespace(long_prompt=0), rng)
    results["colocated"] = run_service("colocated", ClusterSpec(**common, colocated=True, threads_per_worker=2), streams, workloads.get, args, rng)
    results["transformers"] = run_transformers(model, streams, workloads.get)
    print(json.dumps(results, indent=1, default=float))
    import os

    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()

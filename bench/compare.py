"""Disaggregated vs colocated vs transformers continuous batching, in one run:
same model (SmolLM-135M's shape, seeded weights, bf16), same prompts and output
lengths, same two cores. The disaggregated service pins its prefill worker to
core 0 and its decode worker's model thread to core 1 (the decode worker's
gRPC and KV receive run beside the prefill, as host work does beside an
accelerator); the colocated worker and transformers get both cores.

    python bench/compare.py [--streams 8,16,32] [--output-len 32] [--long-prompt 1024] [--rates 1,2,4,6] [--json out.json]

Measures, for all three: decode throughput at each stream count (closed loop);
interference, the inter-token latency of running streams while long prompts
arrive; goodput, the share of requests meeting --ttft-target and --itl-target
at each offered rate (Poisson arrivals). Also the in-process decode step and
prefill (the floor) against the service's inter-token latency and time to
first token, and the decode worker's host gap between device steps with async
mode on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from disagg.clients.grpc_client import AsyncClient
from disagg.engine.backends import load_backend
from disagg.engine.requests import Sampling, Stopping
from disagg.kv_transport.chunk_codec import KvKind
from disagg.tools.loadgen import RequestSpec, closed_loop, open_loop, percentiles, run_one, summarize
from disagg.tools.local_cluster import ClusterSpec, LocalCluster
from disagg.tools.tinymodel import SMOLLM_135M_SHAPE, ensure_tiny_model


class _NoBar:
    def update(self, _):
        pass


def specs(count: int, prompt_len: int, output_len: int, vocab: int, rng: random.Random) -> list[RequestSpec]:
    return [RequestSpec([rng.randrange(3, min(vocab, 1000)) for _ in range(prompt_len)], output_len) for _ in range(count)]


def scrape(address: str) -> dict:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels or "le" not in s.labels}


# -- the measurements, for any client (the service's, or transformers in this process) ---------------
async def throughput(client, streams: int, workload: list[RequestSpec]) -> dict:
    await closed_loop(client, workload[:streams], streams, _NoBar())  # warm-up
    started = time.perf_counter()
    results = await closed_loop(client, workload, streams, _NoBar())
    return summarize(results, time.perf_counter() - started, 1e9, 1e9)


async def timed_gaps(client, spec: RequestSpec, gaps: list[tuple[float, float]]) -> None:
    """Appends (arrival time, gap) per output token after the first, as the client sees them."""
    last = None
    async for chunk in client.generate(prompt_token_ids=spec.prompt_ids, max_new_tokens=spec.output_len, ignore_eos=True):
        now = time.perf_counter()
        if chunk.token_ids and last is not None:
            gaps += [(now, (now - last) / len(chunk.token_ids))] * len(chunk.token_ids)
        last = now if chunk.token_ids else last


async def interference(client, streams: int, long_prompts: list[RequestSpec], rng: random.Random, settle: float = 1.0) -> dict:
    """ITL of `streams` running requests, in steady state (after `settle` seconds:
    their own hand-offs are over), first with no prompts arriving, then while
    long prompts arrive one after another."""

    async def steady_gaps(during) -> list[float]:
        timed: list[tuple[float, float]] = []
        running = [asyncio.ensure_future(timed_gaps(client, s, timed)) for s in specs(streams, 32, 1000, 1000, rng)]
        await asyncio.sleep(settle)
        start = time.perf_counter()
        await during()
        end = time.perf_counter()
        for task in running:  # long enough to outlast the window; not needed after it
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        return [gap for at, gap in timed if start <= at <= end]

    async def long_prompts_arriving():
        for spec in long_prompts:
            await run_one(client, spec)

    quiet = percentiles(await steady_gaps(lambda: asyncio.sleep(3.0)))
    busy = percentiles(await steady_gaps(long_prompts_arriving))
    return {"quiet_itl": quiet, "busy_itl": busy, "p99_busy_over_p50_quiet": busy["p99"] / quiet["p50"]}


async def goodput(client, rates: list[float], seconds: float, args, rng: random.Random) -> dict:
    """Per offered rate: the share of requests meeting both targets; and the highest rate where it is >= 90%."""
    by_rate = {}
    for rate in rates:
        workload = specs(max(4, int(rate * seconds)), args.prompt_len, args.output_len, 1000, rng)
        started = time.perf_counter()
        results = await open_loop(client, workload, rate, rng, _NoBar())
        by_rate[rate] = summarize(results, time.perf_counter() - started, args.ttft_target, args.itl_target)
    met = [rate for rate, summary in by_rate.items() if summary["goodput"]["share"] >= 0.9]
    return {"ttft_target": args.ttft_target, "itl_target": args.itl_target, "by_rate": by_rate, "highest_rate_90pct": max(met, default=0.0)}


async def measure(client, streams: list[int], workload_for, args, rng) -> dict:
    out = {"throughput": {n: await throughput(client, n, workload_for(n)) for n in streams}}
    if args.long_prompt:
        longs = specs(args.long_prompts, args.long_prompt, 1, 1000, rng)
        out["interference"] = await interference(client, min(streams), longs, rng)
    if args.rates:
        out["goodput"] = await goodput(client, args.rates, args.rate_seconds, args, rng)
    return out


def run_service(name: str, spec: ClusterSpec, streams: list[int], workload_for, args, rng, client_cpus=None) -> dict:
    async def run(address: str) -> dict:
        async with AsyncClient(address, timeout=900) as client:
            return await measure(client, streams, workload_for, args, rng)

    all_cpus = os.sched_getaffinity(0)
    with LocalCluster(spec) as cluster:
        os.sched_setaffinity(0, client_cpus or all_cpus)
        try:
            out = {"name": name, **asyncio.run(run(cluster.router_address))}
        finally:
            os.sched_setaffinity(0, all_cpus)
        metrics = scrape(cluster.process("decode-0").metrics_address)
        out["step_seconds_mean"] = metrics["disagg_decode_step_seconds_sum"] / max(1, metrics["disagg_decode_step_seconds_count"])
        out["host_gap_seconds_mean"] = metrics["disagg_decode_host_gap_seconds_sum"] / max(1, metrics["disagg_decode_host_gap_seconds_count"])
    return out


def run_transformers(model_path: str, streams: list[int], workload_for, args, rng) -> dict:
    from transformers_engine import TransformersStreams

    engine = TransformersStreams(model_path, max_batch_tokens=max(512, args.long_prompt + 64), threads=2)
    try:
        asyncio.run(run_one(engine, specs(1, args.prompt_len, 4, 1000, rng)[0]))  # warm-up: the manager sizes its cache
        return {"name": "transformers continuous batching", **asyncio.run(measure(engine, streams, workload_for, args, rng))}
    finally:
        engine.close()


# -- the floor: the same backend without the service ------------------------------------------
def in_process(model_path: str, prompt_len: int, streams: list[int], rng: random.Random) -> dict:
    from decode_worker.decode_loop import DecodeLoop, Sequence

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
                backend.write_kv([slot], layer, KvKind.KEY, 0, k)
                backend.write_kv([slot], layer, KvKind.VALUE, 0, v)
        done = []
        decode_loop = DecodeLoop(backend, lambda events: None, lambda keys: done.extend(keys))
        decode_loop.start()
        for slot in range(n):
            decode_loop.admit(Sequence(str(slot), slot, prompt_len, result.first_token, Sampling(), Stopping(24, frozenset())))
        while len(done) < n:
            time.sleep(0.01)
        decode_loop.stop()
        steps[n] = statistics.median(decode_loop.stats.step_seconds[3:])
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
    parser.add_argument("--rates", default="1,2,4,6", help="goodput: offered request rates per second ('' to skip)")
    parser.add_argument("--rate-seconds", type=float, default=15.0, help="goodput: seconds of arrivals per rate")
    parser.add_argument("--ttft-target", type=float, default=1.0, help="goodput: seconds")
    parser.add_argument("--itl-target", type=float, default=0.15, help="goodput: seconds per output token after the first")
    parser.add_argument("--json", default="bench/results/compare.json")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    model = str(ensure_tiny_model(SMOLLM_135M_SHAPE))
    rng = random.Random(0)
    workloads = {n: specs(n * args.rounds, args.prompt_len, args.output_len, 1000, random.Random(n)) for n in streams}
    common = dict(model=model, dtype="bfloat16", batch_size=max(streams), worker_args=["--max-seq-len", "2048"], log_dir="/tmp/disagg-compare-logs")
    results = {"model": "SmolLM-135M shape, seeded weights, bf16", "streams": streams, "prompt_len": args.prompt_len, "output_len": args.output_len}
    results["in_process"] = in_process(model, args.prompt_len, streams, rng)
    # Core 1 runs the decode model thread and nothing else; every other thread
    # (prefill, router, gRPC, KV receive, this client) shares core 0, where the
    # prefill yields to the others: a thread that holds the decode worker's GIL
    # must not wait behind a prefill (on an accelerator, prefill leaves the host alone).
    pinned = dict(threads_per_worker=1, cpus={"prefill": [0], "decode": [0], "router": [0]}, nice={"prefill": 10})
    results["disaggregated"] = run_service(
        "disaggregated", ClusterSpec(**common, **pinned, decode_args=["--device-cpus", "1"]), streams, workloads.get, args, rng, client_cpus={0}
    )
    save(results, args.json)
    sync_args = argparse.Namespace(**{**vars(args), "long_prompt": 0, "rates": []})
    results["disaggregated_sync"] = run_service(
        "disaggregated, async off", ClusterSpec(**common, **pinned, decode_args=["--device-cpus", "1", "--no-async"]),
        streams[:1], workloads.get, sync_args, rng, client_cpus={0},
    )
    save(results, args.json)
    results["colocated"] = run_service("colocated", ClusterSpec(**common, colocated=True, threads_per_worker=2), streams, workloads.get, args, rng)
    save(results, args.json)
    results["transformers"] = run_transformers(model, streams, workloads.get, args, rng)
    save(results, args.json)
    print(report(results))


def save(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=float)


def report(results: dict) -> str:
    systems = [results[k] for k in ("disaggregated", "colocated", "transformers")]
    lines = ["output tok/s by concurrent streams:"]
    for n in results["streams"]:
        lines.append(f"  {n:3d}: " + ", ".join(f"{s['name']} {s['throughput'][n]['output_tokens_per_second']:.1f}" for s in systems))
    floor = results["in_process"]
    for n in results["streams"]:
        itl = results["disaggregated"]["throughput"][n]["itl"]
        lines.append(
            f"ITL at {n}: disaggregated mean {itl['mean'] * 1e3:.1f} ms, p50 {itl['p50'] * 1e3:.1f} ms"
            f" vs in-process step {floor['step_seconds'][n] * 1e3:.1f} ms"
        )
    for key in ("disaggregated", "disaggregated_sync"):
        s = results[key]
        lines.append(
            f"{s['name']}: host gap {s['host_gap_seconds_mean'] * 1e3:.2f} ms per {s['step_seconds_mean'] * 1e3:.1f} ms step"
            f" = {s['host_gap_seconds_mean'] / s['step_seconds_mean']:.1%}"
        )
    for s in systems:
        if "interference" in s:
            i = s["interference"]
            lines.append(
                f"interference, {s['name']}: busy p99 {i['busy_itl']['p99'] * 1e3:.1f} ms"
                f" / quiet p50 {i['quiet_itl']['p50'] * 1e3:.1f} ms = {i['p99_busy_over_p50_quiet']:.2f}x"
            )
    for s in systems:
        if "goodput" in s:
            g = s["goodput"]
            shares = ", ".join(f"{rate:g}/s {r['goodput']['share']:.0%}" for rate, r in g["by_rate"].items())
            lines.append(
                f"goodput, {s['name']} (TTFT <= {g['ttft_target']:g} s, ITL <= {g['itl_target'] * 1e3:g} ms): {shares};"
                f" highest rate with 90%: {g['highest_rate_90pct']:g}/s"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

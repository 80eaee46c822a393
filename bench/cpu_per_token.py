"""Where a stream's CPU goes, per output token: each process of `disagg serve`'s cluster
(router, prefill worker, decode worker; the decode worker per thread) and this client,
over a closed loop of --streams streams (64-token prompts, 32 tokens out, greedy).

    python bench/cpu_per_token.py [--streams 1] [--requests 16] [--shape smollm-135m]
    python bench/cpu_per_token.py --quantization int8 --quantization-skip ''   # int8 weights, the LM head too

On a host where the decode step splits its products over every core, the CPU any other
thread or process takes while a step runs is taken from the products' `SCHED_IDLE`
helper: this table says whose it is.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pathlib
import resource
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from compare_vllm import NoBar, workload  # noqa: E402

from disagg.clients.grpc_client import AsyncClient  # noqa: E402
from disagg.tools.loadgen import closed_loop, summarize  # noqa: E402
from disagg.tools.local_cluster import ClusterSpec, LocalCluster, decode_nice  # noqa: E402
from disagg.tools.tinymodel import BENCH_SHAPES, ensure_tiny_model  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PROMPT_LEN, OUTPUT_LEN = 64, 32


def thread_times(pid: int) -> dict[str, float]:
    """CPU seconds per thread of process pid ("name/tid": Python's threads are all named after the
    interpreter, so the busiest are told apart by their share), from /proc."""
    times: dict[str, float] = collections.Counter()
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        times[f"{name}/{task.name}"] += (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
    return times


def client_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(address: str, args) -> tuple[dict, int]:
    """The closed loop's summary, and the output tokens its requests received."""
    async with AsyncClient(address, timeout=900) as client:
        specs = workload(args.requests, PROMPT_LEN, OUTPUT_LEN, seed=args.streams)
        await closed_loop(client, specs[: args.streams], args.streams, NoBar())  # warm-up
        started = time.perf_counter()
        results = await closed_loop(client, specs, args.streams, NoBar())
        return summarize(results, time.perf_counter() - started, 1e9, 1e9), sum(r.output_tokens for r in results if r.ok)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--shape", default="smollm-135m", choices=sorted(BENCH_SHAPES))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=["int8", "fp8", "w8a8_int8"], default=None, help="both workers' --quantization (default: none)")
    parser.add_argument("--quantization-skip", default=None, help="both workers' --quantization-skip ('': the LM head quantized too)")
    parser.add_argument("--log-dir", default="/tmp/disagg-cpu-per-token-logs")
    args = parser.parse_args()
    model = str(ensure_tiny_model(BENCH_SHAPES[args.shape]))
    quantization = ["--quantization", args.quantization] if args.quantization else []
    if args.quantization_skip is not None:
        quantization += ["--quantization-skip", args.quantization_skip]
    spec = ClusterSpec(model=model, dtype=args.dtype, batch_size=0, log_dir=args.log_dir, nice=decode_nice(), worker_args=quantization)
    with LocalCluster(spec) as cluster:
        pids = {p.name: p.popen.pid for p in cluster.processes}
        before = {name: thread_times(pid) for name, pid in pids.items()}
        client_before = client_seconds()
        summary, tokens = asyncio.run(run(cluster.router_address, args))
        after = {name: thread_times(pid) for name, pid in pids.items()}
        client_used = client_seconds() - client_before
    print(f"{args.streams} streams, {summary['ok']} requests, {tokens} tokens in {summary['seconds']:.2f} s: {summary['output_tokens_per_second']:.1f} tok/s, "
          f"ITL p50 {summary['itl']['p50'] * 1e3:.2f} ms")
    print(f"{'process / thread':40s} {'CPU ms per token':>16s}")
    for name in pids:
        used = {t: after[name].get(t, 0.0) - before[name].get(t, 0.0) for t in after[name]}
        print(f"{name:40s} {sum(used.values()) / tokens * 1e3:16.3f}")
        for thread, seconds_used in sorted(used.items(), key=lambda kv: -kv[1]):
            if seconds_used / tokens * 1e3 >= 0.01:
                print(f"  {thread:38s} {seconds_used / tokens * 1e3:16.3f}")
    print(f"{'this client (all threads)':40s} {client_used / tokens * 1e3:16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

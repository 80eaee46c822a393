"""Each request's token timeline under a closed-loop load: where the stalls are.

    python bench/token_gaps.py [--streams 8] [--dtype float32] [--kv-transport auto]

Starts `disagg serve`'s cluster (1 prefill + 1 decode worker, slots from the
KV budget) on the SmolLM-135M-shaped model, warms each stream up, then runs
--requests requests (default 2 x --streams; 64-token prompts of random ids, 32
output tokens, greedy, ignore_eos) and prints, per request, its TTFT, its first-to-second
token gap (the KV hand-off plus the wait to join the batch), every later gap
over --stall seconds, and its end-to-end time. A hand-off queued behind
other work shows as first gaps that all end at the same moment.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

from compare_vllm import NoBar, workload  # noqa: E402

from disagg.clients.grpc_client import AsyncClient  # noqa: E402
from disagg.tools.loadgen import closed_loop  # noqa: E402
from disagg.tools.local_cluster import ClusterSpec, LocalCluster  # noqa: E402
from disagg.tools.tinymodel import SMOLLM_135M_SHAPE, ensure_tiny_model  # noqa: E402


async def timelines(address: str, args) -> None:
    async with AsyncClient(address, timeout=900) as client:
        specs = workload(args.requests or 2 * args.streams, args.prompt_len, args.output_len, seed=args.streams)
        await closed_loop(client, specs[: args.streams], args.streams, NoBar())  # warm-up
        started = time.perf_counter()
        results = await closed_loop(client, specs, args.streams, NoBar())
        seconds = time.perf_counter() - started
    for r in results[: args.show]:
        stalls = [round(g, 3) for g in r.token_gaps[1:] if g > args.stall]
        print(f"TTFT {r.ttft:6.3f} s  first gap {r.token_gaps[0]:6.3f} s  later gaps > {args.stall} s: {stalls}  e2e {r.e2e:6.3f} s")
    first_gaps = [r.token_gaps[0] for r in results]
    print(f"{len(results)} requests: {sum(r.output_tokens for r in results) / seconds:.1f} tok/s; first gap mean {statistics.mean(first_gaps):.3f} s, "
          f"max {max(first_gaps):.3f} s; e2e mean {statistics.mean(r.e2e for r in results):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=0, help="measured requests (default: 2 x --streams)")
    parser.add_argument("--show", type=int, default=64, help="print the timelines of this many requests")
    parser.add_argument("--kv-transport", default="auto")
    parser.add_argument("--stall", type=float, default=0.2, help="report later gaps longer than this (seconds)")
    parser.add_argument("--log-dir", default="/tmp/disagg-token-gaps-logs")
    args = parser.parse_args()
    spec = ClusterSpec(
        model=str(ensure_tiny_model(SMOLLM_135M_SHAPE)), dtype=args.dtype, batch_size=0,
        worker_args=["--kv-transport", args.kv_transport], log_dir=args.log_dir,
    )
    with LocalCluster(spec) as cluster:
        asyncio.run(timelines(cluster.router_address, args))


if __name__ == "__main__":
    main()

"""Closed-loop tok/s of `disagg serve`'s default cluster (one prefill and one decode worker, the router),
at several stream counts, from the code tree this runs in. For a before/after comparison in one run, run
it alternately in two checkouts (`git worktree add /tmp/before COMMIT`), each round appending one line:

    for round in 1 2 3; do
      (cd /tmp/before && python /work/main/bench/serve_throughput.py --label before-$round --out results.jsonl)
      (cd /work/main && python bench/serve_throughput.py --label after-$round --out results.jsonl)
    done

Prompts of --prompt-len random ids, --output-len tokens out (greedy, ignore_eos), max(16, 6 x streams)
requests per stream count after a warm-up of one request per stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

sys.path.insert(0, os.getcwd())  # the tree it is run from, before the installed one

from disagg.clients.grpc_client import AsyncClient  # noqa: E402
from disagg.tools.loadgen import RequestSpec, closed_loop  # noqa: E402
from disagg.tools.local_cluster import ClusterSpec, LocalCluster  # noqa: E402
from disagg.tools.tinymodel import BENCH_SHAPES, ensure_tiny_model  # noqa: E402


class _NoBar:
    def update(self, _):
        pass


async def measure(address: str, streams: list[int], prompt_len: int, output_len: int, rng: random.Random) -> dict[int, float]:
    out = {}
    async with AsyncClient(address, timeout=900) as client:
        for n in streams:
            work = [RequestSpec([rng.randrange(3, 1000) for _ in range(prompt_len)], output_len) for _ in range(max(16, 6 * n))]
            await closed_loop(client, work[:n], n, _NoBar())  # warm-up
            started = time.perf_counter()
            results = await closed_loop(client, work, n, _NoBar())
            out[n] = sum(r.output_tokens for r in results if r.ok) / (time.perf_counter() - started)
            print(f"{n} streams: {out[n]:.1f} tok/s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm-135m", choices=sorted(BENCH_SHAPES))
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", default=None, help="append {label, tok_s} as a JSON line here")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    spec = ClusterSpec(model=ensure_tiny_model(BENCH_SHAPES[args.shape]), batch_size=max(streams), log_dir=f"/tmp/serve-throughput-{args.label}")
    with LocalCluster(spec) as cluster:
        tok_s = asyncio.run(measure(cluster.router_address, streams, args.prompt_len, args.output_len, random.Random(0)))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"label": args.label, "tok_s": tok_s}) + "\n")


if __name__ == "__main__":
    main()

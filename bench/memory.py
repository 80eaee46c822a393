"""What each worker of a local cluster holds in memory, against the start-up estimate (issue 45's before/after).

    python bench/memory.py --shape smollm-135m --dtype float32 --json bench/results/memory_smollm_f32.json

Starts one prefill and one decode worker and the router as `disagg serve` does (seeded weights of the
shape), sends a few requests so the KV and the prefix cache are touched, then reads each worker's
resident (RSS), proportional (PSS) and shared memory from its GetLoad and the estimate its start-up
made (disagg/engine/memory.py). --decode-only starts a lone decode worker (a model two workers cannot hold).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import grpc

from disagg.clients.grpc_client import Client
from disagg.engine.memory import GIB, CheckpointFacts
from disagg.tools.local_cluster import ClusterSpec, LocalCluster
from disagg.tools.tinymodel import BENCH_SHAPES, ensure_tiny_model, paragraphs
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc


def worker_memory(address: str, role: str) -> dict:
    with grpc.insecure_channel(address) as channel:
        stub = wgrpc.PrefillServiceStub(channel) if role == "prefill" else wgrpc.DecodeServiceStub(channel)
        load = stub.GetLoad(wpb.LoadRequest(), timeout=30)
    return {"rss_gib": round(load.resident_bytes / GIB, 2), "pss_gib": round(load.proportional_bytes / GIB, 2), "shared_gib": round(load.shared_bytes / GIB, 2)}


def estimates(model: str, dtype: str, kv_cache_gib: float) -> dict:
    from decode_worker.config import DecodeWorkerConfig
    from prefill_worker.config import PrefillWorkerConfig

    facts = CheckpointFacts.read(model)
    decode = DecodeWorkerConfig(model=model, dtype=dtype, kv_cache_gib=kv_cache_gib).memory_need(facts)
    prefill = PrefillWorkerConfig(model=model, dtype=dtype, decode_peers=("127.0.0.1:1",)).memory_need(facts)
    totals = {"decode_gib": round(decode.total / GIB, 2), "prefill_gib": round(prefill.total / GIB, 2)}
    return {"decode": decode.describe(), "prefill": prefill.describe(), **totals}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm-135m", choices=sorted(BENCH_SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--log-dir", default="/tmp/disagg-bench-memory")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = str(ensure_tiny_model(BENCH_SHAPES[args.shape]))
    row = {"shape": args.shape, "dtype": args.dtype, "kv_cache_gib": args.kv_cache_gib, "date": time.strftime("%Y-%m-%d"),
           "cpu": subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True).stdout.strip(),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "estimate": estimates(model, args.dtype, args.kv_cache_gib)}
    spec = ClusterSpec(model=model, dtype=args.dtype, batch_size=0, log_dir=args.log_dir, decode_args=["--kv-cache-gib", str(args.kv_cache_gib)])
    cluster = LocalCluster(spec)
    if args.decode_only:
        process = cluster._spawn("decode-0", "decode_worker", ["--model", model, "--dtype", args.dtype, "--kv-cache-gib", str(args.kv_cache_gib)])
        cluster.wait_serving(3600, process.address)
        row["decode"] = worker_memory(process.address, "decode")
    else:
        cluster.start()
        with Client(cluster.router_address, timeout=600) as client:
            for text in paragraphs()[:4]:
                client.complete(" ".join(text.split()[:40]), max_new_tokens=16)
        for p in cluster.processes[:2]:
            row[p.name.split("-")[0]] = worker_memory(p.address, p.name.split("-")[0])
        row["total_pss_gib"] = round(row["decode"]["pss_gib"] + row["prefill"]["pss_gib"], 2)
    cluster.stop()
    print(json.dumps(row, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

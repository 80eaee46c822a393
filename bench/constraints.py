"""What structured output costs: per-token throughput with a JSON-schema constraint on every
request against none, first-token latency with a new schema, and compile times.

Three parts, each printed as a table and written to --json-out:

  steps    in one process, the decode worker's per-step constraint work for a batch of
           B constrained rows (every matcher advanced by a token, the bitmask filled:
           what the mask thread does while the model computes) and the sampler's mask
           op over B rows of the vocabulary, for B in --batch;
  service  a router, a prefill worker and a decode worker as processes (--model, default
           the built-in tiny model, or --shape smollm-135m): --requests requests of
           --max-tokens tokens (greedy, ignore_eos) at each --streams concurrency, with a
           JSON-schema constraint on every request and without, interleaved, --repeats
           times; output tok/s (median) and the ratio. The schema (an array of at least
           400 integers) cannot end before --max-tokens, so both runs make as many tokens;
           then the first-token latency at one stream of requests each with a schema of
           50 properties never seen before (compiled by the router and both workers)
           against the same requests unconstrained;
  compile  the compile time of a large schema (--properties properties), first and cached,
           with the model's tokenizer.

    .venv/bin/python bench/constraints.py [--streams 1,8,32] [--shape smollm-135m] [--json-out bench/results/constraints.json]

Never part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from disagg.clients.grpc_client import AsyncClient  # noqa: E402
from disagg.engine.constraints import Constraint, ConstraintKind  # noqa: E402
from disagg.engine.constraints.compiler import ConstraintCompiler  # noqa: E402
from disagg.engine.constraints.rows import step_bitmask  # noqa: E402
from disagg.engine.constraints.spec import json_schema  # noqa: E402
from disagg.engine.sampler import apply_bitmask  # noqa: E402
from disagg.tools.local_cluster import ClusterSpec, LocalCluster  # noqa: E402
from disagg.tools.tinymodel import BENCH_SHAPES, ensure_tiny_model  # noqa: E402

LONG = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 400}}, "required": ["values"]}


def wide_schema(properties: int, salt: str = "") -> dict:
    """An object of `properties` required fields of mixed types (new field names per salt: a schema never compiled)."""
    kinds = [{"type": "string", "maxLength": 16}, {"type": "integer"}, {"type": "boolean"}, {"enum": ["red", "green", "blue"]}]
    fields = {f"field_{salt}{i}": kinds[i % len(kinds)] for i in range(properties)}
    return {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def bench_steps(model: str, batches: list[int], steps: int = 200) -> list[dict]:
    tokenizer = load_tokenizer(model)
    vocab = len(tokenizer)
    compiler = ConstraintCompiler(lambda: tokenizer, vocab, [tokenizer.eos_token_id])
    constraint = json_schema(LONG)
    rows = []
    for batch in batches:
        matchers = [compiler.start_row(constraint, []) for _ in range(batch)]
        tokens = [0] * batch  # each row's next token: the lowest allowed one
        fill = apply = 0.0
        logits = torch.randn(batch, vocab)
        for step in range(steps):
            started = time.perf_counter()
            bitmask = step_bitmask(matchers, tokens, vocab) if step else _first(matchers, vocab)
            fill += time.perf_counter() - started
            started = time.perf_counter()
            masked = apply_bitmask(logits, bitmask)
            apply += time.perf_counter() - started
            tokens = masked.argmax(-1).tolist()
        rows.append({"batch": batch, "vocab": vocab, "fill_ms": 1e3 * fill / steps, "apply_ms": 1e3 * apply / steps})
    compiler.close()
    return rows


def _first(matchers, vocab: int) -> torch.Tensor:
    bitmask = torch.full((len(matchers), (vocab + 31) // 32), -1, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill(bitmask, row)
    return bitmask


def bench_compile(model: str, properties: int) -> dict:
    tokenizer = load_tokenizer(model)
    compiler = ConstraintCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiler.compiled(Constraint(ConstraintKind.REGEX, "warm"))  # the tokenizer's table is built first, apart
    schema = json_schema(wide_schema(properties, uuid.uuid4().hex[:6]))
    started = time.perf_counter()
    compiler.compiled(schema)
    first = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(100):
        compiler.compiled(schema)
    cached = (time.perf_counter() - started) / 100
    compiler.close()
    return {"properties": properties, "schema_chars": len(schema.text), "first_ms": 1e3 * first, "cached_ms": 1e3 * cached}


async def _run(address: str, streams: int, requests: int, max_tokens: int, constrained: bool) -> tuple[float, list[float]]:
    """(output tok/s, first-token latencies) of `requests` requests, `streams` at a time."""
    extra = {"json_schema": LONG} if constrained else {}
    queue = list(range(requests))
    tokens, ttfts = 0, []

    async def worker(client):
        nonlocal tokens
        while queue:
            i = queue.pop()
            sent = time.perf_counter()
            first = None
            async for chunk in client.generate(f"Request {i}: the lighthouse keeper", max_new_tokens=max_tokens, ignore_eos=True, **extra):
                first = first or time.perf_counter() - sent
                tokens += len(chunk.token_ids)
            ttfts.append(first)

    async with AsyncClient(address, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(streams)))
        return tokens / (time.perf_counter() - started), ttfts


async def _first_tokens(address: str, count: int, properties: int) -> dict:
    """Median first-token latency, one stream: each request with a schema never seen, and unconstrained."""
    async with AsyncClient(address, timeout=600) as client:
        new, plain = [], []
        for i in range(count):
            for constrained in (True, False):
                extra = {"json_schema": wide_schema(properties, uuid.uuid4().hex[:6])} if constrained else {}
                sent = time.perf_counter()
                async for _ in client.generate(f"Request {i}: the lighthouse keeper", max_new_tokens=1, **extra):
                    (new if constrained else plain).append(time.perf_counter() - sent)
                    break
    return {"properties": properties, "new_schema_ms": 1e3 * statistics.median(new), "unconstrained_ms": 1e3 * statistics.median(plain)}


def bench_service(model: str, streams: list[int], requests: int, max_tokens: int, repeats: int, threads: int) -> dict:
    logs = tempfile.mkdtemp(prefix="bench-constraints-")
    cluster = LocalCluster(ClusterSpec(model=model, dtype="float32", log_dir=logs, threads_per_worker=threads))
    cluster.start(timeout=600)
    try:
        address = cluster.router_address
        asyncio.run(_run(address, max(streams), max(streams), 8, True))  # warm-up: compiles, buckets
        rows = []
        for n in streams:
            runs = {True: [], False: []}
            for _ in range(repeats):
                for constrained in (False, True):
                    runs[constrained].append(asyncio.run(_run(address, n, max(requests, n), max_tokens, constrained))[0])
            plain, masked = statistics.median(runs[False]), statistics.median(runs[True])
            rows.append({"streams": n, "unconstrained_tok_s": plain, "json_schema_tok_s": masked, "ratio": masked / plain})
        first = asyncio.run(_first_tokens(address, 10, 50))
        return {"throughput": rows, "first_token": first}
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint (default: the built-in tiny model, or --shape)")
    parser.add_argument("--shape", choices=sorted(BENCH_SHAPES), default=None, help="a benchmark shape's seeded checkpoint")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--batch", default="1,8,32", help="batch sizes of the in-process step part")
    parser.add_argument("--requests", type=int, default=32, help="requests per throughput run (at least --streams)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--properties", type=int, default=50)
    parser.add_argument("--parts", default="steps,compile,service")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    model = args.model or str(ensure_tiny_model(BENCH_SHAPES[args.shape]) if args.shape else ensure_tiny_model())
    parts = args.parts.split(",")
    out: dict = {"model": model}
    if "steps" in parts:
        out["steps"] = bench_steps(model, [int(b) for b in args.batch.split(",")])
        for row in out["steps"]:
            print(f"steps   batch {row['batch']:>3}  vocab {row['vocab']}: fill {row['fill_ms']:.3f} ms, mask op {row['apply_ms']:.3f} ms per step")
    if "compile" in parts:
        out["compile"] = bench_compile(model, args.properties)
        c = out["compile"]
        print(f"compile {c['properties']} properties ({c['schema_chars']} chars): first {c['first_ms']:.1f} ms, cached {c['cached_ms'] * 1e3:.1f} us")
    if "service" in parts:
        out["service"] = bench_service(model, [int(s) for s in args.streams.split(",")], args.requests, args.max_tokens, args.repeats, args.threads)
        for row in out["service"]["throughput"]:
            print(f"service {row['streams']:>3} streams: {row['unconstrained_tok_s']:.0f} tok/s unconstrained, "
                  f"{row['json_schema_tok_s']:.0f} with a JSON schema: {row['ratio']:.3f}x")
        f = out["service"]["first_token"]
        print(f"service first token, a new {f['properties']}-property schema: {f['new_schema_ms']:.1f} ms against {f['unconstrained_ms']:.1f} ms unconstrained")
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Long prompts arriving beside running streams, `disagg serve` against vLLM's CPU build.

While --streams closed-loop streams run (64-token prompts of random ids, 64 tokens
out, greedy, ignore_eos), a --long-len prompt (16 tokens out) arrives every --every
seconds, --long-prompts of them; the streams stop once the last long prompt is
answered. Both systems over their OpenAI HTTP API, one after the other, each its
own best dtype by default (vLLM bf16, ours --dtype auto), the same load generator.
Reports the running streams' ITL p50 and p99 and output tok/s, and the long
prompts' TTFT p50, with ours / vLLM ratios.

    python bench/long_prompts.py [--systems disagg,vllm] [--json-out bench/results/long_prompts.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_vllm import NoBar, add_run_flags  # noqa: E402
from shared_prefix import HERE, PEER_SCRIPT, add_server_flags, host_facts, random_ids, run_systems  # noqa: E402

from disagg.clients.openai_client import OpenAIClient  # noqa: E402
from disagg.tools.loadgen import RequestSpec, closed_loop, percentiles, run_one  # noqa: E402
from disagg.tools.tinymodel import SMOLLM_135M_SHAPE, ensure_tiny_model  # noqa: E402


async def measure(url: str, args, out: dict, checkpoint) -> None:
    rng = random.Random(11)
    async with OpenAIClient(url, timeout=900) as client:
        warm = [RequestSpec(random_ids(rng, args.long_len), 4)] + [RequestSpec(random_ids(rng, args.prompt_len), 8) for _ in range(args.streams)]
        await closed_loop(client, warm, args.streams, NoBar())
        done, streamed = asyncio.Event(), []

        async def stream() -> None:
            while not done.is_set():
                streamed.append(await run_one(client, RequestSpec(random_ids(rng, args.prompt_len), args.output_len)))

        async def arrivals() -> list:
            sent = []
            for _ in range(args.long_prompts):
                sent.append(asyncio.create_task(run_one(client, RequestSpec(random_ids(rng, args.long_len), args.long_output))))
                await asyncio.sleep(args.every)
            answered = await asyncio.gather(*sent)
            done.set()
            return answered

        started = time.perf_counter()
        streams = [asyncio.create_task(stream()) for _ in range(args.streams)]
        long_results = await arrivals()
        await asyncio.gather(*streams)
        seconds = time.perf_counter() - started
    ok_streams = [r for r in streamed if r.ok]
    gaps = [gap for r in ok_streams for gap in r.token_gaps]
    out.update(
        seconds=seconds, stream_requests=len(streamed), stream_errors=len(streamed) - len(ok_streams),
        itl=percentiles(gaps), stream_tokens_per_second=sum(r.output_tokens for r in ok_streams) / seconds,
        long_ttft=percentiles([r.ttft for r in long_results if r.ok]), long_errors=sum(not r.ok for r in long_results),
    )
    print(f"    streams: ITL p50 {out['itl']['p50'] * 1e3:.1f} ms, p99 {out['itl']['p99'] * 1e3:.1f} ms, {out['stream_tokens_per_second']:.1f} tok/s; "
          f"long prompts: TTFT p50 {out['long_ttft']['p50'] * 1e3:.0f} ms", flush=True)
    checkpoint()


def report(results: dict) -> str:
    ours, peer = results.get("disagg", {}), results.get("vllm", {})
    if "itl" not in ours or "itl" not in peer:
        return "both systems' figures are needed for the ratios"
    rows = [
        ("streams' ITL p50, ms", ours["itl"]["p50"] * 1e3, peer["itl"]["p50"] * 1e3),
        ("streams' ITL p99, ms", ours["itl"]["p99"] * 1e3, peer["itl"]["p99"] * 1e3),
        ("streams' output tok/s", ours["stream_tokens_per_second"], peer["stream_tokens_per_second"]),
        ("long prompts' TTFT p50, ms", ours["long_ttft"]["p50"] * 1e3, peer["long_ttft"]["p50"] * 1e3),
    ]
    lines = [f"{'':28s} {'ours':>9s} {'vLLM':>9s}  ours / vLLM"]
    lines += [f"{name:28s} {a:9.1f} {b:9.1f}  {a / b:.2f}x" for name, a, b in rows]
    errors = {name: (s.get("stream_errors"), s.get("long_errors")) for name, s in (("ours", ours), ("vLLM", peer))}
    if any(any(e) for e in errors.values()):
        lines.append(f"errors (streams, long prompts): {errors}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="disagg,vllm", help="which to run, in this order; one left out keeps its figures from --json-out")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--long-len", type=int, default=900)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--long-prompts", type=int, default=10)
    p.add_argument("--every", type=float, default=3.0, help="seconds between long prompts")
    add_server_flags(p)
    add_run_flags(p, quiet_timeout=180.0, log_dir="/tmp/disagg-long-prompts-logs")
    p.add_argument("--json-out", default="bench/results/long_prompts.json")
    args = p.parse_args()
    args.systems = [s for s in args.systems.split(",") if s]
    if "vllm" in args.systems and not (HERE / "peers" / ".venv-vllm" / "bin" / "python").exists():
        print(f"vLLM CPU is not installed: run {PEER_SCRIPT} install", file=sys.stderr)
        return 2
    model = str(ensure_tiny_model(SMOLLM_135M_SHAPE))
    results = json.load(open(args.json_out)) if os.path.exists(args.json_out) else {}
    keys = ("streams", "prompt_len", "output_len", "long_len", "long_output", "long_prompts", "every")
    results.update(model=f"SmolLM-135M shape, seeded weights; vLLM {args.dtype}, ours {args.disagg_dtype}",
                   settings={k: getattr(args, k) for k in keys}, **host_facts())
    return run_systems(model, args, results, report, workload=measure)


if __name__ == "__main__":
    sys.exit(main())

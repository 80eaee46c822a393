"""Soak run: closed-loop load with random cancels and deadlines, and with --chaos a
worker killed (SIGKILL) every 10-30 s while `disagg serve`'s supervisor
(disagg/tools/supervisor.py) restarts it. Afterwards every finished greedy
request must equal transformers' generate(), every finished seeded request must
equal the same request sent again to the undisturbed service, and no worker may
hold anything.

    python -m disagg.tools.soak --chaos --seconds 600

Two prefill and two decode workers, and a kill only while all four serve, so
one of each role is always up; each KV transport in turn (--transports). A
request is lost if it ends other than OK, cancelled by its own client, or
DEADLINE_EXCEEDED past its own client's deadline. Loopback only, bounded in
time. Exits 1 if anything was lost, wrong or held.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import pathlib
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc

from disagg.clients.grpc_client import AsyncClient
from disagg.tools.local_cluster import ClusterSpec, LocalCluster
from disagg.tools.supervisor import PartState, RestartPolicy, Supervisor
from disagg.tools.tinymodel import TinyModelSpec, ensure_tiny_model, paragraphs

PLAIN_TIMEOUT = 120.0  # a request with no deadline of its own still ends: past this it counts as lost
SEEDED = {"temperature": 0.8, "top_p": 0.95}


@dataclass
class Sent:
    """One request: what was asked, and what came back when."""

    prompt: str
    max_new_tokens: int
    fate: str  # greedy, seeded, cancel, deadline
    seed: int | None = None
    outcome: str = ""
    details: str = ""  # the error's message, where it ended in one
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # monotonic, one per token

    @property
    def lost(self) -> bool:
        allowed = {"OK", "CANCELLED (by client)"} | ({"DEADLINE_EXCEEDED"} if self.fate == "deadline" else set())
        return self.outcome not in allowed


@dataclass
class Report:
    transport: str
    seconds: float = 0.0
    sent: list[Sent] = field(default_factory=list)
    kills: list[tuple[float, str]] = field(default_factory=list)  # (seconds into the run, name)
    restarts: int = 0
    supervisor_lines: list[str] = field(default_factory=list)
    wrong: list[dict] = field(default_factory=list)
    held_at_end: dict = field(default_factory=dict)
    down_at_end: list[str] = field(default_factory=list)
    availability: float = 0.0  # share of 1-second windows in which some request completed
    migration_gaps: list[float] = field(default_factory=list)  # seconds between tokens across a decode worker's kill
    unobserved: list[str] = field(default_factory=list)  # log lines of background failures nothing retrieved
    started: float = 0.0  # monotonic

    @property
    def lost(self) -> list[Sent]:
        return [s for s in self.sent if s.lost]

    @property
    def clean(self) -> bool:
        held = any(any(v) for v in self.held_at_end.values())
        return not self.wrong and not self.lost and not held and not self.down_at_end and bool(self.held_at_end) and not self.unobserved

    def summary(self) -> dict:
        outcomes = collections.Counter(s.outcome for s in self.sent)
        planned = collections.Counter(s.fate for s in self.sent)
        gaps = sorted(self.migration_gaps)
        return {
            "transport": self.transport,
            "seconds": round(self.seconds, 1),
            "requests": len(self.sent),
            "planned": dict(planned),
            "outcomes": dict(outcomes),
            "lost": len(self.lost),
            "lost_examples": [(s.fate, s.outcome, s.details, len(s.token_ids)) for s in self.lost[:5]],
            "checked_greedy": sum(s.fate == "greedy" and s.outcome == "OK" for s in self.sent),
            "checked_seeded": sum(s.fate == "seeded" and s.outcome == "OK" for s in self.sent),
            "wrong": len(self.wrong),
            "kills": [f"{at:.0f}s {name}" for at, name in self.kills],
            "restarts": self.restarts,
            "held_at_end": self.held_at_end,
            "down_at_end": self.down_at_end,
            "unobserved_failures": len(self.unobserved),
            "availability": round(self.availability, 4),
            "migration_gaps": len(gaps),
            "migration_gap_p99_s": round(percentile(gaps, 0.99), 3) if gaps else None,
            "migration_gap_max_s": round(gaps[-1], 3) if gaps else None,
        }


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


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
            # One torch thread: a small model's products gain nothing from more, and with the cores busy (the
            # cluster's workers, other processes) a second OpenMP thread made each generate() 6-40x slower.
            threads = self.torch.get_num_threads()
            self.torch.set_num_threads(1)
            try:
                with self.torch.no_grad():
                    out = self.model.generate(self.torch.tensor([ids]), max_new_tokens=longest, do_sample=False, pad_token_id=self.tokenizer.eos_token_id)
            finally:
                self.torch.set_num_threads(threads)
            self._cache[prompt] = out[0, len(ids) :].tolist()
        return self._cache[prompt][:n]


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- the load ----------------------------------------------------------------------
# A cancelled request asks for this many tokens (past EOS too) and leaves after at most
# --max-new-tokens of them: its end is hundreds of steps away whatever the host's speed.
CANCELLED_LENGTH = 360


def plan_request(rng: random.Random, texts: list[str], args) -> Sent:
    words = rng.choice(texts).split()
    prompt = " ".join(words[: rng.randint(2, min(30, len(words)))])
    n, draw = rng.randint(1, args.max_new_tokens), rng.random()
    shares = [("deadline", args.deadline_share), ("cancel", args.cancel_share), ("seeded", args.seeded_share)]
    for fate, share in shares:
        if draw < share:
            break
        draw -= share
    else:
        fate = "greedy"
    return Sent(prompt, n, fate, seed=rng.randrange(2**31) if fate == "seeded" else None)


async def send(client: AsyncClient, hurried: AsyncClient, sent: Sent, cancel_after: int) -> None:
    """Streams one request, recording its tokens' arrival; a cancel leaves the stream after cancel_after tokens."""
    params = {"max_new_tokens": sent.max_new_tokens}
    if sent.fate == "seeded":
        params.update(SEEDED, seed=sent.seed)
    if sent.fate == "cancel":
        params.update(max_new_tokens=CANCELLED_LENGTH, ignore_eos=True)
    try:
        async for chunk in (hurried if sent.fate == "deadline" else client).generate(sent.prompt, **params):
            now = time.monotonic()
            sent.token_ids += chunk.token_ids
            sent.token_times += [now] * len(chunk.token_ids)
            if sent.fate == "cancel" and len(sent.token_ids) >= cancel_after:
                sent.outcome = "CANCELLED (by client)"
                return  # leaving the stream cancels the call
        sent.outcome = "OK" if sent.fate != "cancel" else f"ended after {len(sent.token_ids)} of {CANCELLED_LENGTH} tokens before its cancel"
    except grpc.aio.AioRpcError as exc:
        sent.outcome, sent.details = exc.code().name, exc.details()


async def closed_loop(address: str, args, rng: random.Random, report: Report, keep_going) -> None:
    texts = paragraphs()
    async with AsyncClient(address, timeout=PLAIN_TIMEOUT) as client, AsyncClient(address, timeout=args.deadline) as hurried:

        async def user() -> None:
            while keep_going():
                sent = plan_request(rng, texts, args)
                report.sent.append(sent)
                await send(client, hurried, sent, cancel_after=rng.randint(1, args.max_new_tokens))

        await asyncio.gather(*(user() for _ in range(args.concurrency)))


# -- the chaos -----------------------------------------------------------------------
async def chaos(cluster: LocalCluster, supervisor: Supervisor, args, rng: random.Random, report: Report, keep_going) -> None:
    """Every LOW-HIGH s, a random prefill or decode worker gets SIGKILL, once all of them serve
    (so one of each role is always up); the supervisor restarts it."""
    low, high = args.kill_every
    while True:
        await asyncio.sleep(rng.uniform(low, high))
        while any(p.state is not PartState.RUNNING for p in supervisor.parts.values()):
            await asyncio.sleep(0.1)
        if not keep_going():
            return
        role = rng.choice(["prefill", "decode"])
        victim = rng.choice([p for p in cluster.processes if p.name.startswith(role)])
        report.kills.append((time.monotonic() - report.started, victim.name))
        victim.popen.send_signal(signal.SIGKILL)


def supervise(supervisor: Supervisor, stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.wait(0.2):
            supervisor.poll()

    thread = threading.Thread(target=loop, name="supervisor", daemon=True)
    thread.start()
    return thread


def wait_all_running(supervisor: Supervisor, within: float) -> list[str]:
    """The parts not yet serving again after `within` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        down = [p.name for p in supervisor.parts.values() if p.state is not PartState.RUNNING]
        if not down:
            return []
        time.sleep(0.2)
    return down


# -- the checks -----------------------------------------------------------------------
def check_greedy(ref: Reference, report: Report, longest: int) -> None:
    for sent in report.sent:
        if sent.fate == "greedy" and sent.outcome == "OK":
            expected = ref.greedy(sent.prompt, sent.max_new_tokens, longest)
            if sent.token_ids != expected:
                report.wrong.append({"fate": "greedy", "prompt": sent.prompt, "got": sent.token_ids, "expected": expected})


async def check_seeded(address: str, report: Report, concurrency: int) -> None:
    """Each finished seeded request sent again to the service, now undisturbed: the same tokens."""
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(address, timeout=PLAIN_TIMEOUT) as client:

        async def again(sent: Sent) -> None:
            async with gate:
                result = await client.complete(sent.prompt, max_new_tokens=sent.max_new_tokens, seed=sent.seed, **SEEDED)
            if result.token_ids != sent.token_ids:
                report.wrong.append({"fate": "seeded", "prompt": sent.prompt, "seed": sent.seed, "got": sent.token_ids, "undisturbed": result.token_ids})

        await asyncio.gather(*(again(s) for s in report.sent if s.fate == "seeded" and s.outcome == "OK"))


def unobserved_failures(log_dir: str) -> list[str]:
    """Lines where asyncio reports a failed future or task that nothing awaited: a failure no one handled."""
    found = []
    for log in sorted(pathlib.Path(log_dir).glob("*.log")):
        found += [f"{log.name}: {line.strip()}" for line in log.read_text(errors="replace").splitlines() if "exception was never retrieved" in line]
    return found


def availability(report: Report, end: float) -> float:
    """Share of the run's whole seconds in which some request completed."""
    windows = max(1, int(end - report.started))
    done = {int(s.token_times[-1] - report.started) for s in report.sent if s.outcome == "OK" and s.token_times}
    return len({w for w in done if w < windows}) / windows


def migration_gaps(report: Report) -> list[float]:
    """For each decode worker's kill, each stream that had tokens on both sides of it: the gap across the kill
    (the streams that were on the killed worker among them: theirs is the time to resume elsewhere)."""
    gaps = []
    for at, name in report.kills:
        if not name.startswith("decode"):
            continue
        killed = report.started + at
        for sent in report.sent:
            times = sent.token_times
            after = next((i for i, t in enumerate(times) if t > killed), None)
            if after:
                gaps.append(times[after] - times[after - 1])
    return gaps


# -- one run ---------------------------------------------------------------------------
async def load_and_chaos(cluster: LocalCluster, supervisor: Supervisor, args, seconds: float, report: Report) -> None:
    rng = random.Random(args.seed)
    report.started = time.monotonic()
    until = report.started + seconds

    def keep_going() -> bool:
        # --min-kills: on a loaded host restarts are slow and kills (made only while every worker serves) few;
        # the run goes on until that many were made, for at most three times its length.
        now = time.monotonic()
        return now < until or (args.chaos and len(report.kills) < args.min_kills and now < report.started + 3 * seconds)

    killer = asyncio.create_task(chaos(cluster, supervisor, args, rng, report, keep_going)) if args.chaos else None
    try:
        await closed_loop(cluster.router_address, args, rng, report, keep_going)
    finally:
        if killer is not None:
            killer.cancel()
    report.seconds = time.monotonic() - report.started


def soak_one(model: str, transport: str, seconds: float, args, ref: Reference) -> Report:
    report = Report(transport)
    log_dir = f"{args.log_dir}/{transport}"
    spec = ClusterSpec(model=model, prefill_workers=2, decode_workers=2, batch_size=4, dtype="float32", log_dir=log_dir,
                       worker_args=["--kv-transport", transport])
    # Chaos kills each worker several times a window: the restart budget is not what is tested here.
    policy = RestartPolicy(limit=1_000_000)
    with LocalCluster(spec) as cluster:
        supervisor = Supervisor(cluster, policy, say=report.supervisor_lines.append)
        stop = threading.Event()
        thread = supervise(supervisor, stop)
        try:
            asyncio.run(load_and_chaos(cluster, supervisor, args, seconds, report))
            report.down_at_end = wait_all_running(supervisor, within=120.0)
            report.held_at_end = cluster.wait_until_idle(within=10.0)  # freed within seconds
            asyncio.run(check_seeded(cluster.router_address, report, args.concurrency))
        finally:
            stop.set()
            thread.join()
        report.restarts = supervisor.restarts
    report.availability = availability(report, report.started + report.seconds)
    report.migration_gaps = migration_gaps(report)
    report.unobserved = unobserved_failures(log_dir)
    check_greedy(ref, report, args.max_new_tokens)
    return report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m disagg.tools.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: a tiny trained Llama made offline")
    parser.add_argument("--chaos", action="store_true", help="kill a random worker every --kill-every seconds (the supervisor restarts it)")
    parser.add_argument("--seconds", type=float, default=600, help="the whole run, split evenly between the transports")
    parser.add_argument("--min-kills", type=int, default=0,
                        help="--chaos: each transport's run goes on past its time (up to three times it) until this many kills were made")
    parser.add_argument("--transports", default="grpc,nixl", help="KV transports, one run each (nixl needs nixl-cu12)")
    parser.add_argument("--kill-every", type=lambda t: tuple(float(v) for v in t.split(":")), default=(10.0, 30.0), metavar="LOW:HIGH")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--seeded-share", type=float, default=0.25)
    parser.add_argument("--cancel-share", type=float, default=0.15)
    parser.add_argument("--deadline-share", type=float, default=0.05)
    parser.add_argument("--deadline", type=float, default=0.05, help="seconds, for the share of requests with a deadline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here too")
    parser.add_argument("--log-dir", default="/tmp/disagg-soak-logs")
    return parser.parse_args(argv)


def run(argv=None) -> list[Report]:
    args = parse_args(argv)
    model = args.model or str(ensure_tiny_model(TinyModelSpec()))
    ref = Reference(model)
    transports = args.transports.split(",")
    reports = [soak_one(model, transport, args.seconds / len(transports), args, ref) for transport in transports]
    summaries = [r.summary() for r in reports]
    print(json.dumps(summaries, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            extra = [{"wrong_examples": r.wrong[:5], "migration_gaps_s": sorted(round(g, 3) for g in r.migration_gaps), "supervisor": r.supervisor_lines}
                     for r in reports]
            json.dump([{**s, **e} for s, e in zip(summaries, extra)], f, indent=2)
    return reports


if __name__ == "__main__":
    raise SystemExit(0 if all(r.clean for r in run()) else 1)

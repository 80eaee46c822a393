"""Worker discovery by DNS (disagg/rpc/discovery.py, router/workers.py).

Unit tests on WorkerPool with an injected resolver; the resolver itself
against a stub DNS server on loopback; then real processes, each started from
the Helm chart's rendered Deployment exactly as the image runs it (its
ENTRYPOINT, args and env), with the router asking the stub DNS server for the
pools' headless Service names while the test changes the answers under
running streams.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
import pytest
from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import DNSLogger, DNSServer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helm_chart import container, render, run_container
from polling import wait_for
from prometheus_client.parser import text_string_to_metric_families

from disagg.clients.grpc_client import Client
from disagg.rpc.discovery import LookupFailed, parse_target, resolve
from disagg.rpc.server import RequestError
from disagg.v1 import worker_pb2 as wpb
from router.workers import WorkerPool


class StubDns:
    """A DNS server on 127.0.0.1 answering A queries from a table the test changes:
    name -> IPv4 addresses; a name not in the table is NXDOMAIN; None is SERVFAIL."""

    def __init__(self):
        self.answers: dict[str, list[str] | None] = {}
        self.asked: dict[str, int] = {}  # name -> A queries answered (from the table as it then was)
        self._lock = threading.Lock()
        self.server = DNSServer(self, port=0, address="127.0.0.1", logger=DNSLogger(logf=lambda _: None))
        self.server.start_thread()
        self.port = self.server.server.server_address[1]

    def set(self, name: str, addresses: list[str] | None) -> None:
        with self._lock:
            self.answers[name] = addresses

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        with self._lock:
            known, addresses = name in self.answers, self.answers.get(name)
            if request.q.qtype == QTYPE.A:
                self.asked[name] = self.asked.get(name, 0) + 1
        if not known:
            reply.header.rcode = RCODE.NXDOMAIN
        elif addresses is None:
            reply.header.rcode = RCODE.SERVFAIL
        elif request.q.qtype == QTYPE.A:
            for address in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=5))
        return reply

    def asked_for(self, name: str) -> int:
        with self._lock:
            return self.asked.get(name, 0)

    def wait_for_lookups(self, name: str, count: int, within: float = 30.0) -> None:
        """Until `count` more A queries for `name` have been answered from the table as it is now."""
        wanted = self.asked_for(name) + count
        wait_for(lambda: self.asked_for(name) >= wanted, within, f"{count} lookups of {name}")

    def stop(self) -> None:
        self.server.stop()


# -- targets -----------------------------------------------------------------------


def test_targets_parse_as_grpc_dns_names_and_bad_ones_name_the_flag():
    assert parse_target("10.0.0.1:50051").address == "10.0.0.1:50051"
    assert parse_target("[::1]:7").address == "[::1]:7"
    pool = parse_target("dns:///prefill.llm.svc.cluster.local:50051")
    assert (pool.dns, pool.host, pool.port, pool.dns_server) == (True, "prefill.llm.svc.cluster.local", 50051, None)
    assert parse_target("dns://10.96.0.10/p.test:1").dns_server == ("10.96.0.10", 53)
    assert parse_target("dns://127.0.0.1:5353/p.test:1").dns_server == ("127.0.0.1", 5353)
    for bad in ("prefill", "dns:///prefill", "dns://10.0.0.1:53", "h:0", "h:70000"):
        with pytest.raises(ValueError, match="--decode"):
            parse_target(bad, "--decode")


def test_the_router_refuses_a_bad_target_with_one_line_naming_the_flag(capsys, llama_path):
    from router.__main__ import parse_config

    config = parse_config([
        "--model", llama_path, "--prefill", "dns:///p.test:1", "--prefill", "10.0.0.1:1", "--decode", "dns://127.0.0.1:5353/d.test:2", "--resolve-seconds", "2"
    ])
    assert config.prefill_workers == ("dns:///p.test:1", "10.0.0.1:1") and config.resolve_seconds == 2
    with pytest.raises(SystemExit) as exit:
        parse_config(["--model", llama_path, "--prefill", "dns:///p.test", "--decode", "10.0.0.1:2"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "router: error: --prefill: 'p.test' is not HOST:PORT"


def test_the_resolver_reads_a_dns_server_and_tells_empty_from_failed():
    dns = StubDns()
    try:
        dns.set("p.test", ["127.0.0.2", "127.0.0.3"])
        dns.set("broken.test", None)

        def lookup(name):
            return asyncio.run(resolve(parse_target(f"dns://127.0.0.1:{dns.port}/{name}:50051")))

        assert lookup("p.test") == {"127.0.0.2:50051", "127.0.0.3:50051"}
        assert lookup("gone.test") == frozenset()  # NXDOMAIN: no workers
        with pytest.raises(LookupFailed, match="SERVFAIL"):
            lookup("broken.test")
        # Without a server named, the system resolver (/etc/hosts here).
        assert asyncio.run(resolve(parse_target("dns:///localhost:9"))) >= {"127.0.0.1:9"}
    finally:
        dns.stop()


# -- the pool's membership ---------------------------------------------------------


def test_the_pool_adds_retires_and_drains_workers_as_the_answers_change():
    answers = {"p.test": {"10.0.0.1:1"}, "d.test": {"10.0.1.1:2", "10.0.1.2:2"}}

    async def resolver(target):
        found = answers[target.host]
        if found is None:
            raise LookupFailed("timed out")
        return frozenset(found)

    async def run():
        pool = WorkerPool.connect(["dns:///p.test:1", "10.9.9.9:1"], ["dns:///d.test:2"], max_queue=4, poll_seconds=60, resolver=resolver, drain_seconds=0.1)
        await pool.discover()
        assert sorted(w.address for w in pool.prefill) == ["10.0.0.1:1", "10.9.9.9:1"]  # DNS and fixed, mixed
        assert sorted(w.address for w in pool.decode) == ["10.0.1.1:2", "10.0.1.2:2"]
        for worker in pool.workers:
            worker.healthy, worker.load = True, wpb.WorkerLoad(capacity=8)
        busy = await pool.acquire_decode()  # a request running on one decode worker
        other = next(w for w in pool.decode if w is not busy)

        answers["d.test"] = {other.address, "10.0.1.3:2"}
        answers["p.test"] = None  # a failed lookup keeps the last answer
        await pool.discover()
        pool.decode[-1].healthy, pool.decode[-1].load = True, wpb.WorkerLoad(capacity=8)
        assert sorted(w.address for w in pool.prefill) == ["10.0.0.1:1", "10.9.9.9:1"]
        assert {w.address for w in pool.decode} == {other.address, "10.0.1.3:2"}
        assert pool.decode[0] is other  # the same worker: its health and load are kept
        assert pool.retired == [busy] and busy.closing is None  # draining: its request runs on
        for _ in range(4):  # and it gets no new ones
            assert (await pool.acquire_decode()) is not busy
        assert busy.outstanding == 1
        pool.release_decode(busy)  # its last request ends: the channel closes
        await busy.closing
        assert pool.retired == []

        answers["d.test"] = set()  # the name is gone: no decode workers
        await pool.discover()
        assert pool.decode == []
        with pytest.raises(RequestError, match="no decode worker"):
            await pool.acquire_decode()
        answers["d.test"] = {busy.address}  # back again: a new connection
        await pool.discover()
        assert [w.address for w in pool.decode] == [busy.address] and pool.decode[0] is not busy
        await pool.close()

    asyncio.run(asyncio.wait_for(run(), 30))


# -- real processes, started as the images start them ---------------------------------


def free_port(hosts: list[str]) -> int:
    """A port free on every one of hosts (pods share a port on different IPs)."""
    while True:
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as probe:
                    probe.bind((host, port))
            return port
        except OSError:
            continue


def serving(address: str, timeout: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            assert process.poll() is None, f"{address} exited with {process.returncode}"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"{address} did not report SERVING"
            time.sleep(0.2)


def metric(address: str, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def wait_for_counts(client: Client, prefill: int, decode: int, within: float = 30.0) -> None:
    """Until the router has this many healthy workers in each pool (GetModelInfo)."""
    deadline = time.monotonic() + within
    while (info := client.model_info()).prefill_workers != prefill or info.decode_workers != decode:
        assert time.monotonic() < deadline, f"the router still has {info.prefill_workers} prefill and {info.decode_workers} decode workers"
        time.sleep(0.05)


class Stream(threading.Thread):
    """One long greedy generation read on its own thread."""

    def __init__(self, address: str, prompt: str, max_new_tokens: int):
        super().__init__(daemon=True)
        self.address, self.prompt, self.max_new_tokens = address, prompt, max_new_tokens
        self.tokens: list[int] = []
        self.decoding = threading.Event()  # a token has come from the decode worker
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with Client(self.address, timeout=120) as client:
                for chunk in client.generate(self.prompt, max_new_tokens=self.max_new_tokens, ignore_eos=True):
                    self.tokens += chunk.token_ids
                    if len(self.tokens) >= 2:
                        self.decoding.set()
        except grpc.RpcError as exc:  # reported by the test
            self.error = exc
            self.decoding.set()


# Tokens: a stream still running when its worker is frozen, which is once all three are decoding
# (at 200, with the prefills not held back, one had finished once on a busy CI host).
LONG = 480
PROMPTS = ["The lighthouse keeper", "A quiet morning in the harbour", "The lighthouse keeper"]


@dataclass
class Pods:
    """The chart's pods as processes on loopback addresses, and the stub DNS server naming them."""

    dns: StubDns
    ips: dict[str, str]  # pod -> its IP
    names: dict[str, str]  # role -> the pool's headless Service name
    grpc_at: dict[str, str]
    metrics_at: dict[str, str]
    router_address: str
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def serve(self, prefill: list[str], decode: list[str]) -> None:
        """DNS names these pods for the pools."""
        self.dns.set(self.names["prefill"], [self.ips[pod] for pod in prefill])
        self.dns.set(self.names["decode"], [self.ips[pod] for pod in decode])

    def metric(self, pod: str, name: str) -> float:
        return metric(self.metrics_at[pod], name)


def chart_values(llama_path: str, dns: StubDns, hosts: list[str]) -> dict:
    return {
        "clusterDomain": "test",
        "model": {"path": llama_path},
        "graceSeconds": 20,
        "router": {"port": free_port(["127.0.0.1"]), "metricsPort": free_port(["127.0.0.1"]), "dnsServer": f"127.0.0.1:{dns.port}", "resolveSeconds": 0.2},
        "prefill": {"port": free_port(hosts), "metricsPort": free_port(hosts), "extraArgs": ["--dtype", "float32", "--threads", "1"]},
        "decode": {"port": free_port(hosts), "metricsPort": free_port(hosts), "extraArgs": ["--dtype", "float32", "--threads", "1", "--batch-size", "4"]},
    }


def start_pods(tmp_path, llama_path: str) -> Pods:
    """Pods A and B of each pool and the router, each as the chart runs it; DNS names only the A pods."""
    ips = {"prefill-a": "127.0.0.11", "decode-a": "127.0.0.12", "prefill-b": "127.0.0.13", "decode-b": "127.0.0.14"}
    dns = StubDns()
    values = chart_values(llama_path, dns, list(ips.values()))
    objects = render(values)
    pods = Pods(
        dns=dns,
        ips=ips,
        names={role: f"demo-disagg-{role}.llm.svc.test" for role in ("prefill", "decode")},
        grpc_at={pod: f"{ip}:{values[pod.split('-')[0]]['port']}" for pod, ip in ips.items()},
        metrics_at={pod: f"{ip}:{values[pod.split('-')[0]]['metricsPort']}" for pod, ip in ips.items()},
        router_address=f"127.0.0.1:{values['router']['port']}",
    )
    pods.serve(prefill=["prefill-a"], decode=["decode-a"])
    for pod, ip in ips.items():
        pods.processes[pod] = run_container(container(objects, pod.split("-")[0]), {"DISAGG_HOST": ip}, tmp_path / f"{pod}.log")
    pods.processes["router"] = run_container(container(objects, "router"), {"DISAGG_HOST": "127.0.0.1"}, tmp_path / "router.log")
    return pods


def wait_until_serving(pods: Pods) -> None:
    for pod in pods.ips:
        serving(pods.grpc_at[pod], 180, pods.processes[pod])
    serving(pods.router_address, 60, pods.processes["router"])


def stop_pods(pods: Pods) -> None:
    for process in pods.processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
    for process in pods.processes.values():
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
    pods.dns.stop()


def streams_frozen_mid_way(pods: Pods) -> list[Stream]:
    """Three long streams on the A pods, then decode A frozen (SIGSTOP) with all three mid-way.

    Prefill A is stopped until all three hold a decode slot, so their prefills run back to back
    and the three start decoding together: no stream can finish while another still waits for
    its prefill, however slowly a busy host starts the others (a fixed head start once did)."""
    streams = [Stream(pods.router_address, p, LONG) for p in PROMPTS]
    pods.processes["prefill-a"].send_signal(signal.SIGSTOP)
    try:
        for stream in streams:
            stream.start()
        # Brief: two missed load polls would make the router doubt prefill A.
        wait_for(lambda: pods.metric("decode-a", "disagg_decode_slots_in_use") == len(streams), 10, "three reserved slots")
    finally:
        pods.processes["prefill-a"].send_signal(signal.SIGCONT)
    for stream in streams:
        assert stream.decoding.wait(60) and stream.error is None, stream.error
    pods.processes["decode-a"].send_signal(signal.SIGSTOP)  # its three streams stop mid-way
    assert all(len(s.tokens) < LONG for s in streams)
    return streams


def new_requests_go_to_b(pods: Pods, client: Client, expected: dict) -> None:
    """B pods appear, decode A disappears (prefill A stays for now): every new request decodes on B."""
    pods.serve(prefill=["prefill-a", "prefill-b"], decode=["decode-b"])
    wait_for_counts(client, 2, 1)
    short = [client.complete(p, max_new_tokens=8, ignore_eos=True) for p in PROMPTS + PROMPTS]
    assert [r.token_ids for r in short] == [expected[p, 8] for p in PROMPTS + PROMPTS]
    assert pods.metric("decode-b", "disagg_decode_tokens_total") == len(short) * 7  # every new request ran on B


def frozen_streams_finish_exactly(pods: Pods, streams: list[Stream], expected: dict) -> None:
    """The removed decode worker resumes and finishes its streams, and does nothing else."""
    pods.processes["decode-a"].send_signal(signal.SIGCONT)
    for stream in streams:
        stream.join(60)
        assert stream.error is None and stream.tokens == expected[stream.prompt, LONG]
    assert pods.metric("decode-a", "disagg_decode_tokens_total") == len(streams) * (LONG - 1)  # and nothing else
    assert pods.metric("decode-a", "disagg_decode_slots_in_use") == 0


def prefill_a_gets_nothing_once_removed(pods: Pods, client: Client, expected: dict) -> None:
    """Prefill A disappears: everything goes to prefill B."""
    pods.serve(prefill=["prefill-b"], decode=["decode-b"])
    # 2 -> 1 could also be a health blip: wait until the router has applied an answer without A.
    # Its rounds run one after another, so by the second lookup since the change the first was applied.
    pods.dns.wait_for_lookups(pods.names["prefill"], 2)
    wait_for_counts(client, 1, 1)
    # Prefills computed (observed at the first token, whatever ends the call later).
    before = {pod: pods.metric(pod, "disagg_prefill_seconds_count") for pod in ("prefill-a", "prefill-b")}
    more = [client.complete(p, max_new_tokens=4, ignore_eos=True) for p in PROMPTS]
    assert [r.token_ids for r in more] == [expected[p, 4] for p in PROMPTS]
    assert pods.metric("prefill-a", "disagg_prefill_seconds_count") == before["prefill-a"]
    assert pods.metric("prefill-b", "disagg_prefill_seconds_count") == before["prefill-b"] + len(PROMPTS)


def removed_pods_drain_on_sigterm(pods: Pods) -> None:
    """What the kubelet does next (after the preStop sleep): SIGTERM, and the pods drain and exit 0."""
    for pod in ("prefill-a", "decode-a"):
        pods.processes[pod].send_signal(signal.SIGTERM)
    assert [pods.processes[pod].wait(30) for pod in ("prefill-a", "decode-a")] == [0, 0]


def test_the_router_follows_the_pools_dns_names_with_streams_running(tmp_path, llama_path, llama_ref):
    """Pods A (prefill, decode) serve three long streams; the decode pod is frozen
    mid-stream, B pods are added to DNS and the frozen one removed: new requests go
    to B only, the frozen pod's streams finish exactly once it resumes, then A's
    prefill pod is removed too and gets nothing more; SIGTERM drains both A pods."""
    pods = start_pods(tmp_path, llama_path)
    try:
        # The expected tokens, while the pods start.
        expected = {(p, n): llama_ref.greedy(p, n, ignore_eos=True) for p in PROMPTS for n in (LONG, 8, 4)}
        wait_until_serving(pods)
        with Client(pods.router_address, timeout=60) as client:
            wait_for_counts(client, 1, 1)  # only the A pods: the B pods run but DNS does not name them
            streams = streams_frozen_mid_way(pods)
            new_requests_go_to_b(pods, client, expected)
            frozen_streams_finish_exactly(pods, streams, expected)
            prefill_a_gets_nothing_once_removed(pods, client, expected)
        removed_pods_drain_on_sigterm(pods)
    finally:
        stop_pods(pods)

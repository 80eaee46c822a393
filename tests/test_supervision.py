"""`disagg serve` heals itself: a part that exits is restarted on its ports and the
rest keep serving (disagg/tools/supervisor.py), with real processes, real
signals and exact tokens; starts wait for progress, not a clock."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
from conftest import assert_nothing_held, reference, start_cluster, tiny_model
from grpc_health.v1 import health_pb2
from polling import wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_step_failures import health

from disagg.clients.grpc_client import Client
from disagg.engine.faults import TEST_FAIL_DECODE_STEP, TEST_HOLD_KV_SEND
from disagg.tools.local_cluster import ClusterSpec, LocalCluster, _Launched
from disagg.tools.process_progress import ProgressWatch, tree_cpu_seconds
from disagg.tools.supervisor import PartState, RestartPolicy, Supervisor
from disagg.tools.tinymodel import paragraphs
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A restarted worker imports torch and loads its model again: on a loaded CI machine that takes a while.
RESTART_WITHIN = 180.0
# Requests arriving while every worker of a role is restarting wait for one this long (a bound, not a guess).
WAIT_FOR_WORKERS = ["--worker-wait-seconds", "180"]


def prompts(count: int) -> list[str]:
    return [" ".join(text.split()[:8]) for text in paragraphs()[:count]]


def held(address: str, role: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = wgrpc.PrefillServiceStub(channel) if role == "prefill" else wgrpc.DecodeServiceStub(channel)
        load = stub.GetLoad(wpb.LoadRequest(), timeout=5)
    return [load.slots_in_use, load.reservations, load.active, load.inflight_transfers, load.queued]


def router_metric(cluster: LocalCluster, name: str, **labels) -> float:
    return worker_metric(cluster.process("router"), name, **labels)


def worker_metric(process, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name and labels.items() <= s.labels.items())


class Streams:
    """Greedy streams read on threads, each recording its tokens or its error."""

    def __init__(self, address: str, prompts: list[str], max_new_tokens: int):
        self.tokens = {p: [] for p in prompts}
        self.errors: dict[str, grpc.RpcError] = {}
        self._threads = [threading.Thread(target=self._read, args=(address, p, max_new_tokens), daemon=True) for p in prompts]
        for thread in self._threads:
            thread.start()

    def _read(self, address: str, prompt: str, n: int) -> None:
        with Client(address, timeout=300) as client:
            try:
                for chunk in client.generate(prompt, max_new_tokens=n, ignore_eos=True):
                    self.tokens[prompt] += chunk.token_ids
            except grpc.RpcError as exc:
                self.errors[prompt] = exc

    def each_has(self, count: int) -> bool:
        return all(len(t) >= count for t in self.tokens.values())

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=300)
            assert not thread.is_alive(), "a stream did not end"


@contextlib.contextmanager
def supervised(cluster: LocalCluster, policy: RestartPolicy = RestartPolicy()):
    """The supervisor `disagg serve` runs, polled on a thread as disagg serve polls it; yields it and its lines."""
    lines: list[str] = []
    supervisor = Supervisor(cluster, policy, say=lines.append)
    stop = threading.Event()

    def loop():
        while not stop.wait(0.1):
            supervisor.poll()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield supervisor, lines
    finally:
        stop.set()
        thread.join()


def said(lines: list[str], pattern: str) -> list[str]:
    return [line for line in list(lines) if re.search(pattern, line)]


# -- disagg serve, the command itself ----------------------------------------------------------
class Serve:
    """`disagg serve` as a user runs it, its output read line by line."""

    def __init__(self, *flags: str):
        disagg = pathlib.Path(sys.executable).with_name("disagg")
        command = [str(disagg)] if disagg.exists() else [sys.executable, "-c", "import sys; from disagg.cli.main import main; sys.exit(main())"]
        self.popen = subprocess.Popen([*command, "serve", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, pattern: str, within: float = RESTART_WITHIN, after: int = 0) -> re.Match:
        def found():
            assert self.popen.poll() is None or any(re.search(pattern, line) for line in self.lines[after:]), self.tail()
            return next((m for line in self.lines[after:] if (m := re.search(pattern, line))), None)

        return wait_for(found, within, f"disagg serve printing {pattern!r}:\n{self.tail()}", every=0.05)

    def tail(self) -> str:
        return "\n".join(self.lines[-30:])


def pid_of(parent: int, module: str, port: str | None = None) -> int:
    """The child of `parent` running `python -m module` (on --port port, where two run the same module)."""
    children = [int(c) for tid in os.listdir(f"/proc/{parent}/task") for c in pathlib.Path(f"/proc/{parent}/task/{tid}/children").read_text().split()]
    for child in children:
        args = pathlib.Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if module.encode() in args and (port is None or args[args.index(b"--port") + 1] == port.encode()):
            return child
    raise AssertionError(f"disagg serve runs no {module}" + (f" on port {port}" if port else ""))


def test_disagg_serve_restarts_a_killed_decode_worker_and_the_router_and_every_stream_is_exact(llama_path):
    ref = reference("llama")
    serve = Serve("--model", llama_path, "--decode-workers", "2", "--port", "0", "--http-port", "-1", "--threads", "1", "--dtype", "float32")
    try:
        router = serve.wait_line(r"router \(GenerationService\): (\S+)").group(1)
        decode = {name: serve.wait_line(rf"  {name}: (\S+)").group(1) for name in ("decode-0", "decode-1")}
        prefill = serve.wait_line(r"  prefill-0: (\S+)").group(1)
        serve.wait_line("Ctrl-C stops everything")
        with Client(router, timeout=30) as client:  # the router serves once it has seen one worker of each kind: wait for both decode workers
            wait_for(lambda: client.model_info().decode_workers == 2, 60, "the router using both decode workers")

        # Eight greedy streams of 380 tokens; a decode worker that runs some of them (decode-0 where it does) killed while they run.
        asked = prompts(8)
        expected = {p: ref.greedy(p, 380, ignore_eos=True) for p in asked}
        streams = Streams(router, asked, 380)
        wait_for(lambda: streams.each_has(8), 120, "every stream's first tokens")
        running = [name for name in ("decode-0", "decode-1") if held(decode[name], "decode")[2] > 0]
        assert running, "no decode worker runs the streams:\n" + serve.tail()
        victim = running[0]
        mark = len(serve.lines)
        os.kill(pid_of(serve.popen.pid, "decode_worker", decode[victim].rsplit(":", 1)[1]), signal.SIGKILL)
        streams.join()
        assert streams.errors == {}
        assert streams.tokens == expected  # 8/8, each token for token, none lost or repeated
        serve.wait_line(rf"{victim} exited \(killed by SIGKILL\); restarting it now", after=mark)
        serve.wait_line(rf"{victim} is serving again; decode 2/2", after=mark)
        assert serve.popen.poll() is None
        wait_for(lambda: health(decode[victim]) == SERVING, 60, f"{victim} serving on its old address")
        with Client(router, timeout=120) as client:
            assert client.complete(asked[0], max_new_tokens=12).token_ids == ref.greedy(asked[0], 12)

        # The router killed mid-stream: its call fails as any server's death does; it comes back and the workers are found again.
        with Client(router, timeout=120) as client:
            stream = client.generate(asked[1], max_new_tokens=380, ignore_eos=True)
            assert next(stream).token_ids
            mark = len(serve.lines)
            os.kill(pid_of(serve.popen.pid, "router"), signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as lost:
                list(stream)
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        serve.wait_line(r"router is serving again", after=mark)
        wait_for(lambda: health(router) == SERVING, RESTART_WITHIN, "the restarted router serving")
        with Client(router, timeout=120) as client:
            assert client.complete(asked[2], max_new_tokens=12).token_ids == ref.greedy(asked[2], 12)
        # Nothing stays held for the calls the router's death ended (the workers saw their calls close).
        parts = [(decode["decode-0"], "decode"), (decode["decode-1"], "decode"), (prefill, "prefill")]
        wait_for(lambda: all(held(address, role) == [0, 0, 0, 0, 0] for address, role in parts), 60, "nothing held on any worker")
        assert serve.popen.poll() is None
    finally:
        serve.popen.send_signal(signal.SIGTERM)  # Ctrl-C and SIGTERM still stop everything cleanly
        assert serve.popen.wait(timeout=120) == 0, serve.tail()
    stopped = serve.wait_line(r"^stopped: (.*)$", within=10).group(1)
    assert sorted(stopped.split(", ")) == ["decode-0 exit 0", "decode-1 exit 0", "prefill-0 exit 0", "router exit 0"], serve.tail()


# -- the supervisor over a cluster the tests drive ------------------------------------------------
@pytest.fixture
def one_prefill(cluster_logs, request):
    # The gRPC push: a send the test can hold mid-transfer (a NIXL pull killed midway: tests/test_kv_nixl_faults.py).
    cluster = start_cluster(cluster_logs / request.node.name, "llama", prefill=1, decode=1, transport="grpc", batch_size=4, router_args=WAIT_FOR_WORKERS,
                            forked=False)  # restarts as `python -m`: the router sees each worker away before it returns (its metrics count that)
    yield cluster
    cluster.stop()


def test_the_only_prefill_worker_killed_mid_prefill_and_mid_transfer_is_restarted_and_the_requests_are_exact(one_prefill, tmp_path, monkeypatch):
    cluster, ref = one_prefill, reference("llama")
    decode, prompt = cluster.process("decode-0"), prompts(3)[2]
    gate = tmp_path / "send-the-rest"
    gate.write_text("")
    monkeypatch.setenv(TEST_HOLD_KV_SEND, str(gate))  # the restarted prefill worker's KV sends stop after one piece while the gate is shut
    with supervised(cluster) as (supervisor, lines), Client(cluster.router_address, timeout=300) as client:
        # Mid-prefill: the worker frozen with the request in it (its decode slot reserved), then killed.
        cluster.signal("prefill-0", signal.SIGSTOP)
        streams = Streams(cluster.router_address, [prompt], 30)
        wait_for(lambda: held(decode.address, "decode")[1] == 1, 60, "the request's decode reservation")
        cluster.signal("prefill-0", signal.SIGKILL)
        streams.join()
        assert streams.errors == {} and streams.tokens[prompt] == ref.greedy(prompt, 30, ignore_eos=True)
        wait_for(lambda: said(lines, r"prefill-0 is serving again"), RESTART_WITHIN, "prefill-0 back")
        assert worker_metric(decode, "disagg_decode_kv_receive_failures_total", transport="grpc") == 0

        # Mid-transfer: the first token out, the decode worker holding part of the KV, when the prefill worker is killed.
        # (Another prompt: the first one's blocks are cached on the decode worker now, and nothing of them would be sent.)
        prompt = prompts(3)[1]
        gate.unlink()
        streams = Streams(cluster.router_address, [prompt], 30)
        wait_for(lambda: streams.tokens[prompt] and held(decode.address, "decode")[3] == 1, 60, "the first token and a KV transfer in progress")
        cluster.signal("prefill-0", signal.SIGKILL)
        gate.write_text("")
        streams.join()
        assert streams.errors == {} and streams.tokens[prompt] == ref.greedy(prompt, 30, ignore_eos=True)
        assert worker_metric(decode, "disagg_decode_kv_receive_failures_total", transport="grpc") == 1  # the transfer the kill broke
        wait_for(lambda: len(said(lines, r"prefill-0 is serving again")) == 2, RESTART_WITHIN, "prefill-0 back again")
        assert client.complete(prompt, max_new_tokens=8).token_ids == ref.greedy(prompt, 8)
        assert supervisor.restarts == 2 and len(said(lines, r"prefill-0 exited \(killed by SIGKILL\)")) == 2
    assert_nothing_held(cluster)


@pytest.fixture
def two_decode(cluster_logs, request):
    cluster = start_cluster(cluster_logs / request.node.name, "llama", prefill=1, decode=2, batch_size=4, router_args=WAIT_FOR_WORKERS,
                            forked=False)  # as above
    yield cluster
    cluster.stop()


def test_a_decode_worker_whose_steps_keep_failing_exits_and_is_restarted_while_its_streams_move(two_decode, monkeypatch):
    cluster, ref = two_decode, reference("llama")
    # Its first restart is a return only once the router has seen it ready (a worker up is not yet polled).
    wait_for(lambda: router_metric(cluster, "disagg_router_workers_available", role="decode") == 2, 60, "the router using both decode workers")
    with supervised(cluster) as (supervisor, lines):
        # decode-0 started again with its next three steps failing (the test-only fault hook); its restart after that is clean.
        monkeypatch.setenv(TEST_FAIL_DECODE_STEP, "after=0,count=3")
        cluster.signal("decode-0", signal.SIGTERM)
        wait_for(lambda: said(lines, r"decode-0 is serving again"), RESTART_WITHIN, "decode-0 back with the fault hook")
        monkeypatch.delenv(TEST_FAIL_DECODE_STEP)
        wait_for(lambda: router_metric(cluster, "disagg_router_workers_available", role="decode") == 2, 60, "the router using both decode workers")
        asked = prompts(3)
        with Client(cluster.router_address, timeout=300) as client:
            for prompt in asked:  # each goes to decode-0 (ties go to the first), fails a step there, and moves to decode-1
                assert client.complete(prompt, max_new_tokens=20, ignore_eos=True).token_ids == ref.greedy(prompt, 20, ignore_eos=True)
            wait_for(lambda: said(lines, r"decode-0 exited \(exit code 1\)"), 60, "decode-0 exiting after three failed steps")
            wait_for(lambda: len(said(lines, r"decode-0 is serving again")) == 2, RESTART_WITHIN, "decode-0 back, clean")
            wait_for(lambda: router_metric(cluster, "disagg_router_workers_available", role="decode") == 2, 60, "the router using it again")
            assert client.complete(asked[0], max_new_tokens=12).token_ids == ref.greedy(asked[0], 12)
        assert supervisor.restarts == 2
        assert router_metric(cluster, "disagg_router_worker_returns_total", role="decode") >= 2  # restarts show in the router's metrics
        assert "decode 2/2; prefill 1/1; router 1/1; 2 restarts" in lines[-1]
    assert_nothing_held(cluster)


def test_a_worker_that_fails_every_start_is_left_down_and_the_last_of_its_role_is_retried_while_the_router_says_not_serving(two_decode):
    cluster, ref = two_decode, reference("llama")
    prompt = prompts(1)[0]
    good = {name: list(cluster.process(name).command) for name in ("decode-0", "decode-1")}
    policy = RestartPolicy(limit=2, window=300, max_delay=1.0)
    with supervised(cluster, policy) as (supervisor, lines), Client(cluster.router_address, timeout=300) as client:
        cluster.process("decode-1").command.append("--no-such-flag")  # every start of it now fails at once
        cluster.signal("decode-1", signal.SIGKILL)
        wait_for(lambda: supervisor.parts["decode-1"].state is PartState.LEFT_DOWN, 60, "decode-1 left down")
        down = said(lines, "left down")
        assert len(down) == 1 and down[0].startswith("disagg serve: decode-1 exited 3 times in 300 s (last: exit code 2): left down"), lines
        assert "--no-such-flag" in down[0]  # the line quotes the end of its log: why it fails
        assert client.complete(prompt, max_new_tokens=12).token_ids == ref.greedy(prompt, 12)  # the other one serves

        # The last decode worker failing too: it is tried again (not left down) and the service says it is down.
        cluster.process("decode-0").command.append("--no-such-flag")
        cluster.signal("decode-0", signal.SIGKILL)
        wait_for(lambda: said(lines, "no decode worker is up"), 60, "the service reported unavailable")
        wait_for(lambda: health(cluster.router_address) == NOT_SERVING, 60, "the router NOT_SERVING")
        wait_for(lambda: supervisor.parts["decode-0"].restarts >= 4, 60, "decode-0 tried again past its limit")
        assert supervisor.parts["decode-0"].state is not PartState.LEFT_DOWN

        cluster.process("decode-0").command[:] = good["decode-0"]  # whatever broke it is mended
        wait_for(lambda: said(lines, "a decode worker is up again"), RESTART_WITHIN, "decode-0 back")
        wait_for(lambda: health(cluster.router_address) == SERVING, 60, "the router SERVING again")
        assert client.complete(prompt, max_new_tokens=12).token_ids == ref.greedy(prompt, 12)
        assert supervisor.parts["decode-1"].state is PartState.LEFT_DOWN


# -- starts that wait for progress ------------------------------------------------------------------
def test_a_progress_watch_counts_cpu_time_of_the_process_and_its_children_and_a_new_phase():
    clock = [0.0]
    sleeper = subprocess.Popen(["sleep", "60"])
    # The shell only waits: the work is its child's, as a compiler's is under a worker.
    busy = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'while True: pass' & wait"], start_new_session=True)
    try:
        idle, working = ProgressWatch(sleeper.pid, clock=lambda: clock[0]), ProgressWatch(busy.pid, clock=lambda: clock[0])
        before = tree_cpu_seconds(busy.pid)
        wait_for(lambda: tree_cpu_seconds(busy.pid) > before + 0.1, 30, "the busy child using CPU")
        clock[0] = 100.0
        assert idle.silent_for() == 100.0 and working.silent_for() == 0.0
        assert idle.silent_for(phase="loading") == 0.0  # a new phase is progress too
    finally:
        sleeper.kill()
        sleeper.wait()
        os.killpg(busy.pid, signal.SIGKILL)
        busy.wait()
    assert tree_cpu_seconds(sleeper.pid) is None  # gone


def test_a_part_silent_before_binding_its_port_fails_the_start_with_its_last_log_lines(tmp_path):
    cluster = LocalCluster(ClusterSpec(model="unused", log_dir=str(tmp_path)))
    (tmp_path / "decode-0.log").write_text("importing torch\nwaiting for something that never comes\n")
    silent = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(TimeoutError) as failed:
            cluster._bound(_Launched("decode-0", str(tmp_path / "never.json"), ["sleep", "--port", "0", "--metrics-port", "0"], silent), silence=1.0)
    finally:
        silent.kill()
    assert str(failed.value).startswith("decode-0 made no progress for 1 s before binding its port; the end of ")
    assert "  | waiting for something that never comes" in str(failed.value)


def test_disagg_serve_starts_and_serves_while_both_cores_are_busy(cluster_logs):
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(min(8, os.cpu_count() or 2))]
    try:
        cluster = LocalCluster(ClusterSpec(model=tiny_model("llama"), dtype="float32", threads_per_worker=1, log_dir=str(cluster_logs / "busy-start")))
        try:
            cluster.start()  # no clock: each part may take as long as it makes progress
            prompt = prompts(1)[0]
            with Client(cluster.router_address, timeout=300) as client:
                assert client.complete(prompt, max_new_tokens=12).token_ids == reference("llama").greedy(prompt, 12)
        finally:
            cluster.stop()
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def test_the_backoff_doubles_and_a_bad_policy_is_refused():
    policy = RestartPolicy(max_delay=30.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5, 6, 7, 8)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    for bad in ({"limit": 0}, {"window": 0}, {"silence": -1}):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)


def test_a_start_interrupted_while_the_router_binds_leaves_no_part_running(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM to `disagg serve` while its router starts: the router is stopped with the rest, never left
    holding the port (gRPC's SO_REUSEPORT would let the next router share it, half its calls going to the orphan)."""
    cluster = LocalCluster(ClusterSpec(model="unused", log_dir=str(tmp_path)))
    started: dict[str, subprocess.Popen] = {}

    def popen(name, command):  # each part a real process that never serves; the workers announce ports at once
        started[name] = subprocess.Popen(["sleep", "600"], start_new_session=True)
        if name != "router":
            pathlib.Path(cluster.port_file(name)).write_text('{"port": 1, "metrics_port": 2}')
        return started[name]

    bound = cluster._bound

    def bound_until_the_router(launched, silence=None):
        if launched.name == "router":
            raise KeyboardInterrupt  # the signal arrives while the router's port is awaited
        return bound(launched, silence)

    monkeypatch.setattr(cluster, "_popen", popen)
    monkeypatch.setattr(cluster, "_bound", bound_until_the_router)
    with pytest.raises(KeyboardInterrupt):
        cluster.start()
    cluster.stop(timeout=5.0)
    assert set(started) == {"decode-0", "prefill-0", "router"}
    assert all(process.poll() is not None for process in started.values()), {name: p.poll() for name, p in started.items()}

"""Starts a router, prefill workers and decode workers as local processes.

`disagg serve` uses it for the one-command demo; the end-to-end tests use it
to start real clusters. Each part is the same `python -m <part>` a user would
run on its own machine.

Start-up waits for every worker's health to say SERVING, for as long as the
worker makes progress, not for a fixed time: a start on a loaded machine (a
compile beside it, a fresh kernel cache) is slow but gets somewhere. Progress is
CPU time spent by the process or its children (importing, loading, building
kernels) or a new start-up phase; a worker silent for `silence` seconds, or one
that exits, fails the start with its last log lines. A worker publishes its
phase (disagg/rpc/startup.py, `--status-file`); while it compiles, its
heartbeat must stay fresh (`stall_seconds`), so a first Neuron compile of tens
of minutes is waited for while a stopped one is not. With `ClusterSpec.neuron`, each worker gets
its own NeuronCores (`NEURON_RT_VISIBLE_CORES`, disagg/tools/neuron_cores.py), and a
split that does not fit is refused before any process starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg.rpc import startup
from disagg.tools.neuron_cores import CorePool, WorkerCores, split
from disagg.tools.process_progress import ProgressWatch
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)
PROGRESS_SECONDS = 30.0  # how often a compiling worker's progress is reported


@dataclass(frozen=True)
class NeuronPlacement:
    """--backend neuron on one instance: each role's tp degree, and the cores the workers split."""

    pool: CorePool
    prefill_tp: int = 1
    decode_tp: int = 1


@dataclass
class ClusterSpec:
    model: str
    prefill_workers: int = 1
    decode_workers: int = 1
    router_port: int = 0  # 0: a free port
    http_port: int | None = None  # the router's OpenAI-compatible HTTP API; None: off, 0: a free port
    dtype: str = "auto"  # dtype_choice: bf16 on a native-bf16 CPU, float32 on others
    batch_size: int = 8
    threads_per_worker: int = 0  # 0: see worker_threads
    worker_args: list[str] = field(default_factory=list)  # extra flags for both workers
    decode_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    log_dir: str | None = None  # None: inherit this process's stderr
    public_tls_ca: str | None = None  # the router serves TLS: check its health with this CA
    compile: bool | None = None  # the decode workers' --compile / --no-compile (None: their default)
    colocated: bool = False  # decode workers also do the prefills (no prefill workers): the baseline
    cpus: dict = field(default_factory=dict)  # role ("prefill", "decode", "router") -> CPU ids to pin it to
    nice: dict = field(default_factory=dict)  # role -> niceness increment, of its threads and its scheduling group (lower_priority)
    neuron: NeuronPlacement | None = None  # the workers run --backend neuron, each on its own NeuronCores
    stall_seconds: float = 60.0  # a compiling worker whose heartbeat is older than this is stuck
    silence: float = 120.0  # a starting part with no progress (CPU time, a new phase) for this long has failed its start
    compile_timeout: float | None = None  # at most this long compiling (None: as long as it makes progress)
    forked: bool = False  # parts forked from a process that imported their libraries (forked_launch.py: the test suite's)

    def worker_threads(self, role: str) -> int:
        """torch threads for a worker of this role: threads_per_worker, else the machine's cores
        split between the decode and prefill workers for a decode worker, and between the
        prefill workers alone for a prefill worker. Why: a decode step reads weights (bandwidth,
        every step) while a prefill computes (bursts, idle between prompts); oneDNN's products
        and SDPA on every core take a 1,024-token bf16 prefill from 1.88 to 1.00 s, and the
        prefill shares the decode worker's cores only while it runs (docs/benchmarks.md)."""
        if self.threads_per_worker:
            return self.threads_per_worker
        cores = os.cpu_count() or 2
        if role == "prefill":
            return max(1, cores // self.prefill_workers)
        return max(1, cores // (self.decode_workers + (0 if self.colocated else self.prefill_workers)))

    def worker_names(self) -> list[str]:
        """In launch order: the decode workers, then the prefill workers (none when colocated)."""
        return [f"decode-{i}" for i in range(self.decode_workers)] + ([] if self.colocated else [f"prefill-{i}" for i in range(self.prefill_workers)])

    def neuron_cores(self) -> dict[str, str]:
        """name -> NEURON_RT_VISIBLE_CORES (empty without neuron); NotEnoughCores when they do not fit."""
        if self.neuron is None:
            return {}
        tp = {"decode": self.neuron.decode_tp, "prefill": self.neuron.prefill_tp}
        return split(self.neuron.pool, [WorkerCores(name, tp[name.split("-")[0]]) for name in self.worker_names()])

    def neuron_args(self, role: str) -> list[str]:
        if self.neuron is None:
            return []
        return ["--backend", "neuron", "--tp-degree", str(self.neuron.prefill_tp if role == "prefill" else self.neuron.decode_tp)]


def router_targets(prefill: list[str], decode: list[str]) -> list[str]:
    """A router's flags for these workers' addresses."""
    return [a for address in prefill for a in ("--prefill", address)] + [a for address in decode for a in ("--decode", address)]


def reserve_port() -> socket.socket:
    """A bound (not listening) socket holding a free port on 127.0.0.1 until closed. SO_REUSEPORT
    lets a gRPC server (which sets it too) bind the same port meanwhile; no one else can take it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


# `disagg serve`'s decode workers yield the cores to a prefill beside them (--decode-nice): with
# 4 streams running and a 900-token prompt every 3 s (bench/long_prompts.py, two cores, the
# prefill's threads bound one per CPU, its model thread for good), the long prompts' TTFT p50
# was 0.9-1.0 s at 10 against 1.2 s at 5 and 1.8 s at 0; at 15, 0.8-1.0 s but the streams'
# ITL p99 104-130 ms against 76-87 at 10 (p50 unchanged). docs/benchmarks.md has the runs.
DECODE_NICE = 10


def decode_nice(niceness: int = DECODE_NICE, no_prefill_beside: bool = False) -> dict:
    """ClusterSpec.nice for `disagg serve`'s decode workers: none where no prefill worker shares
    their CPU cores (colocated: they prefill themselves; on NeuronCores: prefills run there)."""
    return {"decode": niceness} if niceness and not no_prefill_beside else {}


AUTOGROUP = "/proc/self/autogroup"


def lower_priority(increment: int) -> None:
    """In a launched process (before exec): its threads' niceness, and its scheduling group's.
    Each process starts a session of its own (start_new_session), and with Linux's autogroup
    (on by default on desktops and most cloud images) each session is one group, and the
    CPU is shared fairly between the groups: a thread's nice then weighs only against its
    own process's threads. So a decode worker's nice alone changed nothing beside a
    prefill (measured: a long prompt's TTFT as without it); its group's nice does. Raising niceness needs no
    privilege; where there is no autogroup the threads' own niceness does the work."""
    os.nice(increment)
    try:
        with open(AUTOGROUP, "w") as group:
            group.write(str(min(19, increment)))
    except OSError:  # no autogroup (kernel option, or tasks in a cgroup of their own): nice alone
        pass


def compile_flag(compile: bool | None) -> list[str]:
    return [] if compile is None else ["--compile" if compile else "--no-compile"]


@dataclass
class Process:
    name: str
    address: str
    popen: subprocess.Popen
    command: list[str]
    metrics_address: str
    http_port: int | None = None  # the router's, when it serves HTTP


class _Launched(typing.NamedTuple):
    """A part started but not yet known to have bound its ports."""

    name: str
    port_file: str
    command: list[str]
    popen: subprocess.Popen


class LocalCluster:
    def __init__(self, spec: ClusterSpec, progress=None):
        """progress: called with one line per worker start-up event worth telling (default: logged)."""
        self.spec = spec
        self.progress = progress or log.info
        self._env: dict[str, dict[str, str]] = {}  # process name -> environment it adds (its NeuronCores)
        self.processes: list[Process] = []
        self.router_address: str | None = None  # known once the router has bound its port
        self.http_url: str | None = None  # the router's HTTP API, e.g. http://127.0.0.1:8000 (spec.http_port set)
        self._port_dir = tempfile.mkdtemp(prefix="disagg-ports-")

    # -- start ----------------------------------------------------------------
    def start(self, timeout: float | None = None) -> "LocalCluster":
        """timeout: how long a starting part may go without progress (default spec.silence)."""
        spec = self.spec
        silence = spec.silence if timeout is None else timeout
        self._env = {name: {"NEURON_RT_VISIBLE_CORES": cores} for name, cores in spec.neuron_cores().items()}  # refused before anything starts
        common = ["--model", spec.model, "--dtype", spec.dtype, *spec.worker_args]
        decode_args = [*common, "--threads", str(spec.worker_threads("decode")), "--batch-size", str(spec.batch_size), *compile_flag(spec.compile)]
        decode_args += spec.decode_args
        decode_args += ["--colocated"] if spec.colocated else []
        # Every part is started before any is waited for: each spends seconds importing torch (the
        # router, transformers for its tokenizer) before it binds its port, and those imports can run
        # side by side. The prefill workers need the decode workers' addresses (--decode: where they
        # may send KV) and the router everyone's, so the workers' ports are reserved here first
        # (reserve_port) and each worker binds its own; the router waits for them to serve.
        reserved = [reserve_port() for _ in range(spec.decode_workers + (0 if spec.colocated else spec.prefill_workers))]
        addresses = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in reserved]
        decode_addresses = addresses[: spec.decode_workers]
        prefill_addresses = decode_addresses if spec.colocated else addresses[spec.decode_workers :]
        router_args = ["--model", spec.model, *spec.router_args]
        if spec.http_port is not None:
            router_args += ["--http-port", str(spec.http_port)]
        router_args += router_targets(prefill_addresses, decode_addresses)
        try:
            launched = [
                self._launch(f"decode-{i}", "decode_worker", decode_args + spec.neuron_args("decode"), port=reserved[i].getsockname()[1])
                for i in range(spec.decode_workers)
            ]
            if not spec.colocated:
                pool = [a for address in decode_addresses for a in ("--decode", address)]
                prefill_args = common + ["--threads", str(spec.worker_threads("prefill"))] + pool + spec.prefill_args + spec.neuron_args("prefill")
                launched += [
                    self._launch(f"prefill-{i}", "prefill_worker", prefill_args, port=reserved[spec.decode_workers + i].getsockname()[1])
                    for i in range(spec.prefill_workers)
                ]
            # Through _bind_all as the workers: a start interrupted while the router binds (Ctrl-C, SIGTERM to
            # `disagg serve`) must not leave it running unknown to stop(), holding the port (gRPC binds with
            # SO_REUSEPORT, so the next cluster's router would share the port with it, half the calls going nowhere).
            launched.append(self._launch("router", "router", router_args, port=spec.router_port))
            *workers, router = self._bind_all(launched, silence)
        finally:
            for sock in reserved:
                sock.close()
        decode = workers[: spec.decode_workers]
        prefill = decode if spec.colocated else workers[spec.decode_workers :]
        self.router_address = router.address
        if router.http_port is not None:
            self.http_url = f"{'https' if spec.public_tls_ca else 'http'}://127.0.0.1:{router.http_port}"
        # Every worker first: the router serves once one of each kind is up, and a worker
        # still compiling its buckets would otherwise join mid-test.
        # (Workers on mutual TLS are not asked: this health check has no client certificate.)
        plain_workers = [] if "--tls-cert" in spec.worker_args else list({id(p): p for p in (*decode, *prefill)}.values())
        self._wait_workers(plain_workers, silence)
        self._wait_serving(self.router_address, silence, watch=None)  # any part dying now fails the start
        return self

    def add_worker(self, role: str, extra: list[str] = ()) -> Process:
        """Starts one more worker (not known to the running router)."""
        return self.add_workers(role, [extra])[0]

    def add_workers(self, role: str, extras: list[list[str]]) -> list[Process]:
        """Starts one more worker per set of extra flags (not known to the running router), all
        launched before any is waited for: each spends seconds importing torch before it binds its port."""
        spec = self.spec
        launched = []
        try:
            for extra in extras:
                common = ["--model", spec.model, "--dtype", spec.dtype, "--threads", str(spec.worker_threads(role)), *spec.worker_args, *extra]
                if role == "decode":
                    common += compile_flag(spec.compile)
                if role == "prefill" and "--decode" not in extra:  # the decode workers started so far are its pool
                    common += [a for address in self.addresses("decode") for a in ("--decode", address)]
                launched.append(self._launch(f"{role}-extra-{len(self.processes) + len(launched)}", f"{role}_worker", common))
            return [self._bound(part) for part in launched]
        except BaseException:
            known = {p.popen.pid for p in self.processes}
            for part in launched:  # those not yet bound are not in self.processes: stop() would not end them
                if part.popen.pid not in known and part.popen.poll() is None:
                    part.popen.kill()
                    part.popen.wait()
            raise

    def add_router(self, prefill: list[str], decode: list[str], extra: list[str] = ()) -> Process:
        """Starts one more router over these workers' addresses, once it has bound its port (its health
        says SERVING once it uses a prefill and a decode worker: wait_serving)."""
        args = ["--model", self.spec.model, *self.spec.router_args, *extra, *router_targets(prefill, decode)]
        return self._spawn(f"router-extra-{len(self.processes)}", "router", args)

    def _spawn(self, name: str, module: str, args: list[str], port: int = 0) -> Process:
        """Starts a part on the given port (0: one it picks itself) and waits for
        it to announce its bound ports, so no two processes race for one port."""
        return self._bound(self._launch(name, module, args, port))

    def log_path(self, name: str) -> str | None:
        return os.path.join(self.spec.log_dir, f"{name}.log") if self.spec.log_dir else None

    def last_lines(self, name: str, count: int = 10) -> str:
        """The end of a part's log, to quote when it fails (its own output says why)."""
        path = self.log_path(name)
        if path is None:
            return " (its output is above)"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 16384))
                lines = f.read().decode(errors="replace").splitlines()[-count:]
        except OSError:
            return ""
        return f"; the end of {path}:\n" + "\n".join(f"  | {line}" for line in lines)

    def port_file(self, name: str) -> str:
        return os.path.join(self._port_dir, f"{name}.json")

    def _launch(self, name: str, module: str, args: list[str], port: int = 0) -> _Launched:
        port_file = self.port_file(name)
        command = [sys.executable, "-m", module, "--port", str(port), "--metrics-port", "-1", "--port-file", port_file, *args]
        if module.endswith("_worker"):
            command += ["--status-file", self.status_file(name)]
        return _Launched(name, port_file, command, self._popen(name, command))

    def _bind_all(self, launched: list[_Launched], silence: float) -> list[Process]:
        """Each launched part once bound; if one fails, the others not yet bound are
        killed (stop() knows only the bound ones)."""
        try:
            return [self._bound(part, silence) for part in launched]
        except BaseException:
            bound = {id(p.popen) for p in self.processes}
            for part in launched:
                if id(part.popen) not in bound and part.popen.poll() is None:
                    part.popen.kill()
                    part.popen.wait()
            raise

    def _bound(self, launched: _Launched, silence: float | None = None) -> Process:
        """The launched part once it has written the ports it bound (it may take as long as it makes progress)."""
        name, port_file, command, popen = launched
        watch = ProgressWatch(popen.pid)
        silence = self.spec.silence if silence is None else silence
        while not os.path.exists(port_file):
            if popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {popen.returncode} before binding its port{self.last_lines(name)}")
            if watch.silent_for() > silence:
                raise TimeoutError(f"{name} made no progress for {silence:.0f} s before binding its port{self.last_lines(name)}")
            time.sleep(0.02)
        with open(port_file) as f:
            ports = json.load(f)
        # A restart reuses the same ports, so peers find the process where it was.
        command[command.index("--port") + 1] = str(ports["port"])
        command[command.index("--metrics-port") + 1] = str(ports["metrics_port"])
        if "http_port" in ports:
            command[command.index("--http-port") + 1] = str(ports["http_port"])
        process = Process(name, f"127.0.0.1:{ports['port']}", popen, command, f"127.0.0.1:{ports['metrics_port']}", ports.get("http_port"))
        self.processes.append(process)
        return process

    def _popen(self, name: str, command: list[str]) -> subprocess.Popen:
        log = None
        if self.spec.log_dir:
            os.makedirs(self.spec.log_dir, exist_ok=True)
            log = open(self.log_path(name), "a")
        role = name.split("-")[0]
        cpus, nice = self.spec.cpus.get(role), self.spec.nice.get(role, 0)

        def place() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)
            if nice:
                lower_priority(nice)

        env = {**os.environ, **self._env[name]} if name in self._env else None
        if self.spec.forked and command[1:2] == ["-m"]:
            from disagg.tools.forked_launch import ForkedPart

            if log:
                log.close()
            return ForkedPart(command[2], command[3:], env or dict(os.environ), self.log_path(name) if log else None, cpus=cpus, nice=nice)
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT if log else None, env=env, start_new_session=True,
                                preexec_fn=place if cpus or nice else None)

    def restart(self, name: str) -> Process:
        """Starts a process that has exited again, with the same command and ports
        (its port file is written anew once it has bound them)."""
        process = self.process(name)
        if process.popen.poll() is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.port_file(name))
            process.popen = self._popen(name, process.command)
            return process
        raise RuntimeError(f"{name} is still running")

    def signal(self, name: str, sig: int) -> None:
        self.process(name).popen.send_signal(sig)

    def status_file(self, name: str) -> str:
        return os.path.join(self._port_dir, f"{name}.status.json")

    def startup_status(self, process: Process) -> startup.StartupStatus | None:
        """What the worker last published about its start-up, if this very process published it."""
        status = startup.read_status(self.status_file(process.name))
        return status if status is not None and status.pid == process.popen.pid else None

    def _wait_workers(self, workers: list[Process], silence: float) -> None:
        """Until every worker reports SERVING. Each may take as long as it makes progress (CPU
        time, a new phase) and fails once silent for `silence` s; while compiling it has as long
        as its heartbeat is fresh (and compile_timeout, if set). Any process exiting fails the start."""
        channels = {p.name: grpc.insecure_channel(p.address) for p in workers}
        try:
            self._poll_workers(workers, {name: health_pb2_grpc.HealthStub(c) for name, c in channels.items()}, silence)
        finally:
            for channel in channels.values():
                channel.close()

    def _poll_workers(self, workers: list[Process], stubs: dict, silence: float) -> None:
        pending = {p.name: p for p in workers}
        watches = {p.name: ProgressWatch(p.popen.pid) for p in workers}
        told: dict[str, tuple] = {}  # name -> (phase, monotonic time) last reported
        while pending:
            self._check_alive_at_start()
            for name, process in list(pending.items()):
                if self._serving(stubs[name]):
                    del pending[name]
                    continue
                status = self.startup_status(process)
                if status is not None and status.phase in startup.COMPILE_PHASES:
                    self._check_compile_progress(name, status)
                    self._tell(name, status, told)
                elif watches[name].silent_for(status.phase if status else None) > silence:
                    doing = f" ({status.describe()})" if status else ""
                    raise TimeoutError(f"{name} made no progress for {silence:.0f} s and is not serving{doing}{self.last_lines(name)}")
            time.sleep(0.2)

    def _check_alive_at_start(self) -> None:
        """check_alive, quoting the dead part's last log lines."""
        dead = [p for p in self.processes if p.popen.poll() is not None]
        if dead:
            raise RuntimeError("; ".join(f"{p.name} exited with {p.popen.returncode} while starting{self.last_lines(p.name)}" for p in dead))

    def _check_compile_progress(self, name: str, status: startup.StartupStatus) -> None:
        silent = time.time() - status.updated
        if silent > self.spec.stall_seconds:
            raise TimeoutError(f"{name} is stuck: no heartbeat for {silent:.0f} s while {status.describe()}")
        if self.spec.compile_timeout is not None and status.elapsed() > self.spec.compile_timeout:
            raise TimeoutError(f"{name} compiled for longer than compile_timeout {self.spec.compile_timeout:.0f} s: {status.describe()}")

    def _tell(self, name: str, status: startup.StartupStatus, told: dict) -> None:
        """Reports a compile when it starts and every PROGRESS_SECONDS after."""
        phase, at = told.get(name, (None, 0.0))
        if phase != status.phase or time.monotonic() - at >= PROGRESS_SECONDS:
            told[name] = (status.phase, time.monotonic())
            self.progress(f"{name}: {status.describe()}")

    @staticmethod
    def _serving(stub) -> bool:
        try:
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def wait_serving(self, timeout: float, address: str | None = None) -> None:
        """Until the router (or the given server) reports SERVING on grpc.health.v1."""
        address = address or self.router_address
        self._wait_serving(address, timeout, watch=address)

    def _wait_serving(self, address: str, timeout: float, watch: str | None) -> None:
        """watch: the address whose process must stay alive meanwhile (None: all of them, at start:
        then `timeout` counts only the time the process at the address makes no progress)."""
        deadline = time.monotonic() + timeout
        starting = next((ProgressWatch(p.popen.pid) for p in self.processes if p.address == address), None) if watch is None else None
        if address == self.router_address and self.spec.public_tls_ca:
            with open(self.spec.public_tls_ca, "rb") as ca:
                channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.read()))
        else:
            channel = grpc.insecure_channel(address)
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline or (starting is not None and starting.silent_for() < timeout):
                if watch is None:
                    self._check_alive_at_start()
                else:
                    self.check_alive(watch)
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{address} did not report SERVING within {timeout}s")

    def check_alive(self, address: str | None = None) -> None:
        watched = [p for p in self.processes if address is None or p.address == address]
        dead = [p for p in watched if p.popen.poll() is not None]
        if dead:
            raise RuntimeError(", ".join(f"{p.name} exited with {p.popen.returncode}" for p in dead))

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def addresses(self, role: str) -> list[str]:
        return [p.address for p in self.processes if p.name.startswith(role)]

    def held(self) -> dict[str, list[int]]:
        """What each live worker holds, from its GetLoad:
        [slots in use, reservations, running rows, transfers in flight, queued prefills]."""
        out = {}
        for p in self.processes:
            role = p.name.split("-")[0]
            if role not in ("prefill", "decode") or p.popen.poll() is not None:
                continue
            with grpc.insecure_channel(p.address) as channel:
                stub = wgrpc.PrefillServiceStub(channel) if role == "prefill" else wgrpc.DecodeServiceStub(channel)
                load = stub.GetLoad(wpb.LoadRequest(), timeout=5)
            out[p.name] = [load.slots_in_use, load.reservations, load.active, load.inflight_transfers, load.queued]
        return out

    def wait_until_idle(self, within: float = 2.0) -> dict[str, list[int]]:
        """held() once every live worker holds nothing, or as it stands after `within` seconds. A worker that
        does not answer yet (UNAVAILABLE: restarted a moment ago, its connection refused or reset) is asked
        again until then."""
        deadline = time.monotonic() + within
        while True:
            try:
                held = self.held()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
                continue
            if all(not any(v) for v in held.values()) or time.monotonic() > deadline:
                return held
            time.sleep(0.02)

    # -- stop -------------------------------------------------------------------
    def stop(self, timeout: float = 15.0) -> dict[str, int]:
        """SIGTERM everything (router first), then SIGKILL what is left; returns exit codes."""
        for p in reversed(self.processes):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = {}
        for p in self.processes:
            try:
                codes[p.name] = p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                codes[p.name] = p.popen.wait()
        return codes

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

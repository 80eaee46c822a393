"""`disagg serve --backend neuron` on one instance (issue 28, findings 3 and 4), on the NxDI stand-in.

NeuronCores split between the workers and the one-line refusal; a compile
longer than the start timeout waited for while a stuck worker still fails the
start; a compile killed after model.pt was written compiled again; two workers
of one configuration compiling once. Worker processes run with
tests/neuron_serve_hooks on their path: it records each worker's
NEURON_RT_VISIBLE_CORES and can hold the stand-in's compile open (its docstring).
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from conftest import reference, tiny_model
from test_neuron_backend import NEEDS_NXDI_TRANSFORMERS, NXDI_TRANSFORMERS, STANDIN, standin, standin_any_transformers  # noqa: F401  (fixtures)

from disagg.clients.grpc_client import Client
from disagg.engine.backends.neuron import artifacts
from disagg.engine.backends.neuron.config import NeuronOptions, compiled_path
from disagg.engine.requests import Sampling
from disagg.rpc import startup
from disagg.tools.local_cluster import ClusterSpec, LocalCluster, NeuronPlacement
from disagg.tools.neuron_cores import CorePool, NotEnoughCores, WorkerCores, discover, parse_core_list, split

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOOKS = str(pathlib.Path(__file__).parent / "neuron_serve_hooks")
# Worker processes build NxDI configs on the stand-in, which (as NxDI 0.7-0.9) refuses transformers 5's.
needs_nxdi_transformers = pytest.mark.skipif(not NXDI_TRANSFORMERS, reason=NEEDS_NXDI_TRANSFORMERS)
COMPILE_LOG = "standin_compiles.txt"  # the stand-in appends a line per compile into the compiled directory


def compiles(directory: pathlib.Path) -> int:
    return len((directory / COMPILE_LOG).read_text().splitlines())


# -- NeuronCores -----------------------------------------------------------------------------------
def fake_sysfs(root: pathlib.Path, devices: int, cores: int) -> str:
    for d in range(devices):
        (root / f"neuron{d}").mkdir(parents=True)
        (root / f"neuron{d}" / "core_count").write_text(f"{cores}\n")
    return str(root)


def test_cores_are_read_from_the_drivers_sysfs_and_split_widest_tp_first(tmp_path):
    pool = discover(env={}, sysfs_root=fake_sysfs(tmp_path, devices=2, cores=2), neuron_ls="no-such-neuron-ls")
    assert pool.cores == (0, 1, 2, 3) and pool.source == f"{tmp_path}: 2 devices, 4 cores"
    workers = [WorkerCores("decode-0", 1), WorkerCores("decode-1", 1), WorkerCores("prefill-0", 2)]
    assert split(pool, workers) == {"prefill-0": "0-1", "decode-0": "2", "decode-1": "3"}


def test_an_override_or_the_launchers_own_cores_win_over_the_devices(tmp_path):
    sysfs = fake_sysfs(tmp_path, devices=1, cores=2)
    assert discover(8, env={}, sysfs_root=sysfs).cores == tuple(range(8))
    assert discover(env={"NEURON_RT_VISIBLE_CORES": "4-7"}, sysfs_root=sysfs) == CorePool((4, 5, 6, 7), "NEURON_RT_VISIBLE_CORES")
    assert discover(env={"NEURON_LOGICAL_NC_CONFIG": "2"}, sysfs_root=fake_sysfs(tmp_path / "trn2", 1, 8)).cores == (0, 1, 2, 3)
    assert split(CorePool((4, 5, 6, 7), "x"), [WorkerCores("decode-0", 2), WorkerCores("prefill-0", 2)]) == {"decode-0": "4-5", "prefill-0": "6-7"}
    assert parse_core_list("0-1,4") == (0, 1, 4)


def test_no_device_and_too_few_cores_are_refused_in_one_line(tmp_path):
    none = discover(env={}, sysfs_root=str(tmp_path / "absent"), neuron_ls="no-such-neuron-ls")
    assert none.cores == ()
    with pytest.raises(NotEnoughCores, match="no Neuron device found .* pass --neuron-cores"):
        split(none, [WorkerCores("decode-0", 1)])
    colocated = ClusterSpec(model="m", decode_workers=2, colocated=True, neuron=NeuronPlacement(CorePool((0, 1, 2, 3), "t"), prefill_tp=4, decode_tp=2))
    assert colocated.neuron_cores() == {"decode-0": "0-1", "decode-1": "2-3"}  # colocated: no prefill workers to place


def test_disagg_serve_refuses_workers_that_do_not_fit_before_starting_anything(capsys):
    from disagg.cli.main import main

    assert main(["serve", "--backend", "neuron", "--tp", "2", "--neuron-cores", "2", "--model", "/no/such/model"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no model made, no process started
    assert err == ("disagg serve: the workers need 4 NeuronCores (decode-0 tp 2, prefill-0 tp 2) and 2 are available (--neuron-cores); "
                   "lower --tp or the number of workers\n")


# -- compiled directories ----------------------------------------------------------------------------
def test_compiled_paths_are_keyed_by_nxdi_version_and_checkpoint_files(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x" * 8)
    options = NeuronOptions(model=str(model), compiled_root=str(tmp_path / "c"))
    first = compiled_path(options, "0.9.0")
    assert first == compiled_path(options, "0.9.0") and "-nxdi0.9.0-" in first.name
    assert compiled_path(options, "0.8.0") != first
    (model / "model.safetensors").write_bytes(b"y" * 16)  # a checkpoint replaced at the same path
    assert compiled_path(options, "0.9.0") != first


def load(tmp_path, **neuron):
    from disagg.engine.backends import load_backend

    options = {"tp_degree": 2, "compiled_root": str(tmp_path / "compiled"), **neuron}
    return load_backend("neuron", model=tiny_model("llama"), dtype="float32", max_seq_len=64, batch_size=2, neuron=options)


def only_directory(root: pathlib.Path) -> pathlib.Path:
    (path,) = root.iterdir()  # no partial, work or lock files left beside it
    return path


def test_a_compile_interrupted_after_model_pt_is_compiled_again(standin, tmp_path, monkeypatch):  # noqa: F811
    import neuronx_distributed_inference.models.standin_model as standin_model

    original = standin_model.StandInCausalLM.compile

    def killed_after_writing(self, path, *args, **kwargs):
        original(self, path, *args, **kwargs)  # config, model.pt (and the weights) all written ...
        raise KeyboardInterrupt("killed before compile() returned")  # ... and the process dies

    monkeypatch.setattr(standin_model.StandInCausalLM, "compile", killed_after_writing)
    with pytest.raises(KeyboardInterrupt):
        load(tmp_path)
    final = next(p for p in (tmp_path / "compiled").iterdir() if not p.name.endswith(".partial"))
    assert (artifacts.partial_path(final) / "model.pt").exists() and not artifacts.is_complete(final)
    monkeypatch.setattr(standin_model.StandInCausalLM, "compile", original)
    backend = load(tmp_path)
    assert only_directory(tmp_path / "compiled") == final and artifacts.is_complete(final)
    assert compiles(final) == 1  # this compile's log: the interrupted one's went with its directory
    ids = reference("llama").ids("The lighthouse keeper")
    assert backend.prefill(ids, Sampling()).first_token == reference("llama").greedy("The lighthouse keeper", 1)[0]


def test_a_directory_with_model_pt_but_no_marker_is_compiled_again(standin, tmp_path):  # noqa: F811
    load(tmp_path)
    path = only_directory(tmp_path / "compiled")
    (path / artifacts.COMPLETE_MARKER).unlink()  # what an older disagg, or one killed while sharding, left: model.pt, no marker
    (path / "stale-file").write_text("")
    assert (path / "model.pt").exists()
    load(tmp_path)
    assert only_directory(tmp_path / "compiled") == path and artifacts.is_complete(path) and not (path / "stale-file").exists()
    assert compiles(path) == 1  # the new compile's directory replaced the old one


# -- whole clusters ----------------------------------------------------------------------------------
def worker_env(tmp_path: pathlib.Path, gate: pathlib.Path | None = None) -> dict:
    records = tmp_path / "records"
    records.mkdir(exist_ok=True)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (HOOKS, STANDIN, os.environ.get("PYTHONPATH")) if p), "DISAGG_TEST_RECORD_DIR": str(records)}
    if gate is not None:
        env["DISAGG_TEST_COMPILE_GATE"] = str(gate)
    return env


def recorded_cores(tmp_path: pathlib.Path) -> dict[str, str]:
    """Worker name (from its --port-file) -> the NEURON_RT_VISIBLE_CORES it ran with."""
    out = {}
    for record in (tmp_path / "records").glob("*.json"):
        data = json.loads(record.read_text())
        port_file = data["argv"][data["argv"].index("--port-file") + 1]
        out[pathlib.Path(port_file).stem] = data["NEURON_RT_VISIBLE_CORES"]
    return out


class Lines:
    """A process's stdout, read on a thread so that a hang cannot hang the test (a guard, not a timing)."""

    def __init__(self, stream, limit: float = 900.0):
        self.queue: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        self.limit = limit
        threading.Thread(target=lambda: [self.queue.put(line) for line in stream] + [self.queue.put(None)], daemon=True).start()

    def until(self, marker: str | None) -> list[str]:
        """Lines up to the one containing marker (None: up to the end of the stream)."""
        deadline = time.monotonic() + self.limit
        while time.monotonic() < deadline:
            line = self.queue.get(timeout=deadline - time.monotonic())
            if line is None:
                assert marker is None, "the process ended before printing " + repr(marker) + ":\n" + "".join(self.seen)
                return self.seen
            self.seen.append(line)
            if marker is not None and marker in line:
                return self.seen
        raise AssertionError(f"no {marker!r} in time:\n" + "".join(self.seen))


@needs_nxdi_transformers
def test_disagg_serve_backend_neuron_splits_the_cores_compiles_once_and_serves(tmp_path):
    compiled = tmp_path / "compiled"
    command = [sys.executable, "-m", "disagg.cli.main", "serve", "--backend", "neuron", "--model", tiny_model("llama"), "--dtype", "float32",
               "--max-seq-len", "256", "--batch-size", "2", "--decode-workers", "2", "--prefill-tp", "2", "--neuron-cores", "4",
               "--neuron-compiled-path", str(compiled), "--port", "0", "--http-port", "-1", "--kv-transport", "grpc"]
    with open(tmp_path / "workers.log", "w") as log:
        serve = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **worker_env(tmp_path)}, stdout=subprocess.PIPE, stderr=log, text=True)
    output = Lines(serve.stdout)
    try:
        banner = output.until("Ctrl-C stops everything")
        assert "NeuronCores (--neuron-cores): prefill-0 0-1, decode-0 2, decode-1 3\n" in banner
        router = next(line.split(": ")[1].strip() for line in banner if "router (GenerationService)" in line)
        with Client(router, timeout=120) as client:
            for prompt in ("The lighthouse keeper climbed", "Snow fell on the hills"):
                assert client.complete(prompt, max_new_tokens=8).token_ids == reference("llama").greedy(prompt, 8)
        assert recorded_cores(tmp_path) == {"prefill-0": "0-1", "decode-0": "2", "decode-1": "3"}
        directories = sorted(compiled.iterdir())  # decode (two workers, one configuration) and prefill
        assert len(directories) == 2 and all(artifacts.is_complete(d) for d in directories)
        assert [compiles(d) for d in directories] == [1, 1]
    finally:
        serve.send_signal(signal.SIGINT)
        rest = output.until(None)
    assert serve.wait() == 0 and rest[-1] == "stopped: decode-0 exit 0, decode-1 exit 0, prefill-0 exit 0, router exit 0\n"


def neuron_cluster(tmp_path, progress=None, **spec) -> LocalCluster:
    """One prefill and one decode worker at tp 1 on a two-core instance (inf2.xlarge, trn1.2xlarge)."""
    placement = NeuronPlacement(CorePool((0, 1), "test"), prefill_tp=1, decode_tp=1)
    args = ["--max-seq-len", "256", "--neuron-compiled-path", str(tmp_path / "compiled"), "--kv-transport", "grpc"]
    spec = ClusterSpec(model=tiny_model("llama"), dtype="float32", batch_size=2, neuron=placement, worker_args=args, log_dir=str(tmp_path / "logs"), **spec)
    return LocalCluster(spec, progress=progress)


class EnvSet:
    """os.environ with extra variables while the cluster's processes start (they inherit it)."""

    def __init__(self, extra: dict):
        self.extra, self.before = extra, {}

    def __enter__(self):
        self.before = {k: os.environ.get(k) for k in self.extra}
        os.environ.update(self.extra)

    def __exit__(self, *exc):
        for k, v in self.before.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def wait_for_compiling(cluster: LocalCluster, names: list[str], starting: threading.Thread, longer_than: float = 0.0) -> dict[str, startup.StartupStatus]:
    """Polls the workers' published status until each is compiling (for longer than `longer_than` s)."""
    while True:
        assert starting.is_alive(), "the cluster's start ended before its workers compiled (their logs say why)"
        processes = [p for p in cluster.processes if p.name in names]
        statuses = {p.name: cluster.startup_status(p) for p in processes}
        if len(statuses) == len(names) and all(s and s.phase is startup.Phase.COMPILING and s.elapsed() > longer_than for s in statuses.values()):
            return statuses
        time.sleep(0.1)


@needs_nxdi_transformers
def test_a_compile_longer_than_the_start_timeout_is_waited_for(tmp_path):
    gate, lines = tmp_path / "gate", []
    cluster = neuron_cluster(tmp_path, progress=lines.append)
    timeout = 2.0
    with EnvSet(worker_env(tmp_path, gate)):
        started = threading.Thread(target=lambda: lines.append(cluster.start(timeout=timeout)), daemon=True)
        started.start()
        try:
            statuses = wait_for_compiling(cluster, ["decode-0", "prefill-0"], started, longer_than=3 * timeout)
            assert started.is_alive() and "for Neuron (tp 1, 3 KV lines, seq 256, float32)" in statuses["decode-0"].detail
            with grpc.insecure_channel(cluster.addresses("decode")[0]) as channel:  # the reason is visible to a caller too
                from disagg.v1 import worker_pb2 as wpb
                from disagg.v1 import worker_pb2_grpc as wgrpc

                with pytest.raises(grpc.RpcError) as error:
                    wgrpc.DecodeServiceStub(channel).GetLoad(wpb.LoadRequest(), timeout=10)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "not serving yet: compiling" in error.value.details()
            gate.write_text("")
            started.join()
            assert lines[-1] is cluster  # start() returned: no timeout while the workers compiled
            assert any(line.startswith("decode-0: compiling ") for line in lines[:-1])
            with Client(cluster.router_address, timeout=120) as client:
                assert client.complete("The lighthouse keeper", max_new_tokens=6).token_ids == reference("llama").greedy("The lighthouse keeper", 6)
        finally:
            gate.write_text("")
            cluster.stop()


@needs_nxdi_transformers
def test_a_stuck_compile_fails_the_start_and_a_killed_one_is_compiled_again(tmp_path):
    gate = tmp_path / "gate"  # never opened: the compiles never return
    cluster = neuron_cluster(tmp_path, stall_seconds=3.0)
    failures: list[Exception] = []

    def start():
        try:
            cluster.start(timeout=600)
        except Exception as exc:
            failures.append(exc)

    with EnvSet(worker_env(tmp_path, gate)):
        starting = threading.Thread(target=start, daemon=True)
        starting.start()
        try:
            statuses = wait_for_compiling(cluster, ["decode-0", "prefill-0"], starting)
            # Compiling is published before model.pt is written: stopped or killed sooner, a worker leaves none.
            while len([p for p in (tmp_path / "compiled").glob("*.partial") if (p / "model.pt").exists()]) < 2:
                assert starting.is_alive(), "the cluster's start ended before both workers wrote model.pt"
                time.sleep(0.05)
            os.kill(statuses["decode-0"].pid, signal.SIGSTOP)  # alive, but no longer making progress
            starting.join()
        finally:
            for p in cluster.processes:  # killed mid-compile: model.pt written, compile() not returned
                p.popen.kill()
            cluster.stop()
    assert len(failures) == 1 and isinstance(failures[0], TimeoutError), failures
    assert re.fullmatch(
        r"decode-0 is stuck: no heartbeat for \d+ s while compiling tiny-llama-\w+ for Neuron \(tp 1, 3 KV lines, seq 256, float32\) into .*: \d+ s",
        str(failures[0]),
    )
    compiled = tmp_path / "compiled"
    partial = [p for p in compiled.iterdir() if p.name.endswith(".partial")]
    assert len(partial) == 2 and all((p / "model.pt").exists() for p in partial)
    assert not any(artifacts.is_complete(p) for p in compiled.iterdir())

    again = neuron_cluster(tmp_path)
    with EnvSet(worker_env(tmp_path)):
        again.start(timeout=300)
    try:
        with Client(again.router_address, timeout=120) as client:
            assert client.complete("Snow fell on the hills", max_new_tokens=6).token_ids == reference("llama").greedy("Snow fell on the hills", 6)
        directories = sorted(compiled.iterdir())
        assert len(directories) == 2 and all(artifacts.is_complete(d) and compiles(d) == 1 for d in directories)
    finally:
        again.stop()


def test_neuron_validate_imports_and_parses_its_arguments():
    """It cannot run here (no Neuron device); its imports and flags can."""
    import importlib.util

    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "neuron_validate.py"), "--help"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "disagg serve --backend neuron" in result.stdout and "--skip-compiles" in result.stdout
    spec = importlib.util.spec_from_file_location("neuron_validate", ROOT / "scripts" / "neuron_validate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--model", "/models/Llama-3.2-1B", "--serve-tp", "1", "--neuron-cores", "2", "--skip-compiles"])
    assert (args.model, args.tp_degree, args.serve_tp, args.neuron_cores, args.skip_compiles, args.skip_serve) == ("/models/Llama-3.2-1B", 2, 1, 2, True, False)

"""Flags that shape a worker's process: CPU lists and the device thread's pinning."""

import argparse
import os

import pytest

from decode_worker.__main__ import parse_config
from decode_worker.decode_loop import DecodeLoop
from disagg.cli.flags import cpu_list


def test_cpu_lists_parse_and_bad_ones_are_refused():
    assert cpu_list("1") == {1}
    assert cpu_list("0,2") == {0, 2}
    assert cpu_list("2-4,7") == {2, 3, 4, 7}
    for bad in ("", "a", "1-x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cpu_list(bad)


def test_only_the_device_thread_is_pinned(llama_path):
    from disagg.engine.backends import load_backend

    process_cpus = os.sched_getaffinity(0)
    device_cpu = min(process_cpus)
    config = parse_config(["--model", llama_path, "--device-cpus", str(device_cpu)])
    assert config.device_cpus == {device_cpu}
    decode_loop = DecodeLoop(load_backend("torch", model=llama_path, dtype="float32"), lambda events: None, lambda keys: None, device_cpus=config.device_cpus)
    decode_loop.start()
    try:
        assert decode_loop.run_on_device(os.sched_getaffinity, 0).result(timeout=30) == {device_cpu}
        assert os.sched_getaffinity(0) == process_cpus  # gRPC and KV receive keep the process's CPUs
    finally:
        decode_loop.stop()


def test_serve_gives_prefill_workers_the_cores_and_decode_workers_a_share(monkeypatch):
    from disagg.tools.local_cluster import ClusterSpec

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    spec = ClusterSpec(model="m", prefill_workers=2, decode_workers=2)
    assert (spec.worker_threads("prefill"), spec.worker_threads("decode")) == (4, 2)
    assert ClusterSpec(model="m", colocated=True, decode_workers=2).worker_threads("decode") == 4
    assert ClusterSpec(model="m", threads_per_worker=3).worker_threads("prefill") == 3
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert (ClusterSpec(model="m").worker_threads("prefill"), ClusterSpec(model="m").worker_threads("decode")) == (2, 1)


@pytest.mark.parametrize("preset,expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_prefill_worker_sets_openmp_threads_to_sleep_before_torch_loads_unless_told(preset, expected):
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    probe = "import prefill_worker.__main__, os; print(os.environ['OMP_WAIT_POLICY'])"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.strip() == expected


def test_serve_lowers_its_decode_workers_priority_only_beside_prefill_workers_on_the_cpu():
    from disagg.cli.main import build_parser, serve_spec
    from disagg.tools.local_cluster import DECODE_NICE

    def nice(*flags: str) -> dict:
        return serve_spec(build_parser().parse_args(["serve", "--http-port", "-1", *flags])).nice

    assert nice() == {"decode": DECODE_NICE} and DECODE_NICE > 0
    assert nice("--decode-nice", "3") == {"decode": 3}
    assert nice("--decode-nice", "0") == {}
    assert nice("--colocated") == {}  # the decode workers run the prefills themselves
    assert nice("--backend", "neuron", "--neuron-cores", "2") == {}  # prefills run on NeuronCores
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--decode-nice", "20"])

"""Each worker reports what it holds in memory (disagg/engine/memory.py): in GetLoad,
its metrics and its start-up line; shared pages counted as the kernel counts them."""

from __future__ import annotations

import mmap
import subprocess
import sys
import urllib.request

import grpc
from conftest import start_cluster
from prometheus_client.parser import text_string_to_metric_families

from disagg.engine.memory import read_process_memory
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

MIB = 1 << 20


def test_a_file_two_processes_map_is_shared_and_each_pays_half_in_its_pss(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (64 * MIB))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        sum(mapped[i] for i in range(0, len(mapped), 4096))  # every page resident in this process
        alone = read_process_memory()
        assert alone.resident_bytes >= 64 * MIB and alone.proportional_bytes <= alone.resident_bytes
        script = ("import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
                  "sum(m[i] for i in range(0, len(m), 4096)); print('mapped', flush=True); sys.stdin.read()")
        other = subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout.readline().strip() == "mapped"
            together = read_process_memory()
            assert together.shared_bytes - alone.shared_bytes >= 60 * MIB  # now mapped by both
            assert alone.proportional_bytes - together.proportional_bytes >= 28 * MIB  # half of 64 MiB is the other's now
            assert read_process_memory(other.pid).shared_bytes >= 60 * MIB
        finally:
            other.stdin.close()
            other.wait()


def test_workers_report_their_memory_in_get_load_and_their_metrics(cluster_logs):
    cluster = start_cluster(cluster_logs / "memory-report", "llama", prefill=1, decode=1, batch_size=2)
    try:
        for process in cluster.processes[:2]:
            role = process.name.split("-")[0]
            with urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5) as page:
                samples = {s.name: s.value for f in text_string_to_metric_families(page.read().decode()) for s in f.samples}
            with grpc.insecure_channel(process.address) as channel:
                stub = wgrpc.PrefillServiceStub(channel) if role == "prefill" else wgrpc.DecodeServiceStub(channel)
                load = stub.GetLoad(wpb.LoadRequest(), timeout=5)
            actual = read_process_memory(process.popen.pid)
            # torch and a model loaded: well past 100 MiB resident; PSS at most RSS; both near what /proc says now.
            assert 100 * MIB < load.resident_bytes and 0 < load.proportional_bytes <= load.resident_bytes, load
            assert abs(load.resident_bytes - actual.resident_bytes) < 0.2 * actual.resident_bytes
            assert abs(samples[f"disagg_{role}_resident_bytes"] - actual.resident_bytes) < 0.2 * actual.resident_bytes
            assert 0 < samples[f"disagg_{role}_proportional_bytes"] <= samples[f"disagg_{role}_resident_bytes"]
            logs = list((cluster_logs / "memory-report").glob(f"*/{process.name}.log"))
            assert len(logs) == 1 and any("serving on port" in line and "; memory: resident " in line for line in logs[0].read_text().splitlines())
    finally:
        cluster.stop()

"""The NIXL KV transport through real processes: the decode worker reads each
prompt's KV from the prefill worker's staging buffer straight into the slot."""

from __future__ import annotations

import asyncio

import pytest
from conftest import assert_nothing_held, kv_bytes_received, reference, start_cluster, tiny_model
from polling import wait_for

from disagg.clients.grpc_client import AsyncClient
from disagg.kv_transport import nixl_transport
from disagg.tools.tinymodel import paragraphs

pytestmark = pytest.mark.skipif(not nixl_transport.available(), reason="NIXL is not installed (pip install nixl-cu12)")

NIXL = ["--kv-transport", "nixl"]


def cases(count: int) -> list[tuple[str, int]]:
    texts = paragraphs()
    return [(" ".join(texts[i % len(texts)].split()[: 3 + (i * 5) % 37]), 4 + (i * 7) % 30) for i in range(count)]


def run_all(cluster, work: list[tuple[str, int]]):
    async def run():
        async with AsyncClient(cluster.router_address, timeout=120) as client:
            return await asyncio.gather(*(client.complete(p, max_new_tokens=n) for p, n in work), return_exceptions=True)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def nixl_cluster(cluster_logs):
    cluster = start_cluster(cluster_logs, "llama", prefill=2, decode=2, batch_size=4, worker_args=NIXL)
    yield cluster
    cluster.stop()


def test_concurrent_requests_through_nixl_equal_generate(nixl_cluster):
    ref = reference("llama")
    work = cases(16)
    for (prompt, n), result in zip(work, run_all(nixl_cluster, work)):
        assert not isinstance(result, Exception), result
        assert result.token_ids == ref.greedy(prompt, n), prompt
    assert_nothing_held(nixl_cluster)
    assert kv_bytes_received(nixl_cluster, "nixl") > 0 and kv_bytes_received(nixl_cluster, "grpc") == 0


def test_a_prefill_worker_on_nixl_pushes_over_grpc_to_a_decode_worker_without_it(cluster_logs):
    ref = reference("llama")
    # The decode worker says grpc: under the default (auto) it would load NIXL too.
    cluster = start_cluster(cluster_logs, "llama", prefill_args=NIXL, decode_args=["--kv-transport", "grpc"])
    try:
        work = cases(4)
        for (prompt, n), result in zip(work, run_all(cluster, work)):
            assert result.token_ids == ref.greedy(prompt, n), prompt
        assert_nothing_held(cluster)
        assert kv_bytes_received(cluster, "grpc") > 0 and kv_bytes_received(cluster, "nixl") == 0
    finally:
        cluster.stop()


def test_cancelled_requests_during_nixl_transfers_leave_nothing_held(nixl_cluster):
    ref = reference("llama")
    work = cases(12)

    def on_the_workers() -> bool:  # a reservation, a transfer, a running row or a queued prefill
        return any(map(any, nixl_cluster.held().values()))

    async def run():
        async with AsyncClient(nixl_cluster.router_address, timeout=120) as client:
            # The half that is cancelled streams long (300 tokens, EOS ignored), so it is still in
            # flight when a worker is seen holding work, on a fast host too; the other half is checked exact.
            tasks = [asyncio.create_task(client.complete(p, max_new_tokens=300, ignore_eos=True) if i % 2 == 0 else client.complete(p, max_new_tokens=n))
                     for i, (p, n) in enumerate(work)]
            await asyncio.to_thread(wait_for, on_the_workers, 30, "a request held by a worker")
            cancelled = [task.cancel() for task in tasks[::2]]
            return cancelled, await asyncio.gather(*tasks, return_exceptions=True)

    cancelled, results = asyncio.run(run())
    assert any(cancelled), "every request finished before its cancel: nothing was cancelled mid-way"
    for (prompt, n), result in list(zip(work, results))[1::2]:
        assert result.token_ids == ref.greedy(prompt, n), prompt
    assert_nothing_held(nixl_cluster, within=10)


def test_a_nixl_backend_that_does_not_load_stops_the_worker_in_one_line_or_falls_back_under_auto(cluster_logs):
    from disagg.tools.local_cluster import ClusterSpec, LocalCluster

    # PyPI's NIXL ships a LIBFABRIC plugin that cannot load without libfabric >= 1.21 and CUDA.
    logs = cluster_logs / "nixl-libfabric"
    cluster = LocalCluster(ClusterSpec(model=tiny_model("llama"), dtype="float32", compile=False, threads_per_worker=1, log_dir=str(logs)))
    try:
        lenient = cluster.add_worker("decode", ["--nixl-backend", "LIBFABRIC"])  # --kv-transport auto
        strict = cluster.add_worker("prefill", ["--kv-transport", "nixl", "--nixl-backend", "LIBFABRIC"])  # its --decode: lenient
        assert strict.popen.wait(120) == 2
        last_line = (logs / f"{strict.name}.log").read_text().strip().splitlines()[-1]
        assert last_line == "prefill_worker: --kv-transport nixl: NIXL's LIBFABRIC backend did not load"
        cluster.wait_serving(120, lenient.address)
        assert "KV transport: gRPC stream" in (logs / f"{lenient.name}.log").read_text()
    finally:
        cluster.stop()


def test_a_prompts_kv_is_read_while_later_prefills_hold_the_device_thread(nixl_cluster):
    """The NIXL hand-off of a finished prompt never waits for the prefills queued
    behind it: its staging once queued on the model thread after all of them.
    The prefill worker runs in a process of its own (tests/queued_prefill_probe.py)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    ref = reference("llama")
    ids = ref.ids(cases(1)[0][0])
    decode = next(p for p in nixl_cluster.processes if p.name.startswith("decode"))
    probe = pathlib.Path(__file__).with_name("queued_prefill_probe.py")
    root = str(probe.parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    args = json.dumps({"model": tiny_model("llama"), "decode": decode.address, "prompt_ids": ids, "max_new_tokens": 3})
    done = subprocess.run([sys.executable, str(probe), args], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["model_thread_held"] and result["kv_bytes"] > 0
    assert result["tokens"] == ref.greedy(ids, 3, ignore_eos=True)
    assert_nothing_held(nixl_cluster)

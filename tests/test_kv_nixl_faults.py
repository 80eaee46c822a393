"""Faults in the NIXL hand-off, through real processes: a prefill side that dies
before the read, a staging buffer reused during the read, a decode worker
killed while the prefill worker waits on its PullKv. Each fails with a clear
status, holds nothing afterwards, and the next transfer is exact.

The staging side in the first two is a real engine prefill staged by our
NixlSource in a process of its own (STAGER), so the test decides when it dies
or reuses its buffer. This process never loads NIXL (see nixl_transport.available).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from conftest import reference, tiny_model
from polling import wait_for

from disagg.kv_transport import nixl_transport
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

pytestmark = pytest.mark.skipif(not nixl_transport.available(), reason="NIXL is not installed (pip install nixl-cu12)")

PROMPT = "The lighthouse keeper climbed the stairs"
NEW_TOKENS = 8

# A prefill worker's staging side, alone: prefill on the engine, stage with
# NixlSource, announce where; then "reuse" overwrites the buffer under a new
# generation, as the next prompt would.
STAGER = r"""
import json, sys
from disagg.engine.backends import load_backend
from disagg.engine.requests import Sampling
from disagg.kv_transport.layout import KvGeometry
from disagg.kv_transport.nixl_transport import HEADER_BYTES, NixlSource

model, ids, metadata_file = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3]
backend = load_backend("torch", model=model, dtype="float32", device="cpu", max_seq_len=0, global_topk=0)
result = backend.prefill(ids, Sampling())
info = backend.info
source = NixlSource(KvGeometry(info.num_layers, info.kv_heads, info.head_dim, 4, info.max_seq_len), max_tokens=len(ids), buffers=1)
buffer = source.buffers[0]
generation = buffer.next_generation()
for layer, (keys, values) in enumerate(result.layers):
    source.stage_layer(buffer, layer, keys, values)
open(metadata_file, "wb").write(source.metadata)
staged = {"agent_name": source.name, "address": buffer.address, "generation": generation, "first_token": result.first_token, "num_layers": info.num_layers}
print(json.dumps(staged), flush=True)
with source.reading():  # the test's reads may come at any time
    for line in sys.stdin:
        if line.strip() == "reuse":
            generation = buffer.next_generation()
            buffer.tensor[HEADER_BYTES:].fill_(0x7F)
            print(json.dumps({"generation": generation}), flush=True)
"""


class Stager:
    def __init__(self, tmp_path, model: str, ids: list[int]):
        self.metadata_file = tmp_path / f"stager-{time.monotonic_ns()}.md"
        command = [sys.executable, "-c", STAGER, model, ",".join(map(str, ids)), str(self.metadata_file)]
        self.popen = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ids = ids
        self._staged: dict | None = None

    @property
    def staged(self) -> dict:
        """Where the KV waits; blocks until the stager has staged it (they start side by side)."""
        if self._staged is None:
            self._staged = self._answer()
        return self._staged

    def _answer(self) -> dict:
        for line in self.popen.stdout:  # NIXL logs to stdout too
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"the stager exited with {self.popen.wait()}")

    def reuse(self) -> int:
        assert self.staged
        self.popen.stdin.write("reuse\n")
        self.popen.stdin.flush()
        return self._answer()["generation"]

    def pull_request(self, reservation_id: str, generation: int | None = None) -> wpb.PullKvRequest:
        s = self.staged
        return wpb.PullKvRequest(
            reservation_id=reservation_id,
            agent_name=s["agent_name"],
            agent_metadata=self.metadata_file.read_bytes(),
            address=s["address"],
            prompt_len=len(self.ids),
            num_layers=s["num_layers"],
            first_token=s["first_token"],
            generation=s["generation"] if generation is None else generation,
        )

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()


@pytest.fixture(scope="module")
def nixl_workers(cluster_logs):
    """A NIXL prefill worker and two NIXL decode workers, no router (the test plays it)."""
    from disagg.tools.local_cluster import ClusterSpec, LocalCluster, reserve_port

    spec = ClusterSpec(model=tiny_model("llama"), dtype="float32", compile=False, threads_per_worker=1, log_dir=str(cluster_logs / "nixl-faults"),
                       worker_args=["--kv-transport", "nixl"])
    cluster = LocalCluster(spec)
    try:
        decode = cluster.add_worker("decode", ["--lease-seconds", "30", "--batch-size", "2"])
        spare = reserve_port()  # a decode worker a test starts later: in the prefill worker's pool (--decode) from the start
        prefill = cluster.add_worker("prefill", ["--decode", decode.address, "--decode", f"127.0.0.1:{spare.getsockname()[1]}"])
        for worker in (prefill, decode):
            cluster.wait_serving(120, worker.address)
        yield cluster, prefill.address, decode.address, spare
    finally:
        cluster.stop()


def reserve(stub, prompt_len: int, request_id: str = "t"):
    stopping = wpb.WorkerStopping(max_new_tokens=NEW_TOKENS)
    call = stub.Decode(wpb.DecodeRequest(request_id=request_id, prompt_len=prompt_len, sampling=wpb.WorkerSampling(top_p=1.0), stopping=stopping), timeout=60)
    return call, next(call).reserved.reservation_id


def decoded_tokens(call) -> list[int]:
    return [t for event in call for t in event.tokens.token_ids]


def held(stub) -> tuple[int, int, int]:
    load = stub.GetLoad(wpb.LoadRequest(), timeout=5)
    return load.reservations, load.inflight_transfers, load.slots_in_use


def test_a_staging_side_that_died_fails_the_read_and_a_retry_from_another_is_exact(nixl_workers, tmp_path):
    _, _, decode_address, _ = nixl_workers
    ref = reference("llama")
    ids = ref.ids(PROMPT)
    with grpc.insecure_channel(decode_address) as channel:
        decode = wgrpc.DecodeServiceStub(channel)
        dead, live = Stager(tmp_path, tiny_model("llama"), ids), Stager(tmp_path, tiny_model("llama"), ids)
        assert dead.staged and live.staged  # both ready before the lease starts
        call, reservation = reserve(decode, len(ids))
        request = dead.pull_request(reservation)
        dead.kill()  # its registered memory is gone before the read
        with pytest.raises(grpc.RpcError) as error:
            decode.PullKv(request, timeout=30)
        assert error.value.code() == grpc.StatusCode.ABORTED and "KV read" in error.value.details(), error.value
        assert held(decode) == (1, 0, 1)  # the reservation waits for KV again
        try:
            ack = decode.PullKv(live.pull_request(reservation), timeout=30)
            config = ref.model.config
            head_dim = config.hidden_size // config.num_attention_heads
            assert ack.bytes_received == 2 * len(ids) * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # keys and values, float32
            assert [live.staged["first_token"], *decoded_tokens(call)] == ref.greedy(PROMPT, NEW_TOKENS)
        finally:
            live.kill()
        wait_for(lambda: held(decode) == (0, 0, 0), what="the decode worker holding nothing")


def test_a_staging_buffer_reused_during_the_read_is_refused_by_its_generation(nixl_workers, tmp_path):
    _, _, decode_address, _ = nixl_workers
    ids = reference("llama").ids(PROMPT)
    with grpc.insecure_channel(decode_address) as channel:
        decode = wgrpc.DecodeServiceStub(channel)
        stager = Stager(tmp_path, tiny_model("llama"), ids)
        assert stager.staged  # ready before the lease starts
        call, reservation = reserve(decode, len(ids))
        try:
            staged_under = stager.staged["generation"]
            reused_under = stager.reuse()  # another prompt's bytes now, as after a buffer went back to the pool
            with pytest.raises(grpc.RpcError) as error:
                decode.PullKv(stager.pull_request(reservation, staged_under), timeout=30)
            assert error.value.code() == grpc.StatusCode.ABORTED, error.value
            assert f"generation {staged_under} -> {reused_under}" in error.value.details()
            assert held(decode) == (1, 0, 1)  # nothing committed: the reservation waits for KV again
        finally:
            stager.kill()
        call.cancel()
        wait_for(lambda: held(decode) == (0, 0, 0), what="the decode worker holding nothing")


def test_a_decode_worker_killed_during_the_pull_fails_the_prefill_and_frees_its_staging(nixl_workers):
    cluster, prefill_address, decode_address, spare = nixl_workers
    ref = reference("llama")
    ids = ref.ids(PROMPT)
    doomed = cluster.add_worker("decode", ["--batch-size", "1", "--port", str(spare.getsockname()[1])])
    cluster.wait_serving(120, doomed.address)
    with grpc.insecure_channel(prefill_address) as prefill_channel, grpc.insecure_channel(doomed.address) as doomed_channel:
        prefill = wgrpc.PrefillServiceStub(prefill_channel)
        _, reservation = reserve(wgrpc.DecodeServiceStub(doomed_channel), len(ids))
        doomed.popen.send_signal(signal.SIGSTOP)  # it holds the reservation and answers nothing
        outcome = {}

        def run_prefill():
            target = wpb.KvTarget(address=doomed.address, reservation_id=reservation)
            request = wpb.PrefillRequest(request_id="doomed", token_ids=ids, sampling=wpb.WorkerSampling(top_p=1.0), kv_target=target)
            try:
                outcome["events"] = list(prefill.Prefill(request, timeout=60))
            except grpc.RpcError as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=run_prefill)
        thread.start()
        wait_for(lambda: prefill.GetLoad(wpb.LoadRequest(), timeout=5).inflight_transfers == 1, within=30)  # staged, PullKv sent
        doomed.popen.send_signal(signal.SIGKILL)
        thread.join(60)
        assert "error" in outcome and outcome["error"].code() == grpc.StatusCode.ABORTED, outcome
        assert f"KV pull by {doomed.address} failed" in outcome["error"].details()
        load = prefill.GetLoad(wpb.LoadRequest(), timeout=5)
        assert (load.queued, load.inflight_transfers) == (0, 0)

        # Both staging buffers came back: three prompts in a row through the live decode worker are exact.
        with grpc.insecure_channel(decode_address) as channel:
            decode = wgrpc.DecodeServiceStub(channel)
            for n in range(3):
                call, reservation = reserve(decode, len(ids), request_id=f"after-{n}")
                target = wpb.KvTarget(address=decode_address, reservation_id=reservation)
                request = wpb.PrefillRequest(request_id=f"after-{n}", token_ids=ids, sampling=wpb.WorkerSampling(top_p=1.0), kv_target=target)
                events = list(prefill.Prefill(request, timeout=60))
                first = events[0].first_token.token_id
                assert events[1].kv_sent.bytes > 0
                assert [first, *decoded_tokens(call)] == ref.greedy(PROMPT, NEW_TOKENS)
            wait_for(lambda: held(decode) == (0, 0, 0), what="the decode worker holding nothing")

"""KV goes only to the decode pool: a prefill worker refuses a kv_target outside its --decode targets
before any work and never dials it; a target in the pool works; its channels stay bounded
(prefill_worker/peers.py, prefill_worker/channels.py)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from conftest import assert_nothing_held, start_cluster

from disagg.clients.grpc_client import Client
from disagg.rpc.discovery import LookupFailed
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc
from prefill_worker import peers as peers_module
from prefill_worker.channels import ChannelCache
from prefill_worker.peers import DecodePeers

PROMPT = "The lighthouse keeper"


@pytest.fixture(scope="module")
def cluster(cluster_logs):
    cluster = start_cluster(cluster_logs, "llama")
    yield cluster
    cluster.stop()


def prefill_request(ids: list[int], address: str, reservation: str = "r-outside") -> wpb.PrefillRequest:
    return wpb.PrefillRequest(request_id="kv-peers", token_ids=ids, sampling=wpb.WorkerSampling(top_p=1.0),
                              kv_target=wpb.KvTarget(address=address, reservation_id=reservation))


def test_a_kv_target_outside_the_pool_is_refused_never_dialled_and_the_worker_keeps_serving(cluster, llama_ref):
    ids = llama_ref.ids(PROMPT)
    outsider = socket.create_server(("127.0.0.1", 0))  # listens: a dial would complete here
    outsider.setblocking(False)
    port = outsider.getsockname()[1]
    with outsider, grpc.insecure_channel(cluster.addresses("prefill")[0]) as channel:
        prefill = wgrpc.PrefillServiceStub(channel)
        for address in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::ffff:127.0.0.1]:{port}"):
            with pytest.raises(grpc.RpcError) as refused:
                list(prefill.Prefill(prefill_request(ids, address), timeout=30))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, address
            assert refused.value.details().startswith("kv_target.address: ") and address in refused.value.details()
        with pytest.raises(grpc.RpcError) as malformed:
            list(prefill.Prefill(prefill_request(ids, f"dns:///localhost:{port}"), timeout=30))
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_target.address" in malformed.value.details()
        assert_nothing_held(cluster)
        with Client(cluster.router_address, timeout=60) as client:  # the worker keeps serving
            assert client.complete(PROMPT, max_new_tokens=8).token_ids == llama_ref.greedy(PROMPT, 8)
        with pytest.raises(BlockingIOError):
            outsider.accept()  # no connection was ever made to the outsider
    assert_nothing_held(cluster)


def test_a_kv_target_in_the_pool_gets_the_kv_and_decodes_exactly(cluster, llama_ref):
    ids = llama_ref.ids(PROMPT)
    (decode_address,) = cluster.addresses("decode")
    with grpc.insecure_channel(cluster.addresses("prefill")[0]) as prefill_channel, grpc.insecure_channel(decode_address) as decode_channel:
        stopping = wpb.WorkerStopping(max_new_tokens=6)
        request = wpb.DecodeRequest(request_id="kv-peers", prompt_len=len(ids), sampling=wpb.WorkerSampling(top_p=1.0), stopping=stopping)
        call = wgrpc.DecodeServiceStub(decode_channel).Decode(request, timeout=60)
        reservation = next(call).reserved.reservation_id
        events = list(wgrpc.PrefillServiceStub(prefill_channel).Prefill(prefill_request(ids, decode_address, reservation), timeout=60))
        assert events[1].kv_sent.bytes > 0
        tokens = [events[0].first_token.token_id] + [t for event in call for t in event.tokens.token_ids]
    assert tokens == llama_ref.greedy(PROMPT, 6)
    assert_nothing_held(cluster)


def test_a_prefill_worker_without_a_decode_pool_does_not_start():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "prefill_worker", "--port", "0", "--metrics-port", "-1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("prefill_worker: error: --decode is required")


# -- the pool, in process ------------------------------------------------------------------
class FakeDns:
    def __init__(self, answer: set[str]):
        self.answer, self.lookups, self.fail = answer, 0, False

    async def __call__(self, target) -> frozenset[str]:
        self.lookups += 1
        if self.fail:
            raise LookupFailed("SERVFAIL")
        return frozenset(f"{host}:{target.port}" for host in self.answer)


def refused(peers: DecodePeers, address: str) -> grpc.StatusCode | None:
    try:
        asyncio.run(peers.admit(address))
    except Exception as exc:  # RequestError
        return exc.code
    return None


def test_a_fixed_host_target_admits_its_name_and_addresses_and_nothing_else():
    peers = DecodePeers(("localhost:5", "10.0.0.7:6"))
    for address in ("localhost:5", "LOCALHOST:5", "127.0.0.1:5", "10.0.0.7:6"):
        assert refused(peers, address) is None, address
    for address in ("127.0.0.2:5", "localhost:6", "10.0.0.7:5", "decode.example:5"):
        assert refused(peers, address) == grpc.StatusCode.PERMISSION_DENIED, address
    assert refused(peers, "not-an-address") == grpc.StatusCode.INVALID_ARGUMENT


def test_a_dns_pool_is_resolved_again_on_a_miss_and_a_failed_lookup_keeps_the_last_answer(monkeypatch):
    monkeypatch.setattr(peers_module, "MISS_REFRESH_SECONDS", 0.0)
    dns = FakeDns({"10.0.0.1"})
    changes = []

    async def run():
        peers = DecodePeers(("dns:///decode.test:7",), resolver=dns)
        peers.on_change = changes.append
        assert await peers.admit("10.0.0.1:7") == "10.0.0.1:7"
        dns.answer = {"10.0.0.1", "10.0.0.2"}  # a pod came up
        assert await peers.admit("10.0.0.2:7") == "10.0.0.2:7"
        dns.fail = True  # a DNS blip does not empty the pool
        with pytest.raises(Exception) as outside:
            await peers.admit("10.0.0.3:7")
        assert outside.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert await peers.admit("10.0.0.2:7") == "10.0.0.2:7"
        dns.fail, dns.answer = False, {"10.0.0.2"}  # a pod left
        await peers.refresh()
        lookups = dns.lookups
        await asyncio.gather(*(peers.admit("10.0.0.9:7") for _ in range(5)), return_exceptions=True)
        assert dns.lookups == lookups + 1  # concurrent misses share one lookup

    asyncio.run(run())
    assert changes == [frozenset({"10.0.0.1:7"}), frozenset({"10.0.0.1:7", "10.0.0.2:7"}), frozenset({"10.0.0.2:7"})]


# -- the channel cache ---------------------------------------------------------------------
class FakeChannel:
    def __init__(self, address: str, closed: list[str]):
        self.address, self._closed = address, closed

    async def close(self) -> None:
        self._closed.append(self.address)


def test_the_channel_cache_stays_bounded_and_closes_a_channel_only_once_no_send_holds_it():
    closed: list[str] = []

    async def run():
        cache = ChannelCache(lambda address: FakeChannel(address, closed), capacity=3)
        busy = cache.hold("a:1")  # a send in flight on a:1, the least recently used
        for n in range(2, 10):
            cache.hold(f"a:{n}")
            cache.release(f"a:{n}")
            assert len(cache) <= 3 + 1  # the capacity, plus the channel a send holds
        await cache.closes_done()
        assert "a:1" not in closed and cache.get("a:1") is busy
        assert cache.addresses() == ["a:1", "a:8", "a:9"]
        cache.retain(frozenset({"a:9"}))  # a:1 and a:8 left the pool
        await cache.closes_done()
        assert "a:8" in closed and "a:1" not in closed  # still held
        cache.release("a:1")
        await cache.close()
        assert cache.addresses() == []

    asyncio.run(run())
    assert sorted(closed) == sorted(f"a:{n}" for n in range(1, 10))  # each closed exactly once

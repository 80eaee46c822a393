"""Worker failure and graceful shutdown, with real processes and real signals."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import urllib.request

import grpc
import pytest
from conftest import assert_nothing_held, start_cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import wait_for
from prometheus_client.parser import text_string_to_metric_families

from disagg.clients.grpc_client import Client
from disagg.engine.faults import TEST_HOLD_DECODE_STEP
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

LONG_PROMPT = "The ship's captain looked at the stars"
# Two whole KV blocks and more: a second stream of it reads the first one's cached blocks.
SHARED_PROMPT = LONG_PROMPT + " on a cold night far from the harbour, counting the hours until dawn, the first gulls and the smell of bread"


HELD_AFTER_STEPS = 20  # held_cluster: each decode worker's steps after this many wait for the release file


@pytest.fixture
def cluster(cluster_logs, request):
    # With every worker of a role gone a request waits --worker-wait-seconds for one before UNAVAILABLE: short here.
    wait = ["--worker-wait-seconds", "1"]
    cluster = start_cluster(cluster_logs / request.node.name, "llama", prefill=2, decode=2, batch_size=4, http_port=0, router_args=wait)
    yield cluster
    cluster.stop()


def hold_decode_steps(monkeypatch, tmp_path):
    """The path whose creation releases the decode steps after HELD_AFTER_STEPS of the workers started
    from here on (faults.TEST_HOLD_DECODE_STEP): a stream the test acts on is certainly still running
    then, however fast the host (300 tiny-model tokens take well under a second on a fast one)."""
    release = tmp_path / "release-decode-steps"
    monkeypatch.setenv(TEST_HOLD_DECODE_STEP, f"after={HELD_AFTER_STEPS},until={release}")
    return release


@pytest.fixture
def held_cluster(cluster_logs, request, tmp_path, monkeypatch):
    """The cluster above, its decode steps held (hold_decode_steps) until the returned path exists."""
    release = hold_decode_steps(monkeypatch, tmp_path)
    wait = ["--worker-wait-seconds", "1"]
    cluster = start_cluster(cluster_logs / request.node.name, "llama", prefill=2, decode=2, batch_size=4, http_port=0, router_args=wait)
    yield cluster, release
    release.touch()
    cluster.stop()


def first_tokens(stream, count: int) -> list[int]:
    """At least count tokens' chunks read (a slow reader's chunks are merged, so chunks != tokens)."""
    tokens: list[int] = []
    while len(tokens) < count:
        tokens += next(stream).token_ids
    return tokens


def decode_metric(process, name: str) -> float:
    text = urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def active_decode_worker(cluster) -> str:
    for name in ("decode-0", "decode-1"):
        with grpc.insecure_channel(cluster.process(name).address) as channel:
            if wgrpc.DecodeServiceStub(channel).GetLoad(wpb.LoadRequest(), timeout=5).active:
                return name
    raise AssertionError("no decode worker is running the request")


def stream_across_a_killed_decode_worker(cluster, release, client, prompt: str, max_new_tokens: int, while_held=None):
    """A stream of prompt (ignore_eos) whose decode worker, held mid-stream (hold_decode_steps), is killed once
    while_held(victim) has run; the steps are then released. Its tokens, read to the end, and its last chunk."""
    stream = client.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
    received = first_tokens(stream, 5)
    victim = active_decode_worker(cluster)
    if while_held is not None:
        while_held(victim)
    cluster.signal(victim, signal.SIGKILL)
    cluster.process(victim).popen.wait()
    release.touch()
    rest = list(stream)
    return received + [t for chunk in rest for t in chunk.token_ids], rest[-1]


def wait_not_serving(address: str, within: float = 30.0) -> None:
    """Until the server's health says NOT_SERVING (its drain has begun)."""
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING,
                 within, f"{address} saying NOT_SERVING after SIGTERM")


def wait_router_counts(cluster, decode: int, within: float = 60.0) -> None:
    """Until the router reports this many healthy decode workers (GetModelInfo)."""
    with Client(cluster.router_address, timeout=5) as client:
        wait_for(lambda: client.model_info().decode_workers == decode, within, f"the router counting {decode} decode workers")


def reserved_on_decode(cluster) -> bool:
    """Whether a decode worker holds a reservation: the router has admitted the request and
    gone on to its prefill (the slot is reserved before any prefill is sent)."""
    for name in ("decode-0", "decode-1"):
        with grpc.insecure_channel(cluster.process(name).address) as channel:
            if wgrpc.DecodeServiceStub(channel).GetLoad(wpb.LoadRequest(), timeout=5).reservations:
                return True
    return False


def first_choice_prefill(cluster) -> str:
    """The prefill worker that ran the one prefill so far: the router's first choice while both are idle (the least
    loaded, ties to the first it lists, which is not always prefill-0: the order they came up in)."""
    (name,) = [name for name in ("prefill-0", "prefill-1") if decode_metric(cluster.process(name), "disagg_prefill_requests_total")]
    return name


def test_a_prefill_worker_killed_during_prefill_is_retried_elsewhere(cluster, llama_ref):
    with Client(cluster.router_address, timeout=60) as client:
        assert client.complete("The cat", max_new_tokens=3).token_ids == llama_ref.greedy("The cat", 3)
        # Freeze the router's first choice while both are idle, send, then kill it mid-prefill.
        first = first_choice_prefill(cluster)
        other = "prefill-1" if first == "prefill-0" else "prefill-0"
        cluster.signal(first, signal.SIGSTOP)
        # Streamed on a thread (client.generate sends nothing until read); killed once the
        # request is past admission, with the first choice frozen before it could run it.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(lambda: [t for chunk in client.generate(LONG_PROMPT, max_new_tokens=20) for t in chunk.token_ids])
            wait_for(lambda: reserved_on_decode(cluster), 30, "the request's decode reservation")
            cluster.signal(first, signal.SIGKILL)
            assert streamed.result(timeout=60) == llama_ref.greedy(LONG_PROMPT, 20)
        assert decode_metric(cluster.process(other), "disagg_prefill_requests_total") == 1  # retried there

        cluster.signal(other, signal.SIGKILL)
        cluster.process(other).popen.wait()
        with pytest.raises(grpc.RpcError) as error:
            client.complete("The cat", max_new_tokens=3)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "no prefill worker is available" in error.value.details()
    assert_nothing_held(cluster)  # every live worker: both decode workers and nothing queued


def test_a_decode_worker_killed_mid_stream_moves_the_request_with_no_token_lost(held_cluster, llama_ref):
    """Two streams of one prompt on one decode worker, the second reading the first's cached
    blocks, when the worker is killed: both move, and neither loses or repeats a token."""
    cluster, release = held_cluster
    expected = llama_ref.greedy(SHARED_PROMPT, 300, ignore_eos=True)
    with Client(cluster.router_address, timeout=120) as client:
        stream = client.generate(SHARED_PROMPT, max_new_tokens=300, ignore_eos=True)
        received = first_tokens(stream, 5)
        sharing = client.generate(SHARED_PROMPT, max_new_tokens=300, ignore_eos=True)  # routed where the prompt's blocks are
        received_sharing = first_tokens(sharing, 1)  # the prefill's token: the held steps do not stop it
        victim = active_decode_worker(cluster)  # held after HELD_AFTER_STEPS steps: still running
        assert decode_metric(cluster.process(victim), "disagg_decode_prefix_hit_tokens_total") > 0  # the blocks are shared
        cluster.signal(victim, signal.SIGKILL)
        cluster.process(victim).popen.wait()
        release.touch()  # the survivor's steps run freely from here
        rest = list(stream)
        tokens = received + [t for chunk in rest for t in chunk.token_ids]
        assert tokens == expected  # nothing lost, nothing repeated
        assert rest[-1].finish_reason == "length" and rest[-1].completion_tokens == 300
        assert received_sharing + [t for chunk in sharing for t in chunk.token_ids] == expected

        survivor = "decode-1" if victim == "decode-0" else "decode-0"
        cluster.signal(survivor, signal.SIGKILL)
        cluster.process(survivor).popen.wait()
        with pytest.raises(grpc.RpcError) as error:
            client.complete("The cat", max_new_tokens=5)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "no decode worker is available" in error.value.details()

        # The same worker comes back on the same address: used again, no router restart.
        cluster.process(victim).popen.wait()
        cluster.restart(victim)
        wait_router_counts(cluster, decode=1)
        assert client.complete("The cat", max_new_tokens=5).token_ids == llama_ref.greedy("The cat", 5)


def test_sigterm_on_a_decode_worker_drains_it_and_new_requests_go_elsewhere(held_cluster, llama_ref):
    cluster, release = held_cluster
    expected = llama_ref.greedy(LONG_PROMPT, 300, ignore_eos=True)
    with Client(cluster.router_address, timeout=120) as client:
        stream = client.generate(LONG_PROMPT, max_new_tokens=300, ignore_eos=True)
        received = first_tokens(stream, 5)
        draining = active_decode_worker(cluster)  # held after HELD_AFTER_STEPS steps: still running
        cluster.signal(draining, signal.SIGTERM)
        wait_not_serving(cluster.process(draining).address)
        # New requests are served by the other worker while this one drains (5 tokens: under its hold).
        assert client.complete("The cat", max_new_tokens=5).token_ids == llama_ref.greedy("The cat", 5)
        assert cluster.process(draining).popen.poll() is None  # the drain waits for the held stream
        release.touch()
        tokens = received + [t for chunk in stream for t in chunk.token_ids]
    assert tokens == expected  # the stream in flight was not cut
    assert cluster.process(draining).popen.wait(timeout=30) == 0


def test_sigterm_on_the_router_finishes_streams_refuses_new_calls_and_exits_zero(cluster, llama_ref):
    import httpx

    # The drain must outlast the checks below (the HTTP listener closes once the streams finish,
    # and a refused connection is not a 503): the decode workers are stopped (SIGSTOP) while the
    # router drains, so the streams cannot finish however fast the host, and go on after (SIGCONT).
    # The stop is far shorter than the two missed load polls (1 s timeout each) that would make
    # the router doubt them.
    tokens_out = 480
    expected = llama_ref.greedy(LONG_PROMPT, tokens_out, ignore_eos=True)
    body = {"prompt": LONG_PROMPT, "max_tokens": tokens_out, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    with Client(cluster.router_address, timeout=120) as client, httpx.Client(base_url=cluster.http_url, timeout=120) as http:
        stream = client.generate(LONG_PROMPT, max_new_tokens=tokens_out, ignore_eos=True)
        received = [t for _, chunk in zip(range(5), stream) for t in chunk.token_ids]
        with http.stream("POST", "/v1/completions", json=body) as http_stream:  # the same over HTTP
            events = http_stream.iter_lines()
            assert next(events).startswith("data: {")
            for name in ("decode-0", "decode-1"):
                cluster.signal(name, signal.SIGSTOP)
            try:
                cluster.signal("router", signal.SIGTERM)
                wait_not_serving(cluster.router_address)
                with Client(cluster.router_address, timeout=10) as late, pytest.raises(grpc.RpcError) as error:
                    late.complete("The cat", max_new_tokens=3)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
                refused = http.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 3})
            finally:
                for name in ("decode-0", "decode-1"):
                    cluster.signal(name, signal.SIGCONT)
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            tokens = received + [t for chunk in stream for t in chunk.token_ids]
            payloads = [line[len("data: "):] for line in events if line.startswith("data: ")]
        http_tokens = [t for p in payloads[:-1] for t in json.loads(p)["choices"][0]["token_ids"]]
    assert tokens == expected
    assert payloads[-1] == "[DONE]" and http_tokens == expected[-len(http_tokens):] and len(http_tokens) >= tokens_out - 1
    assert cluster.process("router").popen.wait(timeout=30) == 0
    codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes

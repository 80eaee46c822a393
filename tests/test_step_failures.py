"""A failing model step costs only what it must: real processes, faults injected into the step
through the test-only hooks of disagg/engine/faults.py (DISAGG_TEST_FAIL_*_STEP)."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from conftest import assert_nothing_held, start_cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from disagg.clients.grpc_client import Client
from disagg.engine.faults import TEST_FAIL_DECODE_STEP, TEST_FAIL_KV_WRITE, TEST_FAIL_PREFILL_STEP
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

PROMPT = "The ship's captain looked at the stars"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


# With every worker of a role gone a request waits --worker-wait-seconds for one before UNAVAILABLE: short here.
WAIT_ONE_SECOND = ["--worker-wait-seconds", "1"]


@pytest.fixture
def one_decode(cluster_logs, request):
    cluster = start_cluster(cluster_logs / request.node.name, "llama", prefill=1, decode=1, batch_size=2, router_args=WAIT_ONE_SECOND)
    yield cluster
    cluster.stop()


@pytest.fixture
def two_decode(cluster_logs, request):
    cluster = start_cluster(cluster_logs / request.node.name, "llama", prefill=1, decode=2, batch_size=2, router_args=WAIT_ONE_SECOND)
    yield cluster
    cluster.stop()


def poll(condition, what: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        time.sleep(0.05)  # polling the condition, not waiting for it


def health(address: str) -> int | None:
    """The server's grpc.health.v1 status, None when it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return None


def router_counts(cluster) -> tuple[int, int]:
    with Client(cluster.router_address, timeout=5) as client:
        info = client.model_info()
    return info.prefill_workers, info.decode_workers


def restart_with(cluster, monkeypatch, name: str, env: dict[str, str]) -> None:
    """Stops the worker, then starts it again with only these hooks set; returns once the router uses it."""
    counts = router_counts(cluster)
    index = 0 if name.startswith("prefill") else 1
    cluster.signal(name, 15)
    assert cluster.process(name).popen.wait(timeout=60) == 0
    poll(lambda: router_counts(cluster)[index] == counts[index] - 1, f"the router saw {name} go")
    for variable in (TEST_FAIL_DECODE_STEP, TEST_FAIL_PREFILL_STEP, TEST_FAIL_KV_WRITE):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)  # the restarted process inherits this environment
    cluster.restart(name)
    cluster.wait_serving(120, cluster.process(name).address)
    poll(lambda: router_counts(cluster) == counts, f"the router uses {name} again")


def exit_log(cluster, name: str) -> str:
    """Waits for the worker to end; it must end non-zero (its supervisor starts a fresh one). Returns its log."""
    assert cluster.process(name).popen.wait(timeout=60) != 0
    with open(f"{cluster.spec.log_dir}/{name}.log") as f:
        return f.read()


def restart_serves_exactly(cluster, monkeypatch, llama_ref, name: str, prompt: str) -> None:
    """Starts the worker again without any fault hook, as a supervisor would; it serves greedy tokens and leaves nothing held."""
    for variable in (TEST_FAIL_DECODE_STEP, TEST_FAIL_PREFILL_STEP, TEST_FAIL_KV_WRITE):
        monkeypatch.delenv(variable, raising=False)
    cluster.restart(name)
    poll(lambda: router_counts(cluster) == (1, 1), f"the router uses the restarted {name}")
    with Client(cluster.router_address, timeout=120) as client:
        assert client.complete(prompt, max_new_tokens=6, ignore_eos=True).token_ids == llama_ref.greedy(prompt, 6, ignore_eos=True)
    assert_nothing_held(cluster)


def decode_failovers(cluster) -> float:
    text = urllib.request.urlopen(f"http://{cluster.process('router').metrics_address}/metrics", timeout=5).read().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return sum(s.value for s in samples if s.name == "disagg_router_worker_failovers_total" and s.labels.get("role") == "decode")


def stream_until_error(client: Client, max_new_tokens: int) -> tuple[list[int], grpc.RpcError | None]:
    tokens: list[int] = []
    try:
        for chunk in client.generate(PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True):
            tokens += chunk.token_ids
    except grpc.RpcError as error:
        return tokens, error
    return tokens, None


def test_a_failing_decode_step_moves_its_stream_to_the_other_decode_worker(two_decode, llama_ref, monkeypatch):
    cluster = two_decode
    # decode-0, the router's choice when both are idle (ties go to the first), fails its 4th step.
    restart_with(cluster, monkeypatch, "decode-0", {TEST_FAIL_DECODE_STEP: "after=3,count=1"})
    with Client(cluster.router_address, timeout=120) as client:
        tokens, error = stream_until_error(client, 24)
        assert error is None, error
        assert tokens == llama_ref.greedy(PROMPT, 24, ignore_eos=True)  # nothing lost, nothing repeated
        assert decode_failovers(cluster) == 1  # it did fail on decode-0 and moved
        assert health(cluster.process("decode-0").address) == SERVING  # one failing step does not end a worker
        for _ in range(2):  # both decode workers serve again
            assert client.complete("The cat", max_new_tokens=6, ignore_eos=True).token_ids == llama_ref.greedy("The cat", 6, ignore_eos=True)
    assert_nothing_held(cluster)


def test_with_one_decode_worker_a_failing_step_ends_its_stream_with_internal_and_the_next_request_works(one_decode, llama_ref, monkeypatch):
    cluster = one_decode
    restart_with(cluster, monkeypatch, "decode-0", {TEST_FAIL_DECODE_STEP: "after=3,count=1"})
    restart_with(cluster, monkeypatch, "prefill-0", {TEST_FAIL_PREFILL_STEP: "after=1,count=1"})
    expected = llama_ref.greedy(PROMPT, 24, ignore_eos=True)
    with Client(cluster.router_address, timeout=120) as client:
        tokens, error = stream_until_error(client, 24)  # prefill 1; decode steps 1-3, then step 4 fails
        assert error is not None and error.code() == grpc.StatusCode.INTERNAL, error
        assert "decode step failed" in error.details() and "injected failure of step 4" in error.details()
        assert tokens == expected[: len(tokens)] and len(tokens) == 4  # the first token and three decode steps
        assert_nothing_held(cluster)

        with pytest.raises(grpc.RpcError) as failed:  # prefill 2 fails: the reservation made for it is freed
            client.complete(PROMPT, max_new_tokens=5)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert "prefill failed" in failed.value.details() and "injected failure of step 2" in failed.value.details()
        assert_nothing_held(cluster)

        assert client.complete(PROMPT, max_new_tokens=24, ignore_eos=True).token_ids == expected
    assert [health(p.address) for p in cluster.processes] == [SERVING] * 3
    assert_nothing_held(cluster)


def hold_a_reservation(address: str):
    """A Decode call on the worker, reserved and waiting for KV: it keeps a draining worker draining."""
    channel = grpc.insecure_channel(address)
    request = wpb.DecodeRequest(request_id="held", prompt_len=4, stopping=wpb.WorkerStopping(max_new_tokens=4))
    call = wgrpc.DecodeServiceStub(channel).Decode(request, timeout=120)
    assert next(call).HasField("reserved")
    return channel, call


def test_a_decode_step_that_keeps_failing_takes_the_worker_not_serving_and_it_exits_non_zero(one_decode, llama_ref, monkeypatch):
    cluster = one_decode
    decode = cluster.process("decode-0")
    restart_with(cluster, monkeypatch, "decode-0", {TEST_FAIL_DECODE_STEP: "after=0,count=1000"})
    channel, held = hold_a_reservation(decode.address)
    try:
        with Client(cluster.router_address, timeout=120) as client:
            for _ in range(3):  # each request's steps fail; by the third in a row the worker gives up
                _, error = stream_until_error(client, 8)
                assert error is not None and error.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE), error
            poll(lambda: health(decode.address) == NOT_SERVING, "decode-0 NOT_SERVING")  # draining: our reservation is still open
            assert decode.popen.poll() is None
            with pytest.raises(grpc.RpcError) as refused:
                client.complete("The cat", max_new_tokens=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "no decode worker is available" in refused.value.details()
    finally:
        held.cancel()
        channel.close()
    log = exit_log(cluster, "decode-0")
    assert "steps in a row failed" in log and "injected failure" in log
    restart_serves_exactly(cluster, monkeypatch, llama_ref, "decode-0", "The cat")


def test_a_prefill_device_lost_takes_the_prefill_worker_down_non_zero(one_decode, llama_ref, monkeypatch):
    cluster = one_decode
    prefill = cluster.process("prefill-0")
    restart_with(cluster, monkeypatch, "prefill-0", {TEST_FAIL_PREFILL_STEP: "after=0,count=1,fatal=1"})
    with Client(cluster.router_address, timeout=120) as client:
        with pytest.raises(grpc.RpcError) as failed:
            client.complete(PROMPT, max_new_tokens=5)
        assert failed.value.code() == grpc.StatusCode.INTERNAL and "DeviceLost" in failed.value.details()
        assert prefill.popen.wait(timeout=60) != 0
        poll(lambda: router_counts(cluster)[0] == 0, "the router saw the prefill worker go")
        with pytest.raises(grpc.RpcError) as refused:
            client.complete(PROMPT, max_new_tokens=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "no prefill worker is available" in refused.value.details()
    assert_nothing_held(cluster)  # the decode worker holds nothing for the failed request


@pytest.fixture
def colocated_with(cluster_logs, request, monkeypatch):
    """Starts a router and one colocated decode worker (it prefills too) whose prefills fail as the hook says."""
    started = []

    def start(hook: str):
        monkeypatch.setenv(TEST_FAIL_PREFILL_STEP, hook)  # the worker process inherits it
        started.append(start_cluster(cluster_logs / request.node.name, "llama", decode=1, colocated=True, batch_size=2))
        return started[-1]

    yield start
    for cluster in started:
        cluster.stop()


def test_a_kv_write_that_loses_the_device_takes_the_decode_worker_down_non_zero(cluster_logs, request, llama_ref, monkeypatch):
    """The gRPC push, whose pieces the decode worker copies into its cache with write_kv (NIXL into
    a host cache reads in place). A DeviceLost there is the device's, not the transfer's."""
    monkeypatch.setenv(TEST_FAIL_KV_WRITE, "after=0,count=1,fatal=1")  # the prefill worker never writes KV: only decode-0 has the fault
    # The router's wait for a decode worker cut to 1 s, as the fixtures': with its only decode worker gone the stream ends UNAVAILABLE then.
    cluster = start_cluster(cluster_logs / request.node.name, "llama", prefill=1, decode=1, transport="grpc", batch_size=2, router_args=WAIT_ONE_SECOND)
    try:
        with Client(cluster.router_address, timeout=120) as client:
            tokens, error = stream_until_error(client, 8)
        assert tokens == llama_ref.greedy(PROMPT, 1, ignore_eos=True) and error is not None, (tokens, error)  # the prefill's token, then the error
        assert error.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE), error
        log = exit_log(cluster, "decode-0")  # drained, then out
        assert "KV write failed: DeviceLost" in log and "injected failure" in log
        restart_serves_exactly(cluster, monkeypatch, llama_ref, "decode-0", PROMPT)
    finally:
        cluster.stop()


def test_a_colocated_workers_failing_prefill_ends_only_its_request_and_decoding_goes_on(colocated_with, llama_ref):
    cluster = colocated_with("after=1,count=1")  # the worker's second prefill raises
    decode = cluster.process("decode-0")
    with Client(cluster.router_address, timeout=120) as client:
        running = client.generate(PROMPT, max_new_tokens=40, ignore_eos=True)  # prefill 1, then decoding on the worker
        tokens = list(next(running).token_ids)
        with pytest.raises(grpc.RpcError) as failed:  # prefill 2 raises on the device thread the decode steps use
            client.complete("The cat", max_new_tokens=5)
        assert failed.value.code() == grpc.StatusCode.INTERNAL, failed.value
        assert "prefill failed" in failed.value.details() and "injected failure of step 2" in failed.value.details()
        for chunk in running:
            tokens += chunk.token_ids
        assert tokens == llama_ref.greedy(PROMPT, 40, ignore_eos=True)  # the running request lost nothing
        assert_nothing_held(cluster)  # the failed request's reservation is freed
        assert client.complete("The cat", max_new_tokens=6, ignore_eos=True).token_ids == llama_ref.greedy("The cat", 6, ignore_eos=True)
    assert health(decode.address) == SERVING and decode.popen.poll() is None
    assert_nothing_held(cluster)


def test_a_colocated_workers_prefills_that_keep_failing_take_it_not_serving_and_it_exits_non_zero(colocated_with):
    from disagg.engine.faults import FAILURES_BEFORE_EXIT

    cluster = colocated_with("after=0,count=1000")
    decode = cluster.process("decode-0")
    channel, held = hold_a_reservation(decode.address)  # keeps the draining worker draining until we let go
    try:
        with Client(cluster.router_address, timeout=120) as client:
            for _ in range(FAILURES_BEFORE_EXIT):
                with pytest.raises(grpc.RpcError) as failed:
                    client.complete(PROMPT, max_new_tokens=5)
                assert failed.value.code() == grpc.StatusCode.INTERNAL and "injected failure" in failed.value.details(), failed.value
        poll(lambda: health(decode.address) == NOT_SERVING, "decode-0 NOT_SERVING")
        assert decode.popen.poll() is None
    finally:
        held.cancel()
        channel.close()
    log = exit_log(cluster, "decode-0")
    assert f"{FAILURES_BEFORE_EXIT} prefills in a row failed" in log and "injected failure of step 3" in log


def test_the_fault_hook_is_the_backend_step_itself_when_unset_and_refuses_a_malformed_value():
    from disagg.engine.faults import DeviceLost, FailureStreak, InjectedStepFailure, with_injected_faults

    def step(x):
        return x + 1

    assert with_injected_faults(step, TEST_FAIL_DECODE_STEP, environ={}) is step  # no wrapper, no cost
    faulty = with_injected_faults(step, TEST_FAIL_DECODE_STEP, environ={TEST_FAIL_DECODE_STEP: "after=1,count=2"})
    assert faulty(1) == 2
    for _ in range(2):
        with pytest.raises(InjectedStepFailure, match="injected failure of step"):
            faulty(1)
    assert faulty(1) == 2
    with pytest.raises(DeviceLost):
        with_injected_faults(step, TEST_FAIL_DECODE_STEP, environ={TEST_FAIL_DECODE_STEP: "after=0,fatal=1"})(1)
    for bad in ("often", "after=-1", "count=0", "after=1,when=2"):
        with pytest.raises(ValueError, match=TEST_FAIL_DECODE_STEP):
            with_injected_faults(step, TEST_FAIL_DECODE_STEP, environ={TEST_FAIL_DECODE_STEP: bad})
    streak = FailureStreak(limit=3)
    assert not streak.failed(RuntimeError()) and not streak.failed(RuntimeError())
    streak.succeeded()
    assert not streak.failed(RuntimeError()) and streak.failed(DeviceLost())


class DecodeLoopUnderFaults:
    """A decode loop in this process whose step raises where `fails(step number)` says; what it publishes and retires.
    Requests admitted before `decode_loop.start()` are all in its first step."""

    def __init__(self, fails, async_mode: bool = True, slots: int = 2):
        from conftest import reference, tiny_model

        from decode_worker.decode_loop import DecodeLoop
        from disagg.engine.backends import load_backend

        self.ref = reference("llama")
        self.backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
        self.backend.allocate_slots(slots)
        self.events, self.retired, self.fatal, self.steps = [], [], [], 0

        def step(inputs):
            self.steps += 1
            if fails(self.steps):
                raise RuntimeError(f"bounds check at step {self.steps}")
            return self.backend.decode_step(inputs)

        self.decode_loop = DecodeLoop(
            self.backend, self.events.extend, self.retired.extend, async_mode=async_mode, on_fatal=self.fatal.append, decode_step=step
        )

    def admit(self, key: str, slot: int, prompt: str, max_new: int, sampling=None) -> int:
        from test_backend import prefill_into_slot

        from decode_worker.decode_loop import Sequence
        from disagg.engine.requests import Sampling, Stopping

        sampling = sampling or Sampling()
        ids = self.ref.ids(prompt)
        first = prefill_into_slot(self.backend, ids, slot, sampling).first_token
        self.decode_loop.admit(Sequence(key, slot, len(ids), first, sampling, Stopping(max_new), context_ids=tuple(ids)))
        return first

    def tokens(self, key: str) -> list[int]:
        return [t for e in self.events if e.key == key for t in e.token_ids]

    def errors(self) -> dict[str, str]:
        return {e.key: e.error for e in self.events if e.error}

    def wait_retired(self, *keys: str) -> None:
        poll(lambda: set(keys) <= set(self.retired), f"requests {keys} retired", within=60)


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
def test_a_failing_step_fails_its_rows_frees_their_slots_and_the_next_request_decodes_exactly(async_mode):
    run = DecodeLoopUnderFaults(lambda step: step == 3, async_mode)
    prompts = {"a": "The baker opens", "b": "Snow fell"}
    firsts = {key: run.admit(key, slot, prompt, 12) for slot, (key, prompt) in enumerate(prompts.items())}
    run.decode_loop.start()  # both rows in steps 1-3
    run.wait_retired("a", "b")  # both slots handed back
    assert run.errors() == {"a": "decode step failed: RuntimeError: bounds check at step 3", "b": "decode step failed: RuntimeError: bounds check at step 3"}
    for key, prompt in prompts.items():  # the first token and steps 1-2, then nothing
        assert [firsts[key], *run.tokens(key)] == run.ref.greedy(prompt, 3, ignore_eos=True)
    first = run.admit("c", 0, "A river runs", 10)  # the loop goes on
    run.wait_retired("c")
    assert [first, *run.tokens("c")] == run.ref.greedy("A river runs", 10, ignore_eos=True)
    assert run.fatal == [] and run.decode_loop.failure is None
    run.decode_loop.stop()


def test_steps_failing_in_a_row_stop_the_decode_loop_once_and_later_requests_fail_at_once():
    from disagg.engine.faults import FAILURES_BEFORE_EXIT

    run = DecodeLoopUnderFaults(lambda step: step >= 2)
    run.decode_loop.start()
    for i in range(FAILURES_BEFORE_EXIT):
        run.admit(str(i), 0, "The baker opens", 12)
        run.wait_retired(str(i))
    assert len(run.fatal) == 1 and "steps in a row failed" in run.fatal[0] and run.decode_loop.failure == run.fatal[0]
    run.admit("late", 1, "Snow fell", 12)
    run.wait_retired("late")
    assert run.errors()["late"].startswith("decode worker stopped serving: ") and run.tokens("late") == []
    run.decode_loop.stop()


def test_a_penalized_request_whose_penalty_state_cannot_be_set_up_fails_alone():
    from disagg.engine.requests import Sampling

    run = DecodeLoopUnderFaults(lambda step: False)

    def broken_start(*args):
        raise MemoryError("no room for the penalty counts")

    run.backend.start_sequence = broken_start
    run.admit("penalized", 0, "The baker opens", 12, Sampling(presence_penalty=0.5))
    run.admit("plain", 1, "Snow fell", 6)
    run.decode_loop.start()
    run.wait_retired("penalized", "plain")
    assert run.errors() == {"penalized": "decode step failed: MemoryError: no room for the penalty counts"}
    assert run.tokens("penalized") == []  # nothing decoded without its penalties reached the caller
    assert run.tokens("plain") == run.ref.greedy("Snow fell", 6, ignore_eos=True)[1:]
    run.decode_loop.stop()


@pytest.mark.parametrize("device, fatal", [("cuda", True), ("cpu", False)])
def test_an_error_at_the_host_device_sync_is_classified_by_the_backend_and_a_lost_cuda_context_stops_the_loop_at_once(device, fatal):
    """An asynchronous device (CUDA; Neuron in async mode) reports a kernel's error where the host
    reads the step's tokens (`.tolist()`), not where the step was launched: the decode loop asks
    the backend's device_error there. The torch backend's own rule runs, as on that device."""
    import functools
    import types

    import torch

    from disagg.engine.backends.torch_backend import TorchBackend

    run = DecodeLoopUnderFaults(lambda step: False)
    run.backend.device_error = functools.partial(TorchBackend.device_error, types.SimpleNamespace(device=torch.device(device)))
    launched, real_step = [], run.backend.decode_step

    def illegal_address(*args):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    def step_whose_tokens_fail_at_the_sync(inputs):
        launched.append(inputs)
        output = real_step(inputs)
        return types.SimpleNamespace(token_ids=types.SimpleNamespace(tolist=illegal_address)) if len(launched) == 2 else output

    run.backend.decode_step = step_whose_tokens_fail_at_the_sync
    first = run.admit("a", 0, "The baker opens", 12)
    run.decode_loop.start()
    run.wait_retired("a")
    assert [first, *run.tokens("a")] == run.ref.greedy("The baker opens", 2, ignore_eos=True)  # the prefill's token and step 1's
    cause = "DeviceLost: CUDA: CUDA error" if fatal else "AcceleratorError: CUDA error"
    assert run.errors() == {"a": f"decode step failed: {cause}: an illegal memory access was encountered"}
    assert len(run.fatal) == (1 if fatal else 0)  # one lost context stops the loop; on CPU it is one failed step of three allowed
    run.decode_loop.stop()

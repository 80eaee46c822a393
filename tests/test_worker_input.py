"""The workers' own API, called straight at their ports as anything on the network could:
every field a worker takes is checked by the rules the router's public APIs use
(disagg.engine.requests), refused with INVALID_ARGUMENT naming the worker API's field
before any slot or device work, and the worker goes on serving the router's requests."""

from __future__ import annotations

import math

import grpc
import pytest
from conftest import assert_nothing_held

from disagg.clients.grpc_client import Client
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

PROMPT = "The cat sat on the"
NAN, INF = math.nan, math.inf


@pytest.fixture(scope="module")
def workers(llama_cluster):
    """(decode stub, prefill stub, the decode worker's WorkerLoad: vocabulary, context)."""
    channels = [grpc.insecure_channel(llama_cluster.addresses(role)[0]) for role in ("decode", "prefill")]
    decode, prefill = wgrpc.DecodeServiceStub(channels[0]), wgrpc.PrefillServiceStub(channels[1])
    yield decode, prefill, decode.GetLoad(wpb.LoadRequest(), timeout=10)
    for channel in channels:
        channel.close()


# The values the router refuses, each sent to the workers' own API. Each case: the
# field the refusal must name, and the request's fields given (model: vocab V, context M).
SAMPLING = [
    ("sampling.temperature", dict(temperature=NAN)),
    ("sampling.temperature", dict(temperature=-1.0)),
    ("sampling.top_p", dict(top_p=7.0)),
    ("sampling.top_p", dict(top_p=NAN)),
    ("sampling.top_k", dict(top_k=-5)),
    ("sampling.min_p", dict(min_p=3.0)),
    ("sampling.top_logprobs", dict(logprobs=True, top_logprobs=100000)),
    ("sampling.top_logprobs", dict(logprobs=True, top_logprobs=1_000_000)),
    ("sampling.top_logprobs", dict(logprobs=True, top_logprobs=-1)),
    ("sampling.top_logprobs", dict(top_logprobs=3)),  # alternatives with no logprobs asked for
    ("sampling.presence_penalty", dict(presence_penalty=INF)),
    ("sampling.frequency_penalty", dict(frequency_penalty=-3.0)),
    ("sampling.repetition_penalty", dict(repetition_penalty=-1.0)),
]


def decode_request(load, sampling=None, prompt_len=4, **fields) -> wpb.DecodeRequest:
    stopping = fields.pop("stopping", dict(max_new_tokens=3))
    sampling, stopping = wpb.WorkerSampling(**(sampling or {})), wpb.WorkerStopping(**stopping)
    return wpb.DecodeRequest(request_id="bad", prompt_len=prompt_len, sampling=sampling, stopping=stopping, **fields)


BAD_DECODE = [(field, lambda load, s=sampling: decode_request(load, s)) for field, sampling in SAMPLING] + [
    ("request_id", lambda load: wpb.DecodeRequest(request_id="r" * 129, prompt_len=4, stopping=wpb.WorkerStopping(max_new_tokens=3))),
    ("prompt_len", lambda load: decode_request(load, prompt_len=0)),
    ("prompt_len", lambda load: decode_request(load, prompt_len=-3)),
    ("prompt_len", lambda load: decode_request(load, prompt_len=load.max_seq_len, stopping=dict(max_new_tokens=1))),
    ("stopping.max_new_tokens", lambda load: decode_request(load, stopping=dict(max_new_tokens=0))),
    ("stopping.max_new_tokens", lambda load: decode_request(load, stopping=dict(max_new_tokens=load.max_seq_len))),
    ("stopping.stop_token_ids", lambda load: decode_request(load, stopping=dict(max_new_tokens=3, stop_token_ids=[load.vocab_size]))),
    ("stopping.stop_token_ids", lambda load: decode_request(load, stopping=dict(max_new_tokens=3, stop_token_ids=[-1]))),
    ("stopping.stop_token_ids", lambda load: decode_request(load, stopping=dict(max_new_tokens=3, stop_token_ids=range(100_000)))),
    ("first_step", lambda load: decode_request(load, first_step=-1)),
    ("first_step", lambda load: decode_request(load, first_step=4)),  # past the context of 4 tokens
    ("context_token_ids", lambda load: decode_request(load, dict(presence_penalty=0.5), context_token_ids=[1, 2])),
    ("context_token_ids", lambda load: decode_request(load, dict(presence_penalty=0.5), context_token_ids=[1, 2, 3, load.vocab_size])),
    ("context_token_ids", lambda load: decode_request(load, context_token_ids=[1] * 100_000)),
]


def prefill_request(sampling=None, token_ids=(1, 2, 3, 4), **fields) -> wpb.PrefillRequest:
    return wpb.PrefillRequest(request_id="bad", token_ids=list(token_ids), sampling=wpb.WorkerSampling(**(sampling or {})), **fields)


BAD_PREFILL = [(field, lambda load, s=sampling: prefill_request(s)) for field, sampling in SAMPLING] + [
    ("request_id", lambda load: wpb.PrefillRequest(request_id="r" * 129, token_ids=[1, 2])),
    ("token_ids", lambda load: prefill_request(token_ids=())),
    ("token_ids", lambda load: prefill_request(token_ids=(1, load.vocab_size))),
    ("token_ids", lambda load: prefill_request(token_ids=(1, -7))),
    ("token_ids", lambda load: prefill_request(token_ids=[1] * load.max_seq_len)),
    ("first_step", lambda load: prefill_request(first_step=4)),
    ("first_step", lambda load: prefill_request(first_step=-2)),
    ("kv_target.address", lambda load: prefill_request(kv_target=wpb.KvTarget(address="", reservation_id="r0-x"))),
    ("kv_target.address", lambda load: prefill_request(kv_target=wpb.KvTarget(address="a" * 1000, reservation_id="r0-x"))),
    ("kv_target.reservation_id", lambda load: prefill_request(kv_target=wpb.KvTarget(address="127.0.0.1:1"))),
]


def pull_request(load, **fields) -> wpb.PullKvRequest:
    valid = dict(reservation_id="r0-x", agent_name="agent", agent_metadata=b"m", address=4096, prompt_len=4, num_layers=2, first_token=5, generation=1)
    return wpb.PullKvRequest(**{**valid, **fields})


BAD_PULL = [
    ("reservation_id", dict(reservation_id="")),
    ("reservation_id", dict(reservation_id="r" * 200)),
    ("agent_name", dict(agent_name="")),
    ("agent_metadata", dict(agent_metadata=b"")),
    ("address", dict(address=0)),
    ("prompt_len", dict(prompt_len=0)),
    ("first_token", dict(first_token=-1)),
    ("num_layers", dict(num_layers=99)),
]


def assert_refused(call, field: str) -> None:
    with pytest.raises(grpc.RpcError) as error:
        call()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert error.value.details().startswith(f"{field} "), error.value.details()


def assert_worker_holds_nothing(stub) -> None:
    # Refused before any slot is reserved or any prefill queued: nothing to wait for.
    load = stub.GetLoad(wpb.LoadRequest(), timeout=10)
    assert (load.slots_in_use, load.reservations, load.active, load.inflight_transfers, load.queued) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("field,make", BAD_DECODE, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_DECODE)])
def test_the_decode_worker_refuses_a_bad_reservation_naming_the_field(workers, field, make):
    decode, _, load = workers
    assert_refused(lambda: next(decode.Decode(make(load), timeout=30)), field)
    assert_worker_holds_nothing(decode)


@pytest.mark.parametrize("field,make", BAD_PREFILL, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_PREFILL)])
def test_the_prefill_worker_refuses_a_bad_prefill_naming_the_field(workers, field, make):
    _, prefill, load = workers
    assert_refused(lambda: list(prefill.Prefill(make(load), timeout=30)), field)
    assert_worker_holds_nothing(prefill)


@pytest.mark.parametrize("field,fields", BAD_PULL, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_PULL)])
def test_the_decode_worker_refuses_a_bad_pull_before_looking_it_up(workers, field, fields):
    decode, _, load = workers
    assert_refused(lambda: decode.PullKv(pull_request(load, **fields), timeout=30), field)
    assert_worker_holds_nothing(decode)


BAD_CHUNK = [
    ("reservation_id", dict(reservation_id="r" * 200)),
    ("dtype", dict(dtype="f" * 100_000)),
    ("shape", dict(shape=[1] * 100_000)),
]


@pytest.mark.parametrize("field,fields", BAD_CHUNK, ids=[f for f, _ in BAD_CHUNK])
def test_a_kv_chunk_with_overlong_fields_is_refused_before_its_reservation_is_looked_up(workers, field, fields):
    decode, _, _ = workers
    valid = dict(reservation_id="r0-x", layer=0, kind=wpb.KV_KIND_KEY, dtype="float32", shape=[1, 1, 1], data=b"\0" * 4)
    assert_refused(lambda: decode.PushKv(iter([wpb.KvChunk(**{**valid, **fields})]), timeout=30), field)
    assert_worker_holds_nothing(decode)


@pytest.mark.parametrize("field,sampling", SAMPLING[:8], ids=[f"{f}-{i}" for i, (f, _) in enumerate(SAMPLING[:8])])
def test_the_router_refuses_the_same_values_by_the_same_rules(llama_cluster, field, sampling):
    # The public API carries logprobs and top_logprobs beside the sampling, not in it.
    expected = field.replace("sampling.top_logprobs", "top_logprobs")
    with Client(llama_cluster.router_address, timeout=30) as client:
        assert_refused(lambda: client.complete(PROMPT, max_new_tokens=2, **sampling), expected)


def test_after_every_refusal_the_cluster_still_serves_exact_tokens(llama_cluster, workers, llama_ref):
    decode, prefill, load = workers
    for field, make in BAD_DECODE:
        assert_refused(lambda: next(decode.Decode(make(load), timeout=30)), field)
    for field, make in BAD_PREFILL:
        assert_refused(lambda: list(prefill.Prefill(make(load), timeout=30)), field)
    with Client(llama_cluster.router_address, timeout=120) as client:
        assert client.complete(PROMPT, max_new_tokens=8).token_ids == llama_ref.greedy(PROMPT, 8)
    assert_nothing_held(llama_cluster)

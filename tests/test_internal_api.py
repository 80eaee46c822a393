"""Faults on the internal KV hand-off: each is refused with a clear status, frees
what it held, and the decode worker keeps serving."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from conftest import reference
from polling import eventually, wait_for

from disagg.kv_transport.chunk_codec import KvKind, encode
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

PROMPT_LEN = 4


@pytest.fixture
def decode(lone_decode_worker):
    channel = grpc.insecure_channel(lone_decode_worker)
    yield wgrpc.DecodeServiceStub(channel)
    channel.close()


def info():
    config = reference("llama").model.config
    return config.num_hidden_layers, config.num_key_value_heads, config.hidden_size // config.num_attention_heads


def open_reservation(stub, prompt_len=PROMPT_LEN, max_new=3):
    call = stub.Decode(wpb.DecodeRequest(
        request_id="t", prompt_len=prompt_len, sampling=wpb.WorkerSampling(top_p=1.0), stopping=wpb.WorkerStopping(max_new_tokens=max_new)
    ), timeout=30)
    return call, next(call).reserved.reservation_id


def pieces(reservation_id, layers=None, dtype=torch.float32, tokens=PROMPT_LEN, heads=None):
    num_layers, kv_heads, head_dim = info()
    out = []
    for layer in range(num_layers) if layers is None else layers:
        for kind in KvKind:
            for piece in encode(layer, kind, torch.zeros(heads or kv_heads, tokens, head_dim, dtype=dtype), 1 << 20):
                out.append(wpb.KvChunk(
                    reservation_id=reservation_id, layer=piece.layer, kind=int(piece.kind), token_start=piece.token_start,
                    dtype=piece.dtype, shape=list(piece.shape), data=piece.data,
                ))
    return out


def commit(reservation_id, first_token=5, prompt_len=PROMPT_LEN):
    return wpb.KvChunk(reservation_id=reservation_id, commit=wpb.KvCommit(first_token=first_token, prompt_len=prompt_len, num_layers=info()[0]))


def load(stub):
    return stub.GetLoad(wpb.LoadRequest(), timeout=5)


def push_error(stub, chunks) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        stub.PushKv(iter(chunks), timeout=10)
    return error.value


def assert_waiting_again(stub):
    current = load(stub)
    assert (current.reservations, current.inflight_transfers, current.active) == (1, 0, 0)


def wait_slots_free(stub):
    wait_for(lambda: load(stub).slots_in_use == 0, what="every slot freed")


def test_unknown_reservation_is_not_found(decode):
    error = push_error(decode, pieces("no-such-reservation")[:1])
    assert error.code() == grpc.StatusCode.NOT_FOUND and "reservation_id 'no-such-reservation'" in error.details()
    assert load(decode).slots_in_use == 0


@pytest.mark.parametrize(
    "make_chunks,message",
    [
        (lambda r: pieces(r, dtype=torch.bfloat16), "dtype 'bfloat16' does not match"),
        (lambda r: pieces(r, heads=7), "shape [7, 4"),
        (lambda r: pieces(r, tokens=PROMPT_LEN + 2), "outside the prompt of 4"),
        (lambda r: pieces(r, layers=[99]), "layer 99 is not in"),
        (lambda r: pieces(r, layers=[0, 0]), "arrived twice"),
        (lambda r: pieces(r, layers=[0]) + [commit(r)], "missing KV: layer 1 key has 0 of tokens [0, 4)"),
        (lambda r: pieces(r) + [commit(r, prompt_len=9)], "commit for 9 tokens"),
        (lambda r: pieces(r) + [commit(r, first_token=10**6)], "first_token 1000000"),
        (lambda r: pieces(r), "ended without a commit"),
        (lambda r: [wpb.KvChunk(reservation_id=r, layer=0, kind=0, dtype="float32", shape=[1, 1, 1], data=b"1234")], "kind 0 is not KEY or VALUE"),
        (
            lambda r: [p if i else wpb.KvChunk(**{**{f.name: v for f, v in p.ListFields()}, "data": p.data[:-4]}) for i, p in enumerate(pieces(r))],
            "bytes do not match",
        ),
    ],
    ids=["dtype", "shape", "range", "layer", "duplicate", "missing", "commit-len", "first-token", "no-commit", "kind", "bytes"],
)
def test_bad_chunks_are_refused_and_the_reservation_waits_again(decode, make_chunks, message):
    call, reservation = open_reservation(decode)
    try:
        error = push_error(decode, make_chunks(reservation))
        assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ABORTED), error.details()
        assert message in error.details(), error.details()
        assert_waiting_again(decode)
    finally:
        call.cancel()
    wait_slots_free(decode)


def test_a_transfer_that_breaks_midway_frees_its_part_and_a_retry_completes(decode):
    call, reservation = open_reservation(decode, max_new=3)
    chunks = pieces(reservation)

    def broken():
        yield from chunks[:3]
        raise RuntimeError("sender died")  # the client's stream breaks mid-transfer

    with pytest.raises(grpc.RpcError):
        decode.PushKv(broken(), timeout=10)
    eventually(lambda: assert_waiting_again(decode))  # once the worker has seen the stream break
    ack = decode.PushKv(iter(chunks + [commit(reservation)]), timeout=10)
    assert ack.bytes_received == sum(len(c.data) for c in chunks)
    events = list(call)
    assert events[-1].tokens.finish == wpb.WORKER_FINISH_LENGTH
    assert sum(len(e.tokens.token_ids) for e in events) == 2  # the first token came with the KV
    wait_slots_free(decode)


def test_a_second_transfer_into_the_same_reservation_is_refused(decode):
    call, reservation = open_reservation(decode)
    second_refused = threading.Event()
    try:
        chunks = pieces(reservation)

        def held_open():  # the first transfer stays in progress until the second is answered
            yield chunks[0]
            second_refused.wait(30)
            yield from chunks[1:]
            yield commit(reservation)

        first = decode.PushKv.future(held_open(), timeout=10)
        wait_for(lambda: load(decode).inflight_transfers == 1, what="the first transfer in progress")
        try:
            error = push_error(decode, chunks[:1])
        finally:
            second_refused.set()
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "already has a transfer in progress" in error.details()
        assert first.result().bytes_received > 0
    finally:
        second_refused.set()
        call.cancel()


def test_kv_that_never_arrives_frees_the_slot_after_the_lease(decode):
    call, _ = open_reservation(decode)
    assert load(decode).reservations == 1
    with pytest.raises(grpc.RpcError) as error:
        list(call)
    assert error.value.code() == grpc.StatusCode.ABORTED and "lease" in error.value.details()
    assert load(decode).slots_in_use == 0


def test_a_full_worker_refuses_a_reservation_with_resource_exhausted(decode):
    held = [open_reservation(decode) for _ in range(2)]
    try:
        with pytest.raises(grpc.RpcError) as error:
            open_reservation(decode)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "slots are in use" in error.value.details()
    finally:
        for call, _ in held:
            call.cancel()
    wait_slots_free(decode)

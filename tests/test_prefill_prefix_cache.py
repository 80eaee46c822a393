"""Prefix caching on the prefill worker: a prompt that starts with cached blocks computes
only the rest, exactly (prefill_worker/prefix_cache.py, Backend.prefill's prefix_kv), and
the KV of [kv_target.token_start, prompt_len) goes to the decode worker over both transports.

Backend tests run in process on each prefill path (native_step.c, transformers' modules,
sliding windows); worker tests run the real PrefillWorker in process against a stand-in
decode worker that records what arrives (the NIXL path through a stand-in staging source:
NIXL's own agent stays out of pytest's process, see tests/queued_prefill_probe.py); one
test runs a real cluster against transformers' generate().
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import urllib.request
from dataclasses import replace

import grpc
import pytest
import torch
from conftest import tiny_model
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from disagg.engine.backends import load_backend
from disagg.engine.cpu_kernels import small_gemm
from disagg.engine.requests import Sampling
from disagg.kv_transport.chunk_codec import KvKind
from disagg.kv_transport.layout import KvGeometry
from disagg.kv_transport.nixl_control import NixlPullSender
from disagg.kv_transport.nixl_transport import HEADER_BYTES, NixlSource, StagingBuffer
from disagg.rpc import worker_messages
from disagg.rpc.metrics import PrefillMetrics
from disagg.rpc.server import RequestError
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.prefix_cache import PrefixCache
from prefill_worker.worker import FirstToken, KvSent, KvTarget, PrefillWorker

NATIVE = small_gemm.kernel() is not None  # an AVX2 CPU with a C compiler
# name: (test model, torch backend options, whether the native prefill runs it)
BACKENDS = {
    "llama-native": ("llama", {}, True),
    "llama-modules": ("llama", {"native_step": False}, False),
    "mistral-sw-native": ("mistral-sw", {}, True),  # a 16-token sliding window, in native_step.c
    "mistral-sw-modules": ("mistral-sw", {"native_step": False}, False),
    "gemma2-sw": ("gemma2-sw", {}, False),  # sliding and full layers in turn, eager attention, softcapping
}
BLOCK = 16


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """The kernels serve a backend built on one torch thread (the workers' default here)."""


@functools.cache
def backend(name: str):
    model, options, _ = BACKENDS[name]
    return load_backend("torch", model=tiny_model(model), dtype="float32", torch=options)


def prompt(length: int, salt: int = 0, vocab: int = 512) -> list[int]:
    return [(13 * i + 7 * salt + 5) % (vocab - 3) + 3 for i in range(length)]


def noop(*kv) -> None:
    pass


def assert_same_logprobs(ours, theirs) -> None:
    assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
    assert [v for _, v in ours.top] == pytest.approx([v for _, v in theirs.top], abs=1e-5)
    assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-5)


# -- the backend: a prefill over a cached prefix equals a whole prefill -----------------


@pytest.mark.parametrize("name", BACKENDS)
def test_a_prefill_over_a_cached_prefix_equals_a_whole_prefill(name):
    _, _, native = BACKENDS[name]
    if native and not NATIVE:
        pytest.skip("the native prefill needs an AVX2 CPU and a C compiler")
    b = backend(name)
    assert (b.native_prefill is not None) == native  # the path this case means to run
    ids = prompt(70)  # past the 16-token window, over one 64-row block
    whole = b.prefill(ids, Sampling(logprobs=3))
    whole_logits = b.prefill_logits(ids, noop)
    for cached in (1, 16, 47, 69):  # one token, a block, past the window, all but the last
        prefix = [(k[:, :cached].clone(), v[:, :cached].clone()) for k, v in whole.layers]
        handed_on = {}
        result = b.prefill(ids, Sampling(logprobs=3), lambda layer, k, v: handed_on.setdefault(layer, (k.clone(), v.clone())), prefix_kv=prefix)
        torch.testing.assert_close(b.prefill_logits(ids, noop, prefix), whole_logits, rtol=1e-5, atol=1e-5)
        assert result.first_token == whole.first_token
        assert_same_logprobs(result.logprobs, whole.logprobs)
        assert sorted(handed_on) == list(range(b.info.num_layers))
        for layer, (keys, values) in enumerate(whole.layers):  # the new tokens' K/V only
            for ours, theirs in ((result.layers[layer][0], keys), (result.layers[layer][1], values), (*handed_on[layer][:1], keys)):
                assert ours.shape == (b.info.kv_heads, len(ids) - cached, b.info.head_dim)
                torch.testing.assert_close(ours, theirs[:, cached:], rtol=1e-5, atol=1e-5)


def test_penalties_count_the_whole_prompt_with_a_cached_prefix():
    """The cached prefix's tokens are not run, but a repetition penalty still counts them."""
    b = backend("llama-modules")
    ids = prompt(40)
    sampling = Sampling(temperature=0.8, seed=11, repetition_penalty=1.5, presence_penalty=0.5, logprobs=2)
    whole = b.prefill(ids, sampling, first_step=3)  # its last 3 tokens generated earlier
    prefix = [(k[:, :32], v[:, :32]) for k, v in whole.layers]
    cached = b.prefill(ids, sampling, first_step=3, prefix_kv=prefix)
    assert cached.first_token == whole.first_token
    assert_same_logprobs(cached.logprobs, whole.logprobs)


@pytest.mark.parametrize("case", ["as long as the prompt", "a layer missing", "other heads"])
def test_a_prefix_that_does_not_fit_is_refused_naming_prefix_kv(case):
    b = backend("llama-modules")
    ids = prompt(20)
    layers = b.prefill(ids, Sampling()).layers
    prefix = {
        "as long as the prompt": [(k, v) for k, v in layers],
        "a layer missing": [(k[:, :4], v[:, :4]) for k, v in layers][1:],
        "other heads": [(k[:1, :4], v[:1, :4]) for k, v in layers],
    }[case]
    with pytest.raises(ValueError, match="prefix_kv"):
        b.prefill(ids, Sampling(), prefix_kv=prefix)


def test_the_neuron_backend_refuses_a_prefix():
    from disagg.engine.backends.neuron.backend import NeuronBackend

    with pytest.raises(ValueError, match="prefix_kv"):  # before any device work: self is not even read
        NeuronBackend.prefill(object(), [1, 2, 3], Sampling(), prefix_kv=[])


# -- the prefill worker, in process, against a stand-in decode worker --------------------


class StandInDecode(wgrpc.DecodeServiceServicer):
    """Records each PushKv's pieces and commit, and each PullKv's request and staged bytes
    (read straight from the stand-in source's memory: same process)."""

    def __init__(self, geometry: KvGeometry):
        self.geometry = geometry
        self.pushed: list[tuple[list[wpb.KvChunk], wpb.KvCommit]] = []
        self.pulled: list[tuple[wpb.PullKvRequest, bytes]] = []

    async def PushKv(self, request_iterator, context):
        pieces, commit = [], None
        async for chunk in request_iterator:
            if chunk.HasField("commit"):
                commit = chunk.commit
            else:
                pieces.append(chunk)
        self.pushed.append((pieces, commit))
        return wpb.KvAck(bytes_received=sum(len(p.data) for p in pieces))

    async def PullKv(self, request, context):
        size = self.geometry.prompt_bytes(request.prompt_len - request.token_start)
        data = ctypes.string_at(request.address + HEADER_BYTES, size) if size else b""
        self.pulled.append((request, data))
        return wpb.KvAck(bytes_received=size)


class StandInSource:
    """NixlSource's staging (the same layout, the same stage_layer) in plain memory, no agent."""

    name, metadata = "stand-in", b"metadata"
    stage_layer = NixlSource.stage_layer

    def __init__(self, geometry: KvGeometry, max_tokens: int):
        self.geometry = geometry
        self.buffers = [StagingBuffer(torch.zeros(HEADER_BYTES + geometry.prompt_bytes(max_tokens), dtype=torch.uint8))]

    def reading(self):
        return contextlib.nullcontext()


class Harness:
    """A PrefillWorker over the shared llama backend, its metrics, and a stand-in decode worker."""

    def __init__(self, decode: StandInDecode, address: str, prefix_cache_gib: float, pull: bool):
        self.decode, self.address = decode, address
        self.registry = CollectorRegistry()
        self.backend = backend("llama-native" if NATIVE else "llama-modules")
        config = PrefillWorkerConfig(model="tiny", dtype="float32", kv_transport="grpc", decode_peers=(address,),
                                     prefix_cache_gib=prefix_cache_gib, block_size=BLOCK)
        self.worker = PrefillWorker(self.backend, config, PrefillMetrics(self.registry))
        if pull:
            self.worker.pull = NixlPullSender(StandInSource(decode.geometry, 128), self.worker._channel, self.worker.metrics, 30.0)

    def metric(self, name: str) -> float:
        return sum(s.value for family in text_string_to_metric_families(_exposition(self.registry)) for s in family.samples if s.name == name)

    async def prefill(self, ids: list[int], token_start: int | None = 0) -> tuple[int, int | None]:
        """(first token, KV bytes acknowledged; None without a target)."""
        target = None if token_start is None else KvTarget(self.address, f"r-{len(self.decode.pushed) + len(self.decode.pulled)}", token_start)
        events = [event async for event in self.worker.prefill(ids, Sampling(), target)]
        assert isinstance(events[0], FirstToken)
        if target is None:
            return events[0].token_id, None
        assert isinstance(events[1], KvSent)
        return events[0].token_id, events[1].bytes


def _exposition(registry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


def run_with_worker(test, prefix_cache_gib: float = 1.0, pull: bool = False):
    """Runs `await test(harness)` with a worker and a stand-in decode worker serving."""

    async def main():
        info = backend("llama-native" if NATIVE else "llama-modules").info
        decode = StandInDecode(KvGeometry(info.num_layers, info.kv_heads, info.head_dim, 4, info.max_seq_len))
        server = grpc.aio.server()
        wgrpc.add_DecodeServiceServicer_to_server(decode, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        harness = Harness(decode, f"127.0.0.1:{port}", prefix_cache_gib, pull)
        try:
            await harness.worker.start()
            await test(harness)
        finally:
            await harness.worker.stop()
            await server.stop(None)

    asyncio.run(main())


@functools.cache
def reference(ids: tuple[int, ...]):
    """A whole prefill of the prompt (no cache): its first token and per-layer K/V."""
    b = backend("llama-native" if NATIVE else "llama-modules")
    return b.prefill(list(ids), Sampling())


def assert_pushed_exactly(pieces: list[wpb.KvChunk], ids: list[int], token_start: int, num_layers: int) -> None:
    """The pieces cover [token_start, len(ids)) of every layer's K and V once each, with the whole prefill's values."""
    whole = reference(tuple(ids)).layers
    covered = {(layer, kind): [] for layer in range(num_layers) for kind in (KvKind.KEY, KvKind.VALUE)}
    for piece in pieces:
        kind = KvKind(piece.kind)
        tensor = torch.frombuffer(bytearray(piece.data), dtype=torch.float32).view(*piece.shape)
        end = piece.token_start + piece.shape[1]
        covered[(piece.layer, kind)].append((piece.token_start, end))
        theirs = whole[piece.layer][0 if kind is KvKind.KEY else 1][:, piece.token_start : end]
        torch.testing.assert_close(tensor, theirs, rtol=1e-5, atol=1e-5)
    for ranges in covered.values():
        ranges.sort()
        tokens = [t for start, end in ranges for t in range(start, end)]
        assert tokens == list(range(token_start, len(ids))), ranges


def assert_staged_exactly(request: wpb.PullKvRequest, data: bytes, ids: list[int], token_start: int) -> None:
    """The staged bytes are [layer][K, V][kv_heads][prompt_len - token_start][head_dim] of the whole prefill's values."""
    whole = reference(tuple(ids)).layers
    assert (request.prompt_len, request.token_start, request.num_layers) == (len(ids), token_start, len(whole))
    expected = torch.cat([t[:, token_start:].reshape(-1) for keys, values in whole for t in (keys, values)]) if token_start < len(ids) else torch.zeros(0)
    torch.testing.assert_close(torch.frombuffer(bytearray(data), dtype=torch.float32) if data else torch.zeros(0), expected, rtol=1e-5, atol=1e-5)


def test_a_prompt_sharing_a_prefix_computes_only_its_suffix_and_sends_the_whole_prompts_kv():
    a = prompt(40)  # two full blocks cached after it
    b = a[:35] + prompt(20, salt=1)  # shares 35 tokens: two whole blocks

    async def test(h: Harness):
        pool = h.worker.prefix_cache.pool
        bytes_per_token = h.backend.info.kv_bytes_per_token(4)
        for ids, hit, queried in ((a, 0, 32), (b, 32, 48), (a, 32, 32), (a[:32], 16, 16)):
            # (a[:32]: its last block is never looked up, as its last token must run; it is cached already)
            before = {name: h.metric(name) for name in ("disagg_prefill_prefix_hit_tokens_total",
                                                        "disagg_prefill_prefix_queried_tokens_total", "disagg_prefill_computed_tokens_total")}
            first, sent = await h.prefill(ids)
            assert first == reference(tuple(ids)).first_token
            assert sent == len(ids) * bytes_per_token
            pieces, commit = h.decode.pushed[-1]
            assert (commit.prompt_len, commit.first_token) == (len(ids), first)
            assert_pushed_exactly(pieces, ids, 0, h.backend.info.num_layers)
            assert h.metric("disagg_prefill_prefix_hit_tokens_total") - before["disagg_prefill_prefix_hit_tokens_total"] == hit
            assert h.metric("disagg_prefill_prefix_queried_tokens_total") - before["disagg_prefill_prefix_queried_tokens_total"] == queried
            assert h.metric("disagg_prefill_computed_tokens_total") - before["disagg_prefill_computed_tokens_total"] == len(ids) - hit
            pool.check_integrity()
            assert pool.used_blocks == 0  # every table released
        # a's 2 blocks, then b's third: nothing else was kept (a[:32]'s second block was a's own)
        assert (pool.cached_blocks, h.metric("disagg_prefill_kv_blocks")) == (3, pool.usable)
        # Without a target (a request for one token) the prompt is cached all the same.
        assert (await h.prefill(prompt(33, salt=2), token_start=None)) == (reference(tuple(prompt(33, salt=2))).first_token, None)
        assert pool.cached_blocks == 5

    run_with_worker(test)


@pytest.mark.parametrize("pull", [False, True], ids=["grpc-push", "nixl-staging"])
def test_token_start_sends_exactly_the_kv_of_the_tokens_from_it(pull):
    """The decode worker holds [0, T): KV of [T, L) only, from the cached prefix where T < P."""
    ids = prompt(55, salt=3)

    async def test(h: Harness):
        bytes_per_token = h.backend.info.kv_bytes_per_token(4)
        await h.prefill(ids)  # caches its 3 full blocks: later runs take 48 tokens from the cache
        for token_start in (0, 20, 48, 50, 55):  # all, from the cached prefix, at its end, past it, nothing (a commit alone)
            first, sent = await h.prefill(ids, token_start)
            assert first == reference(tuple(ids)).first_token
            assert sent == (len(ids) - token_start) * bytes_per_token
            if pull:
                request, data = h.decode.pulled[-1]
                assert_staged_exactly(request, data, ids, token_start)
            else:
                pieces, commit = h.decode.pushed[-1]
                assert commit.prompt_len == len(ids)
                assert_pushed_exactly(pieces, ids, token_start, h.backend.info.num_layers)
        assert h.metric("disagg_prefill_prefix_hit_tokens_total") == 5 * 48

    run_with_worker(test, pull=pull)


def test_eviction_under_a_tiny_cache_stays_exact():
    info = backend("llama-native" if NATIVE else "llama-modules").info
    gib = 5 * PrefixCache.block_bytes(info, torch.float32, BLOCK) / 2**30  # blocks 1-4 usable

    async def test(h: Harness):
        pool = h.worker.prefix_cache.pool
        assert pool.usable == 4
        prompts = [prompt(40, salt=10 + i) for i in range(3)]  # two blocks each: the third evicts the first
        for ids in prompts + prompts[:1] + [prompts[0][:34] + prompt(10, salt=20)]:
            first, sent = await h.prefill(ids, token_start=5)
            assert first == reference(tuple(ids)).first_token
            assert_pushed_exactly(h.decode.pushed[-1][0], ids, 5, info.num_layers)
            pool.check_integrity()
        assert h.metric("disagg_prefill_prefix_evicted_blocks_total") >= 4
        assert h.metric("disagg_prefill_prefix_hit_tokens_total") == 32  # the last prompt found the first's blocks, cached again
        # A prompt of more blocks than the pool holds prefills uncached, exactly, and leaves the cache as it was.
        cached = pool.cached_blocks
        long = prompt(90, salt=30)
        assert (await h.prefill(long))[0] == reference(tuple(long)).first_token
        assert_pushed_exactly(h.decode.pushed[-1][0], long, 0, info.num_layers)
        assert pool.cached_blocks == cached and h.metric("disagg_prefill_computed_tokens_total") >= len(long)

    run_with_worker(test, prefix_cache_gib=gib)


def test_a_prefill_that_fails_midway_publishes_nothing_and_releases_its_blocks():
    ids = prompt(50, salt=40)

    async def test(h: Harness):
        pool, real = h.worker.prefix_cache.pool, h.worker._prefill_step

        def failing(token_ids, sampling, on_layer, first_step, **kwargs):
            def on_layer_then_fail(layer, keys, values):
                on_layer(layer, keys, values)
                if layer == 1:
                    raise RuntimeError("the device went away mid-prompt")

            return real(token_ids, sampling, on_layer_then_fail, first_step, **kwargs)

        h.worker._prefill_step = failing
        with pytest.raises(RequestError, match="went away") as failed:
            await h.prefill(ids)
        assert failed.value.code == grpc.StatusCode.INTERNAL
        pool.check_integrity()
        assert (pool.used_blocks, pool.cached_blocks) == (0, 0)  # the blocks it took are free again, none published
        h.worker._prefill_step = real
        first, _ = await h.prefill(ids)  # nothing found: computed whole, exactly, and cached now
        assert first == reference(tuple(ids)).first_token and pool.stats.hit_tokens == 0 and pool.cached_blocks == 3

    run_with_worker(test)


def test_token_start_out_of_range_is_refused_naming_the_field():
    ids = list(range(3, 13))
    for token_start in (-1, 11):
        request = wpb.PrefillRequest(request_id="r", token_ids=ids, sampling=wpb.WorkerSampling(top_p=1.0),
                                     kv_target=wpb.KvTarget(address="127.0.0.1:1", reservation_id="r0", token_start=token_start))
        with pytest.raises(RequestError) as refused:
            worker_messages.prefill_order_from_pb(request, backend("llama-modules").info)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and str(refused.value).startswith("kv_target.token_start ")
    request.kv_target.token_start = 10  # all of it held: only the commit goes
    assert worker_messages.prefill_order_from_pb(request, backend("llama-modules").info).target == ("127.0.0.1:1", "r0", 10)

    async def test(h: Harness):
        with pytest.raises(RequestError, match="kv_target.token_start"):
            await h.prefill(ids, token_start=11)

    run_with_worker(test)


def test_prefix_caching_is_off_on_the_neuron_backend_and_by_flag(caplog):
    from prefill_worker.__main__ import parse_config

    real = backend("llama-modules")

    class NeuronLike:
        info = replace(real.info, backend="neuron")
        prefill = real.prefill

    config = PrefillWorkerConfig(model="tiny", dtype="float32", kv_transport="grpc", decode_peers=("127.0.0.1:1",))
    with caplog.at_level(logging.INFO, logger="prefill_worker.worker"):
        worker = PrefillWorker(NeuronLike(), config, PrefillMetrics(CollectorRegistry()))
    assert worker.prefix_cache is None
    assert [r.message for r in caplog.records if "prefix caching off" in r.message] == [
        "prefix caching off: the neuron backend prefills whole prompts (NxDI's context encoding takes no cached prefix)"
    ]
    asyncio.run(worker.stop())
    for flags, on in ((["--no-prefix-caching"], False), (["--prefix-cache-gib", "0"], False), ([], True)):
        worker = PrefillWorker(real, parse_config(["--model", tiny_model("llama"), "--decode", "127.0.0.1:1", "--kv-transport", "grpc", *flags]),
                               PrefillMetrics(CollectorRegistry()))
        assert (worker.prefix_cache is not None) == on, flags
        asyncio.run(worker.stop())
    config = parse_config(["--model", tiny_model("llama"), "--decode", "127.0.0.1:1", "--prefix-cache-gib", "0.25", "--block-size", "32"])
    assert (config.prefix_caching, config.prefix_cache_gib, config.block_size) == (True, 0.25, 32)
    with pytest.raises(SystemExit):
        parse_config(["--model", tiny_model("llama"), "--decode", "127.0.0.1:1", "--block-size", "0"])


# -- a real cluster ---------------------------------------------------------------------


def prefill_metric(cluster, name: str) -> float:
    (process,) = [p for p in cluster.processes if p.name.startswith("prefill")]
    text = urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def test_prompts_sharing_a_prefix_through_a_cluster_equal_generate(llama_cluster, llama_ref):
    from disagg.clients.grpc_client import Client

    context = prompt(50, salt=50)  # three whole blocks, then the questions differ
    prompts = [context + prompt(9 + i, salt=60 + i) for i in range(3)]
    hits = prefill_metric(llama_cluster, "disagg_prefill_prefix_hit_tokens_total")
    with Client(llama_cluster.router_address, timeout=60) as client:
        for ids in prompts:
            assert client.complete(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True).token_ids == llama_ref.greedy(ids, 8, ignore_eos=True)
    assert prefill_metric(llama_cluster, "disagg_prefill_prefix_hit_tokens_total") - hits == 2 * 48

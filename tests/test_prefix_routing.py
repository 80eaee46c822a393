"""Cache-aware routing (router/prefix_index.py): the index, the picks on a WorkerPool, and two
tenants through a real cluster of two prefill and two decode workers."""

from __future__ import annotations

import asyncio
import random
import urllib.request

import httpx
import pytest
from conftest import assert_nothing_held, start_cluster
from grpc_health.v1 import health_pb2
from polling import eventually
from prometheus_client.parser import text_string_to_metric_families

from disagg.engine.kv_blocks import block_hashes
from disagg.v1 import worker_pb2 as wpb
from router.prefix_index import PREFILL_QUEUE_SLACK, ROUTER_SALT, PrefixIndex, RoutedPrompt, WorkerBlocks, choose_by_overlap
from router.workers import Worker, WorkerPool

BLOCK = 16


def ids(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(count)]


def routed(index: PrefixIndex, token_ids: list[int]) -> RoutedPrompt:
    return RoutedPrompt(index.hashes(token_ids), len(token_ids))


class FakeHealth:
    def __init__(self, status=health_pb2.HealthCheckResponse.SERVING):
        self.status = status

    async def Check(self, request, timeout=None):
        return health_pb2.HealthCheckResponse(status=self.status)


class FakeChannel:
    async def close(self, grace=None):
        pass


def worker(name: str, role: str, capacity: int = 4, queued: int = 0) -> Worker:
    load = wpb.WorkerLoad(capacity=capacity, queued=queued)
    return Worker(name, role, FakeChannel(), None, FakeHealth(), healthy=True, load=load)


def make_pool(enabled: bool = True, prefill: int = 2, decode: int = 2, capacity: int = 4, observe=None) -> WorkerPool:
    return WorkerPool(
        prefill=[worker(f"p{i}", "prefill") for i in range(prefill)],
        decode=[worker(f"d{i}", "decode", capacity) for i in range(decode)],
        max_queue=8, poll_seconds=1.0, prefix=PrefixIndex(BLOCK, enabled, observe=observe),
    )


# -- the index -----------------------------------------------------------------
def test_overlap_counts_leading_blocks_and_the_lru_keeps_a_prompts_first_blocks_longest():
    blocks = WorkerBlocks(capacity=6)
    first, second = block_hashes(ids(1, 64), BLOCK, ROUTER_SALT), block_hashes(ids(2, 64), BLOCK, ROUTER_SALT)
    blocks.record(first)
    assert blocks.overlap(first) == 4 and blocks.overlap(first[:2] + second[2:]) == 2 and blocks.overlap(second) == 0
    blocks.record(second)  # 8 hashes in 6 places: the least recently sent go, the first prompt's last blocks first
    assert len(blocks) == 6 and blocks.overlap(second) == 4 and blocks.overlap(first) == 2
    blocks.record(first[:1])  # sent again: most recent now
    blocks.record(ids_hashes := block_hashes(ids(3, 64), BLOCK, ROUTER_SALT))
    assert blocks.overlap(ids_hashes) == 4 and blocks.overlap(first) == 1 and blocks.overlap(second) == 1


def test_the_index_hashes_full_blocks_with_its_own_salt_and_nothing_when_off():
    on, off = PrefixIndex(BLOCK), PrefixIndex(BLOCK, enabled=False)
    prompt = ids(4, 40)
    assert on.hashes(prompt) == tuple(block_hashes(prompt, BLOCK, "router")) and len(on.hashes(prompt)) == 2
    assert off.hashes(prompt) == ()
    assert PrefixIndex(BLOCK, index_tokens=3 * BLOCK).hashes(ids(5, 100)) == tuple(block_hashes(ids(5, 100), BLOCK, "router"))[:3]


def test_the_policy_weighs_blocks_against_extra_load_and_skips_deep_queues():
    overlap = {"a": 3, "b": 0, "c": 5}
    loads = {"a": 0, "b": 0, "c": 3}
    pick = choose_by_overlap(["a", "b", "c"], loads.get, overlap.get, BLOCK)
    assert pick == "a"  # c: 5 blocks - 3 requests of extra load = 2 < a's 3
    assert choose_by_overlap(["a", "b", "c"], loads.get, {"a": 1, "b": 0, "c": 5}.get, BLOCK) == "c"
    assert choose_by_overlap(["a", "b", "c"], loads.get, {"a": 0, "b": 0, "c": 5}.get, BLOCK, max_extra_load=2) is None
    assert choose_by_overlap(["a", "b"], {"a": 2, "b": 0}.get, {"a": 2, "b": 0}.get, BLOCK) is None  # a hit that does not beat its load
    assert choose_by_overlap(["a", "b"], {"a": 0, "b": 0}.get, {"a": 2, "b": 2}.get, BLOCK) == "a"  # a tie: the first


# -- the picks on a pool ---------------------------------------------------------
def test_overlap_wins_when_loads_are_close():
    async def run():
        pool = make_pool()
        tenant = ids(10, 64)
        first = await pool.acquire_decode(prompt=routed(pool.prefix, tenant + ids(11, 8)))
        prefill = pool.pick_prefill(prompt=routed(pool.prefix, tenant + ids(11, 8)))
        assert (first.address, prefill.address) == ("d0", "p0")  # no hit anywhere: as without an index
        pool.release_decode(first)
        held = await pool.acquire_decode()  # someone else's request on d0: d1 has more free slots
        assert held.address == "d0"
        pool.prefill[0].outstanding = 1  # and a prefill in flight on p0
        turn = routed(pool.prefix, tenant + ids(12, 8))
        assert (await pool.acquire_decode(prompt=turn)).address == "d0"
        assert pool.pick_prefill(prompt=turn).address == "p0"
        stranger = routed(pool.prefix, ids(13, 72))
        assert (await pool.acquire_decode(prompt=stranger)).address == "d1"  # no hit: the most free slots
        assert pool.pick_prefill(prompt=stranger).address == "p1"

    asyncio.run(run())


def test_load_wins_when_the_overlap_worker_is_saturated():
    async def run():
        pool = make_pool(capacity=2)
        tenant = ids(20, 64)
        assert (await pool.acquire_decode(prompt=routed(pool.prefix, tenant))).address == "d0"
        assert pool.pick_prefill(prompt=routed(pool.prefix, tenant)).address == "p0"
        pool.decode[0].outstanding = 2  # d0 now has no free slot
        assert (await pool.acquire_decode(prompt=routed(pool.prefix, tenant + ids(21, 8)))).address == "d1"
        pool.prefill[0].load = wpb.WorkerLoad(queued=PREFILL_QUEUE_SLACK + 1)  # a deep queue on p0
        assert pool.pick_prefill(prompt=routed(pool.prefix, tenant + ids(21, 8))).address == "p1"

    asyncio.run(run())


def test_a_waiter_is_admitted_where_its_prefix_is():
    async def run():
        pool = make_pool(capacity=2)
        holder = await pool.acquire_decode(prompt=routed(pool.prefix, ids(30, 64)))
        pool.decode[0].outstanding = pool.decode[1].outstanding = 2  # every slot taken
        waiter = asyncio.ensure_future(pool.acquire_decode(prompt=routed(pool.prefix, ids(30, 64) + ids(31, 8))))
        await asyncio.sleep(0)
        assert pool.queued == 1
        pool.decode[1].outstanding = 0  # d1 empties before the queue is served: it has the most free slots
        pool.release_decode(holder)
        assert (await asyncio.wait_for(waiter, 1)).address == "d0"

    asyncio.run(run())


def test_an_unavailable_removed_or_not_serving_workers_index_is_forgotten():
    async def run():
        pool = make_pool()
        tenant = routed(pool.prefix, ids(40, 64))
        d0, d1, p0, p1 = pool.decode + pool.prefill
        for w in (d1, p0, p1):
            pool.prefix.record(w, tenant)
        d1.outstanding = 1
        first = await pool.acquire_decode(prompt=tenant)
        assert first is d1  # its hit outweighs one request of extra load
        pool.release_decode(first)
        pool.mark_unavailable(d1)
        assert pool.prefix.held(d1) == 0 and pool.prefix.held(p0) == 4
        d1.healthy = True  # back, and cold: load alone picks
        assert (await pool.acquire_decode(prompt=tenant)) is d0
        p0.health = FakeHealth(health_pb2.HealthCheckResponse.NOT_SERVING)  # draining or restarting
        await pool._poll(p0)
        assert not p0.healthy and pool.prefix.held(p0) == 0 and pool.prefix.held(p1) == 4
        pool._apply("prefill", [])  # discovery removed p1
        assert pool.prefix.held(p1) == 0 and p1 in pool.retired

    asyncio.run(run())


def test_off_or_without_overlap_the_picks_are_exactly_the_load_based_ones():
    """The same random traffic through a pool without an index, one with it off, and one with it on
    but prompts that share no block: every pick the same."""

    async def drive(pool: WorkerPool, prompts, rng: random.Random) -> list[str]:
        picks, held = [], []
        for step in range(200):
            prompt = routed(pool.prefix, prompts[step])
            if held and rng.random() < 0.45:
                pool.release_decode(held.pop(rng.randrange(len(held))))
            elif sum(w.free_slots for w in pool.decode) > 0:
                held.append(await pool.acquire_decode(prompt=prompt))
                picks.append(held[-1].address)
            pool.prefill[rng.randrange(2)].outstanding = rng.randrange(3)
            picks.append(pool.pick_prefill(prompt=prompt).address)
        return picks

    async def run():
        prompts = [ids(1000 + i, 40) for i in range(200)]
        baseline = WorkerPool(prefill=make_pool().prefill, decode=make_pool(capacity=3).decode, max_queue=8, poll_seconds=1.0)
        results = [await drive(baseline, prompts, random.Random(7))]
        for enabled in (False, True):
            results.append(await drive(make_pool(enabled, capacity=3), prompts, random.Random(7)))
        assert results[0] == results[1] == results[2]
        assert set(results[0]) == {"d0", "d1", "p0", "p1"}  # the traffic did move between workers

    asyncio.run(run())


def test_routed_and_hit_tokens_are_observed_per_role():
    seen = []
    pool = make_pool(observe=lambda role, tokens, hit: seen.append((role, tokens, hit)))
    tenant = ids(50, 64)
    pool.pick_prefill(prompt=routed(pool.prefix, tenant + ids(51, 10)))
    pool.pick_prefill(prompt=routed(pool.prefix, tenant + ids(52, 10)))
    assert seen == [("prefill", 74, 0), ("prefill", 74, 64)]


def test_router_and_serve_flags():
    from disagg.cli.main import build_parser, serve_router_args, serve_worker_args
    from router.__main__ import parse_config

    config = parse_config(["--model", "unused", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"])
    assert (config.block_size, config.prefix_caching) == (16, True)
    config = parse_config(["--model", "unused", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--block-size", "32", "--no-prefix-caching"])
    assert (config.block_size, config.prefix_caching) == (32, False)
    with pytest.raises(SystemExit):
        parse_config(["--model", "unused", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--block-size", "0"])
    assert serve_router_args(build_parser().parse_args(["serve"])) == []
    args = build_parser().parse_args(["serve", "--block-size", "32", "--no-prefix-caching"])
    assert serve_router_args(args) == ["--block-size", "32", "--no-prefix-caching"]
    args_given = serve_worker_args(args)[-3:]
    assert args_given == ["--block-size", "32", "--no-prefix-caching"]  # both workers' caches alike
    from decode_worker.__main__ import parse_config as decode_config
    from prefill_worker.__main__ import parse_config as prefill_config

    for worker_config in (decode_config(["--model", "m", *args_given]), prefill_config(["--model", "m", "--decode", "127.0.0.1:2", *args_given])):
        assert (worker_config.block_size, worker_config.prefix_caching) == (32, False)  # and the workers take them


# -- two tenants through real processes ------------------------------------------
PREFIX_BLOCKS = 6
NEW_TOKENS = 4
ROUNDS = 3  # per tenant


@pytest.fixture(scope="module")
def two_by_two_http(cluster_logs):
    # A small KV cache: what the test needs, and four workers start sooner in less memory.
    cluster = start_cluster(cluster_logs / "prefix-routing", "llama", prefill=2, decode=2, batch_size=8, http_port=0, decode_args=["--kv-cache-gib", "0.25"])
    yield cluster
    cluster.stop()


def scrape(process) -> dict[tuple, float]:
    text = urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def served(cluster) -> dict[str, float]:
    """Per worker, what it has served: prefills run (counted before the first token leaves), tokens that decode steps made."""
    counts = {}
    for process in cluster.processes:
        samples = scrape(process)
        if process.name.startswith("prefill"):
            counts[process.name] = samples.get(("disagg_prefill_seconds_count", ()), 0.0)
        elif process.name.startswith("decode"):
            counts[process.name] = samples.get(("disagg_decode_tokens_total", ()), 0.0)
    return counts


def one_round(cluster, prompts: list[list[int]], before: dict[str, float]) -> tuple[list[list[int]], dict[str, float], dict[str, float]]:
    """The prompts as one HTTP batch (their generations start together, so each pick sees the others'
    slots taken); returns their tokens and, once every count has come in, each worker's share."""
    body = {"prompt": prompts, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    tokens = [c["token_ids"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]

    def settled():
        after = served(cluster)
        delta = {name: after[name] - before[name] for name in after}
        assert sum(v for k, v in delta.items() if k.startswith("prefill")) == len(prompts)
        assert sum(v for k, v in delta.items() if k.startswith("decode")) == len(prompts) * (NEW_TOKENS - 1)  # the first from prefill
        return after, delta

    after, delta = eventually(settled)
    return tokens, after, delta


def test_each_tenants_turns_stay_on_one_prefill_and_one_decode_worker(two_by_two_http, llama_ref):
    """Two tenants, each a 96-token context and a new question per turn, take turns; each turn is two
    of the tenant's questions at once. Without the index the second of each pair goes to the other
    decode worker (it has more free slots) and pairs move between workers from turn to turn."""
    cluster = two_by_two_http
    contexts = {"a": ids(60, PREFIX_BLOCKS * BLOCK), "b": ids(61, PREFIX_BLOCKS * BLOCK)}
    where: dict[str, set[tuple[str, ...]]] = {"a": set(), "b": set()}
    router_before = scrape(cluster.process("router"))
    counts = served(cluster)
    for turn in range(ROUNDS):
        for tenant, context in contexts.items():
            prompts = [context + ids(100 * turn + 10 * ord(tenant) + i, 8) for i in range(2)]
            tokens, counts, delta = one_round(cluster, prompts, counts)
            assert tokens == [llama_ref.greedy(p, NEW_TOKENS, ignore_eos=True) for p in prompts]
            # Both prompts on one worker of each role: every count this turn added sits on it.
            assert sorted(delta.values()) == [0, 0, 2, 2 * (NEW_TOKENS - 1)], delta
            where[tenant].add(tuple(sorted(name for name, v in delta.items() if v)))
    assert all(len(places) == 1 for places in where.values()), where
    router = scrape(cluster.process("router"))
    for role in ("prefill", "decode"):
        hits = router[("disagg_router_routed_hit_tokens_total", (("role", role),))] - router_before.get(
            ("disagg_router_routed_hit_tokens_total", (("role", role),)), 0.0)
        routed_tokens = router[("disagg_router_routed_prompt_tokens_total", (("role", role),))] - router_before.get(
            ("disagg_router_routed_prompt_tokens_total", (("role", role),)), 0.0)
        # Every prompt but each tenant's first found its context's blocks where it went.
        assert hits == (2 * ROUNDS - 1) * 2 * PREFIX_BLOCKS * BLOCK and routed_tokens == 2 * ROUNDS * 2 * (PREFIX_BLOCKS * BLOCK + 8)
    assert_nothing_held(cluster)

"""Speculation across the split: the router uses only workers whose speculation settings are the pool's
(router/speculation.py), and `disagg bench` reports what the decode workers' speculative steps did."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import re
import urllib.request

import grpc
import pytest
from conftest import tiny_model
from polling import wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_speculation import PLAIN, REPEATING

from disagg.clients.grpc_client import AsyncClient, Client
from disagg.rpc.worker_config import WorkerConfig
from disagg.rpc.worker_messages import speculation_to_pb
from disagg.tools.loadgen import scrape_speculation, speculation_lines, speculation_summary
from disagg.v1 import worker_pb2 as wpb
from router.speculation import Speculation
from router.workers import Worker, WorkerPool

NGRAM = ["--speculative-method", "ngram"]
REFUSED = re.compile(r"(prefill|decode) worker (\S+) refused: its speculation \((.*?)\) is not the pool's \((.*?)\)")


# -- the pool's rule, in process ------------------------------------------------------


def load(method: str = "", num_tokens: int = 0, draft_model: str = "") -> wpb.WorkerLoad:
    speculation = wpb.WorkerSpeculation(method=method, num_tokens=num_tokens, draft_model=draft_model) if method else None
    return wpb.WorkerLoad(capacity=4, speculation=speculation)


def worker(address: str, **settings) -> Worker:
    return Worker(address, "prefill" if address.startswith("p") else "decode", None, None, None, load=load(**settings))


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if " refused: " in r.getMessage()]


def test_a_worker_reports_its_speculation_as_the_router_compares_it():
    assert speculation_to_pb(WorkerConfig(model="m")) is None
    ngram = speculation_to_pb(WorkerConfig(model="m", speculative_method="ngram"))
    assert (ngram.method, ngram.num_tokens, ngram.draft_model) == ("ngram", 4, "")  # the default count, resolved
    draft = speculation_to_pb(WorkerConfig(model="m", speculative_method="draft", draft_model="/mnt/a/llama-draft/", num_speculative_tokens=3))
    assert (draft.method, draft.num_tokens, draft.draft_model) == ("draft", 3, "llama-draft")  # named as a model is, not by its path


def test_the_pools_speculation_is_most_workers_and_one_that_differs_gets_no_request_and_one_line(caplog):
    caplog.set_level(logging.INFO, logger="router.workers")
    p0, d0, d1 = worker("p0"), worker("d0", method="ngram", num_tokens=4), worker("d1", method="ngram", num_tokens=4)
    pool = WorkerPool(prefill=[p0], decode=[d0, d1], max_queue=4, poll_seconds=1.0)
    pool._take_in([p0, d0, d1])
    assert pool.speculation == Speculation("ngram", 4) and (p0.healthy, d0.healthy, d1.healthy) == (False, True, True)
    assert refusals(caplog) == [
        "prefill worker p0 refused: its speculation (off) is not the pool's (ngram, 4 tokens); it gets no requests until it comes back with"
        " the pool's (every prefill and decode worker needs the same --speculative-method, --num-speculative-tokens and --draft-model)"
    ]
    pool._take_in([p0, d0, d1])  # polled again, as it was: no second line
    assert len(refusals(caplog)) == 1 and not pool.ready()

    # While the pool serves on a worker its settings stay, though a newcomer of others would be the most.
    d2, d3 = worker("d2", method="draft", num_tokens=4, draft_model="a"), worker("d3", method="draft", num_tokens=4, draft_model="b")
    pool.decode += [d2, d3]
    pool._take_in([p0, d0, d1, d2, d3])
    assert not d2.healthy and not d3.healthy and "(draft a, 4 tokens)" in refusals(caplog)[1] and "(draft b, 4 tokens)" in refusals(caplog)[2]

    # p0 comes back with the pool's settings: used.
    p0.load = load("ngram", 4)
    pool._take_in([p0, d0, d1, d2, d3])
    assert p0.healthy and p0.refused is None and pool.ready()

    # Once it serves on none, the settings are decided anew; a tie goes to the first in the pool's order (prefill first).
    fresh = WorkerPool(prefill=[worker("p0")], decode=[worker("d0", method="ngram", num_tokens=2)], max_queue=4, poll_seconds=1.0)
    fresh._take_in(fresh.workers)
    assert fresh.speculation == Speculation() and fresh.prefill[0].healthy and not fresh.decode[0].healthy


def test_the_speculation_summary_is_the_counters_growth_and_none_without_guesses():
    before = {"a": {("proposed", 1): 10.0, ("proposed", 2): 8.0, ("accepted", 1): 6.0, ("accepted", 2): 3.0}, "b": {}, "c": None}
    after = {"a": {("proposed", 1): 30.0, ("proposed", 2): 20.0, ("accepted", 1): 16.0, ("accepted", 2): 6.0},
             "b": {("proposed", 1): 5.0, ("accepted", 1): 5.0}, "c": None}
    spec = speculation_summary(before, after)
    assert spec["steps"] == 25 and spec["proposed_per_step"] == 37 / 25 and spec["accepted_per_step"] == 18 / 25
    assert spec["emitted_per_step"] == 1 + 18 / 25 and spec["acceptance_rate"] == 18 / 37
    assert spec["acceptance_by_position"] == {"1": 15 / 25, "2": 3 / 12} and spec["unreachable"] == ["c"]
    assert speculation_lines(spec)[0] == "speculation: metrics not read from c"
    restarted = speculation_summary({"a": {("proposed", 1): 50.0}}, {"a": {("proposed", 1): 4.0, ("accepted", 1): 1.0}})
    assert restarted["steps"] == 4 and restarted["acceptance_rate"] == 0.25  # its counters began again from zero
    del after["c"]
    assert speculation_summary(after, after) is None and speculation_lines(None) == []  # nothing guessed in between


# -- through real processes ------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_workers(cluster_logs):
    """A prefill worker and a decode worker with prompt lookup, and a decode worker without it, all serving; no router yet."""
    from disagg.tools.local_cluster import ClusterSpec, LocalCluster

    cluster = LocalCluster(ClusterSpec(model=tiny_model("llama"), dtype="float32", compile=False, threads_per_worker=1,
                                       log_dir=str(cluster_logs / "speculation-mixed")))
    try:
        speculating, plain = cluster.add_workers("decode", [["--batch-size", "4", *NGRAM], ["--batch-size", "4"]])
        (prefill,) = cluster.add_workers("prefill", [NGRAM])  # the decode workers started so far are its pool
        for process in (speculating, plain, prefill):  # every worker up before a router polls: its first poll sees them all
            cluster.wait_serving(180, process.address)
        yield cluster, prefill, speculating, plain
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def router_over_all(mixed_workers):
    """A router over the three workers, serving."""
    cluster, prefill, speculating, plain = mixed_workers
    router = cluster.add_router([prefill.address], [speculating.address, plain.address])
    cluster.wait_serving(120, router.address)
    return router


def refusal_lines(cluster, router) -> list[re.Match]:
    return [m for line in pathlib.Path(cluster.log_path(router.name)).read_text().splitlines() if (m := REFUSED.search(line))]


def scrape(process) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5).read().decode()
    return {f"{s.name}{sorted(s.labels.items())}": s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_prefill_worker_and_a_decode_worker_of_different_speculation_are_not_served_together(mixed_workers):
    """The router's line names the refused worker and both settings; with no pair left, every request is UNAVAILABLE."""
    cluster, prefill, _, plain = mixed_workers
    router = cluster.add_router([prefill.address], [plain.address])
    (line,) = wait_for(lambda: refusal_lines(cluster, router), within=120, what="the router's refusal line")
    role, address, carried, pool = line.groups()
    assert (role, address) in {("prefill", prefill.address), ("decode", plain.address)}  # a tie: the first one the router took in sets the pool's
    assert {carried, pool} == {"off", "ngram, 4 tokens"} and (carried == "off") == (role == "decode")
    with Client(router.address, timeout=30) as client, pytest.raises(grpc.RpcError) as refused:
        client.complete(PLAIN[0], max_new_tokens=4)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_decode_worker_of_other_speculation_gets_no_request_and_the_rest_serve_exactly(mixed_workers, router_over_all, llama_ref):
    (cluster, _, speculating, plain), router = mixed_workers, router_over_all
    (line,) = refusal_lines(cluster, router)  # logged before the router served: it had taken in the pool's workers
    assert line.groups() == ("decode", plain.address, "off", "ngram, 4 tokens")
    cases = [(REPEATING, 40), (PLAIN[0], 20), (REPEATING, 24), (PLAIN[1], 30)]

    async def together():
        async with AsyncClient(router.address, timeout=120) as client:
            return await asyncio.gather(*(client.complete(prompt, max_new_tokens=n, ignore_eos=True) for prompt, n in cases))

    for (prompt, n), result in zip(cases, asyncio.run(together())):
        assert result.token_ids == llama_ref.greedy(prompt, n, ignore_eos=True)
    assert scrape(plain).get("disagg_decode_tokens_total[]", 0.0) == 0  # four at once, and none on it
    assert scrape(speculating)["disagg_decode_tokens_total[]"] > 0 and scrape(speculating)["disagg_decode_spec_accepted_tokens_total[('position', '1')]"] > 0
    assert scrape(router)["disagg_router_workers_available[('role', 'decode')]"] == 1


def test_bench_reports_the_speculating_workers_figures(mixed_workers, router_over_all, tmp_path, capsys):
    """`disagg bench` against a speculating service: its speculation section, consistent with the workers' own counters."""
    from disagg.cli.main import main

    (_, _, speculating, plain), router = mixed_workers, router_over_all
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": prompt, "output_len": 32}) + "\n" for prompt in [REPEATING, PLAIN[2], REPEATING, PLAIN[3]]))
    before = scrape_speculation(speculating.metrics_address)
    status = main(["bench", "--address", router.address, "--metrics", speculating.metrics_address, "--metrics", plain.metrics_address,
                   "--dataset", str(dataset), "--requests", "4", "--warmup", "0", "--concurrency", "2", "--no-progress", "--json", str(tmp_path / "run.json")])
    assert status == 0
    grown = {key: value - before.get(key, 0.0) for key, value in scrape_speculation(speculating.metrics_address).items()}
    report = capsys.readouterr().out
    assert re.search(r"speculation \(\d+ steps with guesses\): per step [\d.]+ proposed, [\d.]+ accepted, [\d.]+ emitted; acceptance [\d.]+%", report)
    assert "acceptance by position: 1: " in report
    (run,) = json.loads((tmp_path / "run.json").read_text())
    spec = run["speculation"]
    assert spec["steps"] == grown["proposed", 1] > 0 and spec["unreachable"] == []
    assert spec["proposed_per_step"] * spec["steps"] == pytest.approx(sum(v for (kind, _), v in grown.items() if kind == "proposed"))
    assert 0 <= spec["accepted_per_step"] <= spec["proposed_per_step"] and spec["emitted_per_step"] == pytest.approx(1 + spec["accepted_per_step"])
    assert 0 <= spec["acceptance_rate"] <= 1 and all(0 <= rate <= 1 for rate in spec["acceptance_by_position"].values())

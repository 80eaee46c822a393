"""Every part serves Prometheus metrics on its own port; the counts add up."""

from __future__ import annotations

import urllib.request

from conftest import DEFAULT_TRANSPORT
from polling import eventually
from prometheus_client.parser import text_string_to_metric_families

from disagg.clients.grpc_client import Client

PROMPTS = ["The cat slept", "The market is busy on Saturdays", "A clock tower stands"]
NEW_TOKENS = 9


def scrape(address: str) -> dict[tuple, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counts_after_a_few_requests(llama_cluster, llama_ref):
    parts = {p.name: p.metrics_address for p in llama_cluster.processes}
    before = {name: scrape(address) for name, address in parts.items()}
    with Client(llama_cluster.router_address, timeout=60) as client:
        results = [client.complete(p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in PROMPTS]
    # A part may count a call just after its client has the answer (a slot freed, a
    # transfer's seconds observed): the counts are checked until they add up.
    eventually(lambda: check_counts(parts, before, results, llama_ref))


def check_counts(parts: dict, before: dict, results: list, llama_ref) -> None:
    after = {name: scrape(address) for name, address in parts.items()}

    def delta(part, name, **labels):
        return value(after[part], name, **labels) - value(before[part], name, **labels)

    n = len(PROMPTS)
    tokens = sum(r.completion_tokens for r in results)
    assert tokens == n * NEW_TOKENS
    assert delta("router", "disagg_router_requests_total", outcome="ok") == n
    assert delta("router", "disagg_router_time_to_first_token_seconds_count") == n
    assert delta("router", "disagg_router_request_seconds_count") == n
    assert delta("router", "disagg_router_generated_tokens_total") == tokens
    assert delta("router", "disagg_router_inter_token_latency_seconds_count") == tokens - n
    assert value(after["router"], "disagg_router_in_flight_requests") == 0

    config = llama_ref.model.config
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4  # float32
    kv_bytes = sum(len(llama_ref.ids(p)) for p in PROMPTS) * kv_bytes_per_token
    assert delta("prefill-0", "disagg_prefill_requests_total", outcome="ok") == n
    assert delta("prefill-0", "disagg_prefill_seconds_count") == n
    by_transport = {"transport": DEFAULT_TRANSPORT}
    assert delta("prefill-0", "disagg_prefill_kv_transfer_bytes_total", **by_transport) == kv_bytes
    assert delta("prefill-0", "disagg_prefill_kv_transfer_seconds_count", **by_transport) == n
    assert delta("decode-0", "disagg_decode_kv_received_bytes_total", **by_transport) == kv_bytes
    assert delta("decode-0", "disagg_decode_kv_receive_seconds_count", **by_transport) == n
    assert delta("decode-0", "disagg_decode_tokens_total") == tokens - n  # the first tokens came from prefill
    assert delta("decode-0", "disagg_decode_step_seconds_count") >= NEW_TOKENS - 1
    assert value(after["decode-0"], "disagg_decode_slots_in_use") == 0

"""Prometheus metrics: one scheme for every part, each part on its own port.

Names are `disagg_<part>_<what>_<unit>`; a process registers only its part's
metrics. docs/metrics.md lists them with their labels.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Token and step latencies on a CPU run from ~1 ms; first tokens and requests to minutes.
FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("disagg_router_requests", "Generate calls by outcome (ok, cancelled, or a status code)", ["outcome"], registry=registry)
        self.queue = Histogram("disagg_router_queue_seconds", "Time waiting for a decode slot", buckets=SLOW, registry=registry)
        self.ttft = Histogram("disagg_router_time_to_first_token_seconds", "Request arrival to first token sent", buckets=SLOW, registry=registry)
        self.itl = Histogram("disagg_router_inter_token_latency_seconds", "Time between consecutive tokens of a stream", buckets=FAST, registry=registry)
        self.e2e = Histogram("disagg_router_request_seconds", "Request arrival to last token", buckets=SLOW, registry=registry)
        self.tokens = Counter("disagg_router_generated_tokens", "Tokens streamed to clients", registry=registry)
        self.failovers = Counter("disagg_router_worker_failovers", "Requests moved off a failed worker", ["role"], registry=registry)
        self.queued = Gauge("disagg_router_queued_requests", "Requests waiting for a decode slot", registry=registry)
        self.workers_available = Gauge("disagg_router_workers_available", "Workers whose health says SERVING, by role", ["role"], registry=registry)
        self.worker_returns = Counter(
            "disagg_router_worker_returns", "Workers serving again after being unavailable (restarted, or a network healed), by role",
            ["role"], registry=registry,
        )
        self.in_flight = Gauge("disagg_router_in_flight_requests", "Generate calls in progress", registry=registry)
        # Cache-aware routing (router/prefix_index.py): their ratio is the router's estimate of the workers' prefix-cache hit rate.
        self.routed_prompt_tokens = Counter(
            "disagg_router_routed_prompt_tokens", "Prompt tokens sent to a worker, by the worker's role", ["role"], registry=registry
        )
        self.routed_hit_tokens = Counter(
            "disagg_router_routed_hit_tokens", "Of those, tokens of a prefix the router had sent that worker before (an estimate of its cache hits)",
            ["role"], registry=registry,
        )

    def observe_routed(self, role: str, prompt_tokens: int, hit_tokens: int) -> None:
        self.routed_prompt_tokens.labels(role).inc(prompt_tokens)
        self.routed_hit_tokens.labels(role).inc(hit_tokens)


def memory_gauges(part: str, registry: CollectorRegistry) -> None:
    """The process's memory as last sampled (disagg/engine/memory.py: at most 2 s old)."""
    from disagg.engine.memory import sampled_process_memory

    for field, what in (("resident", "Resident memory (RSS)"), ("proportional", "Proportional set size (PSS): shared pages divided between their users"),
                        ("shared", "Of the resident memory, pages other processes map too")):
        gauge = Gauge(f"disagg_{part}_{field}_bytes", f"{what} of this worker process", registry=registry)
        gauge.set_function(lambda field=field: getattr(sampled_process_memory(), f"{field}_bytes"))


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry):
        memory_gauges("prefill", registry)
        self.requests = Counter("disagg_prefill_requests", "Prefill calls by outcome", ["outcome"], registry=registry)
        self.prefill = Histogram("disagg_prefill_seconds", "Queue plus compute time of a prefill, to its first token", buckets=SLOW, registry=registry)
        self.queued = Gauge("disagg_prefill_queued_requests", "Prefills submitted and not finished", registry=registry)
        # What the prefill pool's autoscaler watches: work waiting, in tokens (prompts differ in cost).
        self.queued_tokens = Gauge("disagg_prefill_queued_prompt_tokens", "Prompt tokens of the prefills submitted and not finished", registry=registry)
        self.kv_seconds = Histogram(
            "disagg_prefill_kv_transfer_seconds", "KV hand-off, first byte sent (or staged) to acknowledgement, by transport", ["transport"],
            buckets=SLOW, registry=registry,
        )
        self.kv_bytes = Counter("disagg_prefill_kv_transfer_bytes", "KV bytes acknowledged by decode workers, by transport", ["transport"], registry=registry)
        self.kv_failures = Counter("disagg_prefill_kv_transfer_failures", "KV hand-offs that failed, by transport", ["transport"], registry=registry)
        # The prefix cache (prefill_worker/prefix_cache.py): hits over queries is its hit rate.
        self.computed_tokens = Counter("disagg_prefill_computed_tokens", "Prompt tokens run through the model (prefix cache hits excluded)", registry=registry)
        self.cache_queried_tokens = Counter(
            "disagg_prefill_prefix_queried_tokens", "Prompt tokens looked up in the prefix cache (whole blocks)", registry=registry
        )
        self.cache_hit_tokens = Counter("disagg_prefill_prefix_hit_tokens", "Of those, tokens found cached (not computed)", registry=registry)
        self.cache_evictions = Counter("disagg_prefill_prefix_evicted_blocks", "Cached blocks dropped to make room", registry=registry)
        self.cache_blocks = Gauge(
            "disagg_prefill_kv_blocks", "Prefix cache blocks by state: used (a prefill reads them), cached (kept for reuse), free",
            ["state"], registry=registry,
        )


class BlockPoolCollector:
    """A KV block pool's state, read when scraped: blocks used, free and cached (published, no
    reader), and the prefix cache's counts (tokens looked up, tokens found, blocks evicted)."""

    def __init__(self, role: str, pool):
        self.role, self.pool = role, pool

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        pool, prefix = self.pool, f"disagg_{self.role}_kv_blocks"
        blocks = GaugeMetricFamily(prefix, "KV blocks by state: used (read by a sequence), cached (kept for reuse), free", labels=["state"])
        for state, count in (("used", pool.used_blocks), ("cached", pool.cached_blocks), ("free", pool.free_blocks)):
            blocks.add_metric([state], count)
        yield blocks
        stats = pool.stats
        yield CounterMetricFamily(
            f"disagg_{self.role}_prefix_queried_tokens", "Prompt tokens (full blocks) looked up in the prefix cache", stats.queried_tokens
        )
        yield CounterMetricFamily(f"disagg_{self.role}_prefix_hit_tokens", "Of those, tokens found cached (not computed, not received)", stats.hit_tokens)
        yield CounterMetricFamily(f"disagg_{self.role}_prefix_evicted_blocks", "Cached blocks dropped to make room", pool.stats.evictions)


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        memory_gauges("decode", registry)
        self.slots_in_use = Gauge("disagg_decode_slots_in_use", "Slots reserved or running", registry=registry)
        # With slots_in_use, the decode pool's autoscaling signal: the share of slots taken.
        self.slots = Gauge("disagg_decode_slots", "Slots this worker has (its decode batch size)", registry=registry)
        self.batch_size = Gauge("disagg_decode_running_batch_size", "Rows in the last decode step", registry=registry)
        self.step = Histogram("disagg_decode_step_seconds", "Device time of one decode step", buckets=FAST, registry=registry)
        self.host_gap = Histogram(
            "disagg_decode_host_gap_seconds", "Device idle time between consecutive steps of a busy batch", buckets=FAST, registry=registry
        )
        self.tokens = Counter("disagg_decode_tokens", "Tokens produced by decode steps (dropped async extras excluded)", registry=registry)
        self.kv_bytes = Counter("disagg_decode_kv_received_bytes", "KV bytes received into slots, by transport", ["transport"], registry=registry)
        self.kv_seconds = Histogram(
            "disagg_decode_kv_receive_seconds", "A transfer into a slot, first byte to commit, by transport", ["transport"], buckets=SLOW, registry=registry
        )
        self.kv_failures = Counter("disagg_decode_kv_receive_failures", "KV transfers refused or broken, by transport", ["transport"], registry=registry)
        # Speculative decoding: guesses scored and kept, by their place in the row's guesses (1: the first).
        self.spec_proposed = Counter("disagg_decode_spec_proposed_tokens", "Speculative guesses scored, by position", ["position"], registry=registry)
        self.spec_accepted = Counter("disagg_decode_spec_accepted_tokens", "Speculative guesses kept, by position", ["position"], registry=registry)

    def count_speculation(self, proposed: int, accepted: int) -> None:
        """One row's step: proposed guesses scored, the first accepted of them kept."""
        for position in range(1, proposed + 1):
            self.spec_proposed.labels(str(position)).inc()
            if position <= accepted:
                self.spec_accepted.labels(str(position)).inc()

    def watch_blocks(self, pool) -> None:
        self.registry.register(BlockPoolCollector("decode", pool))


def serve_metrics(port: int, host: str, metrics_class):
    """(metrics, bound port): a part's metrics served on host:port; port 0 serves
    nothing (bound port 0), port -1 takes any free port."""
    registry = CollectorRegistry()
    metrics = metrics_class(registry)
    if not port:
        return metrics, 0
    httpd, _ = start_http_server(max(port, 0), addr=host, registry=registry)
    return metrics, httpd.server_port


def outcome_label(code) -> str:
    return "ok" if code is None else code.name.lower()

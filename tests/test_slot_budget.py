"""Decode slots sized from a KV memory budget (vLLM's KV cache space), or given."""

from __future__ import annotations

import grpc
import pytest
from conftest import tiny_model

from decode_worker.config import GIB, DecodeWorkerConfig
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc


def test_slots_fill_the_budget_up_to_the_cap():
    per_slot = 3 * 2**20
    assert DecodeWorkerConfig(model="m", kv_cache_gib=1.0).slots_for(per_slot) == 64  # 341 fit, capped
    assert DecodeWorkerConfig(model="m", kv_cache_gib=1.0, max_batch_size=500).slots_for(per_slot) == GIB // per_slot
    assert DecodeWorkerConfig(model="m", kv_cache_gib=0.01).slots_for(per_slot) == 3
    assert DecodeWorkerConfig(model="m", batch_size=5, kv_cache_gib=0.001).slots_for(per_slot) == 5  # given wins


def test_a_budget_that_holds_no_slot_is_refused_with_the_flag_named():
    with pytest.raises(ValueError, match="--kv-cache-gib 0.001 holds no slot"):
        DecodeWorkerConfig(model="m", kv_cache_gib=0.001).slots_for(2 * 2**20)


def test_the_neuron_backend_compiles_for_a_batch_chosen_before_loading():
    assert DecodeWorkerConfig(model="m", backend="neuron").slots_before_load() == 8
    assert DecodeWorkerConfig(model="m", backend="neuron", batch_size=3).slots_before_load() == 3
    assert DecodeWorkerConfig(model="m").slots_before_load() == 0


def capacities(cluster, *flag_sets: list[str]) -> list[int]:
    """One decode worker per set of flags, started together; each one's slot count."""
    workers = cluster.add_workers("decode", list(flag_sets))
    counts = []
    for worker in workers:
        cluster.wait_serving(120, worker.address)
        with grpc.insecure_channel(worker.address) as channel:
            counts.append(wgrpc.DecodeServiceStub(channel).GetLoad(wpb.LoadRequest(), timeout=5).capacity)
    return counts


def test_a_decode_worker_sizes_its_slots_from_the_budget(cluster_logs):
    from disagg.engine.backends import load_backend
    from disagg.tools.local_cluster import ClusterSpec, LocalCluster

    info = load_backend("torch", model=tiny_model("llama"), dtype="float32").info
    per_slot = info.kv_bytes_per_token(4) * info.max_seq_len
    cluster = LocalCluster(ClusterSpec(
        model=tiny_model("llama"), dtype="float32", compile=False, threads_per_worker=1, log_dir=str(cluster_logs / "slot-budget"),
    ))
    try:
        # Paged, the budget is blocks (here 5.5 slots' worth, 176 blocks): the rows of the batch are the cap of 64,
        # or a given size. The slot layout (the compiled step, neuron) still sizes its slots from the budget: slots_for above.
        assert capacities(cluster, ["--kv-cache-gib", str(5.5 * per_slot / GIB)], [], ["--batch-size", "3"]) == [64, 64, 3]
    finally:
        cluster.stop()

"""Each worker reports what it holds in memory (disagg/engine/memory.py): in GetLoad,
its metrics and its start-up line; shared pages counted as the kernel counts them."""

from __future__ import annotations

import mmap
import os
import re
import subprocess
import sys
import urllib.request

import grpc
from conftest import start_cluster
from prometheus_client.parser import text_string_to_metric_families

from disagg.engine.memory import read_process_memory
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

MIB = 1 << 20


def test_a_file_two_processes_map_is_shared_and_each_pays_half_in_its_pss(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (64 * MIB))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        sum(mapped[i] for i in range(0, len(mapped), 4096))  # every page resident in this process
        alone = read_process_memory()
        assert alone.resident_bytes >= 64 * MIB and alone.proportional_bytes <= alone.resident_bytes
        script = ("import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
                  "sum(m[i] for i in range(0, len(m), 4096)); print('mapped', flush=True); sys.stdin.read()")
        other = subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout.readline().strip() == "mapped"
            together = read_process_memory()
            assert together.shared_bytes - alone.shared_bytes >= 60 * MIB  # now mapped by both
            assert alone.proportional_bytes - together.proportional_bytes >= 28 * MIB  # half of 64 MiB is the other's now
            assert read_process_memory(other.pid).shared_bytes >= 60 * MIB
        finally:
            other.stdin.close()
            other.wait()


def test_workers_report_their_memory_in_get_load_and_their_metrics(cluster_logs):
    # Launched as `python -m`: a fork shares its libraries' pages with the fork server, which lowers its proportional memory.
    cluster = start_cluster(cluster_logs / "memory-report", "llama", prefill=1, decode=1, batch_size=2, forked=False)
    try:
        for process in cluster.processes[:2]:
            role = process.name.split("-")[0]
            with urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5) as page:
                samples = {s.name: s.value for f in text_string_to_metric_families(page.read().decode()) for s in f.samples}
            with grpc.insecure_channel(process.address) as channel:
                stub = wgrpc.PrefillServiceStub(channel) if role == "prefill" else wgrpc.DecodeServiceStub(channel)
                load = stub.GetLoad(wpb.LoadRequest(), timeout=5)
            actual = read_process_memory(process.popen.pid)
            # torch and a model loaded: well past 100 MiB resident; PSS at most RSS; both near what /proc says now.
            assert 100 * MIB < load.resident_bytes and 0 < load.proportional_bytes <= load.resident_bytes, load
            assert abs(load.resident_bytes - actual.resident_bytes) < 0.2 * actual.resident_bytes
            assert abs(samples[f"disagg_{role}_resident_bytes"] - actual.resident_bytes) < 0.2 * actual.resident_bytes
            assert 0 < samples[f"disagg_{role}_proportional_bytes"] <= samples[f"disagg_{role}_resident_bytes"]
            if role == "decode":  # the start-up estimate is not below what the worker really holds
                from decode_worker.config import DecodeWorkerConfig
                from disagg.engine.memory import CheckpointFacts

                model = cluster.spec.model
                need = DecodeWorkerConfig(model=model, dtype="float32", batch_size=2).memory_need(CheckpointFacts.read(model))
                assert load.resident_bytes <= need.total, (load.resident_bytes, need)
            logs = list((cluster_logs / "memory-report").glob(f"*/{process.name}.log"))
            assert len(logs) == 1 and any("serving on port" in line and "; memory: resident " in line for line in logs[0].read_text().splitlines())
    finally:
        cluster.stop()


# -- a start that knows its memory ----------------------------------------------------------------
def test_a_worker_that_cannot_fit_refuses_in_one_line_before_loading(llama_path):
    from disagg.engine.memory import TEST_MEMORY_AVAILABLE

    env = {**os.environ, TEST_MEMORY_AVAILABLE: str(300 * MIB)}
    done = subprocess.run([sys.executable, "-m", "decode_worker", "--model", llama_path, "--port", "0", "--kv-cache-gib", "2"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert re.fullmatch(
        r"decode_worker: this worker would hold about 1\.\d GiB \(decode worker 1\.\d GiB \(weights \d+ MiB in their serving layout, shared by the box, "
        r"KV \d+ MiB, working 1\.2 GiB\)\), more than the 300 MiB free \(DISAGG_TEST_MEMORY_AVAILABLE_BYTES\): lower --kv-cache-gib .*--dtype bfloat16",
        lines[0],
    ), lines[0]


def test_disagg_serve_sums_its_workers_and_refuses_before_starting_any(llama_path):
    from disagg.engine.memory import TEST_MEMORY_AVAILABLE

    serve = [sys.executable, "-c", "import sys; from disagg.cli.main import main; sys.exit(main())", "serve", "--model", llama_path,
             "--port", "0", "--http-port", "-1"]
    # A decode worker needs about 1.4 GiB here (its KV capped by 64 sequences of the model's 1,024 positions), a prefill
    # worker about 2.3 (its 1 GiB prefix cache): 3.6 together, and 2.7 without the prefix cache; 3 GiB free.
    env = {**os.environ, TEST_MEMORY_AVAILABLE: str(3 << 30)}
    done = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert re.search(r"^disagg serve: its 2 workers would hold about 3\.\d GiB \(decode worker .*; prefill worker .*prefix cache 1\.0 GiB.*\), "
                     r"more than the 3\.0 GiB free", done.stderr, re.M), done.stderr
    assert "decode-0" not in done.stdout and "Ctrl-C" not in done.stdout  # nothing was started

    from disagg.cli.main import build_parser, check_memory, serve_spec

    args = build_parser().parse_args(["serve", "--model", llama_path, "--prefix-cache-gib", "0"])
    os.environ[TEST_MEMORY_AVAILABLE] = env[TEST_MEMORY_AVAILABLE]
    try:
        check_memory(serve_spec(args), args)  # without the prefix cache the two fit
    finally:
        del os.environ[TEST_MEMORY_AVAILABLE]


def llama_3_2_1b_shapes(folder) -> str:
    """Llama-3.2-1B's config and safetensors header (its tensors' shapes, no data): all the estimate reads."""
    import json
    import struct

    hidden, inter, layers, kv = 2048, 8192, 16, 512
    shapes = {"model.embed_tokens.weight": [128256, hidden], "model.norm.weight": [hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": [hidden, hidden], p + "self_attn.k_proj.weight": [kv, hidden],
                       p + "self_attn.v_proj.weight": [kv, hidden], p + "self_attn.o_proj.weight": [hidden, hidden],
                       p + "mlp.gate_proj.weight": [inter, hidden], p + "mlp.up_proj.weight": [inter, hidden],
                       p + "mlp.down_proj.weight": [hidden, inter], p + "input_layernorm.weight": [hidden],
                       p + "post_attention_layernorm.weight": [hidden]})
    header = json.dumps({name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]} for name, shape in shapes.items()}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    }))
    return str(folder)


def test_llama_3_2_1b_in_float32_fits_a_24_gib_box_with_one_shared_copy_and_a_smaller_box_is_refused(tmp_path):
    """The issue's case: with two layouts per weight and a copy per worker, float32 Llama-3.2-1B needed ~28.4 GiB
    for a prefill and a decode worker. One layout, mapped once per box: 5.6 GiB of weights (1.24 B values and the
    tied head's panels), counted once for the two workers. A box with less free is refused in one line."""
    from decode_worker.config import DecodeWorkerConfig
    from disagg.cli.main import build_parser, check_memory, serve_spec
    from disagg.engine.memory import TEST_MEMORY_AVAILABLE, CheckpointFacts, NotEnoughMemory

    model = llama_3_2_1b_shapes(tmp_path)
    need = DecodeWorkerConfig(model=model, dtype="float32").memory_need(CheckpointFacts.read(model))
    assert round(need.weights / (1 << 30), 1) == 5.6 and need.kv == 4 << 30 and need.shared
    alone = DecodeWorkerConfig(model=model, dtype="float32", share_weights=False).memory_need(CheckpointFacts.read(model))
    assert alone.weights == need.weights and not alone.shared
    args = build_parser().parse_args(["serve", "--model", model, "--dtype", "float32"])
    try:
        os.environ[TEST_MEMORY_AVAILABLE] = str(22 << 30)
        check_memory(serve_spec(args), args)  # the 24 GiB box: fits
        os.environ[TEST_MEMORY_AVAILABLE] = str(12 << 30)
        try:
            check_memory(serve_spec(args), args)
            raise AssertionError("not refused")
        except NotEnoughMemory as refused:
            assert str(refused).startswith("its 2 workers would hold about 13.6 GiB (decode worker 10.8 GiB (weights 5.6 GiB in their serving "
                                           "layout, shared by the box"), refused
        unshared = build_parser().parse_args(["serve", "--model", model, "--dtype", "float32", "--no-share-weights"])
        os.environ[TEST_MEMORY_AVAILABLE] = str(19 << 30)
        try:
            check_memory(serve_spec(unshared), unshared)  # each worker its own copy: 19.2 GiB
            raise AssertionError("not refused")
        except NotEnoughMemory as refused:
            assert str(refused).startswith("its 2 workers would hold about 19.2 GiB"), refused
    finally:
        del os.environ[TEST_MEMORY_AVAILABLE]

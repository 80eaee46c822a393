"""The neuron backend's own logic, and the whole gRPC path with --backend neuron.

No Neuron device here: where NxDI itself is needed, tests/nxdi_standin is put
on the path, a STAND-IN that implements the slice of NxDI's API we call on the
CPU (see its docstring). Everything under disagg/engine/backends/neuron is the
real code that runs on Trn1/Inf2/Trn2.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest
import torch
from conftest import kv_bytes_received, reference, start_cluster, tiny_model

from disagg.clients.grpc_client import Client
from disagg.engine.backends.neuron.config import NeuronOptions, compiled_path, neuron_config_kwargs
from disagg.engine.backends.neuron.layout import KvLayout, Sharding, UnsupportedLayout, sort_rows
from disagg.engine.backends.neuron.packages import INSTALL, NeuronPackagesMissing, import_nxdi
from disagg.engine.backends.neuron.settings import read_serving_properties, read_worker_config
from disagg.engine.requests import Sampling
from disagg.kv_transport import resolve
from disagg.kv_transport.chunk_codec import KvKind

STANDIN = str(pathlib.Path(__file__).parent / "nxdi_standin")
# NxDI 0.7-0.9 pin transformers 4.56/4.57, and the stand-in fails as NxDI does under 5
# (LlamaInferenceConfig.validate_config needs rope_theta, which transformers 5 moved into
# rope_parameters): whatever builds a neuron backend runs under NxDI's transformers.
NXDI_TRANSFORMERS = int(__import__("transformers").__version__.split(".")[0]) < 5
NEEDS_NXDI_TRANSFORMERS = ("NxDI 0.7-0.9 run under transformers 4.56/4.57 (the stand-in, as NxDI, refuses transformers 5's configs); "
                           "the CI runs these in its transformers-4.57 virtualenv")
NEURON_TRANSPORT = resolve("auto")  # NIXL where installed: the host-staging landing for a device slot cache


# -- the NxDI config we build ------------------------------------------------------
def test_neuron_config_for_continuous_batching_with_on_device_sampling_and_a_spare_line():
    options = NeuronOptions(
        model="/m", tp_degree=8, batch_size=16, seq_len=4096, max_context_length=2048, context_buckets=(512, 1024, 2048), token_buckets=(4096,)
    )
    sampling = object()
    kwargs = neuron_config_kwargs(options, sampling)
    assert kwargs == {
        "tp_degree": 8, "batch_size": 17, "ctx_batch_size": 1, "tkg_batch_size": 17, "max_batch_size": 17,
        "seq_len": 4096, "max_context_length": 2048, "torch_dtype": "bfloat16", "is_continuous_batching": True,
        "apply_seq_ids_mask": True, "on_device_sampling_config": sampling, "async_mode": False, "enable_bucketing": True,
        "save_sharded_checkpoint": True, "context_encoding_buckets": [512, 1024, 2048], "token_generation_buckets": [4096],
    }
    assert neuron_config_kwargs(NeuronOptions(model="/m", nxdi_async_mode=True), sampling)["async_mode"] is True  # neuron_validate.py compares
    assert "context_encoding_buckets" not in neuron_config_kwargs(NeuronOptions(model="/m"), sampling)  # NxDI's powers of two


def test_a_changed_config_compiles_into_a_new_directory(tmp_path):
    base = NeuronOptions(model="/models/llama", compiled_root=str(tmp_path))
    assert compiled_path(base) == compiled_path(NeuronOptions(model="/models/llama", compiled_root=str(tmp_path)))
    assert compiled_path(base) != compiled_path(NeuronOptions(model="/models/llama", compiled_root=str(tmp_path), tp_degree=2))
    assert compiled_path(base) != compiled_path(NeuronOptions(model="/models/llama", compiled_root=str(tmp_path), token_buckets=(128, 2048)))
    # async_mode: the decode loop's, not compiled
    assert compiled_path(base) == compiled_path(NeuronOptions(model="/models/llama", compiled_root=str(tmp_path), async_mode=False))


@pytest.mark.parametrize(
    "bad", [dict(dtype="int8"), dict(seq_len=128, max_context_length=256), dict(context_buckets=(512, 128)), dict(k_cache_transposed=True)]
)
def test_invalid_options_are_refused(bad):
    with pytest.raises(ValueError):
        NeuronOptions(model="/m", **bad)


# -- weight quantization ----------------------------------------------------------------
def test_quantization_settings_map_onto_nxdis_neuron_config_arguments(tmp_path):
    sampling = object()
    int8 = neuron_config_kwargs(NeuronOptions(model="/models/llama", compiled_root=str(tmp_path), quantization="int8"), sampling)
    assert {k: int8[k] for k in ("quantized", "quantization_dtype", "quantization_type", "modules_to_not_convert")} == {
        "quantized": True, "quantization_dtype": "int8", "quantization_type": "per_channel_symmetric", "modules_to_not_convert": ["lm_head"]}
    path = pathlib.Path(int8["quantized_checkpoints_path"])
    assert path.parent == tmp_path / "quantized" and path.name.startswith("llama-int8-per_channel-")
    fp8 = neuron_config_kwargs(NeuronOptions(model="/models/llama", compiled_root=str(tmp_path), quantization="fp8", quantization_type="per_tensor",
                                             quantization_skip=()), sampling)
    assert (fp8["quantization_dtype"], fp8["quantization_type"], fp8["modules_to_not_convert"]) == ("f8e4m3", "per_tensor_symmetric", None)
    assert pathlib.Path(fp8["quantized_checkpoints_path"]) != path  # one state dict per checkpoint and settings
    skip = neuron_config_kwargs(NeuronOptions(model="/models/llama", compiled_root=str(tmp_path), quantization="int8",
                                              quantization_skip=["lm_head", "mlp.down_proj"]), sampling)  # a worker JSON's list
    assert skip["modules_to_not_convert"] == ["lm_head", "mlp.down_proj"] and skip["quantized_checkpoints_path"] != str(path)
    # A tp degree, a batch or buckets of their own share the quantized state dict; no quantization sets none of NxDI's arguments.
    assert neuron_config_kwargs(NeuronOptions(model="/models/llama", compiled_root=str(tmp_path), quantization="int8", tp_degree=8, batch_size=4),
                                sampling)["quantized_checkpoints_path"] == str(path)
    assert not {"quantized", "quantization_dtype", "quantized_checkpoints_path"} & set(neuron_config_kwargs(NeuronOptions(model="/m"), sampling))


def test_nxdis_neuron_config_takes_the_quantization_arguments_and_checks_them_as_nxdi_does(standin_any_transformers, tmp_path):
    from neuronx_distributed_inference.models.config import NeuronConfig

    kwargs = neuron_config_kwargs(NeuronOptions(model="/models/llama", compiled_root=str(tmp_path), quantization="fp8"), object())
    config = NeuronConfig(**kwargs)
    assert (config.quantized, config.quantization_dtype, config.quantization_type, config.modules_to_not_convert) == (
        True, "f8e4m3", "per_channel_symmetric", ["lm_head"])
    assert config.quantized_checkpoints_path == kwargs["quantized_checkpoints_path"]
    with pytest.raises(AssertionError, match="quantized_checkpoints_path is required"):
        NeuronConfig(quantized=True)
    with pytest.raises(AssertionError, match="fp8 is not a valid QuantizedDtype"), pytest.warns(UserWarning):  # NxD's name is f8e4m3
        NeuronConfig(quantized=True, quantized_checkpoints_path=str(tmp_path), quantization_dtype="fp8")
    with pytest.warns(UserWarning, match="Assuming all modules will be quantized"):
        NeuronConfig(**neuron_config_kwargs(NeuronOptions(model="/m", compiled_root=str(tmp_path), quantization="int8", quantization_skip=()), object()))


def test_a_quantized_compile_never_loads_for_an_unquantized_one(tmp_path):
    def path(**quantization):
        return compiled_path(NeuronOptions(model="/models/llama", compiled_root=str(tmp_path), **quantization))

    base = path()
    variants = [path(quantization="int8"), path(quantization="fp8"), path(quantization="int8", quantization_skip=()),
                path(quantization="int8", quantization_skip=("lm_head", "mlp")), path(quantization="fp8", quantization_type="per_tensor", quantization_skip=())]
    assert len({base, *variants}) == 1 + len(variants)
    assert "-int8-" in variants[0].name and "-fp8-" in variants[1].name
    # Without quantization its other settings change nothing: the unquantized key is the one from before they existed.
    assert path(quantization_type="per_tensor", quantization_skip=()) == base


@pytest.mark.parametrize("bad,why", [
    (dict(quantization="int4"), "quantization must be one of"),
    (dict(quantization="int8", quantization_type="blockwise"), "quantization_type must be one of"),
    (dict(quantization="int8", quantization_type="per_tensor"), "per_tensor quantizes every linear"),  # the default skip: lm_head
    (dict(quantization="int8", extra={"on_cpu": True}), "CPU mode"),
    (dict(quantization="int8", extra={"quantized": True, "quantized_checkpoints_path": "/q"}), "quantized, quantized_checkpoints_path"),
    # NxDI's fp8 activation quantization would take the MLPs' weights as fp8, which neither an unquantized nor an int8 checkpoint is.
    (dict(extra={"activation_quantization_type": "dynamic"}), "activation_quantization_type .*fp8 activation quantization"),
    (dict(quantization="int8", extra={"quantized_mlp_kernel_enabled": True}), "quantized_mlp_kernel_enabled"),
    (dict(quantization="fp8", extra={"activation_quantization_type": "static", "rmsnorm_quantize_kernel_enabled": True}),
     "activation_quantization_type, rmsnorm_quantize_kernel_enabled"),
])
def test_quantization_nxdi_cannot_serve_as_asked_is_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        NeuronOptions(model="/m", **bad)


@pytest.mark.parametrize("lines,quantization", [
    ("option.quantize=static_int8", "int8"), ("option.quantize=bitsandbytes8", "int8"), ("option.load_in_8bit=true", "int8"),
    ("option.load_in_8bit=True", "int8"), ("option.load_in_8bit=false", None), ("option.quantize=static_int8\noption.load_in_8bit=false", "int8"),
])
def test_lmi_quantize_and_load_in_8bit_map_to_int8_weights(tmp_path, lines, quantization):
    props = tmp_path / "serving.properties"
    props.write_text(f"option.model_id=/models/llama\n{lines}\n")
    settings, notes = read_serving_properties(str(props))
    assert settings.get("quantization") == quantization and not notes


@pytest.mark.parametrize("line,option", [("option.quantize=awq", "option.quantize"), ("option.quantize=fp8", "option.quantize"),
                                         ("option.load_in_8bit=maybe", "option.load_in_8bit")])
def test_an_lmi_quantization_value_disagg_does_not_know_is_refused_naming_the_option(tmp_path, line, option):
    props = tmp_path / "serving.properties"
    props.write_text(f"option.model_id=/models/llama\n{line}\n")
    with pytest.raises(ValueError, match=f"{option}=.* is not a valid value") as error:
        read_serving_properties(str(props))
    if option == "option.quantize":
        assert "static_int8" in str(error.value) and "--quantization fp8" in str(error.value)


def test_a_worker_config_sets_the_quantization_by_our_names(tmp_path):
    path = tmp_path / "worker.json"
    path.write_text('{"quantization": "fp8", "quantization_type": "per_channel", "quantization_skip": ["lm_head", "mlp.down_proj"]}')
    settings, _ = read_worker_config(str(path))
    options = NeuronOptions(model="/m", **settings)
    assert (options.quantization, options.quantization_type, options.quantization_skip) == ("fp8", "per_channel", ("lm_head", "mlp.down_proj"))


# -- speculation: our flags -> NxDI's fused speculation (built on NxDI's own classes: test_neuron_on_nxdi_cpu.py) ----
def test_speculation_flags_map_onto_nxdis_fused_speculation(tmp_path):
    from disagg.engine.backends.neuron.config import SPECULATION_FIELDS, compiled_key_options, speculation_options

    fields = speculation_options("draft", 4, "/models/draft")
    assert fields == {"speculation": "draft", "speculation_length": 5, "draft_model": "/models/draft"}  # 4 guesses + the input token
    assert speculation_options(None, 0, None) == {}
    options = NeuronOptions(model="/m", seq_len=4096, token_buckets=(512, 4096), compiled_root=str(tmp_path), **fields)
    kwargs = neuron_config_kwargs(options, object())
    assert {k: kwargs[k] for k in ("speculation_length", "enable_fused_speculation", "disable_kv_cache_tiling")} == {
        "speculation_length": 5, "enable_fused_speculation": True, "disable_kv_cache_tiling": True}
    assert "enable_eagle_speculation" not in kwargs
    # A fused step at our last position asks for a bucket of the mask's length + speculation_length (get_target_bucket).
    assert kwargs["seq_len"] == 4101 and kwargs["token_generation_buckets"] == [512, 4101]
    eagle = neuron_config_kwargs(NeuronOptions(model="/m", **speculation_options("eagle", 3, "/models/eagle")), object())
    assert (eagle["speculation_length"], eagle["enable_eagle_speculation"], eagle["enable_fused_speculation"]) == (4, True, True)
    # Speculation off: the same kwargs and compiled key as before these fields existed.
    plain = NeuronOptions(model="/m", seq_len=4096, token_buckets=(512, 4096), compiled_root=str(tmp_path))
    assert not set(SPECULATION_FIELDS) & set(compiled_key_options(plain)) and neuron_config_kwargs(plain, None)["seq_len"] == 4096
    assert "speculation_length" not in neuron_config_kwargs(plain, None)
    assert compiled_path(options) != compiled_path(plain) and "-draft5-" in compiled_path(options).name


@pytest.mark.parametrize("bad,why", [
    (dict(speculation="ngram", speculation_length=5, draft_model="/d"), "ngram is served by the torch backend only"),
    (dict(speculation="draft", speculation_length=5), "needs --draft-model"),
    (dict(speculation="draft", speculation_length=1, draft_model="/d"), "at least one guess"),
    (dict(speculation_length=5), "need speculation"),
    (dict(speculation="draft", speculation_length=5, draft_model="/d", extra={"on_cpu": True}), "CPU mode"),
    (dict(speculation="draft", speculation_length=5, draft_model="/d", nxdi_async_mode=True), "async_mode"),
    (dict(speculation="draft", speculation_length=5, draft_model="/d", extra={"enable_eagle_speculation": True}), "enable_eagle_speculation"),
    (dict(speculation="draft", speculation_length=5, draft_model="/d", context_buckets=(5, 128), seq_len=256), "bucket of 5 positions equals"),
    (dict(speculation="draft", speculation_length=8, draft_model="/d", seq_len=256, max_context_length=8), "bucket of 8 positions equals"),
])
def test_speculation_nxdi_cannot_run_as_asked_is_refused_in_one_line(bad, why):
    with pytest.raises(ValueError, match=why) as error:
        NeuronOptions(model="/m", **bad)
    assert "\n" not in str(error.value)


def test_the_workers_refuse_prompt_lookup_on_the_neuron_backend():
    from disagg.rpc.worker_config import WorkerConfig

    with pytest.raises(ValueError, match="--speculative-method ngram on the neuron backend: NxDI has no prompt lookup") as error:
        WorkerConfig(model="/m", backend="neuron", speculative_method="ngram")
    assert "\n" not in str(error.value)


def test_the_workers_give_the_neuron_backend_the_same_fused_speculation_on_both_sides():
    from disagg.rpc.worker_config import WorkerConfig

    config = WorkerConfig(model="/m", backend="neuron", speculative_method="draft", draft_model="/d", num_speculative_tokens=3)
    assert config.neuron_speculation_options() == {"speculation": "draft", "speculation_length": 4, "draft_model": "/d"}
    assert WorkerConfig(model="/m", backend="neuron").neuron_speculation_options() == {}
    assert WorkerConfig(model="/m", speculative_method="ngram").neuron_speculation_options() == {}  # the torch backend's own


def test_a_fused_step_returns_each_rows_accepted_tokens_padded_as_nxdi_pads_them():
    """NeuronFusedSpecModel's outputs (fused_outputs: accepted tokens padded with -1, next input ids, next attention
    mask, next position ids) -> [rows, speculation_length]; a plain step's tokens -> [rows, 1]."""
    from types import SimpleNamespace

    from disagg.engine.backends.neuron.backend import step_tokens

    accepted = torch.tensor([[7, 8, -1, -1], [9, -1, -1, -1], [1, 2, 3, 4]], dtype=torch.int32)
    fused = SimpleNamespace(fused_outputs=[accepted, accepted[:, :1], None, torch.tensor([[12], [30], [8]])])
    assert step_tokens(fused).tolist() == accepted.tolist() and step_tokens(fused).dtype == torch.long
    assert step_tokens(SimpleNamespace(tokens=torch.tensor([[5], [6]]))).tolist() == [[5], [6]]


# -- rows, sampling parameters -----------------------------------------------------------
def test_rows_sort_by_seq_id_and_outputs_go_back():
    slots = [5, 1, 7, 3]
    order, inverse = sort_rows(slots)
    assert [slots[i] for i in order] == [1, 3, 5, 7]
    outputs = torch.tensor([slots[i] * 10 for i in order])  # what the device returns, sorted
    assert outputs[inverse].tolist() == [50, 10, 70, 30]


def test_sampling_parameters_are_one_row_of_top_k_top_p_temperature_each():
    from disagg.engine.backends.neuron.sampling import nxdi_sampling_params
    from disagg.engine.sampler import params_tensor

    params = params_tensor([Sampling(temperature=0.7, top_k=40, top_p=0.9), Sampling()])
    # Ours: NxDI's three columns first, then min_p and the penalties (neutral here).
    assert params.shape == (2, 7) and params[0, :3].tolist() == pytest.approx([40, 0.9, 0.7]) and params[1].tolist() == [0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    # What NxDI is given: [n, 3], greedy as (1, 1, 1).
    torch.testing.assert_close(nxdi_sampling_params(params, global_topk=256), torch.tensor([[40, 0.9, 0.7], [1.0, 1.0, 1.0]]))


# -- KV lines: layouts and conversion -----------------------------------------------------
def rank_caches(layout: KvLayout, slots=3, seq_len=10, head_dim=4):
    return [torch.zeros((slots, layout.heads_per_rank, seq_len, head_dim), dtype=torch.bfloat16) for _ in range(layout.tp_degree)]


@pytest.mark.parametrize(
    "tp,kv_heads,sharding",
    [(1, 2, Sharding.SHARD), (2, 2, Sharding.SHARD), (4, 2, Sharding.REPLICATE), (2, 8, Sharding.SHARD), (8, 2, Sharding.REPLICATE)],
)
def test_write_then_read_is_byte_exact(tp, kv_heads, sharding):
    layout = KvLayout(tp, kv_heads, num_attention_heads=kv_heads * 4)
    assert layout.sharding is sharding
    line = torch.randn(kv_heads, 6, 4).to(torch.bfloat16)
    caches = rank_caches(layout)
    layout.write_line(caches, slot=1, start=2, line=line)
    read = layout.read_line(caches, slot=1, length=8)
    assert read[:, 2:8].view(torch.int16).equal(line.view(torch.int16))
    assert not read[:, :2].any()  # nothing written before start
    assert all(not c[0].any() and not c[2].any() for c in caches)  # other slots untouched


def test_replicated_heads_go_to_consecutive_ranks_as_nxdi_repeat_interleave():
    layout = KvLayout(tp_degree=8, kv_heads=2, num_attention_heads=16)
    assert [layout.rank_heads(r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert KvLayout(tp_degree=2, kv_heads=8, num_attention_heads=32).rank_heads(1) == [4, 5, 6, 7]


def test_prefill_tp2_to_decode_tp8_conversion_through_the_wire():
    prefill, decode = KvLayout(2, 4, 16), KvLayout(8, 4, 16)
    line = torch.randn(4, 5, 4).to(torch.bfloat16)
    src = rank_caches(prefill)
    prefill.write_line(src, 0, 0, line)
    wire = prefill.read_line(src, 0, 5)  # what a prefill worker sends
    dst = rank_caches(decode)
    decode.write_line(dst, 2, 0, wire)
    assert decode.read_line(dst, 2, 5).view(torch.int16).equal(line.view(torch.int16))
    assert dst[7][2, 0, :5].view(torch.int16).equal(line[3].view(torch.int16))  # rank 7 holds head 3


@pytest.mark.parametrize(
    "tp,kv_heads,heads,why",
    [(3, 2, 8, "neither divides the other"), (3, 8, 8, "do not divide by tp_degree"), (6, 4, 32, "neither divides the other")],
)
def test_layouts_the_conversion_does_not_cover_are_refused_at_start_up(tp, kv_heads, heads, why):
    with pytest.raises(UnsupportedLayout, match=why):
        KvLayout(tp, kv_heads, heads)


# -- packages --------------------------------------------------------------------------
def test_missing_packages_name_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "neuronx_distributed_inference", None)  # what the PyPI placeholder amounts to
    with pytest.raises(NeuronPackagesMissing) as error:
        import_nxdi()
    assert INSTALL in str(error.value) and "placeholders" in str(error.value)


@pytest.mark.skipif(NXDI_TRANSFORMERS, reason="the torch backend serves under transformers 5 only (tests/test_install.py: it refuses NxDI's release)")
def test_the_torch_backend_never_imports_nxdi():
    import disagg.engine.backends.torch_backend  # noqa: F401

    assert not any(
        name.startswith("neuronx_distributed_inference") and sys.modules[name] is not None
        for name in sys.modules
        if name.startswith("neuronx_distributed_inference")
    )


# -- settings files users already have -------------------------------------------------
def test_lmi_serving_properties_map_to_our_settings_and_say_what_is_not_supported(tmp_path):
    props = tmp_path / "serving.properties"
    props.write_text("engine=Python\noption.model_id=/models/llama\noption.tensor_parallel_degree=8\noption.n_positions=4096\n"
                     "option.max_rolling_batch_size=32\noption.context_length_estimate=512,1024,2048\noption.amp=bf16\n"
                     "option.compiled_graph_path=/cache/neuron\noption.neuron_optimize_level=2\noption.load_in_8bit=true\noption.rolling_batch=auto\n")
    settings, notes = read_serving_properties(str(props))
    assert settings == {"model": "/models/llama", "tp_degree": 8, "max_seq_len": 4096, "batch_size": 32, "context_buckets": (512, 1024, 2048),
                        "dtype": "bfloat16", "compiled_root": "/cache/neuron", "neuron_optimize_level": 2, "quantization": "int8"}
    assert not any(n.startswith("option.load_in_8bit") for n in notes)
    assert any(n.startswith("option.rolling_batch: ignored") for n in notes) and any(n.startswith("engine: ignored") for n in notes)


def test_transformers_neuronx_names_in_a_worker_config(tmp_path):
    path = tmp_path / "worker.json"
    path.write_text('{"tp_degree": 2, "n_positions": 1024, "batch_size": 4, "amp": "bf16", "context_length_estimate": [256, 1024]}')
    settings, _ = read_worker_config(str(path))
    assert settings == {"tp_degree": 2, "max_seq_len": 1024, "batch_size": 4, "dtype": "bfloat16", "context_buckets": (256, 1024)}


# -- against the stand-in -----------------------------------------------------------------
def torch_prefill(ids):
    """The prompt's KV and greedy first token from transformers itself."""
    from test_neuron_findings import torch_prefill as from_transformers

    return from_transformers(ids)


@pytest.fixture
def standin_any_transformers(monkeypatch):
    monkeypatch.syspath_prepend(STANDIN)
    for name in [n for n in sys.modules if n.startswith("neuronx_distributed_inference")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [n for n in sys.modules if n.startswith("neuronx_distributed_inference")]:
        del sys.modules[name]  # the stand-in's modules leave with it (test_the_torch_backend_never_imports_nxdi)


@pytest.fixture
def standin(standin_any_transformers):
    if not NXDI_TRANSFORMERS:
        pytest.skip(NEEDS_NXDI_TRANSFORMERS)
    yield


def test_compiles_once_then_loads_and_prefill_kv_matches_the_torch_backend(standin, tmp_path):
    from disagg.engine.backends import load_backend

    model = tiny_model("llama")
    options = dict(model=model, dtype="float32", max_seq_len=64, batch_size=2, neuron={"tp_degree": 4, "compiled_root": str(tmp_path)})
    first = load_backend("neuron", **options)
    again = load_backend("neuron", **options)
    (compiled,) = list(tmp_path.iterdir())
    assert (compiled / "standin_compiles.txt").read_text().count("compiled") == 1
    assert first.model.config.neuron_config.kwargs["tkg_batch_size"] == 3  # two slots and the prefill line

    ids = reference("llama").ids("The baker opens his shop")
    torch_result = torch_prefill(ids)
    result = again.prefill(ids, Sampling())
    assert result.first_token == torch_result.first_token
    for (k, v), (tk, tv) in zip(result.layers, torch_result.layers):
        torch.testing.assert_close(k, tk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, tv, rtol=1e-4, atol=1e-5)
    again.write_kv([1], 0, KvKind.KEY, 0, torch_result.layers[0][0])
    assert again.layout.read_line(again._caches(0, KvKind.KEY), 1, len(ids)).equal(torch_result.layers[0][0])


def draft_kv_line(backend, layer: int, line: int, length: int) -> torch.Tensor:
    """The draft's K of one line, [kv_heads, length, head_dim], from the fused model's state (draft_model.), tp 1."""
    state = backend.model.context_encoding_model.model.nxd_model.state[0]
    return state[f"draft_model.kv_mgr.past_key_values.{2 * layer}"][line, :, :length]


FUSED_PROMPTS = ["The lighthouse keeper climbed", "Snow fell on the hills and the hills", "Our café"]
MIGRATED_AFTER = {2: 4}  # slot 2: a request migrated after 4 tokens


def handed_off_rows(backend) -> dict[int, tuple[list[int], list[int]]]:
    """Each FUSED_PROMPTS prompt prefilled on the spare line, the target's KV written into its slot as a hand-off
    writes it, and start_sequence (the draft's K/V of the context, recomputed into the slot's line): slot -> (its
    context, its tokens so far)."""
    backend.allocate_slots(len(FUSED_PROMPTS))
    rows = {}
    for slot, prompt in enumerate(FUSED_PROMPTS):
        ids = reference("llama").ids(prompt)
        before = reference("llama").greedy(prompt, MIGRATED_AFTER[slot], ignore_eos=True) if slot in MIGRATED_AFTER else []
        result = backend.prefill(ids + before, Sampling())  # the router prefills the prompt and the tokens streamed
        for layer, (keys, values) in enumerate(result.layers):
            backend.write_kv([slot], layer, KvKind.KEY, 0, keys)
            backend.write_kv([slot], layer, KvKind.VALUE, 0, values)
        backend.start_sequence(slot, ids, [*before, result.first_token])  # as the decode loop's token_history gives them
        rows[slot] = (ids + before, [result.first_token])
    return rows


def fused_steps_keep_generates_tokens(backend, rows, wanted: int = 20) -> None:
    """Fused steps of every live row until each has `wanted` tokens: each row's kept tokens (up to its first -1)
    are generate()'s, and the draft's guesses were kept (fewer steps than tokens)."""
    from disagg.engine.backends import StepInputs
    from disagg.engine.sampler import params_row

    k, steps, kept_lengths = backend.tokens_per_step, 0, []
    while live := [slot for slot, (_, out) in rows.items() if len(out) < wanted]:
        positions = torch.tensor([len(rows[s][0]) + len(rows[s][1]) - 1 for s in live])
        n = len(live)
        inputs = StepInputs(slots=torch.tensor(live), positions=positions, input_ids=torch.tensor([rows[s][1][-1] for s in live]),
                            params=torch.tensor([params_row(Sampling())] * n, dtype=torch.float32), seeds=torch.zeros(n, dtype=torch.long),
                            steps=torch.zeros(n, dtype=torch.long), kv_len=int(positions.max()) + 1, min_position=int(positions.min()), contiguous_from=None)
        for slot, row in zip(live, backend.decode_step(inputs).token_ids.tolist()):
            kept = row[: row.index(-1)] if -1 in row else row
            assert len(row) == k and kept and all(t == -1 for t in row[len(kept):])
            rows[slot][1].extend(kept)
            kept_lengths.append(len(kept))
        steps += 1
    for slot, prompt in enumerate(FUSED_PROMPTS):
        skip = MIGRATED_AFTER.get(slot, 0)
        assert rows[slot][1][:wanted] == reference("llama").greedy(prompt, skip + wanted, ignore_eos=True)[skip:]
    assert steps < wanted - 1 and max(kept_lengths) > 1


def test_fused_speculation_keeps_the_targets_tokens_and_the_draft_gets_its_kv_of_a_handed_off_prompt(standin, tmp_path):
    """Prefill on the spare line, the target's KV written into slots as a hand-off writes it, start_sequence (the
    draft's K/V of the context, recomputed into the slot's line), then fused steps of several rows: every row's kept
    tokens are generate()'s, and the draft's K/V at the slot is what transformers computes from the context."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from disagg.engine.backends import load_backend

    draft = tiny_model("llama-draft")
    backend = load_backend("neuron", model=tiny_model("llama"), dtype="float32", max_seq_len=128, batch_size=3,
                           neuron={"compiled_root": str(tmp_path), "speculation": "draft", "speculation_length": 5, "draft_model": draft})
    assert (backend.tokens_per_step, backend.starts_every_sequence) == (5, True)
    rows = handed_off_rows(backend)
    draft_model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
    for slot in (1, 2):  # a prompt's, and a migrated request's context (its prompt and the tokens before the newest)
        cache = DynamicCache()
        draft_model(torch.tensor([rows[slot][0]]), past_key_values=cache, use_cache=True)
        torch.testing.assert_close(draft_kv_line(backend, 0, slot, len(rows[slot][0])), cache.layers[0].keys[0], rtol=1e-4, atol=1e-5)
    fused_steps_keep_generates_tokens(backend, rows)


def eagle_keys(head_path: str, context: list[int]) -> torch.Tensor:
    """The EAGLE head's layer-0 K of a context, [kv_heads, len - 1, head_dim], as the torch backend's head computes
    it: position q holds the pair (the embedding of token q + 1, the target's final hidden state at q)."""
    from transformers import AutoModelForCausalLM

    from disagg.engine.speculation.eagle import _rotate, load_eagle_head

    target, head = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32), load_eagle_head(head_path)
    ids = torch.tensor([context])
    with torch.no_grad():
        hidden = target.model(ids).last_hidden_state
        x = head.fc(torch.cat([target.get_input_embeddings()(ids[:, 1:]), hidden[:, :-1]], dim=-1))
        layer = head.layers[0]
        h = layer.input_layernorm(x) if layer.input_layernorm is not None else x
        cos, sin = head._angles(torch.arange(len(context) - 1), x)
        keys = layer.self_attn.k_proj(h).view(1, len(context) - 1, layer.self_attn.kv_heads, -1).transpose(1, 2)
        return _rotate(keys, cos, sin)[0]


def test_fused_eagle_keeps_the_targets_tokens_and_its_draft_is_our_heads_over_the_targets_hidden_states(standin, tmp_path):
    """--speculative-method eagle on the neuron backend: NxDI's EAGLE draft directory written from our head's
    checkpoint and the target's embeddings and LM head (once for both workers); after a hand-off, start_sequence's
    context encoding gives the draft the K/V our torch head computes over the target's hidden states (a position
    behind); the fused EAGLE steps of several rows, one of them migrated, keep generate()'s tokens, guesses kept."""
    from conftest import eagle_head

    from disagg.engine.backends import load_backend
    from disagg.engine.backends.neuron.eagle_draft import draft_directory

    head = eagle_head("llama")
    options = dict(model=tiny_model("llama"), dtype="float32", max_seq_len=128, batch_size=3,
                   neuron={"compiled_root": str(tmp_path), "speculation": "eagle", "speculation_length": 5, "draft_model": head})
    backend = load_backend("neuron", **options)
    written = backend.model.config.fused_spec_config.draft_model_path
    assert written == str(draft_directory(backend.options)) and pathlib.Path(written, "model.safetensors").is_file()
    assert backend.model.config.fused_spec_config.draft_config.neuron_config.is_eagle_draft
    assert (backend.tokens_per_step, backend.starts_every_sequence) == (5, True)
    rows = handed_off_rows(backend)
    for slot in (1, 2):  # a prompt's, and a migrated request's context; the last position's line is the first step's
        context = rows[slot][0]
        torch.testing.assert_close(draft_kv_line(backend, 0, slot, len(context) - 1), eagle_keys(head, context), rtol=1e-4, atol=1e-5)
    fused_steps_keep_generates_tokens(backend, rows)
    for slot, (context, out) in rows.items():  # each step's last draft run rewrote its positions over the target's hidden states
        sequence = context + out[:-1]  # the newest token is the next step's input: its pair is not written yet
        torch.testing.assert_close(draft_kv_line(backend, 0, slot, len(sequence) - 1), eagle_keys(head, sequence), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.97), (1.3, 1.0)])
def test_nxdis_eagle_acceptance_as_the_stand_in_computes_it_keeps_the_targets_distribution(standin, temperature, top_p):
    """NxDI's sampled EAGLE acceptance (_adjust_target_probs, _speculative_token_selection, a greedy draft), as the
    stand-in computes it, over 20,000 rows of one fused step (the input and two guesses): the first token, and where
    the first guess was kept the second, are distributed as NxDI's sampler draws them without speculation."""
    from types import SimpleNamespace

    from neuronx_distributed_inference.models.standin_eagle import EagleFusedSpec
    from neuronx_distributed_inference.modules.generation.sampling import Sampler
    from test_speculation import chi_square_holds

    draws, ref = 20_000, reference("llama")
    ids = ref.ids("and the")  # a context the tiny model is unsure of at both positions
    with torch.no_grad():
        first = ref.model(torch.tensor([ids])).logits[0, -1].float()
        second = ref.model(torch.tensor([ids + [int(first.argmax())]])).logits[0, -1].float()
        third = ref.model(torch.tensor([ids + [int(first.argmax()), int(second.argmax())]])).logits[0, -1].float()
    guesses = torch.tensor([[int(first.argmax()), int(second.argmax())]]).repeat(draws, 1)  # the greedy draft's, as if it were the target
    params = torch.tensor([[64.0, top_p, temperature]]).repeat(draws, 1)  # NxDI's rows: top_k, top_p, temperature
    sampler = Sampler(SimpleNamespace(global_topk=64, dynamic=True), torch.Generator().manual_seed(0))
    step = SimpleNamespace(sampler=sampler, context_encoding_model=SimpleNamespace(config=SimpleNamespace(pad_token_id=0)))
    tokens, kept_guesses = EagleFusedSpec._eagle_rejection_sampling(step, guesses, torch.stack([first, second, third]).repeat(draws, 1, 1), params)

    def without_speculation(logits: torch.Tensor) -> torch.Tensor:
        indices, probs = sampler.probabilities(logits[None], params[:1])
        return torch.zeros(logits.shape[0], dtype=torch.float64).index_add_(0, indices[0], probs[0].double())

    vocab = first.shape[0]
    assert chi_square_holds(torch.bincount(tokens[:, 0], minlength=vocab), without_speculation(first), draws)
    seconds = tokens[kept_guesses[:, 0] >= 1, 1]
    assert len(seconds) > 1000  # the first guess, the most likely token, was kept often enough to test
    assert chi_square_holds(torch.bincount(seconds, minlength=vocab), without_speculation(second), len(seconds))


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_the_instance_checks_speculation_passes_on_the_stand_in(standin, tmp_path, monkeypatch, capsys, method):
    """scripts/neuron_validate.py's check 9, as an instance runs it (our decode loop over a fused backend, in process),
    over the stand-in in float32, with a draft model or an EAGLE head: every prompt's greedy tokens, with guesses kept."""
    import functools
    import importlib.util
    import types

    from conftest import eagle_head

    from disagg.engine.backends import load_backend

    root = pathlib.Path(__file__).parent.parent
    spec = importlib.util.spec_from_file_location("neuron_validate", root / "scripts" / "neuron_validate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "load_backend", functools.partial(load_backend, dtype="float32"))
    monkeypatch.setenv("HOME", str(tmp_path))  # the compiled artifacts' default root
    guesser = tiny_model("llama-draft") if method == "draft" else eagle_head("llama")
    args = types.SimpleNamespace(model=tiny_model("llama"), draft_model=guesser, speculative_method=method, speculative_tokens=3, tp_degree=2,
                                 batch_size=2, max_seq_len=128, new_tokens=14)
    expected = {prompt: reference("llama").greedy(prompt, args.new_tokens, ignore_eos=True) for prompt in script.PROMPTS}  # its loop ignores EOS
    results = {}
    script.speculation_check(args, reference("llama").tokenizer, expected, results)
    out = capsys.readouterr().out
    assert results == {"greedy tokens with fused speculation": True}, out
    kept, proposed = map(int, re.search(r"guesses kept: (\d+) of (\d+)", out).groups())
    assert 0 < kept <= proposed


def test_a_quantized_model_is_quantized_once_by_nxdi_then_compiled_and_served(standin, tmp_path):
    from neuronx_distributed_inference.models.standin_model import COMPILE_LOG, QUANTIZE_LOG
    from safetensors.torch import load_file

    from disagg.engine.backends import load_backend

    model = tiny_model("llama")
    options = dict(model=model, dtype="float32", max_seq_len=64, batch_size=2, quantization="int8", quantization_type="per_channel",
                   quantization_skip=("lm_head",), neuron={"tp_degree": 2, "compiled_root": str(tmp_path)})  # the WorkerConfig fields
    first = load_backend("neuron", **options)
    neuron_config = first.model.config.neuron_config
    (quantized,) = (tmp_path / "quantized").iterdir()
    assert (neuron_config.quantized, neuron_config.quantization_dtype, neuron_config.quantization_type, neuron_config.modules_to_not_convert,
            neuron_config.quantized_checkpoints_path) == (True, "int8", "per_channel_symmetric", ["lm_head"], str(quantized))
    assert (quantized / "model.safetensors").is_file() and (quantized / "disagg-compiled.json").is_file()
    state_dict = load_file(str(quantized / "model.safetensors"))
    assert state_dict["layers.0.mlp.down_proj.weight"].dtype == torch.int8 and "layers.0.mlp.down_proj.scale" in state_dict
    assert "lm_head.scale" not in state_dict  # quantization_skip
    (compiled,) = [p for p in tmp_path.iterdir() if p.name != "quantized"]
    assert "-int8-" in compiled.name and f"weights from {quantized}:" in (compiled / COMPILE_LOG).read_text()
    assert first.prefill(reference("llama").ids("The baker opens his shop"), Sampling()).first_token >= 0

    load_backend("neuron", **options)  # loads: neither quantized nor compiled again
    load_backend("neuron", **{**options, "neuron": {"tp_degree": 1, "compiled_root": str(tmp_path)}})  # compiles, same state dict
    load_backend("neuron", **{**options, "quantization": None})  # an unquantized compile of its own
    assert (quantized / QUANTIZE_LOG).read_text().count("quantized") == 1
    compiled_dirs = [p for p in tmp_path.iterdir() if p.name != "quantized"]
    assert len(compiled_dirs) == 3 and (compiled / COMPILE_LOG).read_text().count("compiled in") == 1


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_a_quantized_model_speculates_with_a_draft_nxdi_quantized_too(standin, tmp_path, method):
    """--quantization int8 with --speculative-method draft or eagle: NxDI converts both models of a fused model to
    quantized linears, so the draft's own quantized state dict is made once by NxDI's quantizer beside the target's
    (for EAGLE, of the draft directory written from the head, with the head's fc added in full precision, which NxD
    does not convert), and is the draft_model_path NxDI reads its weights from; the rows keep generate()'s tokens (the
    stand-in computes with the checkpoints' weights: what it checks is the settings and the files)."""
    from conftest import eagle_head
    from neuronx_distributed_inference.models.standin_model import QUANTIZE_LOG
    from safetensors.torch import load_file

    from disagg.engine.backends import load_backend

    guesser = tiny_model("llama-draft") if method == "draft" else eagle_head("llama")
    options = dict(model=tiny_model("llama"), dtype="float32", max_seq_len=128, batch_size=3, quantization="int8", quantization_type="per_channel",
                   quantization_skip=("lm_head",),
                   neuron={"compiled_root": str(tmp_path), "speculation": method, "speculation_length": 5, "draft_model": guesser})
    backend = load_backend("neuron", **options)
    fused, target = backend.model.config.fused_spec_config, backend.model.config.neuron_config
    draft_dir, target_dir = pathlib.Path(fused.draft_model_path), pathlib.Path(target.quantized_checkpoints_path)
    assert sorted((tmp_path / "quantized").iterdir()) == sorted([draft_dir, target_dir]) and draft_dir != target_dir
    assert fused.draft_config.neuron_config.quantized_checkpoints_path == str(draft_dir)
    assert (fused.draft_config.neuron_config.quantized, fused.draft_config.neuron_config.modules_to_not_convert) == (True, ["lm_head"])
    state = load_file(str(draft_dir / "model.safetensors"))
    assert state["layers.0.mlp.down_proj.weight"].dtype == torch.int8 and "layers.0.mlp.down_proj.scale" in state
    assert state["layers.0.mlp.down_proj.weight"].shape[1] == (96 if method == "draft" else 192)  # the draft's intermediate size
    if method == "eagle":
        assert state["fc.weight"].dtype == torch.float32 and state["fc.weight"].shape == (64, 128)
    assert ("tiny-llama" if method == "draft" else "eagle-drafts") in (draft_dir / QUANTIZE_LOG).read_text()
    fused_steps_keep_generates_tokens(backend, handed_off_rows(backend))


def test_eagles_fc_joins_a_quantized_state_dict_nxdi_sharded(tmp_path):
    """Where NxDI's quantizer sharded the EAGLE draft's state dict (over 10 GB), the head's fc goes into a file of its own
    that the shards' index names, as NxDI's load_state_dict reads a sharded directory."""
    import json

    from conftest import eagle_head
    from safetensors.torch import load_file, save_file

    from disagg.engine.backends.neuron.eagle_draft import FC_SHARD, add_fc

    shard = "model-00001-of-00001.safetensors"
    save_file({"layers.0.mlp.down_proj.weight": torch.zeros(2, 2, dtype=torch.int8)}, str(tmp_path / shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"layers.0.mlp.down_proj.weight": shard}}))
    add_fc(NeuronOptions(model="/m", speculation="eagle", speculation_length=5, draft_model=eagle_head("llama")), tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"layers.0.mlp.down_proj.weight": shard, "fc.weight": FC_SHARD}
    fc = load_file(str(tmp_path / FC_SHARD))["fc.weight"]
    assert fc.dtype == torch.float32 and fc.shape == (64, 128)


def start_standin_cluster(cluster_logs, compiled, max_seq_len: int, worker_args=(), **spec):
    """start_cluster with --backend neuron, its workers importing the stand-in NxDI (on PYTHONPATH while they start)."""
    if not NXDI_TRANSFORMERS:
        pytest.skip(NEEDS_NXDI_TRANSFORMERS)
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (STANDIN, previous) if p)
    try:
        return start_cluster(cluster_logs, "llama", worker_args=["--backend", "neuron", "--max-seq-len", str(max_seq_len),
                                                                 "--neuron-compiled-path", str(compiled), *worker_args], **spec)
    finally:
        os.environ.pop("PYTHONPATH") if previous is None else os.environ.__setitem__("PYTHONPATH", previous)


@pytest.fixture(scope="module")
def neuron_cluster(cluster_logs, tmp_path_factory):
    # Different tensor-parallel layouts on the two sides: KV heads sharded (tp 2) and replicated (tp 4).
    cluster = start_standin_cluster(cluster_logs, tmp_path_factory.mktemp("neuron-compiled"), 512, batch_size=4,
                                    prefill_args=["--tp-degree", "2"], decode_args=["--tp-degree", "4"], transport=NEURON_TRANSPORT)
    yield cluster
    cluster.stop()


def decode_metric(cluster, name: str) -> float:
    """A sum over the cluster's decode workers' samples of one metric."""
    from test_failures import decode_metric as process_metric

    return sum(process_metric(process, name) for process in cluster.processes if process.name.startswith("decode"))


def fused_draft_args(method: str = "draft") -> list[str]:
    from conftest import eagle_head

    guesser = tiny_model("llama-draft") if method == "draft" else eagle_head("llama")
    return ["--speculative-method", method, "--draft-model", guesser, "--num-speculative-tokens", "4"]


@pytest.fixture(scope="module", params=["draft", "eagle"])
def neuron_speculating_cluster(cluster_logs, tmp_path_factory, request):
    """--speculative-method draft or eagle on --backend neuron: NxDI's fused speculation on both workers (the stand-in's)."""
    cluster = start_standin_cluster(cluster_logs / f"neuron-{request.param}", tmp_path_factory.mktemp(f"neuron-compiled-{request.param}"), 256,
                                    fused_draft_args(request.param), batch_size=4, transport="grpc", prefill_args=["--tp-degree", "2"],
                                    decode_args=["--tp-degree", "1"])
    yield cluster
    cluster.stop()


def test_fused_speculation_through_the_service_gives_generates_tokens_in_a_batch(neuron_speculating_cluster):
    """Requests at once, of other prompt lengths and limits (a limit falls inside a fused step's tokens): each stream
    is generate()'s, token for token; a sampled request gets its tokens; the steps kept draft tokens; nothing is held
    afterwards."""
    import asyncio

    from conftest import assert_nothing_held

    from disagg.clients.grpc_client import AsyncClient

    cluster = neuron_speculating_cluster
    cases = [("The lighthouse keeper climbed", 23), ("Snow fell on the hills and the hills were white", 17),
             ("Our café", 30), ("The baker opens his shop before the sun", 9), ("Rain", 2)]

    async def together():
        async with AsyncClient(cluster.router_address, timeout=120) as client:
            return await asyncio.gather(*(client.complete(prompt, max_new_tokens=n, ignore_eos=True) for prompt, n in cases))

    results = asyncio.run(together())
    for (prompt, n), result in zip(cases, results):
        assert result.token_ids == reference("llama").greedy(prompt, n, ignore_eos=True), prompt
    with Client(cluster.router_address, timeout=120) as client:  # and alone, with EOS
        assert client.complete(cases[0][0], max_new_tokens=12).token_ids == reference("llama").greedy(cases[0][0], 12)
        # Sampled: NxDI accepts a fused step's guesses by rejection sampling over its sampler's top-k probabilities.
        sampled = client.complete(cases[1][0], max_new_tokens=21, temperature=0.9, top_k=20, ignore_eos=True)
        assert (len(sampled.token_ids), sampled.finish_reason) == (21, "length")
    assert decode_metric(cluster, "disagg_decode_spec_accepted_tokens_total") > 0
    assert_nothing_held(cluster)


@pytest.fixture(params=["draft", "eagle"])
def held_neuron_speculating_cluster(cluster_logs, tmp_path, monkeypatch, request):
    """Two decode workers with NxDI's fused speculation (the stand-in's), their steps held
    (test_failures.hold_decode_steps) until the returned path exists."""
    from test_failures import hold_decode_steps

    release = hold_decode_steps(monkeypatch, tmp_path)
    cluster = start_standin_cluster(cluster_logs / f"neuron-{request.param}-held", tmp_path / "compiled", 512, fused_draft_args(request.param), decode=2,
                                    batch_size=2, transport="grpc", router_args=["--worker-wait-seconds", "1"])
    yield cluster, release
    release.touch()
    cluster.stop()


def test_a_decode_worker_killed_mid_fused_speculation_loses_and_repeats_no_token(held_neuron_speculating_cluster):
    """The stream resumes on the other decode worker, whose start recomputes the draft's K/V of the prompt and the
    tokens already streamed: together, generate()'s tokens; a cancelled stream frees its slot."""
    from conftest import assert_nothing_held
    from test_failures import stream_across_a_killed_decode_worker

    cluster, release = held_neuron_speculating_cluster
    prompt = "The lighthouse keeper climbed the stairs of the old tower every night"
    expected = reference("llama").greedy(prompt, 120, ignore_eos=True)

    def kept_draft_tokens(victim):  # held mid-stream, its fused steps having kept draft tokens
        assert decode_metric(cluster, "disagg_decode_spec_accepted_tokens_total") > 0

    with Client(cluster.router_address, timeout=120) as client:
        tokens, last = stream_across_a_killed_decode_worker(cluster, release, client, prompt, 120, kept_draft_tokens)
        assert tokens == expected
        assert last.finish_reason == "length" and last.completion_tokens == 120
        cancelled = client.generate(prompt, max_new_tokens=120, ignore_eos=True)
        next(cancelled)
        cancelled.close()
    assert_nothing_held(cluster, within=10.0)


def test_the_grpc_path_with_backend_neuron_gives_transformers_tokens(neuron_cluster):
    # On NIXL (where installed) the KV lands in the decode worker's host staging buffer
    # (NixlHostStagingSink) and from there goes through the neuron backend's write_kv.
    # The ground truth is transformers' generate() (the torch backend, which equals it in
    # test_e2e, serves only under its own transformers release, not NxDI's).
    prompts = ["The lighthouse keeper climbed", "Snow fell on the hills", "Our café on the corner"]
    with Client(neuron_cluster.router_address, timeout=120) as neuron_client:
        assert neuron_client.model_info().backend == "neuron"
        for prompt in prompts:
            assert neuron_client.complete(prompt, max_new_tokens=16).token_ids == reference("llama").greedy(prompt, 16)
        for prompt in prompts[:2]:  # seeded sampling where NxDI's sampler is deterministic: top_k 1
            sampled = neuron_client.complete(prompt, max_new_tokens=8, temperature=0.8, top_k=1, seed=7).token_ids
            assert sampled == reference("llama").greedy(prompt, 8)
    assert kv_bytes_received(neuron_cluster, NEURON_TRANSPORT) > 0


NXDI_CANNOT = [(dict(min_p=0.1), "sampling.min_p"), (dict(presence_penalty=0.5), "sampling.presence_penalty"),
               (dict(frequency_penalty=0.5), "sampling.frequency_penalty"),
               (dict(repetition_penalty=1.3), "sampling.repetition_penalty"), (dict(logprobs=True), "logprobs")]


def test_what_nxdis_sampler_cannot_do_is_refused_naming_the_field_by_router_and_workers(neuron_cluster):
    import grpc
    from conftest import assert_nothing_held

    from disagg.v1 import worker_pb2 as wpb
    from disagg.v1 import worker_pb2_grpc as wgrpc

    with Client(neuron_cluster.router_address, timeout=120) as client:
        for params, field in NXDI_CANNOT:
            with pytest.raises(grpc.RpcError) as error:
                client.complete("The cat", max_new_tokens=4, **params)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.value.details() and "neuron backend" in error.value.details()
        choices = client.choices("The cat", n=2, max_new_tokens=6)  # n runs as independent requests: served
        assert [c.token_ids for c in choices] == [reference("llama").greedy("The cat", 6)] * 2
    # A worker does not trust the router to have checked.
    with grpc.insecure_channel(neuron_cluster.addresses("prefill")[0]) as channel:
        request = wpb.PrefillRequest(request_id="r", token_ids=[1, 2, 3], sampling=wpb.WorkerSampling(min_p=0.1))
        with pytest.raises(grpc.RpcError) as error:
            list(wgrpc.PrefillServiceStub(channel).Prefill(request, timeout=30))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.min_p" in error.value.details()
    assert_nothing_held(neuron_cluster)


def test_the_colocated_neuron_worker_keeps_a_running_requests_tokens_while_another_prefills(cluster_logs, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    if not NXDI_TRANSFORMERS:
        pytest.skip(NEEDS_NXDI_TRANSFORMERS)
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (STANDIN, previous) if p)
    try:
        cluster = start_cluster(cluster_logs, "llama", colocated=True, batch_size=2,
                                worker_args=["--backend", "neuron", "--max-seq-len", "256", "--tp-degree", "2", "--neuron-compiled-path", str(tmp_path)])
    finally:
        os.environ.pop("PYTHONPATH") if previous is None else os.environ.__setitem__("PYTHONPATH", previous)
    try:
        long_prompt, short_prompts = "The lighthouse keeper climbed", ["Snow fell on the hills", "Our café on the corner", "A fox"]
        with Client(cluster.router_address, timeout=120) as client, ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.complete, long_prompt, max_new_tokens=48, ignore_eos=True)
            for prompt in short_prompts:  # each prefills on the device while the long one decodes
                assert client.complete(prompt, max_new_tokens=4).token_ids == reference("llama").greedy(prompt, 4)
            assert running.result().token_ids == reference("llama").greedy(long_prompt, 48, ignore_eos=True)
    finally:
        cluster.stop()

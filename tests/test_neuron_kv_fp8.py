"""The neuron backend's `--kv-cache-dtype fp8`: NxDI's fp8 KV cache (kv_cache_quant, kv_quant_config with a
direct cast), each K/V line cast to e4m3 as NxDI writes it and widened as it reads it.

The reference is transformers itself with a cache written here, independently of the engine: the attention
of a step takes the positions before it as e4m3 values and its own new K/V as computed (NxDI's context
encoding attends over the prompt's K/V before they are cast, and token generation over the cached lines
and the new token's own, compute_for_token_gen); the cache keeps each new line cast to e4m3. The stand-in
(tests/nxdi_standin) computes NxDI's KVCacheManager the same way; tests/test_neuron_on_nxdi_cpu.py runs it
on NxDI's own code in its CPU mode."""

from __future__ import annotations

import pytest
from conftest import reference, tiny_model
from fp8_kv_reference import E4M3, fp8_lines_greedy, same_lines  # the reference, shared with test_neuron_on_nxdi_cpu.py
from test_neuron_backend import standin, standin_any_transformers  # noqa: F401  (fixtures: the test taking them says noqa: F811)
from test_neuron_findings import greedy_decode, neuron, work_dir, write_prompt  # noqa: F401  (work_dir: a fixture)

from disagg.engine.backends.neuron.config import NeuronOptions, compiled_key_options, neuron_config_kwargs
from disagg.engine.requests import Sampling
from disagg.kv_transport.chunk_codec import KvKind
from disagg.rpc.worker_messages import kv_format


def fp8_cache_greedy(ids: list[int], count: int):
    return fp8_lines_greedy(reference("llama").model, ids, count)


def test_kv_cache_dtype_fp8_maps_onto_nxdis_fp8_kv_cache_and_its_own_compile(tmp_path):
    plain = NeuronOptions(model="/m", compiled_root=str(tmp_path))
    fp8 = NeuronOptions(model="/m", compiled_root=str(tmp_path), kv_cache_dtype="fp8")
    kwargs = neuron_config_kwargs(fp8, None)
    assert kwargs["kv_cache_quant"] is True and kwargs["kv_quant_config"] == {"direct_cast": True}
    assert "kv_cache_quant" not in neuron_config_kwargs(plain, None) and "kv_quant_config" not in neuron_config_kwargs(plain, None)
    assert "kv_cache_dtype" not in compiled_key_options(plain) and compiled_key_options(fp8)["kv_cache_dtype"] == "fp8"


@pytest.mark.parametrize("bad,why", [
    (dict(kv_cache_dtype="int8"), "NxDI's KV cache quantization is fp8"),
    (dict(kv_cache_dtype="fp8", extra={"kv_cache_quant": True}), "kv_cache_quant: leave them out"),
])
def test_what_nxdis_kv_cache_cannot_hold_is_refused_in_one_line(bad, why):
    with pytest.raises(ValueError, match=why):
        NeuronOptions(model="/m", **bad)


def test_a_worker_config_s_kv_cache_quant_is_the_fp8_kv_cache(tmp_path):
    from disagg.engine.backends.neuron.settings import read_worker_config

    path = tmp_path / "worker.json"
    path.write_text('{"kv_cache_quant": true, "tp_degree": 2}')
    assert read_worker_config(str(path))[0] == {"kv_cache_dtype": "fp8", "tp_degree": 2}
    path.write_text('{"kv_cache_quant": false}')
    assert read_worker_config(str(path))[0] == {}
    path.write_text('{"kv_cache_quant": "false"}')  # a string would read as on: refused naming the setting
    with pytest.raises(ValueError, match=r"worker.json: kv_cache_quant 'false': true or false"):
        read_worker_config(str(path))


def test_the_workers_give_the_neuron_backend_the_kv_cache_dtype_and_the_torch_backend_nothing_of_it():
    from decode_worker.config import DecodeWorkerConfig
    from prefill_worker.config import PrefillWorkerConfig

    prefill = PrefillWorkerConfig(model="m", backend="neuron", kv_cache_dtype="fp8", decode_peers=("127.0.0.1:1",))
    for config in (DecodeWorkerConfig(model="m", backend="neuron", kv_cache_dtype="fp8"), prefill):
        assert config.neuron_kv_cache_options() == {"kv_cache_dtype": "fp8"} and config.kv_cache_options(16) == {}
    torch_config = DecodeWorkerConfig(model="m", kv_cache_dtype="fp8")
    assert torch_config.neuron_kv_cache_options() == {} and torch_config.kv_cache_options(16)["kv_cache_dtype"] == "fp8"


def test_a_handed_off_prompt_decodes_as_transformers_over_an_fp8_cache(standin, tmp_path):  # noqa: F811
    """Prefill on one backend, its lines handed to another's slot, greedy steps there: the reference's tokens
    over an fp8 cache; the lines handed off are the e4m3 values that cache holds, widened exactly."""
    from disagg.engine.backends import load_backend

    options = dict(model=tiny_model("llama"), dtype="float32", max_seq_len=64, batch_size=2,
                   neuron={"tp_degree": 2, "compiled_root": str(tmp_path), "kv_cache_dtype": "fp8"})
    prefill, decode = load_backend("neuron", **options), load_backend("neuron", **options)
    assert prefill.info.device_kv_dtype == "fp8" and prefill.info.kv_cache_dtype == "" and kv_format(prefill.info) == "fp8 in the device state"
    assert {c.dtype for c in decode._caches(0, KvKind.KEY)} == {E4M3}  # what NxDI built: the device state in e4m3
    ids = reference("llama").ids("The baker opens his shop before the sun is up")
    expected, lines, after = fp8_cache_greedy(ids, 12)
    result = prefill.prefill(ids, Sampling())
    assert result.first_token == expected[0]
    assert all(same_lines(got, want) for pair, ref in zip(result.layers, lines) for got, want in zip(pair, ref))
    write_prompt(decode, 1, result)
    assert greedy_decode(decode, 1, len(ids), result.first_token, 12) == expected
    # The decode steps' own lines, written cast to e4m3 after attending over e4m3 lines: the reference's.
    length = len(ids) + 11
    assert all(same_lines(decode.read_line(layer, kind, 1, length), ref[kind is KvKind.VALUE])
               for layer, ref in enumerate(after) for kind in KvKind)


def test_an_fp8_kv_cache_with_scales_is_refused_at_start_up(work_dir, tmp_path, monkeypatch):  # noqa: F811
    """Should a release read NxDI's fp8 KV cache with static scales (kv_quant_config's direct_cast off: k_scales and v_scales
    in the state), its lines are not what the hand-off carries: refused when the loaded model's config says so."""
    from disagg.engine.backends.neuron import config
    from disagg.engine.backends.neuron.layout import UnsupportedLayout

    monkeypatch.setitem(config.NXDI_FP8_KV, "kv_quant_config", {"direct_cast": False})
    with pytest.raises(UnsupportedLayout, match="with scales"):
        neuron(tmp_path, kv_cache_dtype="fp8")

"""The nine findings of the NxDI source review (issue 10), each through the strict stand-in.

Each test here fails on the adapter as it was before the review (commit ea7f8d5)
because tests/nxdi_standin enforces what NxDI does at that point, and passes
after the fix. Backends are built directly (no workers) to keep this file fast.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from conftest import reference, tiny_model
from disagg.engine.backends.base import PrefillResult, StepInputs
from disagg.engine.backends.neuron.config import NeuronOptions, neuron_config_kwargs
from disagg.engine.backends.neuron.layout import UnsupportedLayout
from disagg.kv.codec import KvKind
from disagg.engine.requests import Sampling
from disagg.engine.sampler import params_tensor
from test_neuron_backend import standin  # noqa: F401  (fixture)

GREEDY = (1.0, 1.0, 1.0)  # a row NxDI accepts as greedy, for tests that isolate another finding


def standin_module(name: str):
    return importlib.import_module(f"neuronx_distributed_inference.{name}")


@pytest.fixture
def work_dir(standin, tmp_path, monkeypatch):  # noqa: F811
    """The stand-in's default compile work directory, moved out of /tmp/nxd_model."""
    default = tmp_path / "nxd_model"
    monkeypatch.setattr(standin_module("models.standin_model"), "DEFAULT_COMPILE_WORK_DIR", str(default) + "/")
    return default


def neuron(tmp_path, batch_size=2, tp=1, seq_len=64, model=None, **extra_options):
    from disagg.engine.backends import load_backend

    options = {"tp_degree": tp, "compiled_root": str(tmp_path / "compiled"), **extra_options}
    return load_backend("neuron", model=model or tiny_model("llama"), dtype="float32", max_seq_len=seq_len, batch_size=batch_size, neuron=options)


def torch_prefill(ids):
    """The prompt's KV and greedy first token from transformers itself (the ground truth)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = reference("llama").model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    layers = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]
    return PrefillResult(first_token=int(out.logits[0, -1].argmax()), layers=layers)


def write_prompt(backend, slot, result):
    for layer, (keys, values) in enumerate(result.layers):
        backend.write_kv(slot, layer, KvKind.KEY, 0, keys)
        backend.write_kv(slot, layer, KvKind.VALUE, 0, values)


def step(backend, rows: dict[int, tuple[int, int]], row=GREEDY):
    """One decode step; rows: slot -> (position, input token). Returns slot -> token."""
    slots = sorted(rows)
    positions = torch.tensor([rows[s][0] for s in slots])
    inputs = StepInputs(slots=torch.tensor(slots), positions=positions, input_ids=torch.tensor([rows[s][1] for s in slots]),
                        params=torch.tensor([row] * len(slots)), seeds=torch.zeros(len(slots), dtype=torch.long),
                        steps=torch.zeros(len(slots), dtype=torch.long), kv_len=int(positions.max()) + 1, contiguous_from=None)
    return dict(zip(slots, backend.decode_step(inputs).token_ids.tolist()))


def greedy_decode(backend, slot, prompt_len, first, count, row=GREEDY):
    tokens = [first]
    for i in range(count - 1):
        tokens.append(step(backend, {slot: (prompt_len + i, tokens[-1])}, row)[slot])
    return tokens


def slot_line(backend, slot, layer, length, kind=KvKind.KEY):
    """[kv_heads, length, head_dim] as the stand-in itself gathers it."""
    return backend.model._gather(layer, kind is KvKind.KEY, slot, list(range(length)))


# -- 1. sampling parameters ----------------------------------------------------------------
def test_1_sampling_rows_are_mapped_to_what_nxdi_accepts():
    from disagg.engine.backends.neuron.sampling import nxdi_sampling_params

    ours = params_tensor([Sampling(), Sampling(temperature=0.7), Sampling(temperature=0.7, top_k=5000, top_p=0.9), Sampling(temperature=0.5, top_k=40), Sampling(temperature=0.9, top_k=1)])
    expected = torch.tensor([[1, 1, 1], [256, 1, 0.7], [256, 0.9, 0.7], [40, 1, 0.5], [1, 1, 1]])
    torch.testing.assert_close(nxdi_sampling_params(ours, global_topk=256), expected)


def test_1_default_sampling_prefills_and_decodes_greedily(work_dir, tmp_path):
    ids = reference("llama").ids("The baker opens his shop")
    backend = neuron(tmp_path, tp=2)
    result = backend.prefill(ids, Sampling())  # temperature 0, top_k 0: NxDI refuses the raw row
    expected = reference("llama").greedy(ids, 6)
    assert result.first_token == expected[0]
    write_prompt(backend, 0, result)
    assert greedy_decode(backend, 0, len(ids), result.first_token, 6, row=(0.0, 1.0, 0.0)) == expected


# -- 2. decode attention mask ---------------------------------------------------------------
def test_2_decode_mask_covers_positions_before_the_current_token(work_dir, tmp_path):
    backend = neuron(tmp_path, tp=2)
    ids = reference("llama").ids("Snow fell on the hills")
    generator = torch.Generator().manual_seed(0)
    shape = (backend.info.kv_heads, 40, backend.info.head_dim)
    earlier = [(4 * torch.randn(shape, generator=generator), 4 * torch.randn(shape, generator=generator)) for _ in range(backend.info.num_layers)]
    write_prompt(backend, 0, PrefillResult(0, earlier))  # what the slot's previous occupant left behind
    write_prompt(backend, 0, torch_prefill(ids))
    expected = reference("llama").greedy(ids, 12)
    assert greedy_decode(backend, 0, len(ids), expected[0], 12) == expected


# -- 3. writing and reading a slot's KV -----------------------------------------------------------
def test_3_kv_is_written_from_host_one_contiguous_run_at_a_time(work_dir, tmp_path):
    backend = neuron(tmp_path, tp=1)  # two KV heads per rank: a whole-slot slice is strided
    assert backend.layout.heads_per_rank == 2
    line = torch.randn(2, 7, backend.info.head_dim)
    backend.write_kv(1, 0, KvKind.VALUE, 3, line)
    assert slot_line(backend, 1, 0, 10, KvKind.VALUE)[:, 3:].equal(line)
    assert not slot_line(backend, 0, 0, 10, KvKind.VALUE).any() and not slot_line(backend, 1, 0, 3, KvKind.VALUE).any()


def test_3_prefill_moves_only_the_prompts_lines_to_the_host(work_dir, tmp_path):
    device = standin_module("device")
    backend = neuron(tmp_path, tp=2)
    ids = reference("llama").ids("Our café on the corner")
    device.DeviceTensor.bytes_to_host = 0
    backend.prefill(ids, Sampling())
    info = backend.info
    assert device.DeviceTensor.bytes_to_host == 2 * info.num_layers * info.kv_heads * len(ids) * info.head_dim * 4


# -- 4. NxDI's async mode ----------------------------------------------------------------------
def test_4_a_refilled_slot_keeps_the_kv_written_into_it(work_dir, tmp_path):
    backend = neuron(tmp_path, tp=2)
    first, second = (torch_prefill(reference("llama").ids(p)) for p in ("The lighthouse keeper climbed", "Snow fell"))
    write_prompt(backend, 0, first)
    write_prompt(backend, 1, second)
    a, b = first.layers[0][0].shape[1], second.layers[0][0].shape[1]
    out = step(backend, {0: (a, first.first_token), 1: (b, second.first_token)})
    step(backend, {0: (a + 1, out[0]), 1: (b + 1, out[1])})
    # Slot 1's request finished; the batcher gives the slot to a longer prompt.
    refill = torch_prefill(reference("llama").ids("A new and much longer request arrives in the freed slot of the batch"))
    write_prompt(backend, 1, refill)
    step(backend, {0: (a + 2, 5)})
    length = refill.layers[0][0].shape[1]
    for layer, (keys, values) in enumerate(refill.layers):
        assert slot_line(backend, 1, layer, length).equal(keys)
        assert slot_line(backend, 1, layer, length, KvKind.VALUE).equal(values)


def test_4_nxdi_async_mode_is_off_and_the_batchers_stays_on():
    kwargs = neuron_config_kwargs(NeuronOptions(model="/m", async_mode=True), object())
    assert kwargs["async_mode"] is False


# -- 5. Mixtral's config class -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    path = tmp_path_factory.mktemp("tiny-mixtral")
    config = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=128, sliding_window=None)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(path)
    return str(path)


def test_5_mixtral_gets_its_moe_neuron_config(work_dir, tmp_path, tiny_mixtral):
    backend = neuron(tmp_path, model=tiny_mixtral, tp=2)
    assert type(backend.model.config.neuron_config).__name__ == "MoENeuronConfig"
    result = backend.prefill([3, 17, 42, 9], Sampling())
    assert result.layers[0][0].shape == (2, 4, 8)


# -- 6. colocated prefill ------------------------------------------------------------------
def test_6_a_prefill_leaves_the_decoding_slots_alone(work_dir, tmp_path):
    backend = neuron(tmp_path, tp=2, batch_size=2)
    ids = reference("llama").ids("The lighthouse keeper climbed")
    expected = reference("llama").greedy(ids, 10)
    write_prompt(backend, 0, torch_prefill(ids))
    tokens = greedy_decode(backend, 0, len(ids), expected[0], 4)
    backend.prefill(reference("llama").ids("Another prompt prefills on the same device meanwhile"), Sampling())  # colocated mode
    for i in range(6):
        tokens.append(step(backend, {0: (len(ids) + 3 + i, tokens[-1])})[0])
    assert tokens == expected


# -- 7. compile directory -----------------------------------------------------------------------
def test_7_an_interrupted_compile_is_compiled_again(work_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(standin_module("models.standin_model"), "fail_next_trace", True)
    with pytest.raises(KeyboardInterrupt):
        neuron(tmp_path)
    backend = neuron(tmp_path)  # neuron_config.json is there; the traced model is not
    assert backend.prefill([5, 6, 7], Sampling()).first_token >= 0


def test_7_each_compiled_path_traces_in_its_own_work_directory(work_dir, tmp_path):
    work_dir.mkdir()
    (work_dir / "tracing-other-worker").write_text("")  # the other worker on this instance, compiling
    neuron(tmp_path)
    assert (work_dir / "tracing-other-worker").exists()
    (compiled,) = (tmp_path / "compiled").iterdir()
    assert (compiled / "standin_compiles.txt").read_text() == f"compiled in {compiled}.work\n"


def test_7_weights_are_sharded_at_compile():
    assert neuron_config_kwargs(NeuronOptions(model="/m"), object())["save_sharded_checkpoint"] is True


# -- 8. the layout is the loaded model's ---------------------------------------------------------
@pytest.mark.parametrize("extra,why", [({"k_cache_transposed": True}, "k_cache_transposed"), ({"kv_cache_tiling": True}, "kv_cache_tiling"),
                                       ({"attention_dp_degree": 2}, "attention_dp_degree"), ({"kv_cache_quant": True}, "quantized"),
                                       ({"attention_dtype": "bfloat16"}, "attention_dtype")])
def test_8_settings_that_change_the_kv_layout_are_refused(work_dir, tmp_path, extra, why):
    with pytest.raises(UnsupportedLayout, match=why):
        neuron(tmp_path, seq_len=256, extra=extra)


def test_8_a_rolling_cache_is_refused(work_dir, tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    with pytest.raises(UnsupportedLayout, match="sliding_window 16"):
        neuron(tmp_path, model=str(tmp_path / "mistral"))


# -- 9. buckets ------------------------------------------------------------------------------
@pytest.mark.parametrize("options,why", [(dict(max_context_length=256, context_buckets=(128, 512)), "over max_context_length"),
                                         (dict(token_buckets=(128, 256)), "must be seq_len")])
def test_9_buckets_nxdi_would_fail_on_are_refused_at_start_up(options, why):
    with pytest.raises(ValueError, match=why):
        NeuronOptions(model="/m", seq_len=512, **options)

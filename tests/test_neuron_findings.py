"""The findings of the NxDI source reviews, each through the strict stand-in.

Issue 10's nine findings (test_1..test_9) each fail on the adapter as it was before
that review (commit ea7f8d5); issue 28's rules (test_r1..test_r7, read at NxDI 0.9.0)
each fail on the adapter as it was before that issue (commit b64d505): tests/nxdi_standin
enforces what NxDI does at that point. Backends are built directly (no workers) to
keep this file fast.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import reference, tiny_model
from test_neuron_backend import standin, standin_any_transformers  # noqa: F401  (fixtures: the tests taking them say noqa: F811)

from disagg.engine.backends.base import PrefillResult, StepInputs
from disagg.engine.backends.neuron.config import NeuronOptions, neuron_config_kwargs
from disagg.engine.backends.neuron.layout import UnsupportedLayout
from disagg.engine.requests import Sampling
from disagg.engine.sampler import params_tensor
from disagg.kv_transport.chunk_codec import KvKind

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
        backend.write_kv([slot], layer, KvKind.KEY, 0, keys)
        backend.write_kv([slot], layer, KvKind.VALUE, 0, values)


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

    ours = params_tensor([
        Sampling(), Sampling(temperature=0.7), Sampling(temperature=0.7, top_k=5000, top_p=0.9),
        Sampling(temperature=0.5, top_k=40), Sampling(temperature=0.9, top_k=1),
    ])
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
    backend.write_kv([1], 0, KvKind.VALUE, 3, line)
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
    # Slot 1's request finished; the decode loop gives the slot to a longer prompt.
    refill = torch_prefill(reference("llama").ids("A new and much longer request arrives in the freed slot of the batch"))
    write_prompt(backend, 1, refill)
    step(backend, {0: (a + 2, 5)})
    length = refill.layers[0][0].shape[1]
    for layer, (keys, values) in enumerate(refill.layers):
        assert slot_line(backend, 1, layer, length).equal(keys)
        assert slot_line(backend, 1, layer, length, KvKind.VALUE).equal(values)


def test_4_nxdi_async_mode_is_off_and_our_decode_loops_stays_on():
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

    config = MistralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, sliding_window=16
    )
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    with pytest.raises(UnsupportedLayout, match="sliding_window 16"):
        neuron(tmp_path, model=str(tmp_path / "mistral"))


# -- 9. buckets ------------------------------------------------------------------------------
@pytest.mark.parametrize("options,why", [(dict(max_context_length=256, context_buckets=(128, 512)), "over max_context_length"),
                                         (dict(token_buckets=(128, 256)), "must be seq_len")])
def test_9_buckets_nxdi_would_fail_on_are_refused_at_start_up(options, why):
    with pytest.raises(ValueError, match=why):
        NeuronOptions(model="/m", seq_len=512, **options)


# == Issue 28: the stand-in as strict as NxDI 0.9 where the adapter touches it ======================
# Each rule is in tests/nxdi_standin and names the NxDI function it mirrors; each test below
# passes only when the adapter handles that rule.
def reference_greedy(model_path: str, ids: list[int], count: int) -> list[int]:
    """transformers' greedy tokens for a checkpoint made here (no tokenizer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_prefill(model_path: str, ids: list[int]) -> PrefillResult:
    """A prompt's canonical KV ([kv_heads, tokens, head_dim] per layer) and greedy first token."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    cache = DynamicCache()
    with torch.no_grad():
        out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return PrefillResult(first_token=int(out.logits[0, -1].argmax()), layers=[(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers])


# -- rule 1: KVCacheManager._init_kv_shape and the seq_ids mask ------------------------------------
def test_r1_the_cache_carries_nxdis_seq_ids_mask_pad_and_serves_exactly(work_dir, tmp_path):
    backend = neuron(tmp_path, tp=2, seq_len=64)
    state = backend.model.context_encoding_model.model.nxd_model.state
    assert tuple(state[0]["kv_mgr.past_key_values.0"].shape) == (3, 1, 64 + 128, 16)  # [lines, heads/rank, seq_len + 128, head_dim]
    ids = reference("llama").ids("The baker opens his shop")
    expected = reference("llama").greedy(ids, 8)
    result = backend.prefill(ids, Sampling())
    assert result.first_token == expected[0]
    write_prompt(backend, 1, result)
    assert greedy_decode(backend, 1, len(ids), result.first_token, 8) == expected


def test_r1_a_decode_step_leaves_a_slot_receiving_kv_alone(work_dir, tmp_path):
    backend = neuron(tmp_path, tp=1, batch_size=2)
    running, arriving = (torch_prefill(reference("llama").ids(p)) for p in ("Snow fell", "The lighthouse keeper climbed the stairs"))
    write_prompt(backend, 0, running)
    write_prompt(backend, 1, arriving)  # a hand-off lands while slot 0 decodes
    step(backend, {0: (running.layers[0][0].shape[1], running.first_token)})  # slot 1 is a padded row of this step
    length = arriving.layers[0][0].shape[1]
    for layer, (keys, values) in enumerate(arriving.layers):
        assert slot_line(backend, 1, layer, length).equal(keys) and slot_line(backend, 1, layer, length, KvKind.VALUE).equal(values)


@pytest.fixture(scope="module")
def tiny_mistral_factory(tmp_path_factory):
    def make(window: int) -> str:
        from transformers import MistralConfig, MistralForCausalLM

        path = tmp_path_factory.mktemp(f"tiny-mistral-w{window}")
        config = MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, sliding_window=window, initializer_range=0.3, pad_token_id=0)
        torch.manual_seed(window)
        MistralForCausalLM(config).save_pretrained(path)
        return str(path)

    return make


@pytest.mark.parametrize("window", [8, 128])  # below seq_len (rolling), above it (Mistral-7B-v0.1's 4096 at seq_len 2048)
def test_r1_a_windowed_model_is_served_exactly_or_refused_at_start_up(work_dir, tmp_path, tiny_mistral_factory, window):
    """NxDI sizes a Llama or Mistral cache to the window whenever one is set (+128), writes at
    position % (window - 1), and its padded rows then skip the seq_ids mask: serving it means
    the rolled layout and a hand-off that survives the other slots' steps."""
    model = tiny_mistral_factory(window)
    try:
        backend = neuron(tmp_path, model=model, tp=1, batch_size=2, seq_len=64)
    except UnsupportedLayout as refused:
        assert "sliding_window" in str(refused)
        return
    prompt, other = [5 + i % 200 for i in range(20)], [7, 9, 11]
    expected = reference_greedy(model, prompt, 12)
    assert backend.prefill(prompt, Sampling()).first_token == expected[0]
    running = hf_prefill(model, other)
    write_prompt(backend, 0, running)
    write_prompt(backend, 1, hf_prefill(model, prompt))
    step(backend, {0: (len(other), running.first_token)})  # slot 1 is a padded row here
    assert greedy_decode(backend, 1, len(prompt), expected[0], 12) == expected


# -- rule 2: application_base.compile writes model.pt, THEN shards the weights -----------------------
def test_r2_the_standin_cannot_load_without_the_sharded_weights(work_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(standin_module("models.standin_model"), "fail_next_shard", True)
    llama = standin_module("models.llama.modeling_llama")
    config_module = standin_module("models.config")
    hf_adapter = standin_module("utils.hf_adapter")
    config = llama.LlamaInferenceConfig(config_module.NeuronConfig(tp_degree=2, save_sharded_checkpoint=True, torch_dtype="float32"),
                                        load_config=hf_adapter.load_pretrained_config(tiny_model("llama")))
    with pytest.raises(KeyboardInterrupt):
        llama.NeuronLlamaForCausalLM(tiny_model("llama"), config).compile(str(tmp_path / "c") + "/")
    assert (tmp_path / "c" / "model.pt").exists() and (tmp_path / "c" / "weights" / "tp0_sharded_checkpoint.safetensors").exists()
    with pytest.raises(FileNotFoundError, match="tp1_sharded_checkpoint"):
        llama.NeuronLlamaForCausalLM(tiny_model("llama"), config).load(str(tmp_path / "c") + "/")


def test_r2_a_compile_interrupted_while_sharding_is_compiled_again(work_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(standin_module("models.standin_model"), "fail_next_shard", True)
    with pytest.raises(KeyboardInterrupt):
        neuron(tmp_path, tp=2)
    backend = neuron(tmp_path, tp=2)  # model.pt is there; rank 1's weights are not
    ids = reference("llama").ids("Snow fell on the hills")
    assert backend.prefill(ids, Sampling()).first_token == reference("llama").greedy(ids, 1)[0]


# -- rule 3: ModelWrapper.pad_inputs pads position_ids with 1; the output is at their max -----------
def test_r3_nxdi_samples_a_one_token_prompt_at_its_first_pad(work_dir, tmp_path):
    """The rule bites: called as NxDI is called, the stand-in's first token of some one-token
    prompts differs from transformers' (the hidden state taken is the pad's)."""
    backend = neuron(tmp_path, tp=1)
    row = torch.tensor([GREEDY])
    wrong = []
    for token in range(3, 40):
        out = backend.model.forward(input_ids=torch.tensor([[token]]), attention_mask=torch.ones(1, 1, dtype=torch.int32),
                                    position_ids=torch.zeros(1, 1, dtype=torch.int32), seq_ids=torch.tensor([2]), sampling_params=row)
        wrong.append(int(out.tokens[0, 0]) != reference("llama").greedy([token], 1)[0])
    assert any(wrong)


def test_r3_a_one_token_prompt_gets_transformers_tokens(work_dir, tmp_path):
    backend = neuron(tmp_path, tp=2)
    for token in range(3, 40):
        expected = reference("llama").greedy([token], 6, ignore_eos=True)
        result = backend.prefill([token], Sampling())
        assert result.first_token == expected[0], token
    write_prompt(backend, 0, result)
    assert greedy_decode(backend, 0, 1, result.first_token, 6) == expected


# -- rule 4: NxDI's release, and a config that kept apply_seq_ids_mask -------------------------------
def test_r4_the_standin_exposes_its_version_as_nxdi_does_and_old_releases_drop_the_mask(standin, monkeypatch, caplog):  # noqa: F811 (a fixture)
    import importlib.metadata

    package = standin_module("_version")
    assert importlib.import_module("neuronx_distributed_inference").__version__ == package.__version__ == "0.9.0"
    assert importlib.metadata.version("neuronx-distributed-inference") == "0.9.0"
    monkeypatch.setattr(importlib.import_module("neuronx_distributed_inference"), "__version__", "0.3.0")
    config = standin_module("models.config").NeuronConfig(apply_seq_ids_mask=True, tp_degree=2)
    assert not hasattr(config, "apply_seq_ids_mask") and config.tp_degree == 2
    assert "Unexpected keyword arguments: {'apply_seq_ids_mask': True}" in caplog.text


@pytest.mark.parametrize("version", ["0.3.0", "0.6.0", "0.10.0"])
def test_r4_nxdi_releases_outside_0_7_to_0_9_are_refused_at_start_up(work_dir, tmp_path, monkeypatch, version):
    monkeypatch.setattr(importlib.import_module("neuronx_distributed_inference"), "__version__", version)
    with pytest.raises(Exception, match=r">=0\.7,<0\.10"):
        neuron(tmp_path)


@pytest.mark.parametrize("version", ["0.7.14366", "0.8.0", "0.9.0"])
def test_r4_nxdi_0_7_to_0_9_are_served(work_dir, tmp_path, monkeypatch, version):
    monkeypatch.setattr(importlib.import_module("neuronx_distributed_inference"), "__version__", version)
    ids = reference("llama").ids("Our café on the corner")
    assert neuron(tmp_path).prefill(ids, Sampling()).first_token == reference("llama").greedy(ids, 1)[0]


def test_r4_a_loaded_config_without_apply_seq_ids_mask_is_refused(work_dir, tmp_path):
    with pytest.raises(Exception, match="apply_seq_ids_mask"):
        neuron(tmp_path, extra={"apply_seq_ids_mask": False})


# -- rule 5: InferenceConfig.validate_config and each model's required attributes -------------------
@pytest.mark.parametrize("module,cls,missing", [("llama.modeling_llama", "LlamaInferenceConfig", "rope_theta"),
                                                ("mistral.modeling_mistral", "MistralInferenceConfig", "tie_word_embeddings"),
                                                ("qwen2.modeling_qwen2", "Qwen2InferenceConfig", "pad_token_id"),
                                                ("qwen3.modeling_qwen3", "Qwen3InferenceConfig", "head_dim"),
                                                ("mixtral.modeling_mixtral", "MixtralInferenceConfig", "num_local_experts")])
def test_r5_a_missing_required_attribute_fails_as_in_nxdi(standin_any_transformers, module, cls, missing):  # noqa: F811 (a fixture)
    config_cls = getattr(standin_module(f"models.{module}"), cls)
    required = config_cls.get_required_attributes(None)

    def load_config(config):
        for name in required:
            if name != missing:
                setattr(config, name, 1)

    with pytest.raises(AssertionError, match=rf"Config must define \['{missing}'\]"):
        config_cls(config_cls.get_neuron_config_cls()(), load_config=load_config)


@pytest.mark.skipif(int(__import__("transformers").__version__.split(".")[0]) < 5, reason="transformers 4.x configs carry rope_theta")
def test_r5_under_transformers_5_the_backend_serves_exactly_or_refuses_naming_transformers(standin_any_transformers, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(standin_module("models.standin_model"), "DEFAULT_COMPILE_WORK_DIR", str(tmp_path / "nxd_model") + "/")
    try:
        backend = neuron(tmp_path)
    except AssertionError as bare:
        pytest.fail(f"NxDI's own assertion reached the user instead of a start-up line: {bare}")
    except Exception as refused:  # noqa: BLE001  (whichever error the adapter refuses with, it must say why)
        assert "transformers" in str(refused)
        return
    ids = reference("llama").ids("Snow fell on the hills")
    assert backend.prefill(ids, Sampling()).first_token == reference("llama").greedy(ids, 1)[0]


# -- rule 7 (finding 6): context buckets below the context limit ------------------------------------
def test_r7_the_standin_picks_buckets_as_get_target_bucket_and_generate_buckets(standin_any_transformers):  # noqa: F811 (a fixture)
    wrapper = standin_module("models.model_wrapper")
    buckets = standin_module("modules.autobucketing")
    picks = {length: wrapper.get_target_bucket([128, 512], torch.ones(1, length), "context_encoding_model") for length in (1, 127, 128, 511, 512)}
    assert picks == {1: 128, 127: 128, 128: 512, 511: 512, 512: 512}
    with pytest.raises(ValueError, match=r"Input len 513 exceeds largest bucket \(512\) for context_encoding_model"):
        wrapper.get_target_bucket([128, 512], torch.ones(1, 513), "context_encoding_model")
    assert buckets.generate_buckets(128, 300) == [128, 300] and buckets.generate_buckets(128, 384) == [128, 256, 384]
    assert buckets.generate_buckets(128, 64) == [64] and buckets.generate_buckets(128, 2048) == [128, 256, 512, 1024, 2048]


def test_r7_lmi_context_buckets_end_at_the_context_limit():
    options = NeuronOptions(model="/m", seq_len=4096, context_buckets=(512, 1024, 2048))  # LMI: context_length_estimate, n_positions
    assert neuron_config_kwargs(options, object())["context_encoding_buckets"] == [512, 1024, 2048, 4096]
    capped = NeuronOptions(model="/m", seq_len=4096, max_context_length=2048, context_buckets=(512, 1024, 2048))
    assert neuron_config_kwargs(capped, object())["context_encoding_buckets"] == [512, 1024, 2048]


def test_r7_a_prompt_between_the_last_bucket_and_the_limit_is_served(work_dir, tmp_path):
    backend = neuron(tmp_path, seq_len=64, context_buckets=(16, 32))
    ids = [3 + i % 400 for i in range(40)]  # over the last given bucket, under the limit (64)
    expected = reference("llama").greedy(ids, 4, ignore_eos=True)
    result = backend.prefill(ids, Sampling())
    assert result.first_token == expected[0]
    write_prompt(backend, 0, result)
    assert greedy_decode(backend, 0, len(ids), result.first_token, 4) == expected

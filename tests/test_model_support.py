"""The model-support sweep over transformers' causal-LM architectures, and the
start-up refusal of what it does not find exact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from disagg.engine.backends import architectures, load_backend, row_masks
from disagg.engine.backends.architectures import UnsupportedModel
from disagg.tools import model_support


@pytest.fixture(scope="module")
def sweep_verdicts():
    return model_support.sweep()


def test_every_causal_lm_architecture_is_exact_or_refused_as_the_checked_in_verdicts_say(sweep_verdicts):
    checked_in = json.loads(architectures.VERDICTS.read_text())
    fresh = model_support.verdict_table(sweep_verdicts)
    assert fresh["transformers"] == checked_in["transformers"]
    assert fresh["exact"] == checked_in["exact"]
    assert fresh["refused"] == checked_in["refused"]
    assert set(fresh["exact"]) | set(fresh["refused"]) == set(model_support.causal_lm_architectures())


def test_the_families_users_come_with_are_served_exactly(sweep_verdicts):
    exact = {v.model_type for v in sweep_verdicts if v.exact}
    # LMI's tested list, sliding-window and softcapping families, latent attention.
    for model_type in ("llama", "mistral", "mixtral", "gpt_neox", "gptj", "bloom", "gpt2", "opt", "gpt_bigcode", "gemma2", "gemma3_text", "qwen2", "qwen3",
                       "phi3", "falcon", "deepseek_v3", "gpt_oss"):
        assert model_type in exact, model_type


def test_sliding_layers_are_checked_past_their_window(sweep_verdicts):
    layers = {v.model_type: v.reason for v in sweep_verdicts if v.exact}
    assert "sliding_attention" in layers["mistral"]
    assert "sliding_attention" in layers["gemma2"] and "full_attention" in layers["gemma2"]
    assert min(model_support.PROMPT_LENGTHS) > model_support.WINDOW


@pytest.mark.parametrize("model_type", ["mistral", "gemma2", "cohere2"])
def test_a_mask_that_ignores_the_window_is_caught(monkeypatch, model_type):
    from transformers.masking_utils import causal_mask_function

    original = row_masks.row_mask

    def window_ignored(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, device):
        return original(batch_size, q_length, kv_length, q_offset, kv_offset, causal_mask_function, attention_mask, device)

    monkeypatch.setattr(row_masks, "row_mask", window_ignored)
    verdict = model_support.check(model_type, model_support.causal_lm_architectures()[model_type])
    assert not verdict.exact and "logits differ" in verdict.reason


def test_gpt_neo_local_attention_is_refused(sweep_verdicts):
    """GPT-Neo spells its window `window_size` / `attention_types`; every real checkpoint has a
    256-token local window, which the slot cache does not serve."""
    verdict = next(v for v in sweep_verdicts if v.model_type == "gpt_neo")
    assert not verdict.exact and "logits differ" in verdict.reason


def test_a_window_under_a_name_the_sweep_does_not_shrink_is_caught_by_the_long_probe(monkeypatch):
    """The long probe finds a window from the model's behaviour, not its config's key names:
    with GPT-Neo's `window_size` left at its default 256, prompts past it still show it."""
    monkeypatch.delitem(model_support.SMALL, "window_size")
    verdict = model_support.check("gpt_neo", model_support.causal_lm_architectures()["gpt_neo"])
    assert not verdict.exact and f"past {min(model_support.LONG_PROMPT_LENGTHS)} tokens" in verdict.reason
    assert min(model_support.LONG_PROMPT_LENGTHS) > 256


def test_rows_at_the_wrong_position_are_caught(monkeypatch):
    from disagg.engine.backends import slot_kv_cache

    monkeypatch.setattr(slot_kv_cache.DecodeCache, "get_query_offset", lambda self, layer_idx=0: self.step.positions * 0 + self.step.kv_len - 1)
    verdict = model_support.check("gemma2", "Gemma2ForCausalLM")
    assert not verdict.exact


def save_small(model_type: str, path, **overrides) -> str:
    config = model_support.small_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    model_support.sharpen(model, seed=0)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("worker", ["decode_worker", "prefill_worker"])
def test_a_refused_architecture_exits_at_start_up_with_one_line(tmp_path, worker):
    model = save_small("mamba", tmp_path / "mamba")
    pool = ["--decode", "127.0.0.1:1"] if worker == "prefill_worker" else []
    command = [sys.executable, "-m", worker, "--model", model, "--port", "0", "--metrics-port", "-1", "--dtype", "float32", *pool]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last == f"{worker}: refusing {model}: MambaForCausalLM (model type 'mamba') cannot be served exactly: {architectures.verdicts()['refused']['mamba']}"
    assert "Traceback" not in run.stderr


def test_an_encoder_lm_head_not_set_up_as_a_decoder_is_refused(tmp_path):
    model = save_small("bert", tmp_path / "bert", is_decoder=False)
    with pytest.raises(UnsupportedModel, match="BertLMHeadModel .* attention is not causal"):
        load_backend("torch", model=model, dtype="float32")


def test_an_unverified_model_type_is_refused(monkeypatch, tmp_path):
    model = save_small("llama", tmp_path / "llama")
    import transformers

    monkeypatch.setattr(architectures, "verdicts", lambda: {"transformers": "9.9", "exact": {}, "refused": {}})
    monkeypatch.setattr(transformers, "__version__", "9.9")  # the release the (empty) verdicts were made with
    with pytest.raises(UnsupportedModel,
                       match=r"LlamaForCausalLM \(model type 'llama'\) cannot be served exactly: not verified by the model-support sweep for transformers 9.9"):
        load_backend("torch", model=model, dtype="float32")


def test_a_sliding_layer_reads_only_its_window():
    from disagg.engine.backends.slot_kv_cache import DecodeStep, LayerPlan, _DecodeLayer

    keys = torch.zeros(3, 2, 64, 4)  # the slot layout: slot i is block i, of every position
    slots, positions = torch.tensor([0, 2]), torch.tensor([40, 30])
    step = DecodeStep(slots=slots, positions=positions, kv_len=41, min_position=30, tables=slots[:, None])
    written = (slots, positions)  # each row's line: its slot's block, at its position
    sliding = _DecodeLayer(LayerPlan("sliding_attention", 8), keys, keys.clone(), step, written)
    full = _DecodeLayer(LayerPlan("full_attention"), keys, keys.clone(), step, written)
    assert sliding.get_mask_sizes(1) == (41 - 23, 23)  # row at 30 still sees 23..30
    assert full.get_mask_sizes(1) == (41, 0)
    k, _ = sliding.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))
    assert k.shape == (2, 2, 41 - 23, 4)
    assert keys[0, :, 40].eq(1).all() and keys[2, :, 30].eq(1).all() and keys.sum() == 2 * 2 * 4  # one line per row, nothing else

"""Our NeuronBackend on NxDI's real code, in NxDI's CPU mode (NeuronConfig(on_cpu=True), to_cpu()).

Skipped unless NXDI_SRC names a folder holding source checkouts of
aws-neuron/neuronx-distributed-inference and aws-neuron/neuronx-distributed, laid out as
$NXDI_SRC/neuronx-distributed-inference/src and $NXDI_SRC/neuronx-distributed/src, and the
environment has NxDI's transformers (4.57) and its imports (boto3, requests, tenacity, pyyaml).
The hardware-only packages get import shims (tests/nxdi_cpu/shims.py). Run without the suite's
conftest (it trains the suite's checkpoints under another transformers):

    NXDI_SRC=/work/nxdi_src python -m pytest --noconftest tests/test_neuron_on_nxdi_cpu.py -q

Each backend instance runs in its own process (tests/nxdi_cpu/run_backend.py): to_cpu() leaves a
gloo process group behind. Checkpoints: tiny trained models made under this transformers.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

NXDI_SRC = os.environ.get("NXDI_SRC", "")
TESTS = pathlib.Path(__file__).parent
SEQ_LEN = 128  # CPU mode needs max_context_length == seq_len
BATCH = 3  # decode slots; NxDI compiles one more line, the prefill's


def _have_sources() -> bool:
    return bool(NXDI_SRC) and all((pathlib.Path(NXDI_SRC) / repo / "src").is_dir() for repo in ("neuronx-distributed-inference", "neuronx-distributed"))


pytestmark = pytest.mark.skipif(not _have_sources(), reason="NXDI_SRC does not name checkouts of neuronx-distributed-inference and neuronx-distributed")


def tiny_checkpoint(**spec) -> str:
    import transformers

    from disagg.tools.tinymodel import TinyModelSpec, cache_dir, ensure_tiny_model

    # Made under this transformers (LlamaInferenceConfig needs 4.57's rope_theta), apart from the suite's.
    root = cache_dir() / f"nxdi-cpu-tf{transformers.__version__}"
    return str(ensure_tiny_model(TinyModelSpec(**spec), root=root))


def run_backend(tmp_path: pathlib.Path, name: str, model: str, actions: list[dict], seq_len: int = SEQ_LEN, **options) -> dict:
    """One NeuronBackend in a fresh process running `actions` (options: NeuronOptions fields run_backend reads, kv_cache_dtype); their results."""
    import torch

    job = {"nxdi_src": NXDI_SRC, "model": model, "seq_len": seq_len, "batch_size": BATCH, "actions": actions, "out": str(tmp_path / f"{name}.pt"), **options}
    job_file = tmp_path / f"{name}.json"
    job_file.write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "nxdi_cpu.run_backend", str(job_file)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(job["out"])


class Greedy:
    """transformers generate() on the same weights, float32, greedy: the ground truth."""

    def __init__(self, path: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def tokens(self, prompt: list[int], count: int) -> list[int]:
        with self.torch.no_grad():
            out = self.model.generate(self.torch.tensor([prompt]), attention_mask=self.torch.ones(1, len(prompt), dtype=self.torch.long),
                                      do_sample=False, max_new_tokens=count, min_new_tokens=count, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def kv(self, prompt: list[int]):
        with self.torch.no_grad():
            cache = self.model(self.torch.tensor([prompt]), use_cache=True).past_key_values
        return [(cache.layers[i].keys[0], cache.layers[i].values[0]) for i in range(len(cache.layers))]


PROMPTS = {
    "long": [1, 87, 112, 45, 201, 33, 76, 150, 9, 64, 120, 18, 95],
    "short": [1, 150, 22, 37, 88],
    "one": [1],  # finding 7: NxDI's own padding would take the hidden state of a pad
}
STEPS = {"long": 10, "short": 14, "one": 12}


@pytest.fixture(scope="module")
def llama() -> str:
    return tiny_checkpoint(architecture="llama")


def test_prefill_hand_off_decode_equal_generate(llama, tmp_path):
    """Prefill in one backend, KV into slots of another, decode there: greedy tokens equal
    generate()'s, with three rows at different positions in each step, one of them a one-token prompt."""
    prefill = run_backend(tmp_path, "prefill", llama, [{"do": "shapes"}] + [{"do": "prefill", "name": n, "prompt": p} for n, p in PROMPTS.items()])
    # The real KV shapes, accepted at start-up: [lines, kv_heads, seq_len + 128 (apply_seq_ids_mask's pad), head_dim].
    assert set(prefill["shapes"]) == {((BATCH + 1, 2, SEQ_LEN + 128, 16), "torch.float32")}
    reference = Greedy(llama)
    for name, prompt in PROMPTS.items():
        assert prefill[name]["first"] == reference.tokens(prompt, 1)[0], name
        for (keys, values), (ref_keys, ref_values) in zip(prefill[name]["layers"], reference.kv(prompt)):
            assert keys.shape == ref_keys.shape == (2, len(prompt), 16)
            assert (keys - ref_keys).abs().max() < 1e-4 and (values - ref_values).abs().max() < 1e-4

    slots = {name: slot for slot, name in enumerate(PROMPTS)}
    rows = [{"slot": slots[n], "first": prefill[n]["first"], "position": len(p), "steps": STEPS[n]} for n, p in PROMPTS.items()]
    writes = [{"do": "write", "slot": slots[n], "kv": str(tmp_path / "prefill.pt"), "name": n} for n in PROMPTS]
    decoded = run_backend(tmp_path, "decode", llama, writes + [{"do": "decode", "rows": rows}])["decoded"][0]
    for name, prompt in PROMPTS.items():
        assert decoded[slots[name]] == reference.tokens(prompt, STEPS[name] + 1), name


def test_idle_slot_keeps_its_handed_off_kv_while_others_step(llama, tmp_path):
    """A slot that received KV and has not joined yet is untouched by steps of the others
    (apply_seq_ids_mask: padded rows write into the 128-position pad)."""
    prompt = PROMPTS["long"]
    prefill = run_backend(tmp_path, "prefill", llama, [{"do": "prefill", "name": "long", "prompt": prompt}])
    kv = str(tmp_path / "prefill.pt")
    rows = [{"slot": 0, "first": prefill["long"]["first"], "position": len(prompt), "steps": 4}]
    out = run_backend(tmp_path, "decode", llama, [{"do": "write", "slot": s, "kv": kv, "name": "long"} for s in (0, 2)]
                      + [{"do": "decode", "rows": rows}, {"do": "line", "slot": 2, "length": len(prompt)}])
    for (keys, values), (sent_keys, sent_values) in zip(out["lines"][0], prefill["long"]["layers"]):
        assert keys.equal(sent_keys) and values.equal(sent_values)


def test_an_fp8_kv_cache_hands_off_and_decodes_as_transformers_over_an_fp8_cache(llama, tmp_path):
    """--kv-cache-dtype fp8 on NxDI's own KV cache manager (kv_cache_quant, kv_quant_config's direct cast): the
    device state in e4m3, the prompt's lines handed off as the e4m3 values it holds, the steps after the hand-off
    attending over them; tokens and lines as tests/fp8_kv_reference.py computes them over transformers."""
    from fp8_kv_reference import fp8_lines_greedy, same_lines

    prompt = PROMPTS["long"]
    prefill = run_backend(tmp_path, "prefill", llama, [{"do": "shapes"}, {"do": "prefill", "name": "long", "prompt": prompt}], kv_cache_dtype="fp8")
    assert {dtype for _, dtype in prefill["shapes"]} == {"torch.float8_e4m3fn"}
    expected, lines, after = fp8_lines_greedy(Greedy(llama).model, prompt, STEPS["long"] + 1)
    assert prefill["long"]["first"] == expected[0]
    assert all(same_lines(got, want) for pair, ref in zip(prefill["long"]["layers"], lines) for got, want in zip(pair, ref))
    rows = [{"slot": 1, "first": prefill["long"]["first"], "position": len(prompt), "steps": STEPS["long"]}]
    decoded = run_backend(tmp_path, "decode", llama, [{"do": "write", "slot": 1, "kv": str(tmp_path / "prefill.pt"), "name": "long"},
                                                      {"do": "decode", "rows": rows}, {"do": "line", "slot": 1, "length": len(prompt) + STEPS["long"]}],
                          kv_cache_dtype="fp8")
    assert decoded["decoded"][0][1] == expected
    assert all(same_lines(got, want) for pair, ref in zip(decoded["lines"][0], after) for got, want in zip(pair, ref))


@pytest.fixture(scope="module")
def mistral_window() -> str:
    return tiny_checkpoint(architecture="mistral", sliding_window=200)


def test_a_window_the_sequence_never_reaches_is_served_as_full_attention(mistral_window, tmp_path):
    """Mistral passes sliding_window to NxDI's KV manager, whose windowed cache rolls and whose
    windowed prefill fails for a bucket shorter than the window (get_last_kv_window). A window
    of seq_len or more never masks anything, so NxDI gets none: a plain cache of seq_len + 128
    positions, tokens equal to generate()'s (whose model keeps the window), and an idle slot's
    handed-off KV survives the others' steps."""
    prompt = PROMPTS["long"]
    prefill = run_backend(tmp_path, "prefill", mistral_window, [{"do": "shapes"}, {"do": "prefill", "name": "long", "prompt": prompt}])
    assert set(prefill["shapes"]) == {((BATCH + 1, 2, SEQ_LEN + 128, 16), "torch.float32")}
    kv = str(tmp_path / "prefill.pt")
    rows = [{"slot": 0, "first": prefill["long"]["first"], "position": len(prompt), "steps": 8}]
    out = run_backend(tmp_path, "decode", mistral_window, [{"do": "write", "slot": s, "kv": kv, "name": "long"} for s in (0, 1)]
                      + [{"do": "decode", "rows": rows}, {"do": "line", "slot": 1, "length": len(prompt)}])
    assert out["decoded"][0][0] == Greedy(mistral_window).tokens(prompt, 9)
    for (keys, values), (sent_keys, sent_values) in zip(out["lines"][0], prefill["long"]["layers"]):
        assert keys.equal(sent_keys) and values.equal(sent_values)


def test_a_window_below_seq_len_is_refused_at_start_up(mistral_window, tmp_path):
    out = run_backend(tmp_path, "refused", mistral_window, [], seq_len=256)
    assert out["load_error"].startswith("UnsupportedLayout: ")
    assert "sliding_window 200 is below seq_len 256" in out["load_error"] and "\n" not in out["load_error"]


# -- speculation: NxDI's fused speculation configs, built through ours (its CPU mode runs no speculation) ----------------
@pytest.fixture(scope="module")
def llama_draft() -> str:
    return tiny_checkpoint(architecture="llama", num_layers=1, hidden_size=32, intermediate_size=96)


@pytest.fixture(scope="module")
def llama_eagle(llama) -> str:
    """An EAGLE head for the tiny Llama, in the checkpoint format the torch backend serves (fc and the layers)."""
    import transformers

    from disagg.tools.tiny_eagle import ensure_eagle_head
    from disagg.tools.tinymodel import cache_dir

    return str(ensure_eagle_head(llama, steps=20, root=cache_dir() / f"nxdi-cpu-tf{transformers.__version__}"))


def speculation_job(tmp_path: pathlib.Path, name: str, model: str, method: str, draft: str, num_tokens: int = 3, quantization=None) -> dict:
    import torch

    job = {"nxdi_src": NXDI_SRC, "model": model, "seq_len": SEQ_LEN, "batch_size": BATCH, "out": str(tmp_path / f"{name}.pt"),
           "compiled_root": str(tmp_path / "compiled"), "quantization": quantization or {},
           "speculation": {"method": method, "num_tokens": num_tokens, "draft_model": draft}}
    (tmp_path / f"{name}.json").write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "nxdi_cpu.run_backend", str(tmp_path / f"{name}.json")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(job["out"])


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_fused_speculation_configs_built_through_ours_are_what_nxdi_builds(llama, llama_draft, llama_eagle, tmp_path, method):
    """--speculative-method draft|eagle --num-speculative-tokens 3 --draft-model D: NxDI's own NeuronConfig,
    FusedSpecNeuronConfig and draft InferenceConfig (as its inference_demo derives the draft's), accepted by NxDI's
    application (a context-encoding and a fused-speculation graph, both NeuronFusedSpecModel); its to_cpu() refuses
    speculation, which is why no fused step runs here; the fused model, built in CPU mode, holds the target's KV under
    the state key the backend reads, in the layout the hand-off converts; and NxDI's get_state_dict over the draft's
    path gives every weight of the draft model NxDI built (for EAGLE: the directory written from our head's checkpoint
    and the target's embeddings and LM head, read by NxDI's EAGLE draft, with its fc and no input norms)."""
    from disagg.engine.backends.neuron.backend import FUSED_TARGET_PREFIX, KV_STATE_KEY, SEQ_IDS_MASK_PAD

    eagle = method == "eagle"
    out = speculation_job(tmp_path, method, llama, method, llama_eagle if eagle else llama_draft)
    length = 4  # 3 guesses and the input token
    assert out["target"] == {
        "speculation_length": length, "enable_fused_speculation": True, "enable_eagle_speculation": eagle, "is_eagle_draft": False,
        "kv_cache_tiling": False, "seq_len": SEQ_LEN + length, "max_length": SEQ_LEN + length, "batch_size": BATCH + 1,
        "tkg_batch_size": BATCH + 1, "apply_seq_ids_mask": True, "is_continuous_batching": True,
    }
    assert out["draft"] == dict(out["target"], speculation_length=length if eagle else 0, enable_fused_speculation=False, is_eagle_draft=eagle)
    assert (out["draft_layers"], out["draft_hidden"], out["target_layers"]) == (1, 64 if eagle else 32, 2)  # read from the draft's checkpoint
    assert out["fused_spec_config"] == "neuronx_distributed_inference.models.config.FusedSpecNeuronConfig"
    assert (out["worker_cls"], out["draft_model_cls"]) == ("NeuronLlamaModel", None)
    if eagle:
        assert pathlib.Path(out["draft_model_path"]).parent == tmp_path / "compiled" / "eagle-drafts"
    else:
        assert out["draft_model_path"] == llama_draft
    assert (out["draft_weights_missing"], out["draft_weights_misshapen"]) == ([], [])
    assert (out["draft_has_fc"], out["draft_input_norm"]) == (eagle, not eagle)
    assert (out["graphs"], out["tags"]) == (["NeuronFusedSpecModel"] * 2, ["context_encoding_model", "fused_speculation_model"])
    assert out["to_cpu"] == "NotImplementedError: Speculation is not yet supported for CPU inference."
    targets = [name for name in out["kv_parameters"] if name.startswith(FUSED_TARGET_PREFIX)]
    assert targets == [FUSED_TARGET_PREFIX + KV_STATE_KEY.format(i) for i in range(4)]  # 2 layers, K and V
    assert out["kv_shapes"][targets[0]] == (BATCH + 1, 2, SEQ_LEN + length + SEQ_IDS_MASK_PAD, 16)


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_a_quantized_fused_models_draft_is_quantized_by_nxdi_into_what_nxdis_converted_draft_loads(llama, llama_draft, llama_eagle, tmp_path, method):
    """--quantization int8 with --speculative-method draft or eagle: NxDI's tracing converts the fused model's draft to
    quantized linears too, so its weights (read from draft_model_path) must be a quantized state dict: the one NxDI's
    own quantizer makes of the draft's checkpoint (for EAGLE, of the draft directory written from the head, with its
    fc added), through ours, holds every weight of the converted draft in its shape and dtype: 8-bit where the
    draft's linears are, the LM head (skipped) and EAGLE's fc (not converted) in full precision."""
    eagle = method == "eagle"
    out = speculation_job(tmp_path, "quantized", llama, method, llama_eagle if eagle else llama_draft,
                          quantization={"quantization": "int8", "quantization_type": "per_channel", "quantization_skip": ["lm_head"]})
    assert (out["draft_weights_missing"], out["draft_weights_misshapen"], out["draft_weights_of_another_dtype"]) == ([], [], [])
    assert out["draft_weight_dtypes"]["layers.0.mlp.down_proj.weight"] == ("torch.int8", "torch.int8")
    assert out["draft_weight_dtypes"]["lm_head.weight"] == ("torch.float32", "torch.float32")
    if eagle:
        assert out["draft_weight_dtypes"]["fc.weight"] == ("torch.float32", "torch.float32")
    assert pathlib.Path(out["draft_model_path"]).parent == tmp_path / "compiled" / "quantized"


def test_a_draft_of_another_architecture_is_refused_in_one_line(llama, mistral_window, tmp_path):
    out = speculation_job(tmp_path, "refused", llama, "draft", mistral_window)
    assert out["load_error"].startswith("ValueError: ") and "\n" not in out["load_error"]
    assert "is a MistralForCausalLM: NxDI's fused speculation builds the draft with the model's own class" in out["load_error"]

"""The model-support sweep: every causal-LM architecture in transformers' auto
mapping, built small, served exactly by the torch backend or refused (why).

For each architecture: a small config (a sliding window of 8 where the
architecture has one), seeded weights scaled so attention is sharp, two prompts
longer than the window. transformers' own forward with its own cache gives the
reference logits: the prefill's last position, then 8 teacher-forced decode
steps. The backend gives the same through the slot cache: both prompts in
non-adjacent slots, at different lengths, decoded in the same batched step.
"Exact" means every logit within float32 tolerance; anything else, or an error
anywhere on our side, is a refusal with its reason. A long probe then repeats the
comparison with the architecture's own default windows and prompts of ~300
tokens: a window the engine does not read from the config (GPT-Neo spells its
own `window_size` / `attention_types`) shows in the logits, not in key names. `scripts/model_support.py`
writes the verdicts (read at start-up) and docs/models.md from this.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from dataclasses import dataclass

import torch

WINDOW = 8
PROMPT_LENGTHS = (21, 13)  # both past the window, unequal so rows sit at different positions
# The long probe: the same comparison with every window and position setting at the
# architecture's own defaults, and prompts past any window up to this long whatever the
# config calls it (GPT-Neo's 256-token `window_size`, which none of SMALL's names shrank).
LONG_PROMPT_LENGTHS = (300, 290)
LONG_POSITIONS = 512
DECODE_STEPS = 9  # the prefill, then 8 decode steps
VOCAB = 256
ATOL, RTOL = 1e-4, 1e-4
MAX_PARAMETERS = 20_000_000

# Small values for the size fields transformers' configs use; only names the
# architecture's own config has are set.
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "embed_dim": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2,
    "head_dim": 16, "kv_channels": 16,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "ffn_hidden_size": 128, "d_ff": 128, "dff": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "decoder_sparse_step": 1,
    "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256, "max_sequence_length": 256, "seq_length": 256,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "rotary_dim": 8,
    "sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1,
    "sliding_window_pattern": 2, "sliding_window_size": WINDOW,
    "attention_chunk_size": WINDOW, "window_size": WINDOW,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    # GPT-Neo: one (global, local) pair of layers.
    "attention_types": [[["global", "local"], 1]],
}


@dataclass(frozen=True)
class Verdict:
    model_type: str
    architecture: str
    exact: bool
    reason: str = ""  # why refused; for exact ones, what was checked
    max_diff: float | None = None


def causal_lm_architectures() -> dict[str, str]:
    """model_type -> class name, as transformers' auto mapping has them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


# Sub-configs that only split a text decoder's own settings.
TEXT_SUB_CONFIGS = ("text_config", "attn_config", "ffn_config")
MODALITIES = ("vision", "audio", "image", "vq", "speech")


def skip_reason(config, architecture: str) -> str | None:
    """Multimodal, encoder-decoder and composite architectures are out of the sweep, named."""
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder model: the engine serves decoder-only models"
    parts = [name for name in (getattr(config, "sub_configs", None) or {}) if name not in TEXT_SUB_CONFIGS]
    if any(m in name for name in parts for m in MODALITIES) or architecture.endswith("ForConditionalGeneration") or config.model_type == "fuyu":
        return "multimodal model: needs image, audio or other non-text inputs the engine does not take"
    if parts:
        return f"composite model ({', '.join(parts)}): not one text decoder with a KV cache"
    return None


# SMALL's names for windows and position ranges: the long probe leaves the former at the
# architecture's defaults and widens the latter.
WINDOW_KEYS = (
    "sliding_window", "use_sliding_window", "max_window_layers", "sliding_window_pattern", "sliding_window_size", "attention_chunk_size", "window_size"
)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def small_config(model_type: str, long_probe: bool = False):
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    known = set(defaults.to_dict()) | set(vars(defaults))
    overrides = {k: v for k, v in SMALL.items() if k in known}
    if long_probe:
        overrides = {k: v for k, v in overrides.items() if k not in WINDOW_KEYS}
        overrides.update({k: max(LONG_POSITIONS, getattr(defaults, k, 0) or 0) for k in POSITION_KEYS if k in known})
    if "kv_lora_rank" in known and "num_key_value_heads" in overrides:
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]  # latent attention expands K/V per head
    config = AutoConfig.for_model(model_type, **overrides)
    config.is_decoder = True  # encoder models' LM heads are causal only as decoders
    return config


def sharpen(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with unit-scale activations, so a wrong mask or position shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def build(model_type: str, long_probe: bool = False):
    from transformers import AutoModelForCausalLM

    config = small_config(model_type, long_probe)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise RuntimeError(f"the smallest config the sweep makes still has {size:,} parameters")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    sharpen(model, seed=0)
    return model


def token_rows(vocab: int, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    top = min(vocab, VOCAB) - 1
    return [torch.randint(3, top, (n + DECODE_STEPS,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def reference_logits(model, tokens: list[int], prompt_len: int) -> list[torch.Tensor]:
    """transformers' own path: prefill then one token at a time with its DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(torch.tensor([tokens[:prompt_len]]), past_key_values=cache, use_cache=True)
    logits = [out.logits[0, -1]]
    for pos in range(prompt_len, prompt_len + DECODE_STEPS - 1):
        out = model(torch.tensor([[tokens[pos]]]), past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[0, -1])
    return logits


@torch.no_grad()
def backend_logits(model, rows: list[list[int]], lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[torch.Tensor]]:
    """The torch backend: each prompt prefilled into its slot, then all rows decoded together."""
    from disagg.engine.backends.base import StepInputs
    from disagg.engine.backends.torch_backend import TorchBackend, TorchBackendConfig
    from disagg.kv_transport.chunk_codec import KvKind

    backend = TorchBackend(TorchBackendConfig(model="sweep", dtype="float32", max_seq_len=max(64, max(lengths) + DECODE_STEPS + 1)), model=model)
    backend.allocate_slots(3)
    slots = [2, 0]  # not in row order and not adjacent: the gather path
    logits: list[list[torch.Tensor]] = [[] for _ in rows]
    for row, (tokens, n, slot) in enumerate(zip(rows, lengths, slots)):
        kv: dict[int, tuple] = {}
        logits[row].append(backend.prefill_logits(tokens[:n], lambda layer, k, v: kv.setdefault(layer, (k, v)))[0])
        for layer, (k, v) in kv.items():
            backend.write_kv([slot], layer, KvKind.KEY, 0, k)
            backend.write_kv([slot], layer, KvKind.VALUE, 0, v)
    order = sorted(range(len(rows)), key=lambda r: slots[r])  # rows sorted by slot, as the decode loop sends them
    for step in range(DECODE_STEPS - 1):
        positions = [lengths[r] + step for r in order]
        inputs = StepInputs(
            slots=torch.tensor([slots[r] for r in order]),
            positions=torch.tensor(positions),
            input_ids=torch.tensor([rows[r][p] for r, p in zip(order, positions)]),
            params=torch.zeros(len(order), 3),
            seeds=torch.zeros(len(order), dtype=torch.long),
            steps=torch.zeros(len(order), dtype=torch.long),
            kv_len=max(positions) + 1,
            contiguous_from=None,
            min_position=min(positions),
        )
        step_logits = backend.decode_logits(inputs)
        for i, r in enumerate(order):
            logits[r].append(step_logits[i])
    return logits


def compare(model, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> float:
    """The largest logit difference; raises AssertionError past the tolerance."""
    rows = token_rows(model.config.get_text_config(decoder=True).vocab_size, lengths)
    expected = [reference_logits(model, tokens, n) for tokens, n in zip(rows, lengths)]
    got = backend_logits(model, rows, lengths)
    worst = 0.0
    for row_expected, row_got in zip(expected, got):
        for step, (e, g) in enumerate(zip(row_expected, row_got)):
            worst = max(worst, float((e - g).abs().max()))
            torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL, msg=lambda m, step=step: f"step {step}: {m.splitlines()[0]}")
    return worst


def long_probe_problem(model_type: str) -> str | None:
    """The comparison again with the architecture's own windows and past them: a window the
    engine does not know of (whatever the config calls it) shows as logits that differ."""
    try:
        worst = compare(build(model_type, long_probe=True), LONG_PROMPT_LENGTHS)
    except AssertionError as e:
        return f"logits differ from transformers' own forward past {min(LONG_PROMPT_LENGTHS)} tokens with its default settings ({one_line(e)})"
    except Exception as e:
        return f"fails the long probe ({min(LONG_PROMPT_LENGTHS)}+ tokens, default windows): {type(e).__name__}: {one_line(e)}"
    return None if worst is not None else "the long probe compared nothing"


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:200]


def check(model_type: str, architecture: str) -> Verdict:
    from disagg.engine.backends.architectures import UnsupportedModel, structural_problem
    from disagg.engine.backends.slot_kv_cache import layer_plans

    def refuse(reason: str) -> Verdict:
        return Verdict(model_type, architecture, False, reason)

    try:
        config = small_config(model_type)
    except Exception as e:  # the sweep reports every failure as a verdict
        return refuse(f"the sweep could not make a small config: {one_line(e)}")
    if (skip := skip_reason(config, architecture)) is not None:
        return refuse(skip)
    try:
        model = build(model_type)
    except Exception as e:
        return refuse(f"the sweep could not build a small model: {one_line(e)}")
    if (problem := structural_problem(model)) is not None:
        return refuse(problem)
    try:
        reference_logits(model, token_rows(VOCAB)[0], PROMPT_LENGTHS[0])
    except AttributeError as e:
        return refuse(f"keeps no transformers KV cache (recurrent or legacy model): {one_line(e)}")
    except Exception as e:
        return refuse(f"transformers' own cached forward fails on the sweep's small model: {one_line(e)}")
    try:
        worst = compare(model)
    except UnsupportedModel as e:
        return refuse(str(e).split(": ", 1)[-1])
    except AssertionError as e:
        return refuse(f"logits differ from transformers' own forward ({one_line(e)})")
    except Exception as e:
        return refuse(f"fails through the slot cache: {type(e).__name__}: {one_line(e)}")
    if (problem := long_probe_problem(model_type)) is not None:
        return refuse(problem)
    plans = {p.layer_type for p in layer_plans(model.config)}
    return Verdict(model_type, architecture, True, f"layers: {', '.join(sorted(plans))}", worst)


def sweep(model_types: list[str] | None = None, progress=None) -> list[Verdict]:
    mapping = causal_lm_architectures()
    verdicts = []
    for model_type, architecture in mapping.items():
        if model_types is not None and model_type not in model_types:
            continue
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            verdict = check(model_type, architecture)
        verdicts.append(verdict)
        if progress:
            progress(verdict)
    return verdicts


def verdict_table(verdicts: list[Verdict]) -> dict:
    """The table the engine reads at start-up, keyed by config.json's model_type."""
    import transformers

    return {
        "transformers": transformers.__version__,
        "exact": {v.model_type: v.architecture for v in verdicts if v.exact},
        "refused": {v.model_type: v.reason for v in verdicts if not v.exact},
    }

"""Which checkpoints the torch backend serves exactly; everything else is refused at start-up.

An architecture is served only if the sweep (`scripts/model_support.py`, also
run in CI) found its logits through the slot cache equal to transformers' own
forward with its own cache, prefill and batched decode, past its sliding
window. The sweep's verdicts for the installed transformers release live in
`model_support.json`; an architecture it did not verify is refused, never
guessed. On top of the verdicts, checks that read the checkpoint itself refuse
what the slot cache cannot hold whatever the architecture's name says.
"""

from __future__ import annotations

import functools
import json
import pathlib

VERDICTS = pathlib.Path(__file__).with_name("model_support.json")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")  # the mask builders row_masks extends


class UnsupportedModel(ValueError):
    """A checkpoint the engine cannot serve exactly; the message is one line naming why."""


@functools.cache
def verdicts() -> dict:
    if not VERDICTS.exists():
        return {"transformers": None, "exact": {}, "refused": {}}
    return json.loads(VERDICTS.read_text())


def check_transformers_release() -> None:
    """Refuses the torch backend under any transformers release but the one the verdicts
    were made with: another release changes model code and cache classes, so an exact
    verdict there would be a guess. (NxDI's pin, 4.56/4.57, is the usual other one.)"""
    import transformers

    made_with = verdicts()["transformers"]
    if transformers.__version__ != made_with:
        raise UnsupportedModel(
            f"the torch backend serves under transformers {made_with} (its model-support verdicts were made there); this "
            f"environment has {transformers.__version__}: use --backend neuron here, or install transformers=={made_with}, "
            f"or remake the verdicts with scripts/model_support.py"
        )


def architecture_of(config) -> str:
    names = getattr(config, "architectures", None) or [type(config).__name__]
    return f"{names[0]} (model type {config.model_type!r})"


def verdict(model_type: str) -> str | None:
    """None when the sweep found the model type exact, else the reason for refusing it."""
    table = verdicts()
    if model_type in table["exact"]:
        return None
    if model_type in table["refused"]:
        return table["refused"][model_type]
    return f"not verified by the model-support sweep for transformers {table['transformers']} (see docs/models.md)"


def check_verdict(config) -> None:
    """Refuses, before any weight is loaded, what the sweep did not find exact."""
    reason = verdict(config.model_type)
    if reason is not None:
        refuse(config, reason)


def structural_problem(model) -> str | None:
    """What in a loaded model the slot cache cannot serve, whatever its architecture's verdict."""
    from .slot_kv_cache import SERVED_LAYER_TYPES, layer_plans

    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder: the engine serves decoder-only models"
    others = sorted({p.layer_type for p in layer_plans(config)} - set(SERVED_LAYER_TYPES))
    if others:
        return f"layer types {others} keep state other than per-token K/V"
    implementation = config._attn_implementation
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        return f"attention implementation {implementation!r} is not one of {ATTENTION_IMPLEMENTATIONS}"
    return None


def refuse(config, reason: str):
    raise UnsupportedModel(f"{architecture_of(config)} cannot be served exactly: {reason}")


def check_structure(model) -> None:
    problem = structural_problem(model)
    if problem is not None:
        refuse(model.config, problem)


def config_eos(config) -> tuple[int, ...]:
    eos = getattr(config.get_text_config(decoder=True), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def check_kv_shapes(config, shapes: dict[int, tuple], num_layers: int) -> tuple[int, int]:
    """(kv_heads, head_dim) shared by every layer, from a probe forward's K/V shapes."""
    try:
        return _uniform_kv_shape(shapes, num_layers)
    except UnsupportedModel as e:
        refuse(config, str(e))


def _uniform_kv_shape(shapes: dict[int, tuple], num_layers: int) -> tuple[int, int]:
    missing = [i for i in range(num_layers) if i not in shapes]
    if missing:
        raise UnsupportedModel(f"layers {missing} write no K/V of their own (shared or absent KV cache)")
    # Each shape is [kv_heads, tokens, head_dim].
    distinct = {(k[0], k[2], v[0], v[2]) for k, v in shapes.values()}
    if len(distinct) != 1:
        raise UnsupportedModel(f"K/V shapes differ between layers: {sorted(distinct)}")
    kv_heads, head_dim, v_heads, v_dim = distinct.pop()
    if (v_heads, v_dim) != (kv_heads, head_dim):
        raise UnsupportedModel(f"keys [{kv_heads}, {head_dim}] and values [{v_heads}, {v_dim}] differ in shape")
    return kv_heads, head_dim


def context_limit(text_config) -> int:
    """The longest sequence the checkpoint's positions cover (4096 where it names none)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4096

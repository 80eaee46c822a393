"""Worker settings from files users already have: an LMI `serving.properties`
(DJL-Serving) or a JSON worker config that may use transformers-neuronx names.

Each option maps to one of ours or is reported as unsupported, with the reason.
"""

from __future__ import annotations

import json
import pathlib

# option.quantize values LMI's Neuron engines accept (djl_python's TnXQuantizeMethods: static_int8,
# bitsandbytes8 in LMI releases before it), each of which LMI turns into load_in_8bit=True:
# int8 weights. Ours: NxDI's int8 weights, per channel unless --quantization-type says otherwise.
LMI_QUANTIZE = {"static_int8": "int8", "bitsandbytes8": "int8"}
# The strings LMI's properties (pydantic) read as booleans.
LMI_BOOLEANS = {**dict.fromkeys(("true", "1", "yes", "on", "t", "y"), True), **dict.fromkeys(("false", "0", "no", "off", "f", "n"), False)}


def lmi_quantize(value: str) -> str:
    if value.lower() not in LMI_QUANTIZE:
        raise ValueError(f"LMI's Neuron engines quantize with {' or '.join(LMI_QUANTIZE)} (int8 weights); for fp8 weights "
                         f"set --quantization fp8 (or \"quantization\": \"fp8\" in a --worker-config file)")
    return LMI_QUANTIZE[value.lower()]


def lmi_load_in_8bit(value: str) -> str | None:
    """true: int8 weights; false: no setting (LMI's default), so it never undoes option.quantize."""
    if value.lower() not in LMI_BOOLEANS:
        raise ValueError("a boolean: true or false")
    return "int8" if LMI_BOOLEANS[value.lower()] else None


# LMI option -> (our setting, converter; a converter's None sets nothing)
LMI_OPTIONS = {
    "option.model_id": ("model", str),
    "option.tensor_parallel_degree": ("tp_degree", int),
    "option.n_positions": ("max_seq_len", int),
    "option.max_rolling_batch_size": ("batch_size", int),
    "option.context_length_estimate": ("context_buckets", lambda v: tuple(int(x) for x in v.split(","))),
    "option.amp": ("dtype", lambda v: {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "f32": "float32", "fp32": "float32"}[v.lower()]),
    "option.dtype": ("dtype", lambda v: {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(v.lower(), v.lower())),
    "option.compiled_graph_path": ("compiled_root", str),
    "option.neuron_optimize_level": ("neuron_optimize_level", int),
    "option.max_input_len": ("max_context_length", int),
    "option.quantize": ("quantization", lmi_quantize),
    "option.load_in_8bit": ("quantization", lmi_load_in_8bit),
    # transformers-neuronx's speculative sampling with a draft model, as LMI configures it: --speculative-method draft.
    "option.speculative_draft_model": ("draft_model", str),
    "option.speculative_length": ("num_speculative_tokens", int),
}
LMI_UNSUPPORTED = {
    "option.rolling_batch": "ignored: disagg always batches continuously",
    "option.entryPoint": "ignored: disagg is its own server",
    "engine": "ignored: disagg is its own server",
}
# transformers-neuronx name -> ours
TNX_ALIASES = {"tp_degree": "tp_degree", "n_positions": "max_seq_len", "batch_size": "batch_size", "amp": "dtype", "context_length_estimate": "context_buckets"}
# NxDI's speculation settings (NeuronConfig's, and inference_demo's draft path) -> ours. speculation_length counts the
# positions a fused step scores, the input token's too: one more than our guesses a row (config.speculation_options).
def nxdi_speculation_length(value) -> dict:
    """speculation_length: the input token's position and at least one guess (2 or more); a whole number."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(f"speculation_length {value!r}: NxDI's fused step scores the input token and at least one guess (an integer, 2 or more)")
    return {"num_speculative_tokens": value - 1}


NXDI_SPECULATION = {
    "speculation_length": nxdi_speculation_length,
    "draft_model_path": lambda v: {"draft_model": str(v)},
    "enable_fused_speculation": lambda v: {"speculative_method": "draft"} if v else {},
    "enable_eagle_speculation": lambda v: {"speculative_method": "eagle"} if v else {},
}


def nxdi_kv_cache_quant(value) -> dict:
    """NxDI's fp8 KV cache switch (NeuronConfig.kv_cache_quant, inference_demo's --kv-cache-quant) -> --kv-cache-dtype fp8.
    A boolean only: "false" as a string would read as on."""
    if not isinstance(value, bool):
        raise ValueError(f"kv_cache_quant {value!r}: true or false")
    return {"kv_cache_dtype": "fp8"} if value else {}


# NxDI's settings that a worker config may give by NxDI's names -> ours.
NXDI_SETTINGS = {**NXDI_SPECULATION, "kv_cache_quant": nxdi_kv_cache_quant}
NXDI_SPECULATION_NOTES = {
    "enable_eagle_draft_input_norm": "read from the EAGLE head's checkpoint (whether its layers have input norms)",
    "is_eagle_draft": "set on the draft's config by disagg, as NxDI's inference_demo sets it",
}


def read_serving_properties(path: str) -> tuple[dict, list[str]]:
    """(settings, notes on options not used)."""
    settings, notes = {}, []
    for raw in pathlib.Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        if key in LMI_OPTIONS:
            name, convert = LMI_OPTIONS[key]
            try:
                converted = convert(value)
            except (KeyError, ValueError) as exc:
                reason = f": {exc}" if isinstance(exc, ValueError) and str(exc) else ""
                raise ValueError(f"{path}: {key}={value!r} is not a valid value{reason}") from exc
            if converted is not None:
                settings[name] = converted
        else:
            notes.append(f"{key}: {LMI_UNSUPPORTED.get(key, 'not supported by disagg')}")
    return settings, notes


def read_worker_config(path: str) -> tuple[dict, list[str]]:
    """A JSON object of our setting names (or transformers-neuronx's)."""
    raw = json.loads(pathlib.Path(path).read_text())
    settings, notes = {}, []
    # enable_fused_speculation last: NxDI's EAGLE is fused too, so where both are given, EAGLE's method stays.
    for key, value in sorted(raw.items(), key=lambda item: item[0] == "enable_fused_speculation"):
        if key in NXDI_SETTINGS:
            try:
                mapped = NXDI_SETTINGS[key](value)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
            if "speculative_method" in settings:
                mapped.pop("speculative_method", None)
            settings.update(mapped)
            continue
        if key in NXDI_SPECULATION_NOTES:
            notes.append(f"{key}: {NXDI_SPECULATION_NOTES[key]}")
            continue
        name = TNX_ALIASES.get(key, key)
        if name == "dtype":
            value = {"bf16": "bfloat16", "fp16": "float16", "f32": "float32", "fp32": "float32"}.get(str(value).lower(), value)
        if name == "context_buckets" and isinstance(value, int):
            value = (value,)
        settings[name] = tuple(value) if isinstance(value, list) else value
    return settings, notes

"""Worker settings from files users already have: an LMI `serving.properties`
(DJL-Serving) or a JSON worker config that may use transformers-neuronx names.

Each option maps to one of ours or is reported as unsupported, with the reason.
"""

from __future__ import annotations

import json
import pathlib

# LMI option -> (our setting, converter)
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
}
LMI_UNSUPPORTED = {
    "option.load_in_8bit": "weight quantization needs a pre-quantized checkpoint and NxDI's quantized settings; not wired yet",
    "option.quantize": "weight quantization needs a pre-quantized checkpoint and NxDI's quantized settings; not wired yet",
    "option.rolling_batch": "ignored: disagg always batches continuously",
    "option.entryPoint": "ignored: disagg is its own server",
    "engine": "ignored: disagg is its own server",
}
# transformers-neuronx name -> ours
TNX_ALIASES = {"tp_degree": "tp_degree", "n_positions": "max_seq_len", "batch_size": "batch_size", "amp": "dtype", "context_length_estimate": "context_buckets"}


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
                settings[name] = convert(value)
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path}: {key}={value!r} is not a valid value") from exc
        else:
            notes.append(f"{key}: {LMI_UNSUPPORTED.get(key, 'not supported by disagg')}")
    return settings, notes


def read_worker_config(path: str) -> tuple[dict, list[str]]:
    """A JSON object of our setting names (or transformers-neuronx's)."""
    raw = json.loads(pathlib.Path(path).read_text())
    settings, notes = {}, []
    for key, value in raw.items():
        name = TNX_ALIASES.get(key, key)
        if name == "dtype":
            value = {"bf16": "bfloat16", "fp16": "float16", "f32": "float32", "fp32": "float32"}.get(str(value).lower(), value)
        if name == "context_buckets" and isinstance(value, int):
            value = (value,)
        settings[name] = tuple(value) if isinstance(value, list) else value
    return settings, notes

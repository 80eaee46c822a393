"""Pre-quantized checkpoints users have: their 8-bit weights, and the model they dequantize to.

Read:
- compressed-tensors (what llm-compressor writes: config.json's quantization_config with
  quant_method "compressed-tensors"), formats int-quantized, float-quantized, naive-quantized
  and pack-quantized at 8 bits: symmetric int8 or fp8 e4m3 weights with `weight_scale`, one
  scale per output row (strategy "channel", stored [out, 1]) or one per weight ("tensor",
  stored [1] or []). Which linears are quantized is the package's own matching of the config
  groups' targets and the ignore list. A scheme that also quantizes activations (W8A8,
  FP8_DYNAMIC, FP8) is served weight-only: activations stay in full precision (vLLM would
  quantize them), and the format named at start-up says so.
- NxD Inference's quantized state dict (`save_quantized_state_dict`, a safetensors or
  pytorch_model.bin file in the checkpoint directory): `<linear>.weight` int8 or fp8 e4m3
  beside `<linear>.scale` float32 [out, 1] (per channel) or [1] / [] (per tensor). NxDI saves
  the inner model's state dict, so keys may lack the "model." prefix transformers uses.

Refused with a ValueError naming the setting or tensor, never served: other quant_methods and
formats; group, block and token strategies; bit widths other than 8; asymmetric weights;
dynamic weight scales; output-activation or KV-cache quantization; transforms and sparsity;
a quantized non-linear layer or a linear tied to the embedding; a quantized weight whose scale
is missing, misshapen, not a float, or zero, negative or not finite; values of the wrong dtype
or shape; a nonzero zero point; state-dict keys the model does not have, or lacks.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from .schemes import QuantizedWeight

COMPRESSED_TENSORS = "compressed-tensors"
# The compressed-tensors formats whose 8-bit values we read: the first three store `weight` as
# int8 / fp8 itself; pack-quantized packs int8 into int32 words (`weight_packed`, `weight_shape`).
NAIVE_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
PACKED_FORMAT = "pack-quantized"
FORMAT_TYPES = {"int-quantized": ("int",), "float-quantized": ("float",), "naive-quantized": ("int", "float"), PACKED_FORMAT: ("int",)}
STRATEGIES = ("channel", "tensor")
# A static activation scheme's parameters: not applied when serving weight-only, so not loaded.
ACTIVATION_PARAMS = ("input_scale", "input_zero_point")
# safetensors' header names of the 8-bit dtypes (seen without reading the tensors).
EIGHT_BIT_HEADER_DTYPES = ("I8", "F8_E4M3", "F8_E5M2")


@dataclass
class PrequantizedCheckpoint:
    format: str  # for the start-up line, e.g. "compressed-tensors int-quantized (int8 weights per channel)"
    method: str  # "int8" or "fp8"
    weights: dict[str, QuantizedWeight] = field(repr=False)  # by linear module name, as transformers names it
    # The full-precision state dict for the transformers model: every other tensor, and each
    # quantized linear's dequantized weight under "<name>.weight".
    dense: dict[str, torch.Tensor] = field(repr=False)


def read_prequantized(model_dir: str, dtype: torch.dtype = torch.float32) -> PrequantizedCheckpoint | None:
    """The checkpoint's 8-bit weights and dequantized state dict (dequantized weights in `dtype`);
    None where the checkpoint is not pre-quantized, or not a local directory (a hub name is
    transformers' to load)."""
    if not os.path.isdir(model_dir):
        return None
    config = _read_json(os.path.join(model_dir, "config.json"))
    quantization_config = config.get("quantization_config")
    if quantization_config is not None:
        method = quantization_config.get("quant_method")
        if method != COMPRESSED_TENSORS:
            raise ValueError(f"quantization_config.quant_method {method!r} is not read (only {COMPRESSED_TENSORS!r} and NxD Inference's state dict)")
        return _read_compressed_tensors(model_dir, quantization_config, dtype)
    files = _weight_files(model_dir)
    if not _holds_8bit_tensors(files):
        return None
    return _read_nxdi_state_dict(model_dir, _read_tensors(files), dtype)


def load_prequantized_model(model_dir: str, dtype: torch.dtype, device: str | torch.device) -> tuple[nn.Module, PrequantizedCheckpoint] | None:
    """The transformers model with the checkpoint's dequantized weights, in eval mode, and the
    checkpoint; None where the checkpoint is not pre-quantized."""
    checkpoint = read_prequantized(model_dir, dtype)
    if checkpoint is None:
        return None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_model_config(model_dir), dtype=dtype)
    _check_dense_keys(model, checkpoint.dense)
    model.load_state_dict(checkpoint.dense, strict=False)  # tied aliases are absent on purpose (checked above)
    return model.to(device).eval(), checkpoint


# --- compressed-tensors ---------------------------------------------------------------------


def _read_compressed_tensors(model_dir: str, raw: dict, dtype: torch.dtype) -> PrequantizedCheckpoint:
    from compressed_tensors.quantization import QuantizationConfig

    _refuse_unsupported_settings(raw)
    config = QuantizationConfig.model_validate(raw)
    skeleton = _skeleton(model_dir)
    schemes = _schemes_by_linear(skeleton, config)
    formats = {name: _module_format(name, scheme, config.format) for name, scheme in schemes.items()}
    tensors = _read_tensors(_weight_files(model_dir))
    weights = {name: _compressed_weight(name, scheme, formats[name], tensors) for name, scheme in schemes.items()}
    method = _one_method(weights)
    _check_linears(skeleton, weights)
    dense = _dense_state_dict(tensors, weights, dtype)
    _check_dense_keys(skeleton, dense)
    described = _describe(method, {scheme.weights.strategy for scheme in schemes.values()})
    if any(scheme.input_activations is not None for scheme in schemes.values()):
        described += "; served weight-only: the checkpoint's activation quantization is not applied"
    return PrequantizedCheckpoint(f"{COMPRESSED_TENSORS} {'/'.join(sorted(set(formats.values())))} ({described})", method, weights, dense)


def _refuse_unsupported_settings(raw: dict) -> None:
    """Settings that change the model's numbers beyond its linears' weights: served without them
    the model would be another one."""
    for setting in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if raw.get(setting):
            raise ValueError(f"quantization_config.{setting} is set: not supported (only 8-bit weight quantization is read)")


def _schemes_by_linear(skeleton: nn.Module, config) -> dict:
    """Each quantized module's scheme, as the package assigns them (targets, ignore, which group
    wins where several match), on a copy of the model without data (the package adds its
    parameters to the modules it quantizes)."""
    from compressed_tensors.quantization import apply_quantization_config

    marked = copy.deepcopy(skeleton)
    apply_quantization_config(marked, config, show_progress=False)
    schemes = {name: module.quantization_scheme for name, module in marked.named_modules() if getattr(module, "quantization_scheme", None) is not None}
    for name, scheme in schemes.items():
        _check_scheme(name, scheme)
    return schemes


def _check_scheme(name: str, scheme) -> None:
    """Only symmetric 8-bit weights with a scale per row or per weight are read."""
    weights = scheme.weights
    if weights is None:
        raise ValueError(f"{name}: the scheme quantizes no weights (activation-only quantization is not supported)")
    if weights.num_bits != 8:
        raise ValueError(f"{name}: weights num_bits={weights.num_bits} is not supported (only 8)")
    if weights.strategy not in STRATEGIES:
        raise ValueError(f"{name}: weights strategy {weights.strategy!r} is not supported (only {', '.join(STRATEGIES)})")
    if not weights.symmetric:
        raise ValueError(f"{name}: weights symmetric=false (zero points) is not supported")
    if weights.dynamic:
        raise ValueError(f"{name}: weights dynamic={weights.dynamic!r} is not supported (the scales must be stored)")
    if scheme.output_activations is not None:
        raise ValueError(f"{name}: output_activations quantization is not supported")
    if scheme.input_activations is not None and scheme.input_activations.num_bits != 8:
        raise ValueError(f"{name}: input_activations num_bits={scheme.input_activations.num_bits} is not supported (only 8, served weight-only)")


def _module_format(name: str, scheme, config_format: str) -> str:
    format = str(getattr(scheme.format, "value", scheme.format) or config_format)
    if format not in FORMAT_TYPES:
        raise ValueError(f"{name}: compressed-tensors format {format!r} is not supported (only {', '.join(FORMAT_TYPES)} at 8 bits)")
    if scheme.weights.type not in FORMAT_TYPES[format]:
        raise ValueError(f"{name}: format {format!r} does not hold {scheme.weights.type} weights")
    return format


def _compressed_weight(name: str, scheme, format: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    """The module's values and scale, taken out of `tensors` (with its zero point and activation
    parameters, which serving weight-only does not use)."""
    values = _packed_values(name, tensors) if format == PACKED_FORMAT else _take(tensors, f"{name}.weight")
    _check_values(f"{name}.weight", values, (scheme.weights.pytorch_dtype(),))
    scale = _row_scale(f"{name}.weight_scale", _take(tensors, f"{name}.weight_scale"), values, scheme.weights.strategy)
    _check_zero_point(f"{name}.weight_zero_point", tensors.pop(f"{name}.weight_zero_point", None))
    for param in ACTIVATION_PARAMS:
        tensors.pop(f"{name}.{param}", None)
    weight = QuantizedWeight(values, scale)
    weight.check(name)
    return weight


def _packed_values(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """pack-quantized's int32 words back to int8, by the package's own unpacking (at 8 bits its
    layout, four values a word from the low byte up, is the same in every version)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    packed = _take(tensors, f"{name}.weight_packed")
    shape = _take(tensors, f"{name}.weight_shape")
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"{name}.weight_packed: expected 2-D int32 words, got {packed.dtype} {tuple(packed.shape)}")
    if shape.numel() != 2 or shape.is_floating_point():
        raise ValueError(f"{name}.weight_shape: expected the 2 integers [out, in], got {shape.tolist()}")
    out_features, in_features = (int(v) for v in shape.tolist())
    if packed.shape != (out_features, -(-in_features // 4)):
        raise ValueError(f"{name}.weight_packed: shape {tuple(packed.shape)} does not hold a [{out_features}, {in_features}] int8 weight")
    return unpack_from_int32(packed, 8, torch.Size((out_features, in_features)))


def _check_zero_point(key: str, zero_point: torch.Tensor | None) -> None:
    if zero_point is not None and bool((zero_point != 0).any()):
        raise ValueError(f"{key}: nonzero zero point (asymmetric quantization) is not supported")


# --- NxD Inference's state dict -------------------------------------------------------------


def _read_nxdi_state_dict(model_dir: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> PrequantizedCheckpoint:
    skeleton = _skeleton(model_dir)
    tensors = _with_model_prefix(tensors, skeleton)
    weights, strategies = {}, set()
    for key in [key for key, tensor in tensors.items() if _is_8bit(tensor)]:
        if not key.endswith(".weight"):
            raise ValueError(f"{key}: an 8-bit tensor that is not a linear's weight")
        name = key.removesuffix(".weight")
        values = _check_values(key, tensors.pop(key), (torch.int8, torch.float8_e4m3fn))
        scale = _take(tensors, f"{name}.scale", why="NxD Inference stores each quantized weight's scale beside it")
        strategy = _nxdi_strategy(f"{name}.scale", scale, values)
        weights[name] = QuantizedWeight(values, _row_scale(f"{name}.scale", scale, values, strategy))
        weights[name].check(name)
        strategies.add(strategy)
    method = _one_method(weights)
    _check_linears(skeleton, weights)
    dense = _dense_state_dict(tensors, weights, dtype)
    _check_dense_keys(skeleton, dense)
    return PrequantizedCheckpoint(f"NxD Inference quantized state dict ({_describe(method, strategies)})", method, weights, dense)


def _nxdi_strategy(key: str, scale: torch.Tensor, values: torch.Tensor) -> str:
    """NxD writes per-channel scales [out, 1] and per-tensor ones [1] (int8) or [] (fp8)."""
    if scale.dim() == 2 and tuple(scale.shape) == (values.shape[0], 1):
        return "channel"
    if scale.numel() == 1 and scale.dim() <= 1:
        return "tensor"
    raise ValueError(f"{key}: shape {tuple(scale.shape)} is neither per channel [{values.shape[0]}, 1] nor per tensor [1]")


def _with_model_prefix(tensors: dict[str, torch.Tensor], skeleton: nn.Module) -> dict[str, torch.Tensor]:
    """Keys as transformers names them: NxDI saves `hf_model.model`'s state dict (no "model.")
    plus "lm_head.*"."""
    modules = {name for name, _ in skeleton.named_modules()}
    prefix = getattr(skeleton, "base_model_prefix", "")

    def renamed(key: str) -> str:
        owner = key.rpartition(".")[0]
        return f"{prefix}.{key}" if prefix and owner not in modules and f"{prefix}.{owner}" in modules else key

    return {renamed(key): tensor for key, tensor in tensors.items()}


# --- shared by both formats -----------------------------------------------------------------


def _check_values(key: str, values: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if values.dtype not in dtypes:
        raise ValueError(f"{key}: values are {values.dtype}, expected {' or '.join(map(str, dtypes))}")
    if values.dim() != 2:
        raise ValueError(f"{key}: values must be 2-D [out, in], got {tuple(values.shape)}")
    return values


def _row_scale(key: str, scale: torch.Tensor, values: torch.Tensor, strategy: str) -> torch.Tensor:
    """The stored scale as our [out] float32 (bf16 and fp16 widen exactly; a per-tensor scale is
    repeated per row, which computes the same)."""
    if not scale.is_floating_point() or scale.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{key}: a scale must be float32, bfloat16 or float16, got {scale.dtype}")
    out_features = values.shape[0]
    if strategy == "channel" and tuple(scale.shape) != (out_features, 1):
        raise ValueError(f"{key}: per-channel scale must be [{out_features}, 1], got {tuple(scale.shape)}")
    if strategy == "tensor" and tuple(scale.shape) not in ((), (1,)):
        raise ValueError(f"{key}: per-tensor scale must be [1] or [], got {tuple(scale.shape)}")
    return scale.float().reshape(-1).expand(out_features).contiguous()


def _one_method(weights: dict[str, QuantizedWeight]) -> str:
    methods = {weight.method for weight in weights.values()}
    if len(methods) != 1:
        raise ValueError(f"the checkpoint quantizes its linears as {' and '.join(sorted(methods)) or 'nothing'}: one of int8 or fp8 is served")
    return methods.pop()


def _check_linears(skeleton: nn.Module, weights: dict[str, QuantizedWeight]) -> None:
    """Every quantized weight belongs to a linear of that shape, not shared with an embedding
    (which stays full precision: tied, one of the two would be served wrong)."""
    modules = dict(skeleton.named_modules())
    shared = {id(p) for module in skeleton.modules() if not isinstance(module, nn.Linear) for p in module.parameters(recurse=False)}
    for name, weight in weights.items():
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name}: the checkpoint quantizes a module the model does not have as a linear layer")
        if tuple(weight.values.shape) != tuple(linear.weight.shape):
            raise ValueError(f"{name}.weight: quantized shape {tuple(weight.values.shape)} is not the layer's {tuple(linear.weight.shape)}")
        if id(linear.weight) in shared:
            raise ValueError(f"{name}.weight: quantized, but tied to a layer that is not a linear (the embedding)")


def _dense_state_dict(tensors: dict[str, torch.Tensor], weights: dict[str, QuantizedWeight], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {**tensors, **{f"{name}.weight": weight.dequantized(dtype) for name, weight in weights.items()}}


def _check_dense_keys(model: nn.Module, dense: dict[str, torch.Tensor]) -> None:
    """Strict loading, with ties as transformers has them: a key the model ties to another that
    the checkpoint holds may be absent (and where both are present they must agree)."""
    expected = model.state_dict(keep_vars=True)
    unexpected = sorted(set(dense) - set(expected))
    if unexpected:
        raise ValueError(f"the checkpoint holds tensors the model does not have: {', '.join(unexpected)}")
    aliases: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        aliases.setdefault(id(tensor), []).append(key)
    for keys in aliases.values():
        present = [key for key in keys if key in dense]
        if not present:
            raise ValueError(f"the checkpoint lacks {', '.join(keys)}")
        if any(not torch.equal(dense[key], dense[present[0]]) for key in present[1:]):
            raise ValueError(f"{', '.join(present)}: tied in the model but different in the checkpoint")
    for key, tensor in dense.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(f"{key}: shape {tuple(tensor.shape)} is not the model's {tuple(expected[key].shape)}")


def _describe(method: str, strategies: set[str]) -> str:
    return f"{method} weights per {' and per '.join(sorted(strategies))}"


def _take(tensors: dict[str, torch.Tensor], key: str, why: str = "") -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"{key}: missing from the checkpoint" + (f" ({why})" if why else ""))
    return tensors.pop(key)


def _is_8bit(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


# --- files and the model's shape --------------------------------------------------------------


def _read_json(path: str) -> dict:
    with open(path) as file:
        return json.load(file)


def _weight_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files, or else its pytorch_model*.bin files."""
    names = sorted(os.listdir(model_dir))
    files = [n for n in names if n.endswith(".safetensors")] or [n for n in names if n.startswith("pytorch_model") and n.endswith(".bin")]
    return [os.path.join(model_dir, n) for n in files]


def _holds_8bit_tensors(files: list[str]) -> bool:
    """Whether any tensor is 8-bit, from safetensors headers alone (a plain checkpoint, the
    common case, is not read twice)."""
    from safetensors import safe_open

    for path in files:
        if not path.endswith(".safetensors"):
            return any(_is_8bit(tensor) for tensor in _read_tensors([path]).values())
        with safe_open(path, framework="pt") as file:
            if any(file.get_slice(key).get_dtype() in EIGHT_BIT_HEADER_DTYPES for key in file.keys()):
                return True
    return False


def _read_tensors(files: list[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        part = load_file(path) if path.endswith(".safetensors") else torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise ValueError(f"{', '.join(twice)}: in more than one of the checkpoint's files")
        tensors.update(part)
    return tensors


def _model_config(model_dir: str):
    """The checkpoint's transformers config without its quantization_config: the weights are
    dequantized here, so transformers must build the plain model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _skeleton(model_dir: str) -> nn.Module:
    """The model's modules and shapes without memory behind them: what names and shapes the
    checkpoint must have."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_model_config(model_dir))

"""Which of a model's linears are quantized, and the model set to their dequantized weights."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from .schemes import GRANULARITIES, METHODS, QuantizedWeight, quantize, quantize_rows

W8A8_INT8 = "w8a8_int8"  # SGLang's name: int8 weights per channel, each input row quantized to int8 per row at run time
SETTINGS_METHODS = (*METHODS, W8A8_INT8)

# As NxDI's modules_to_not_convert is commonly set: the LM head stays in full precision
# (the embeddings are not linears and are never quantized).
DEFAULT_SKIP = ("lm_head",)


@dataclass(frozen=True)
class QuantizationSettings:
    method: str | None = None  # None: full precision; "int8" or "fp8" (weight-only), or "w8a8_int8"
    granularity: str = "per_channel"
    skip: tuple[str, ...] = DEFAULT_SKIP  # a linear whose name contains one of these stays in full precision

    def __post_init__(self):
        if self.method is not None and self.method not in SETTINGS_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(SETTINGS_METHODS)}, got {self.method!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"quantization granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")

    @property
    def weight_method(self) -> str | None:
        """How the weights are quantized: "int8" or "fp8" (W8A8's weights are int8's)."""
        return "int8" if self.method == W8A8_INT8 else self.method

    @property
    def activations(self) -> str | None:
        """"int8" where each linear's input rows are quantized too (W8A8); None: weight-only."""
        return "int8" if self.method == W8A8_INT8 else None

    def skips(self, name: str) -> bool:
        return any(part and part in name for part in self.skip)


def quantized_linears(model: nn.Module, settings: QuantizationSettings) -> list[tuple[str, nn.Linear]]:
    """The model's nn.Linear modules that settings quantize, by name."""
    return [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear and not settings.skips(name)]


@torch.no_grad()
def quantize_model(model: nn.Module, settings: QuantizationSettings) -> dict[str, QuantizedWeight]:
    """Quantizes every linear settings name and sets each weight to its dequantized values, in
    the model's dtype; returns the 8-bit weights by linear name. A linear whose weight another
    module shares (an LM head tied to the embedding, quantized where --quantization-skip lets it
    be, as llama.cpp's q8_0 does) is untied first: it gets a weight of its own, and the
    embedding keeps the full-precision one its lookups read."""
    if settings.method is None:
        return {}
    tied = {id(p) for name, module in model.named_modules() if not isinstance(module, nn.Linear) for p in module.parameters(recurse=False)}
    quantized: dict[str, QuantizedWeight] = {}
    for name, linear in quantized_linears(model, settings):
        weight = quantize(linear.weight, settings.weight_method, settings.granularity)
        if id(linear.weight) in tied:
            untie(model, linear)
        linear.weight.copy_(weight.dequantized(linear.weight.dtype))
        quantized[name] = weight
    return with_activations(model, quantized, settings.activations)


def with_activations(model: nn.Module, weights: dict[str, QuantizedWeight], activations: str | None) -> dict[str, QuantizedWeight]:
    """The weights marked with how their input rows are quantized (W8A8: "int8"; None: weight-only), and,
    for W8A8, the model's own linears quantizing their rows too (`quantize_inputs`)."""
    if activations is None:
        return weights
    modules = dict(model.named_modules())
    for name in weights:
        quantize_inputs(modules[name])
    return {name: dataclasses.replace(weight, activations=activations) for name, weight in weights.items()}


def untie(model: nn.Module, linear: nn.Linear) -> None:
    """Gives the linear a weight of its own (a copy), and says so in the config, so that transformers'
    tie_weights() never makes it the embedding's again."""
    linear.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False


def quantize_inputs(linear: nn.Linear) -> None:
    """W8A8 in the model's own modules (a device or path without the W8A8 kernel, and the start-up checks'
    reference): the linear's input rows quantized per row before its product (schemes.quantize_rows)."""
    linear.register_forward_pre_hook(lambda module, args: (quantize_rows(args[0]).to(args[0].dtype), *args[1:]))


def apply_prequantized(model: nn.Module, weights: dict[str, QuantizedWeight]) -> None:
    """Sets each named linear's weight to the dequantized values of a pre-quantized checkpoint's."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, weight in weights.items():
            linear = modules.get(name)
            if type(linear) is not nn.Linear:
                raise ValueError(f"{name}: the checkpoint quantizes a module the model does not have as a linear layer")
            if tuple(weight.values.shape) != tuple(linear.weight.shape):
                raise ValueError(f"{name}.weight: quantized shape {tuple(weight.values.shape)} is not the layer's {tuple(linear.weight.shape)}")
            linear.weight.copy_(weight.dequantized(linear.weight.dtype))

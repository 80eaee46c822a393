"""A checkpoint loaded for serving, its linears in 8 bits where they are quantized.

Two ways in: a pre-quantized checkpoint (`checkpoints`: compressed-tensors, NxDI's quantized
state dict) is served with the numbers it holds; a full-precision one is quantized at load
when `--quantization` asks. Either way the model's linears hold the dequantized values (what
`generate()` on the dequantized checkpoint computes with, and what the start-up checks compare
the 8-bit kernels against), and the 8-bit weights go to packed_linear by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .model import QuantizationSettings, quantize_model, with_activations
from .schemes import QuantizedWeight


@dataclass
class LoadedWeights:
    model: nn.Module
    quantized: dict[str, QuantizedWeight]  # by linear name; empty: full precision
    note: str  # what was quantized and how, for the start-up line and the shared weights' key; "" for none


def load_weights(path: str, dtype: torch.dtype, device: torch.device, settings: QuantizationSettings,
                 load_full: Callable[[str, torch.dtype, torch.device], nn.Module]) -> LoadedWeights:
    """The checkpoint at path as settings ask; load_full loads a full-precision one."""
    from . import checkpoints

    prequantized = checkpoints.load_prequantized_model(path, dtype, device)
    if prequantized is not None:
        model, checkpoint = prequantized
        if settings.method is not None and settings.weight_method != checkpoint.method:
            raise ValueError(f"--quantization {settings.method}: the checkpoint is already quantized ({checkpoint.format}); "
                             f"serve it without --quantization, or with --quantization {checkpoint.method}")
        weights = with_activations(model, checkpoint.weights, settings.activations)  # W8A8 where asked: its rows quantized too
        how = f"pre-quantized checkpoint: {checkpoint.format}" + (f", {ACTIVATIONS_NOTE}" if settings.activations else "")
        return LoadedWeights(model, weights, describe(weights, how, model))
    model = load_full(path, dtype, device)
    quantized = quantize_model(model, settings)
    if not quantized:
        return LoadedWeights(model, {}, "")
    how = f"{settings.weight_method} {settings.granularity.replace('_', '-')} symmetric, quantized at load"
    if settings.activations:
        how += f", {ACTIVATIONS_NOTE}"
    return LoadedWeights(model, quantized, describe(quantized, how, model, settings.skip))


ACTIVATIONS_NOTE = "their input rows int8 per row at run time (w8a8_int8)"


def describe(quantized: dict[str, QuantizedWeight], how: str, model: nn.Module, skip: tuple[str, ...] = ()) -> str:
    """'weights: 210 of 211 linear layers int8 per-channel symmetric, quantized at load (0.11 GiB, full precision 0.20); kept: lm_head'."""
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    eight_bit = sum(w.values.numel() + 4 * w.scale.numel() for w in quantized.values())
    full = sum(module.weight.numel() * module.weight.element_size() for name, module in linears if name in quantized)
    kept = [name for name, _ in linears if name not in quantized]
    kept_text = f"; kept in full precision: {', '.join(kept[:4])}{' and more' if len(kept) > 4 else ''}" if kept else ""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    skipped = f" (--quantization-skip {','.join(skip)})" if skip and kept else ""
    return f"weights: {len(quantized)} of {len(linears)} linear layers {how} ({size(eight_bit)}, {size(full)} in {dtype}){kept_text}{skipped}"


def size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"

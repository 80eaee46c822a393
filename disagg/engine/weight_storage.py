"""A float32 model's weights held in bf16, where that changes no number.

Most checkpoints are saved in bf16. A CPU without native bf16 products (AVX-512
without AVX512_BF16, as Cascade Lake and Ice Lake Xeons; AVX2 alone) is served
float32 by `--dtype auto`, so the model holds bf16 numbers in float32's four
bytes, and a decode step, bound by reading its weights, reads twice the bytes
those numbers need. Where every full-precision linear's weight is a bf16 number
exactly, its panels are kept in bf16 and widened to float32 in registers as the
products read them (small_gemm's widen builds, which take float32 rows as they
are): the same products over the same numbers in the same order, so the same
bits as float32 panels, from half the bytes.

Measured on an Intel Xeon (Ice Lake, AVX-512 without AVX512_BF16; 2 cores),
SmolLM-135M's 210 linears on one core: 25.4 ms at one row against float32
panels' 46.9 (docs/benchmarks.md).

Not done where the host's bf16 kernel rounds its rows to bf16 (bf16-dot, chosen
on a CPU with AVX512_BF16, where `--dtype auto` serves bf16 anyway): a float32
model's rows would lose bits there. `DISAGG_F32_WEIGHTS=float32` keeps float32
panels (benchmarks).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .cpu_kernels import small_gemm

VARIABLE = "DISAGG_F32_WEIGHTS"


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of this float32 tensor is a bf16 number: its low 16 bits zero, so that the kernel's
    widening of its upper half (a shift left by 16) gives back these bits exactly."""
    return not bool((weight.contiguous().view(torch.int32) & 0xFFFF).any())


def narrower_storage(model: nn.Module, dtype: torch.dtype, device: torch.device, quantized: set[str]) -> tuple[torch.dtype | None, str]:
    """(the dtype the full-precision linears' panels are held in, or None for the model's own; why), for the log.
    quantized: the linears held in 8 bits (their panels are the 8-bit kernel's)."""
    if dtype != torch.float32 or device.type != "cpu":
        return None, ""
    if os.environ.get(VARIABLE, "") not in ("", "bf16", "float32"):
        raise small_gemm.BadKernelSetting(f"{VARIABLE} must be bf16 or float32, not {os.environ[VARIABLE]!r}")
    if os.environ.get(VARIABLE) == "float32":
        return None, f"weights held in float32 ({VARIABLE})"
    widen = small_gemm.kernel(torch.bfloat16)
    if widen is None or widen.bf16_rows:
        return None, ""
    linears = [(name, module.weight) for name, module in model.named_modules() if type(module) is nn.Linear and name not in quantized]
    if not linears:
        return None, ""
    inexact = next((name for name, weight in linears if weight.dtype != torch.float32 or not bf16_exact(weight.detach())), None)
    if inexact is not None:
        return None, f"weights held in float32: {inexact}'s are not all bf16 numbers"
    return torch.bfloat16, (f"weights held in bf16 and multiplied in float32 (the {widen.name} kernel): every linear's weight is a bf16 "
                            "number, so the same products from half the bytes")

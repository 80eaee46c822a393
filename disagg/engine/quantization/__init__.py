"""Quantized weights: 8-bit linears quantized at load or read from a pre-quantized checkpoint.

The room's parts:
- `schemes`: the numbers (NxDI's per-channel and per-tensor symmetric int8, fp8 e4m3).
- `checkpoints`: pre-quantized checkpoints users have (compressed-tensors, NxDI's state dict).
- `model`: which linears are quantized (`--quantization-skip`), and the model's weights set to
  the dequantized values, so the model the start-up checks compare with is the reference's.
The products over 8-bit weights are the CPU kernels' (cpu_kernels/small_gemm.c's int8 and
fp8 builds), reached through packed_linear.
"""

from .model import QuantizationSettings, quantize_model
from .schemes import QuantizedWeight, quantize

__all__ = ["QuantizationSettings", "QuantizedWeight", "quantize", "quantize_model"]

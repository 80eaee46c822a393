"""How a weight becomes 8 bits: the numbers every quantized path agrees on.

Per-channel symmetric is NxD Inference's `per_channel_symmetric`, computed as its
`PerChannelAbsMaxObserver` computes it (neuronx_distributed/quantization/observer.py):
per output row, scale = max(max|w| / 127, float32's eps), and the values are
round-half-to-even(w / scale) clamped to [-128, 127] (torch.quantize_per_channel),
so a checkpoint NxDI quantized and one quantized here hold the same numbers.
Per-tensor is NxDI's `per_tensor_symmetric`: torch's own MinMaxObserver
(scale = max|w| / 127.5 for qint8), one scale for the whole weight.

fp8 is e4m3 (torch.float8_e4m3fn, largest finite 448), as NxD's quantize_fp8_per_channel
(scale = max(max|w| / 448, 1e-5) per output row, in float32) and quantize_fp8_per_tensor
(one scale max|w| / 448 computed in the weight's dtype) compute it: values = (w / scale)
clamped to +-448 and rounded to nearest-even by the cast. A weight's dequantized value is values * scale in float32: what the kernels
multiply by (they apply the scale to the float32 sums, which differs from the
dequantized product only in rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("int8", "fp8")
GRANULARITIES = ("per_channel", "per_tensor")
VALUE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
EPS = float(torch.finfo(torch.float32).eps)  # NxD's int8 observers' floor under a scale
FP8_CHANNEL_FLOOR = 1e-5  # NxD's quantize_fp8_per_channel's


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear's weight in 8 bits. values: [out, in] int8 or float8_e4m3fn; scale: [out]
    float32 (per channel; a per-tensor scale is repeated per row, which computes the same)."""

    values: torch.Tensor
    scale: torch.Tensor
    # "int8": every row this weight multiplies is quantized first (W8A8, `quantize_rows`); None: weight-only.
    activations: str | None = None

    @property
    def method(self) -> str:
        return "int8" if self.values.dtype == torch.int8 else "fp8"

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """values * scale, computed in float32 and then cast: the reference's weight."""
        return (self.values.float() * self.scale.float()[:, None]).to(dtype)

    def check(self, name: str) -> None:
        """Raises ValueError naming the tensor where values and scale do not make a weight."""
        if self.values.dim() != 2 or self.values.dtype not in VALUE_DTYPES.values():
            raise ValueError(f"{name}: quantized values must be a 2-D int8 or float8_e4m3fn tensor, got {self.values.dtype} {tuple(self.values.shape)}")
        if self.scale.shape != (self.values.shape[0],) or self.scale.dtype != torch.float32:
            raise ValueError(f"{name}: scale must be float32 [{self.values.shape[0]}] (one per output row), got {self.scale.dtype} {tuple(self.scale.shape)}")
        if not bool(torch.isfinite(self.scale).all()) or bool((self.scale <= 0).any()):
            raise ValueError(f"{name}: scale holds a value that is not finite and positive")
        if self.values.dtype == torch.float8_e4m3fn and bool(torch.isnan(self.values.float()).any()):
            raise ValueError(f"{name}: fp8 values hold NaN")


def quantize(weight: torch.Tensor, method: str, granularity: str = "per_channel") -> QuantizedWeight:
    """A full-precision weight [out, in] in 8 bits, as NxDI computes it (see the module's text)."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantization granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    w = weight.detach().float()
    if method == "int8":
        if granularity == "per_channel":
            scale = torch.clamp(w.abs().amax(dim=1) / 127.0, min=EPS)
        else:
            from torch.ao.quantization.observer import MinMaxObserver

            observer = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
            observer(w)
            scale = observer.calculate_qparams()[0].float().reshape(1).expand(w.shape[0]).contiguous()
        values = torch.clamp(torch.round(w / scale[:, None]), -128, 127).to(torch.int8)  # torch.round: half to even
        return QuantizedWeight(values, scale)
    if granularity == "per_channel":  # NxD's quantize_fp8_per_channel: in float32, the scale floored at 1e-5
        scale = torch.clamp(w.abs().amax(dim=1) / FP8_MAX, min=FP8_CHANNEL_FLOOR)
        values = torch.clamp(w / scale[:, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedWeight(values, scale)
    # NxD's quantize_fp8_per_tensor: in the weight's own dtype, no floor (an all-zero weight keeps a tiny one here, not 0/0).
    original = weight.detach()
    tensor_scale = torch.clamp(original.abs().amax() / FP8_MAX, min=torch.finfo(original.dtype).tiny)
    values = torch.clamp(original / tensor_scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(values, tensor_scale.float().reshape(1).expand(w.shape[0]).contiguous())


def quantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """W8A8's activations (`--quantization w8a8_int8`, SGLang's w8a8_int8 scheme): each row [..., in]
    quantized to int8 symmetric on the fly, scale = max|row| / 127 in float32, values = the row / scale
    rounded half to even; returned dequantized in float32 (values * scale), what the W8A8 kernel's
    integer products stand for. An all-zero row stays zero; a row holding an infinity or NaN becomes NaN."""
    x = rows.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    finite = torch.isfinite(scale) & (scale > 0)
    values = torch.clamp(torch.round(x / torch.where(finite, scale, torch.ones_like(scale))), -128, 127)
    return torch.where(finite, values * scale, torch.where(scale == 0, torch.zeros_like(x), torch.full_like(x, float("nan"))))

"""Linear layers with their weights laid out for the CPU's few-row products.

A decode step multiplies a few rows by every weight, so it is bound by reading
the weights; how fast depends on the library and the layout, not the FLOPs.
Measured on the project's 2-core AMD EPYC host (1 thread, float32, 30
SmolLM-135M layers whose weights do not fit in the caches; docs/benchmarks.md):

- PyTorch's `F.linear` goes to MKL, which on this CPU takes 1.7x as long for 2
  rows as for 1, and 2.3x for the 49,152-row LM head (23.5 vs 10.2 ms).
- oneDNN with the weight reordered once into its blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, the pass Inductor's freezing
  applies) keeps 2 to 64 rows near the 1-row time: the LM head at 8 rows in
  14.8 ms against MKL's 27.0.
- For one row, MKL over the transposed weight ([in, out], row-major) reads
  fastest: the LM head in 5.6 ms against 10.2 (MKL) and 7.9 (oneDNN).

So each linear keeps the oneDNN-packed weight, plus the transposed one for the
one-row step. Both are copies; the original is dropped unless something else
holds it (a tied embedding). float32 on any x86 CPU; bfloat16 where oneDNN
packs it (AVX-512 or AVX-NE-CONVERT; not on this AVX2 host, where bf16 keeps
transformers' linears).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN packs this dtype here: tried on a small weight, as its
    support follows the CPU's instruction sets (mkldnn_reorder_linear_weight)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """`nn.Linear`'s product over weights prepared once at load (see the module's text)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Buffers, not parameters: the model's own weights stay what was loaded.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        self.register_buffer("transposed", weight.t().contiguous(), persistent=False)  # [in, out]
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], as `nn.Linear` has it (a view: code that reads the shape or dtype)."""
        return self.transposed.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        # Compiled, the product is one opaque call (Inductor would otherwise want
        # the packed weight as a frozen constant); eager, the plain function.
        product = torch.ops.disagg.packed_linear if torch.compiler.is_compiling() else packed_product
        return product(rows, self.packed, self.transposed, self.bias).reshape(*x.shape[:-1], self.out_features)


def packed_product(rows: torch.Tensor, packed: torch.Tensor, transposed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[n, in] x the weight -> [n, out]: one row over the transposed weight, more through oneDNN."""
    if rows.shape[0] == 1:
        out = rows @ transposed
        return out + bias if bias is not None else out
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


@torch.library.custom_op("disagg::packed_linear", mutates_args=())
def _packed_linear_op(rows: torch.Tensor, packed: torch.Tensor, transposed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_product(rows, packed, transposed, bias)


@_packed_linear_op.register_fake
def _(rows, packed, transposed, bias):
    return rows.new_empty(rows.shape[0], transposed.shape[1])


def prepack_linears(model: nn.Module) -> int:
    """Replaces every `nn.Linear` of the model by a `PackedLinear`; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)

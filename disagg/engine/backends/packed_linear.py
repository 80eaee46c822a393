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
  fastest of the three: the LM head in 5.6 ms against 10.2 (MKL) and 7.9 (oneDNN).
- Faster still, from 1 to 64 rows on one thread, is the project's own float32
  kernel (`small_gemm.c`): the weight packed in panels read as one stream,
  4 rows at a time from L1. 30 SmolLM layers' linears: 1.3-1.5x oneDNN's
  speed at 1 row, 1.6x at 8 and 16, 1.1-1.2x at 64. A single row is split
  across two cores where the calling thread may use two (1.5x faster again).

So each linear keeps the oneDNN-packed weight for the rows of a prefill, plus,
for a decode step's few rows, the kernel's panels (float32, one torch thread,
an AVX2 CPU with a C compiler) or else the transposed weight for one row.
Both are copies; the original is dropped unless something else holds it (a
tied embedding). float32 on any x86 CPU; bfloat16 where oneDNN packs it
(AVX-512 or AVX-NE-CONVERT; not on this AVX2 host, where bf16 keeps
transformers' linears).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import small_gemm

# Up to this many rows go through small_gemm's kernel (faster than oneDNN at 64 rows
# still, measured; a prefill's hundreds of rows are oneDNN's).
SMALL_ROWS = 64


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
        # For a decode step's rows: the kernel's panels [ceil(out / 24), in, 24], or the transposed weight [in, out].
        kernel = small_gemm.kernel() if weight.dtype == torch.float32 and torch.get_num_threads() == 1 else None
        few_rows = kernel.pack(weight) if kernel is not None else weight.t().contiguous()
        self.register_buffer("few_rows", few_rows, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], as `nn.Linear` has it, for code that reads its shape, dtype or
        values: a view of the transposed weight, or a copy unpacked from the panels."""
        if self.few_rows.dim() == 2:
            return self.few_rows.t()
        return self.few_rows.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        # Compiled, the product is one opaque call (Inductor would otherwise want
        # the packed weight as a frozen constant); eager, the plain function.
        product = torch.ops.disagg.packed_linear if torch.compiler.is_compiling() else packed_product
        return product(rows, self.packed, self.few_rows, self.bias).reshape(*x.shape[:-1], self.out_features)


def packed_product(rows: torch.Tensor, packed: torch.Tensor, few_rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[n, in] x the weight -> [n, out]: up to SMALL_ROWS rows through the kernel's
    panels (3-d), else one row over the transposed weight (2-d), else oneDNN."""
    n = rows.shape[0]
    if few_rows.dim() == 3 and n <= SMALL_ROWS:
        return small_gemm.kernel().product(rows, few_rows, packed.shape[0], bias)
    if few_rows.dim() == 2 and n == 1:
        out = rows @ few_rows
        return out + bias if bias is not None else out
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


@torch.library.custom_op("disagg::packed_linear", mutates_args=())
def _packed_linear_op(rows: torch.Tensor, packed: torch.Tensor, few_rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_product(rows, packed, few_rows, bias)


@_packed_linear_op.register_fake
def _(rows, packed, few_rows, bias):
    return rows.new_empty(rows.shape[0], packed.shape[0])


def prepack_linears(model: nn.Module) -> int:
    """Replaces every `nn.Linear` of the model by a `PackedLinear`; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)

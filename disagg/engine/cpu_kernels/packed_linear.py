"""Linear layers with their weights laid out for the CPU's few-row products.

A decode step multiplies a few rows by every weight, so it is bound by reading
the weights; how fast depends on the library and the layout, not the FLOPs.
Measured on the project's 2-core AMD EPYC host (1 thread, float32, 30
SmolLM-135M layers whose weights do not fit in the caches; bench/results/HISTORY.md, The compiled,
bucketed decode step):

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
  speed at 1 row, 1.6x at 8 and 16, 1.1-1.2x at 64. Where the calling thread
  may use two cores, each product is shared with the kernel's helper thread,
  at the lowest priority (1.3-1.4x faster again at 8-32 rows, 1.5x at one,
  when the other core is idle), and a prefill's rows go through it too, 64
  at a time (1.6x oneDNN's speed with the other core idle, 0.97x without).

So each linear keeps the oneDNN-packed weight for the rows of a prefill, plus,
for a decode step's few rows, the kernel's panels (float32 or bf16, any torch
thread count: a split product goes to as many helper threads as the worker has
torch threads but one; an AVX2 CPU with a C compiler) or else the transposed
weight for one row. Both are copies; the original is dropped unless something
else holds it (a tied embedding). Linears that the model calls one after another
on the same input (q, k and v; gate and up) are found at start-up
(`group_shared_inputs`), and a single row reads them as one weight: one kernel
call over their panels laid end to end. float32 on any x86 CPU; bfloat16 where
oneDNN packs it (AVX-512 or AVX-NE-CONVERT; an AVX2-only CPU keeps
transformers' linears in bf16, and `--dtype auto` gives it float32). bf16 rows
go through the kernel widened to float32 and come back rounded once to bf16.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from . import small_gemm

# Up to this many rows go through small_gemm's kernel (faster than oneDNN at 64 rows
# still, measured); a prefill's hundreds of rows in blocks of this many where the
# kernel shares them between two cores, else through oneDNN.
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
        kernel = small_gemm.kernel(weight.dtype)
        few_rows = kernel.pack(weight) if kernel is not None else weight.t().contiguous()
        self.register_buffer("few_rows", few_rows, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self.shared: SharedInput | None = None  # with the linears that read the same input, if any
        self.shared_start = 0  # this linear's first column in the group's product

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], as `nn.Linear` has it, for code that reads its shape, dtype or
        values: a view of the transposed weight, or a copy unpacked from the panels."""
        if self.few_rows.dim() == 2:
            return self.few_rows.t()
        return small_gemm.kernel(self.few_rows.dtype).unpack(self.few_rows, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            # One opaque call (Inductor would otherwise want the packed weight as a frozen constant).
            out = torch.ops.disagg.packed_linear(rows, self.packed, self.few_rows, self.bias)
        elif self.shared is not None and rows.shape[0] == 1:
            out = self.shared.output(self, x, rows)
        else:
            out = packed_product(rows, self.packed, self.few_rows, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def packed_product(rows: torch.Tensor, packed: torch.Tensor, few_rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[n, in] x the weight -> [n, out]: up to SMALL_ROWS rows through the kernel's
    panels (3-d); more (a prefill's) too, in blocks of SMALL_ROWS, where the kernel
    shares them with its helper; else one row over the transposed weight (2-d), else oneDNN.
    The kernel takes and gives float32: bf16 rows are widened (exactly) and the float32
    sums rounded once to bf16, as oneDNN's bf16 product rounds its float32 accumulators."""
    n = rows.shape[0]
    if few_rows.dim() == 3:
        kernel = small_gemm.kernel(few_rows.dtype)
        kernel_bias = None if bias is None else bias.float()
        if n <= SMALL_ROWS:
            return kernel.product(rows.float(), few_rows, packed.shape[0], kernel_bias).to(rows.dtype)
        # A prefill's rows: float32 through the kernel where it shares them with its helpers. bf16 keeps
        # oneDNN, whose AVX512_BF16 products on one core (~200 GFLOP/s on SmolLM's 1,024-row linears)
        # match the kernel on two and need no idle core (a prefill beside decoding streams has none).
        if few_rows.dtype == torch.float32 and kernel.shares(few_rows):
            return prefill_blocks(rows.contiguous(), few_rows, packed.shape[0], bias)
    if few_rows.dim() == 2 and n == 1:
        out = rows @ few_rows
        return out + bias if bias is not None else out
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def prefill_blocks(rows: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """A prefill's rows through the kernel SMALL_ROWS at a time, each block shared
    with the helper. Why blocks: the kernel reads a block's rows again for every 24
    output columns, so a block must stay in the caches; and blocks of 64 rows on two
    cores compute 1.6-1.7x as fast as oneDNN on one, or 0.97x when the helper gets
    no core (SmolLM's layers, 1,024 rows; bench/results/HISTORY.md, both cores shared)."""
    kernel = small_gemm.kernel(panels.dtype)
    out = rows.new_empty(rows.shape[0], out_features)
    for start in range(0, rows.shape[0], SMALL_ROWS):
        kernel.product(rows[start : start + SMALL_ROWS], panels, out_features, bias, out=out[start : start + SMALL_ROWS])
    return out


@torch.library.custom_op("disagg::packed_linear", mutates_args=())
def _packed_linear_op(rows: torch.Tensor, packed: torch.Tensor, few_rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_product(rows, packed, few_rows, bias)


@_packed_linear_op.register_fake
def _(rows, packed, few_rows, bias):
    return rows.new_empty(rows.shape[0], packed.shape[0])


class SharedInput:
    """Linears the model calls one after another on the same input tensor (q, k and v
    of an attention; gate and up of an MLP): their panels laid end to end, so that
    for a single row (a decode step of one sequence) the first call computes every
    member's columns in one kernel call (one stream of weights, shared between two
    cores where a row is) and the others take their slice. Measured over 30 of
    SmolLM's layers: 1.1x faster at one row; at 8 rows, where each member's slice
    of the rows is copied out, 0.95x, so more rows keep one product a member.

    A member's columns come out the same bits as its own product: the kernel
    computes each panel the same way wherever it stands, and a member without a
    bias starts from 0. The product is kept for the input tensor it was computed
    from, until every other member has taken its slice once; a member called on
    any other tensor, a second time, or on the same tensor modified in place
    since (where the tensor counts its versions: not under inference mode, where
    the start-up logits check stands for it), computes the group's product anew
    (correct, only slower)."""

    def __init__(self, members: list["PackedLinear"]):
        self.panels = torch.cat([member.few_rows for member in members])  # [sum of the members' panels, in, 24]
        self.width = self.panels.shape[0] * small_gemm.PANEL
        # float32 whatever the weights' dtype: the kernel adds it to its float32 sums.
        self.bias = torch.zeros(self.width) if any(member.bias is not None for member in members) else None
        self.members = frozenset(members)
        start = 0
        for member in members:
            count = member.few_rows.shape[0]
            member.few_rows = self.panels[start : start + count]  # a view: the separate copy is freed
            member.shared, member.shared_start = self, start * small_gemm.PANEL
            if member.bias is not None:
                self.bias[member.shared_start : member.shared_start + member.out_features] = member.bias
            start += count
        # (input tensor, its version, the product, the members yet to take their slice):
        # one attribute, replaced whole, so that a thread never reads another thread's
        # product for its own input.
        self._last: tuple[torch.Tensor, int, torch.Tensor, frozenset] | None = None

    def output(self, member: "PackedLinear", x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """member's product of rows (x reshaped), from the group's product of x."""
        last, version = self._last, _version(x)
        if last is not None and last[0] is x and last[1] == version and member in last[3]:
            product, waiting = last[2], last[3] - {member}
        else:
            product, waiting = small_gemm.kernel(self.panels.dtype).product(rows.float(), self.panels, self.width, self.bias), self.members - {member}
        self._last = (x, version, product, waiting) if waiting else None
        start = member.shared_start
        return product[:, start : start + member.out_features].to(rows.dtype).contiguous()


def _version(x: torch.Tensor) -> int:
    """How often x was modified in place; -1 for an inference tensor, which does not count."""
    return -1 if x.is_inference() else x._version


def group_shared_inputs(model: nn.Module, run: Callable[[], object]) -> int:
    """Groups the kernel-packed linears that `run` (a forward pass) calls one after
    another on the same input tensor (see SharedInput); returns how many groups."""
    calls: list[tuple[PackedLinear, torch.Tensor]] = []
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and m.few_rows.dim() == 3 and m.shared is None]
    # A linear called with its input as a keyword shows no positional argument: it joins no group.
    hooks = [m.register_forward_pre_hook(lambda module, args: calls.append((module, args[0] if args else None))) for m in linears]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    groups: list[list[PackedLinear]] = []
    for (module, x), (previous, previous_x) in zip(calls[1:], calls[:-1]):
        if x is not None and x is previous_x and module.in_features == previous.in_features:
            if groups and groups[-1][-1] is previous:
                groups[-1].append(module)
            else:
                groups.append([previous, module])
    seen: set[int] = set()
    distinct = []
    for group in groups:  # a module met twice (a shared layer, a second pass) joins one group only
        if len({id(m) for m in group}) == len(group) and not seen & {id(m) for m in group}:
            seen |= {id(m) for m in group}
            distinct.append(group)
    for group in distinct:
        SharedInput(group)
    return len(distinct)


def prepack_linears(model: nn.Module) -> int:
    """Replaces every `nn.Linear` of the model by a `PackedLinear`; returns how many. The weights
    left as loaded are then copied out of the loader's storage (release_loaded_storage)."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    release_loaded_storage(model)
    return len(targets)


def release_loaded_storage(model: nn.Module) -> int:
    """Copies every parameter and buffer the packed linears did not make into a storage of its own; returns
    how many. Why: the loader builds tensors over a few large buffers (or the checkpoint's mapped file), and
    one tensor the model keeps (an embedding, a norm) holds its whole buffer, the packed linears' originals
    included, though no view shows it. Llama-3.2-1B in bf16, packed: 7.34 GiB resident, 5.53 after this."""
    copies: dict[int, torch.Tensor] = {}  # a tensor two modules share (tied weights) stays one tensor
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PackedLinear):
                continue  # its buffers are its own copies already
            for tensors in (module._parameters, module._buffers):
                for name, tensor in tensors.items():
                    if tensor is None or tensor.layout is not torch.strided or tensor.device.type != "cpu":
                        continue
                    if id(tensor) not in copies:
                        copy = tensor.detach().clone()
                        copies[id(tensor)] = nn.Parameter(copy, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else copy
                    tensors[name] = copies[id(tensor)]
    return len(copies)

"""The linear layers of one decode step alone, per product path and row count.

30 SmolLM-135M layers' worth of linears (q, k, v, o, gate, up, down), each with
weights of its own so that they come from memory as in a real step, one torch
thread, float32; the median of --repeats passes over all of them, the paths
interleaved. Paths: `kernel` (small_gemm.c over its panels, the default for up
to 64 rows; more rows in blocks of 64, as a prefill's go), `onednn` (the
oneDNN-packed weight), `mkl` (F.linear over the transposed weight, the one-row
path without the kernel), `unpacked` (the panels unpacked to [out, in] for
each product, then F.linear: the prefill's weight derived on the fly from
the one layout a worker keeps), `reordered` (the same, then oneDNN's reorder
and its product). --dtype bfloat16 keeps the weights in bf16
(the rows too, for oneDNN and F.linear). --split lets the kernel share each
product with its helper thread on the second core.

    python bench/linears.py [--rows 1,2,4,8,16,32,64] [--repeats 7] [--dtype float32|bfloat16] [--split]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

from disagg.engine.cpu_kernels import small_gemm  # noqa: E402

HIDDEN, KV, INTERMEDIATE, LAYERS = 576, 192, 1536, 30  # SmolLM-135M
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # [out, in]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--split", action="store_true", help="the kernel shares each product with its helper thread")
    parser.add_argument("--paths", default="kernel,onednn,mkl,unpacked")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    kernel = small_gemm.kernel(dtype)
    if kernel is None:
        raise SystemExit("the few-row kernel is not available here (see the log line above)")
    layers = []
    for _ in range(LAYERS):
        for out_features, in_features in SHAPES:
            weight = (torch.randn(out_features, in_features) / in_features**0.5).to(dtype)
            layers.append((out_features, in_features, kernel.pack(weight), torch.ops.mkldnn._reorder_linear_weight(weight, None), weight.t().contiguous()))
    kernel.split_here(args.split)
    every = {
        "kernel": lambda x, n, panels, packed, transposed: kernel_blocks(kernel, x, panels, n),
        "onednn": lambda x, n, panels, packed, transposed: torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, None, "none", [], ""),
        "mkl": lambda x, n, panels, packed, transposed: x.to(dtype) @ transposed,
        "unpacked": lambda x, n, panels, packed, transposed: torch.nn.functional.linear(x.to(dtype), kernel.unpack(panels, n, x.shape[1])),
        "reordered": lambda x, n, panels, packed, transposed: torch.ops.mkldnn._linear_pointwise(
            x.to(dtype), torch.ops.mkldnn._reorder_linear_weight(kernel.unpack(panels, n, x.shape[1]).contiguous(), None), None, "none", [], ""
        ),
    }
    paths = {name: every[name] for name in args.paths.split(",")}
    flops_per_row = 2 * LAYERS * sum(o * i for o, i in SHAPES)
    print(f"{LAYERS} layers x {len(SHAPES)} linears, {flops_per_row // 2 * dtype.itemsize / 1e6:.0f} MB of weights, 1 thread, {args.dtype}"
          f"{', the kernel ' + kernel.name + (' on two cores' if args.split else ' on one') }")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {width: torch.randn(rows, width) for width in (HIDDEN, INTERMEDIATE)}
        times = {name: [] for name in paths}
        for repeat in range(args.repeats + 1):
            for name, product in paths.items():
                started = time.perf_counter()
                for out_features, in_features, *weights in layers:
                    product(inputs[in_features], out_features, *weights)
                if repeat:  # the first pass warms up
                    times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(t) for name, t in times.items()}
        cells = "   ".join(f"{name} {m * 1e3:6.1f} ms ({rows * flops_per_row / m / 1e9:4.1f} GFLOP/s)" for name, m in medians.items())
        ratio = f"   onednn/kernel {medians['onednn'] / medians['kernel']:.2f}x" if {"onednn", "kernel"} <= medians.keys() else ""
        print(f"{rows:4d} rows: {cells}{ratio}", flush=True)


def kernel_blocks(kernel, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """x's rows through the kernel 64 at a time (packed_linear's prefill blocks)."""
    if x.shape[0] <= 64:
        return kernel.product(x, panels, out_features, None)
    out = x.new_empty(x.shape[0], out_features)
    for start in range(0, x.shape[0], 64):
        kernel.product(x[start : start + 64], panels, out_features, None, out=out[start : start + 64])
    return out


if __name__ == "__main__":
    main()

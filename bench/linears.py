"""The linear layers of one decode step alone, per product path and row count.

30 SmolLM-135M layers' worth of linears (q, k, v, o, gate, up, down), each with
weights of its own so that they come from memory as in a real step, one torch
thread, float32; the median of --repeats passes over all of them, the paths
interleaved. Paths: `kernel` (small_gemm.c over its panels, the default for up
to 64 rows), `onednn` (the oneDNN-packed weight), `mkl` (F.linear over the
transposed weight, the one-row path without the kernel).

    python bench/linears.py [--rows 1,2,4,8,16,32,64] [--repeats 7]
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernel = small_gemm.kernel()
    if kernel is None:
        raise SystemExit("the few-row kernel is not available here (see the log line above)")
    layers = []
    for _ in range(LAYERS):
        for out_features, in_features in SHAPES:
            weight = torch.randn(out_features, in_features) / in_features**0.5
            layers.append((out_features, in_features, kernel.pack(weight), torch.ops.mkldnn._reorder_linear_weight(weight, None), weight.t().contiguous()))
    paths = {
        "kernel": lambda x, n, panels, packed, transposed: kernel.product(x, panels, n, None),
        "onednn": lambda x, n, panels, packed, transposed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "mkl": lambda x, n, panels, packed, transposed: x @ transposed,
    }
    flops_per_row = 2 * LAYERS * sum(o * i for o, i in SHAPES)
    print(f"{LAYERS} layers x {len(SHAPES)} linears, {flops_per_row // 2 * 4 / 1e6:.0f} MB of weights, 1 thread, float32")
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
        print(f"{rows:3d} rows: {cells}   onednn/kernel {medians['onednn'] / medians['kernel']:.2f}x", flush=True)


if __name__ == "__main__":
    main()

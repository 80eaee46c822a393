"""A decode step's products alone, through small_gemm builds from several copies of small_gemm.c, in one process.

Why: this host's memory bandwidth moves by up to 1.8x from one minute to the next, so a kernel change
measured before and after in two runs can read as anything. Here every copy of the source is compiled
(each its own library, with its own helper thread) and the copies' passes are interleaved, a few dozen
passes each in turn, so each sees the same machine.

A pass is one step's products in a step's order, each weight its own (streamed from memory, as in a real
step): per layer q|k|v (one product), o, gate|up (one product), down; then the LM head. The layers' weights
are --weights (int8 through int8-dot, or bf16 through bf16-dot: the AVX512_BF16 builds; float32 through
the float32-avx512 build), the LM head bf16 unless --head int8. Rows: --rows, each count on its own; "split"
lets each product share with the helper (two cores, as a decode worker's step), "one core" does not.

    git show HEAD~1:disagg/engine/cpu_kernels/small_gemm.c > /tmp/before.c
    python bench/kernel_ab.py --sources /tmp/before.c,disagg/engine/cpu_kernels/small_gemm.c --rows 1,8,32
    python bench/kernel_ab.py --sources ... --weights bf16 --shape llama-3.2-1b --rows 1
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

from disagg.engine.cpu_kernels import small_gemm  # noqa: E402
from disagg.engine.dtype_choice import cpu_flags  # noqa: E402
from disagg.tools.tinymodel import BENCH_SHAPES  # noqa: E402

WEIGHT_BUILDS = {"int8": "int8-dot", "int8-vnni": "int8-vnni-bf16", "bf16": "bf16-dot", "float32": "float32-avx512"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", default=str(small_gemm.SOURCE), help="comma-separated copies of small_gemm.c")
    parser.add_argument("--shape", default="smollm-135m", choices=sorted(BENCH_SHAPES))
    parser.add_argument("--weights", default="int8", help=f"the layers' weights, comma-separated builds to interleave ({', '.join(WEIGHT_BUILDS)})")
    parser.add_argument("--head", default="", choices=["", "int8"], help="the LM head: int8, or (default) bf16 (float32 with --weights float32)")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=4, help="turns of every source and mode")
    parser.add_argument("--passes", type=int, default=20, help="timed passes per turn")
    return parser.parse_args()


def build(source: str, name: str) -> small_gemm.SmallGemm:
    _, flags, needs = small_gemm.BUILDS[name]
    missing = [feature for feature in needs if feature not in cpu_flags()]
    library = None if missing else small_gemm.load_library(pathlib.Path(source), small_gemm.FLAGS + flags, (), f"{name} from {source}")
    if library is None:
        sys.exit(f"{name} from {source} does not build or run here" + (f" (the CPU lacks {', '.join(missing)})" if missing else ""))
    library.small_gemm_set_helpers.argtypes, library.small_gemm_set_helpers.restype = [ctypes.c_long], None
    library.small_gemm_set_helpers(1)
    return small_gemm.SmallGemm(library, name)


def step_shapes(shape: str) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """([out, in] of each layer's products, in order, over every layer), [out, in] of the LM head."""
    spec = BENCH_SHAPES[shape]
    hidden, head_dim = spec.hidden_size, spec.hidden_size // spec.num_heads
    layer = [(hidden + 2 * spec.num_kv_heads * head_dim, hidden), (hidden, hidden), (2 * spec.intermediate_size, hidden), (hidden, spec.intermediate_size)]
    return layer * spec.num_layers, (spec.vocab_size, hidden)


def packed(kernel: small_gemm.SmallGemm, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight (int8 values and their scales) in this build's panels: as they are, or dequantized to its dtype."""
    if kernel.scale_rows:
        return kernel.pack_quantized(values, scale)
    return kernel.pack((values.float() * scale[:, None]).to(kernel.weight_dtype))


def main() -> None:
    args = parse_args()
    sources = args.sources.split(",")
    layers, head = step_shapes(args.shape)
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator), torch.rand(shape[0], generator=generator) / 64 + 1e-3)
               for shape in [*layers, head]]
    kinds = args.weights.split(",")
    if unknown := [kind for kind in kinds if kind not in WEIGHT_BUILDS]:
        sys.exit(f"--weights: {', '.join(unknown)} not among {', '.join(WEIGHT_BUILDS)}")
    passes = {}
    for source in sources:
        for kind in kinds:
            head_build = "int8-dot" if args.head == "int8" else "float32-avx512" if kind == "float32" else "bf16-dot"
            body, last = build(source, WEIGHT_BUILDS[kind]), build(source, head_build)
            label = source if len(kinds) == 1 else f"{source} [{WEIGHT_BUILDS[kind]}]"
            passes[label] = [(body, packed(body, *w), *w[0].shape) for w in weights[:-1]] + [(last, packed(last, *weights[-1]), *head)]
    first = next(iter(passes.values()))
    weight_bytes = sum(panels.numel() * panels.element_size() for _, panels, _, _ in first)
    print(f"{args.shape}, {args.weights} layers, LM head {first[-1][0].name}: {weight_bytes / 1e6:.0f} MB a pass")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=generator) for _, _, _, k in first}
        outputs = {n: torch.empty(rows, n) for _, _, n, _ in first}

        def one_pass(products, split: bool) -> float:
            started = time.perf_counter()
            for kernel, panels, n, k in products:
                call = kernel._split if split and kernel.shares(panels) else kernel._call
                call(inputs[k].data_ptr(), rows, k, panels.data_ptr(), n, None, outputs[n].data_ptr())
            return time.perf_counter() - started

        times = {(source, split): [] for source in passes for split in (True, False)}
        for _ in range(args.rounds):
            for (source, split), samples in times.items():
                one_pass(passes[source], split)  # warm
                samples.extend(one_pass(passes[source], split) for _ in range(args.passes))
        for (source, split), samples in times.items():
            median, mode = statistics.median(samples), "split" if split else "one core"
            print(f"rows {rows:3d}  {mode:8s}  {median * 1e3:7.2f} ms  {weight_bytes / median / 1e9:5.1f} GB/s  {source}", flush=True)


if __name__ == "__main__":
    main()

"""One prompt's prefill in one process: through transformers' modules against native_step.c.

For each prompt length, the median time of `TorchBackend.prefill_logits` (the
logits after the prompt, each layer's K/V handed to a callback) with the
linears prepacked, through the modules (`--no-native-step`) and natively,
measured interleaved, SmolLM-135M's shape with seeded weights, float32, one
torch thread. `--one-core` keeps every product on the calling core (as under
load, when the decode worker holds the other); otherwise the kernel's helper
takes the idle core.

    python bench/prefill_step.py --lengths 16,64,128,256,512
    python bench/prefill_step.py --lengths 64,256 --one-core
    python bench/prefill_step.py --dtype bfloat16 --lengths 512,1024
    python bench/prefill_step.py --attention --lengths 256,1024 --threads 2

--attention times one layer's attention alone (SmolLM-135M's 9 query and 3 KV heads
of 64, bf16, causal): PyTorch's SDPA against prefill_attention.c.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

from disagg.engine.backends.torch_backend import TorchBackend, TorchBackendConfig  # noqa: E402
from disagg.engine.cpu_kernels import native_step, prefill_attention, small_gemm  # noqa: E402
from disagg.tools.tinymodel import SMOLLM_135M_SHAPE, ensure_tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="16,64,128,256,512")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--one-core", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the kernel gets threads - 1 helpers, at least one)")
    parser.add_argument("--attention", action="store_true", help="one layer's attention alone: SDPA against prefill_attention.c (bf16)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.attention:
        attention_only([int(n) for n in args.lengths.split(",")], args.repeats)
        return
    path = str(ensure_tiny_model(SMOLLM_135M_SHAPE))
    modules = TorchBackend(TorchBackendConfig(model=path, dtype=args.dtype, native_step=False))
    native = TorchBackend(TorchBackendConfig(model=path, dtype=args.dtype))
    if native.native_prefill is None:
        sys.exit("the native prefill does not serve this model here (see the log)")
    longest = max(int(n) for n in args.lengths.split(","))
    native_step.PREFILL_MAX_ROWS = native_step.PREFILL_MAX_ROWS_BF16_THREADED = longest  # every length natively, to compare
    small_gemm.kernel(getattr(torch, args.dtype)).split_here(not args.one_core)
    for length in (int(n) for n in args.lengths.split(",")):
        prompt = [(13 * i + 5) % native.info.vocab_size for i in range(length)]
        times = {"modules": [], "native": []}
        for _ in range(args.repeats + 1):
            for name, backend in (("modules", modules), ("native", native)):
                started = time.perf_counter()
                backend.prefill_logits(prompt, lambda *kv: None)
                times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(values[1:]) * 1e3 for name, values in times.items()}
        print(
            f"{length:5d} tokens: modules {medians['modules']:8.1f} ms   native {medians['native']:8.1f} ms"
            f"   ({medians['modules'] / medians['native']:.2f}x faster)",
            flush=True,
        )


def attention_only(lengths: list[int], repeats: int) -> None:
    kernel = prefill_attention.kernel()
    if kernel is None:
        sys.exit("prefill_attention.c does not run here (see the log)")
    shape = SMOLLM_135M_SHAPE
    d = shape.hidden_size // shape.num_heads
    for length in lengths:
        generator = torch.Generator().manual_seed(length)
        query = torch.randn(1, length, shape.num_heads, d, generator=generator).to(torch.bfloat16).transpose(1, 2)  # as transformers hands it
        keys, values = (torch.randn(1, shape.num_kv_heads, length, d, generator=generator).to(torch.bfloat16) for _ in range(2))
        runs = {
            "sdpa": lambda: F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True),
            "kernel": lambda: kernel.attend(query, keys, values, d**-0.5),
        }
        times = {name: [] for name in runs}
        for _ in range(repeats + 1):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(values[1:]) * 1e3 for name, values in times.items()}
        flops = 2 * 2 * shape.num_heads * length * (length + 1) / 2 * d  # causal: scores and sums over the keys up to each row
        print(
            f"{length:5d} tokens: sdpa {medians['sdpa']:7.2f} ms   kernel {medians['kernel']:7.2f} ms   ({medians['sdpa'] / medians['kernel']:.2f}x faster;"
            f" {flops / medians['kernel'] / 1e6:.0f} GFLOP/s)",
            flush=True,
        )


if __name__ == "__main__":
    main()

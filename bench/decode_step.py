"""The decode step in one process: eager against compiled, against the roofline.

For each batch size, the median time of one `TorchBackend.decode_step` (the
model over the slots, then greedy sampling) with every row at `--context`
positions, eager and compiled (buckets; CUDA graphs on CUDA), measured
interleaved. The roofline is the weights' bytes over the memory read
bandwidth measured here (a sum over a buffer larger than the caches, on the
same threads), the least time a batch-1 step can take.

    python bench/decode_step.py                       # SmolLM-135M shape, bf16, CPU
    python bench/decode_step.py --dtype float32 --batch 1,8,32,64
    python bench/decode_step.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

from disagg.engine.backends.base import StepInputs  # noqa: E402
from disagg.engine.backends.torch_backend import TorchBackend, TorchBackendConfig  # noqa: E402
from disagg.tinymodel import SMOLLM_135M_SHAPE, ensure_tiny_model  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second a sum reads, over a buffer far larger than the caches."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(5):
        sync(device)
        started = time.perf_counter()
        buffer.sum()
        sync(device)
        times.append(time.perf_counter() - started)
    return nbytes / min(times)


def step_inputs(batch: int, context: int, vocab: int, device: torch.device) -> StepInputs:
    return StepInputs(
        slots=torch.arange(batch),
        positions=torch.full((batch,), context - 1),
        input_ids=torch.randint(0, vocab, (batch,), device=device),
        params=torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]] * batch),  # greedy
        seeds=torch.zeros(batch, dtype=torch.long),
        steps=torch.zeros(batch, dtype=torch.long),
        kv_len=context,
        contiguous_from=0,
        min_position=context - 1,
    )


def time_step(backend: TorchBackend, inputs: StepInputs, device: torch.device) -> float:
    sync(device)
    started = time.perf_counter()
    backend.decode_step(inputs).token_ids.tolist()  # the host reads the tokens, as the batcher does
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the compile's progress
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch.split(",")]
    path = str(ensure_tiny_model(SMOLLM_135M_SHAPE))
    backends = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        config = TorchBackendConfig(model=path, dtype=args.dtype, device=args.device, max_seq_len=max(2 * args.context, 256), compile=compiled)
        backend = backends[name] = TorchBackend(config)
        started = time.perf_counter()
        backend.allocate_slots(max(batches))
        print(f"{name}: slots ready in {time.perf_counter() - started:.1f}s", flush=True)
        for cache in (*backend.cache.keys, *backend.cache.values):
            cache.normal_()
    model = backends["eager"].model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = read_bandwidth(device)
    roofline = weight_bytes / bandwidth
    result = {"device": args.device, "dtype": args.dtype, "threads": args.threads, "context": args.context, "weight_bytes": weight_bytes, "read_bandwidth_gbs": bandwidth / 1e9, "roofline_ms": roofline * 1e3, "steps": {}}
    print(f"weights {weight_bytes / 1e6:.0f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s: roofline {roofline * 1e3:.2f} ms per step")
    vocab = backends["eager"].info.vocab_size
    for batch in batches:
        inputs = step_inputs(batch, args.context, vocab, device)
        times = {"eager": [], "compiled": []}
        for name, backend in backends.items():
            time_step(backend, inputs, device)  # warm
        for _ in range(args.repeats):
            for name, backend in backends.items():
                times[name].append(time_step(backend, inputs, device))
        eager, compiled = (statistics.median(times[n]) for n in ("eager", "compiled"))
        result["steps"][batch] = {"eager_ms": eager * 1e3, "compiled_ms": compiled * 1e3}
        print(f"batch {batch:3d}: eager {eager * 1e3:8.2f} ms   compiled {compiled * 1e3:8.2f} ms   eager/compiled {eager / compiled:5.2f}x   compiled/roofline {compiled / roofline:5.2f}x   {batch / compiled:8.0f} tok/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

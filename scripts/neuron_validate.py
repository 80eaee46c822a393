"""Validation on a Neuron instance: token equality with the CPU backend, TTFT and ITL.

    python scripts/neuron_validate.py --model /models/Llama-3.2-1B --tp-degree 2 [--batch-size 4]

Runs the same prompts through the neuron backend (NxDI, compiled once into
~/.cache/disagg/neuron) and the torch backend on the CPU, both in this process,
greedy; prints whether the tokens match and the neuron backend's time to first
token and inter-token latency. Needs the Neuron packages (docs/neuron.md).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from transformers import AutoTokenizer

from decode_worker.batcher import Batcher, Sequence
from disagg.engine.backends import load_backend
from disagg.engine.kv_wire import KvKind
from disagg.engine.requests import Sampling, Stopping

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def generate(backend, ids: list[int], new_tokens: int, decode_backend=None) -> tuple[list[int], float, list[float]]:
    """Prefill on backend, decode on decode_backend (the same by default): tokens, TTFT, step times."""
    decode_backend = decode_backend or backend
    start = time.perf_counter()
    result = backend.prefill(ids, Sampling())
    ttft = time.perf_counter() - start
    for layer, (k, v) in enumerate(result.layers):
        decode_backend.write_kv(0, layer, KvKind.KEY, 0, k)
        decode_backend.write_kv(0, layer, KvKind.VALUE, 0, v)
    tokens, done = [result.first_token], threading.Event()
    batcher = Batcher(decode_backend, lambda events: [tokens.extend(e.token_ids) for e in events], lambda keys: done.set())
    batcher.start()
    batcher.admit(Sequence("v", 0, len(ids), result.first_token, Sampling(), Stopping(new_tokens, frozenset())))
    done.wait(600)
    batcher.stop()
    return tokens, ttft, batcher.stats.step_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp-degree", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    neuron = load_backend("neuron", model=args.model, max_seq_len=args.max_seq_len, batch_size=args.batch_size, neuron={"tp_degree": args.tp_degree})
    neuron.allocate_slots(args.batch_size)
    cpu = load_backend("torch", model=args.model, dtype="bfloat16", max_seq_len=args.max_seq_len)
    cpu.allocate_slots(1)
    ttfts, steps, matches = [], [], 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        got, ttft, step_times = generate(neuron, ids, args.new_tokens)
        expected, _, _ = generate(cpu, ids, args.new_tokens)
        same = got == expected
        matches += same
        ttfts.append(ttft)
        steps += step_times[2:]
        print(f"{'MATCH' if same else 'DIFFER'}  {prompt!r}\n  neuron: {tokenizer.decode(got)!r}\n  cpu:    {tokenizer.decode(expected)!r}")
    print(f"\n{matches}/{len(PROMPTS)} prompts give the CPU backend's tokens (bf16 on both: a late divergence can be rounding)")
    print(f"time to first token: median {statistics.median(ttfts) * 1000:.1f} ms; inter-token latency: median {statistics.median(steps) * 1000:.2f} ms")


if __name__ == "__main__":
    main()

"""The first thing to run on a Neuron instance: does the neuron backend hold on hardware?

    python scripts/neuron_validate.py --model /models/Llama-3.2-1B --tp-degree 2 [--batch-size 4]

Checks, in order, printing each result (the tests here run only against a stand-in):
 1. the model's device state: every key, shape and dtype per rank;
 2. a KV write/read round trip on one slot while the other slots decode;
 3. prefill with seq_ids=[k], k > 0 (the spare line), touching only line k;
 4. greedy tokens equal to the torch backend's on the same checkpoint (CPU);
 5. two first compiles at once on one instance (separate work directories);
 6. decode step time with NxDI's own async_mode off (ours) and on.
Needs the Neuron packages (docs/neuron.md).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
from transformers import AutoTokenizer

from decode_worker.batcher import Batcher, Sequence
from disagg.engine.backends import load_backend
from disagg.engine.backends.base import StepInputs
from disagg.engine.backends.neuron.config import prefill_line
from disagg.kv.codec import KvKind
from disagg.engine.requests import Sampling, Stopping
from disagg.engine.sampler import params_tensor

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def print_state(backend) -> None:
    for rank, state in enumerate(backend._state()):
        for key in sorted(state):
            print(f"  rank {rank} {key}: {tuple(state[key].shape)} {state[key].dtype}")


def write_prompt(backend, slot: int, layers) -> None:
    for layer, (keys, values) in enumerate(layers):
        backend.write_kv(slot, layer, KvKind.KEY, 0, keys)
        backend.write_kv(slot, layer, KvKind.VALUE, 0, values)


def one_step(backend, rows: dict[int, tuple[int, int]]) -> dict[int, int]:
    slots = sorted(rows)
    positions = torch.tensor([rows[s][0] for s in slots])
    n = len(slots)
    inputs = StepInputs(torch.tensor(slots), positions, torch.tensor([rows[s][1] for s in slots]), params_tensor([Sampling()] * n),
                        torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), int(positions.max()) + 1, None)
    return dict(zip(slots, backend.decode_step(inputs).token_ids.tolist()))


def round_trip_while_decoding(backend, ids: list[int]) -> bool:
    """Slots 1.. decode while slot 0 receives KV; slot 0 then reads back byte for byte."""
    result = backend.prefill(ids, Sampling())
    others = list(range(1, backend.options.batch_size))
    for slot in others:
        write_prompt(backend, slot, result.layers)
    rows = {slot: (len(ids), result.first_token) for slot in others}
    done = threading.Event()
    writer = threading.Thread(target=lambda: (write_prompt(backend, 0, result.layers), done.set()))
    writer.start()
    while not done.is_set() and rows:
        out = one_step(backend, rows)
        rows = {s: (p + 1, out[s]) for s, (p, _) in rows.items() if p + 2 < backend.info.max_seq_len}
    writer.join()
    return all(backend.layout.read_line(backend._caches(layer, kind), 0, len(ids)).equal(tensor)
               for layer, (k, v) in enumerate(result.layers) for kind, tensor in ((KvKind.KEY, k), (KvKind.VALUE, v)))


def prefill_touches_only_its_line(backend, ids: list[int]) -> bool:
    line = prefill_line(backend.options)
    before = [c.to("cpu") for c in backend._caches(0, KvKind.KEY)]
    backend.prefill(ids, Sampling())
    after = [c.to("cpu") for c in backend._caches(0, KvKind.KEY)]
    return line > 0 and all(torch.equal(torch.cat([b[:line], b[line + 1:]]), torch.cat([a[:line], a[line + 1:]])) for b, a in zip(before, after))


def generate(backend, ids: list[int], new_tokens: int) -> tuple[list[int], float, list[float]]:
    """Prefill then decode on one backend through our batcher: tokens, TTFT, step times."""
    start = time.perf_counter()
    result = backend.prefill(ids, Sampling())
    ttft = time.perf_counter() - start
    write_prompt(backend, 0, result.layers)
    tokens, done = [result.first_token], threading.Event()
    batcher = Batcher(backend, lambda events: [tokens.extend(e.token_ids) for e in events], lambda keys: done.set())
    batcher.start()
    batcher.admit(Sequence("v", 0, len(ids), result.first_token, Sampling(), Stopping(new_tokens, frozenset())))
    done.wait(600)
    batcher.stop()
    return tokens, ttft, batcher.stats.step_seconds


def concurrent_first_compiles(args) -> bool:
    """Two processes compile the same model into two fresh roots at once, as two workers started together."""
    code = ("import sys; from disagg.engine.backends import load_backend; "
            "load_backend('neuron', model=sys.argv[1], max_seq_len=int(sys.argv[2]), batch_size=1, neuron={'tp_degree': int(sys.argv[3]), 'compiled_root': sys.argv[4]})")
    roots = [tempfile.mkdtemp(prefix="disagg-compile-") for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", code, args.model, str(args.max_seq_len), str(args.tp_degree), root]) for root in roots]
    return all(p.wait() == 0 for p in procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp-degree", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-compiles", action="store_true", help="skip check 5 (two more compiles)")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    options = dict(model=args.model, max_seq_len=args.max_seq_len, batch_size=args.batch_size)
    neuron = load_backend("neuron", **options, neuron={"tp_degree": args.tp_degree})
    neuron.allocate_slots(args.batch_size)
    print("1. device state:")
    print_state(neuron)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    print(f"2. KV round trip on slot 0 while slots 1..{args.batch_size - 1} decode: {'OK' if round_trip_while_decoding(neuron, ids) else 'FAILED'}")
    print(f"3. prefill into line {prefill_line(neuron.options)} touches no other line: {'OK' if prefill_touches_only_its_line(neuron, ids) else 'FAILED'}")
    cpu = load_backend("torch", model=args.model, dtype="bfloat16", max_seq_len=args.max_seq_len)
    cpu.allocate_slots(1)
    ttfts, steps, matches = [], [], 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        got, ttft, step_times = generate(neuron, ids, args.new_tokens)
        expected, _, _ = generate(cpu, ids, args.new_tokens)
        matches += got == expected
        ttfts.append(ttft)
        steps += step_times[2:]
        print(f"   {'MATCH' if got == expected else 'DIFFER'}  {prompt!r}\n     neuron: {tokenizer.decode(got)!r}\n     cpu:    {tokenizer.decode(expected)!r}")
    print(f"4. {matches}/{len(PROMPTS)} prompts give the CPU backend's greedy tokens (bf16 on both: a late divergence can be rounding)")
    print(f"   time to first token: median {statistics.median(ttfts) * 1000:.1f} ms; step: median {statistics.median(steps) * 1000:.2f} ms (NxDI async off)")
    if not args.skip_compiles:
        print(f"5. two first compiles at once: {'OK' if concurrent_first_compiles(args) else 'FAILED'}")
    with_async = load_backend("neuron", **options, neuron={"tp_degree": args.tp_degree, "nxdi_async_mode": True})
    with_async.allocate_slots(args.batch_size)
    _, _, async_steps = generate(with_async, tokenizer(PROMPTS[0])["input_ids"], args.new_tokens)
    print(f"6. step median with NxDI's async_mode on: {statistics.median(async_steps[2:]) * 1000:.2f} ms (off: above)")


if __name__ == "__main__":
    main()

"""The first thing to run on a Neuron instance: does the neuron backend hold on hardware?

    python scripts/neuron_validate.py --model /models/Llama-3.2-1B [--tp-degree 2] [--batch-size 4]

Runs on a trn1.2xlarge or inf2.xlarge (2 NeuronCores) with Llama-3.2-1B, through
the code the workers run (load_backend, the launcher of `disagg serve`), and
prints each check's result, then a summary; exit status 1 if any failed:
 0. the NeuronCores found (disagg/tools/neuron_cores.py: sysfs, neuron-ls or --neuron-cores);
 1. `disagg serve --backend neuron`: a prefill and a decode worker on their own
    cores (--serve-tp each), compiled once, serving greedy tokens equal to
    transformers' generate() on the CPU;
 2. the model's device state: every key, shape and dtype per rank;
 3. a KV write/read round trip on one slot while the other slots decode;
 4. prefill with seq_ids=[k], k > 0 (the spare line), touching only line k, and a
    one-token prompt's first token equal to transformers' (the padded position tie);
 5. greedy tokens equal to transformers' generate() on the same checkpoint (CPU);
 6. two processes asking for one new configuration at once compile it once;
 7. a compile killed after NxDI wrote model.pt is compiled again on the next start;
 8. decode step time with NxDI's own async_mode off (ours) and on;
 9. with --draft-model: NxDI's fused speculation through our decode loop (a fused step's
    tokens a row; the draft's K/V of each prompt recomputed into its slot) gives the
    greedy tokens of check 5; its guesses kept and its step time. With --speculative-method
    eagle, --draft-model is an EAGLE head's checkpoint (NxDI's EAGLE flow, a Llama model).
Needs the Neuron packages (docs/neuron.md). Checks 6 and 7 compile three more times
(--skip-compiles leaves them out).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from decode_worker.decode_loop import DecodeLoop, Sequence
from disagg.engine.backends import load_backend
from disagg.engine.backends.base import StepInputs
from disagg.engine.backends.neuron import artifacts
from disagg.engine.backends.neuron.config import prefill_line
from disagg.engine.requests import Sampling, Stopping
from disagg.engine.sampler import params_tensor
from disagg.kv_transport.chunk_codec import KvKind
from disagg.rpc import startup
from disagg.tools.neuron_cores import CorePool, discover

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def print_state(backend) -> None:
    """Every layer's K and V on every rank, as the backend holds them (checked at start-up)."""
    for layer in range(backend.info.num_layers):
        for kind in KvKind:
            for rank, cache in enumerate(backend._caches(layer, kind)):
                print(f"  layer {layer} {kind.name} rank {rank}: {tuple(cache.shape)} {cache.dtype}")


def one_token_prompt_first_token(backend, model_path: str, token_id: int) -> bool:
    """A one-token prompt (finding 7): the backend pads it to its bucket with positions 0, so the
    position maximum ties and the device's max must pick the first index, the real token."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = int(model(torch.tensor([[token_id]])).logits[0, -1].argmax())
    got = backend.prefill([token_id], Sampling()).first_token
    print(f"   token {token_id}: neuron {got}, cpu {expected}")
    return got == expected


def write_prompt(backend, slot: int, layers) -> None:
    for layer, (keys, values) in enumerate(layers):
        backend.write_kv([slot], layer, KvKind.KEY, 0, keys)
        backend.write_kv([slot], layer, KvKind.VALUE, 0, values)


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


def generate(backend, ids: list[int], new_tokens: int):
    """Prefill then decode on one backend through our decode loop: tokens, TTFT, the loop's stats (step times,
    guesses proposed and kept)."""
    start = time.perf_counter()
    result = backend.prefill(ids, Sampling())
    ttft = time.perf_counter() - start
    write_prompt(backend, 0, result.layers)
    tokens, done = [result.first_token], threading.Event()
    decode_loop = DecodeLoop(backend, lambda events: [tokens.extend(e.token_ids) for e in events], lambda keys: done.set())
    decode_loop.start()
    # The prompt's ids: a speculating backend recomputes the draft's K/V from them (Backend.starts_every_sequence).
    decode_loop.admit(Sequence("v", 0, len(ids), result.first_token, Sampling(), Stopping(new_tokens, frozenset()), context_ids=tuple(ids)))
    done.wait(600)
    decode_loop.stop()
    return tokens, ttft, decode_loop.stats


LOAD = ("import sys; from disagg.engine.backends import load_backend; "
        "load_backend('neuron', model=sys.argv[1], max_seq_len=int(sys.argv[2]), batch_size=1,"
        " neuron={'tp_degree': int(sys.argv[3]), 'compiled_root': sys.argv[4]})")


def loader(args, root: str) -> subprocess.Popen:
    """A process loading (compiling first) the model at batch 1 into root, as a worker does."""
    return subprocess.Popen([sys.executable, "-c", LOAD, args.model, str(args.max_seq_len), str(args.tp_degree), root])


def compiled_once_for_two(args) -> bool:
    """Two processes ask for one new configuration at once: one compiles, the other waits and loads it."""
    root = tempfile.mkdtemp(prefix="disagg-compile-")
    procs = [loader(args, root) for _ in range(2)]
    codes = [p.wait() for p in procs]
    complete = [d for d in pathlib.Path(root).iterdir() if artifacts.is_complete(d)]
    print(f"   exit codes {codes}; compiled directories: {[d.name for d in pathlib.Path(root).iterdir()]}")
    return codes == [0, 0] and len(complete) == 1 and len(list(pathlib.Path(root).iterdir())) == 1


def killed_compile_is_redone(args) -> bool:
    """A compile killed once NxDI has written model.pt (it shards the weights after) leaves no
    directory a later start loads: the next start compiles again and loads."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="disagg-compile-"))
    proc = loader(args, str(root))
    while proc.poll() is None and not any((p / "model.pt").exists() for p in root.glob("*.partial")):
        time.sleep(0.5)
    proc.kill()
    proc.wait()
    interrupted = not any(artifacts.is_complete(d) for d in root.iterdir())
    again = loader(args, str(root)).wait()
    print(f"   killed with model.pt written: {'nothing complete left' if interrupted else 'the compile had finished first'}; next start exit {again}")
    return interrupted and again == 0 and any(artifacts.is_complete(d) for d in root.iterdir())


def reference_tokens(args, tokenizer) -> dict[str, list[int]]:
    """transformers' greedy generate() on the CPU, new_tokens per prompt (EOS not stopping)."""
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    out = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        generated = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        out[prompt] = generated[0, ids.shape[1]:].tolist()
    return out


def serves_on_split_cores(args, pool: CorePool, tokenizer, expected: dict[str, list[int]]) -> bool:
    """`disagg serve --backend neuron`'s launcher: a prefill and a decode worker, each on its own cores."""
    from disagg.clients.grpc_client import Client
    from disagg.tools.local_cluster import ClusterSpec, LocalCluster, NeuronPlacement
    from disagg.tools.neuron_cores import NotEnoughCores

    placement = NeuronPlacement(pool, prefill_tp=args.serve_tp, decode_tp=args.serve_tp)
    spec = ClusterSpec(model=args.model, batch_size=args.batch_size, neuron=placement, worker_args=["--max-seq-len", str(args.max_seq_len)])
    try:
        print(f"   cores: {spec.neuron_cores()}")
    except NotEnoughCores as exc:
        print(f"   {exc}")
        return False
    cluster = LocalCluster(spec, progress=lambda line: print(f"   {line}", flush=True))
    try:
        cluster.start(timeout=900)  # outside compiles: a compile is waited for as long as it makes progress
        with Client(cluster.router_address, timeout=300) as client:
            got = {prompt: client.complete(prompt, max_new_tokens=args.new_tokens, ignore_eos=True).token_ids for prompt in PROMPTS}
    finally:
        print(f"   stopped: {cluster.stop()}")
    for prompt in PROMPTS:
        print(f"   {'MATCH' if got[prompt] == expected[prompt] else 'DIFFER'}  {prompt!r}: {tokenizer.decode(got[prompt])!r}")
    return all(got[p] == expected[p] for p in PROMPTS)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local checkpoint directory, e.g. /models/Llama-3.2-1B")
    parser.add_argument("--tp-degree", type=int, default=2, help="tp of the in-process checks 2-8")
    parser.add_argument("--serve-tp", type=int, default=1, help="tp of each worker in check 1 (1 + 1 cores on a 2-core instance)")
    parser.add_argument("--neuron-cores", type=int, default=0, help="cores to split in check 1 (default: found on the instance)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-serve", action="store_true", help="skip check 1 (two more compiles)")
    parser.add_argument("--skip-compiles", action="store_true", help="skip checks 6 and 7 (three more compiles)")
    parser.add_argument("--draft-model", default="", help="check 9: a draft checkpoint of the model's architecture and tokenizer")
    parser.add_argument("--speculative-tokens", type=int, default=4, help="check 9: guesses a row (speculation_length - 1)")
    parser.add_argument("--speculative-method", choices=("draft", "eagle"), default="draft",
                        help="check 9: draft (a draft model) or eagle (an EAGLE head's checkpoint as --draft-model)")
    return parser.parse_args(argv)


def record(results: dict, name: str, ok: bool) -> None:
    results[name] = ok
    print(f"   -> {'PASSED' if ok else 'FAILED'}: {name}", flush=True)


def in_process_checks(args, tokenizer, expected, results: dict) -> None:
    """Checks 2-5 and 8 on backends loaded in this process, as a worker loads them."""
    options = dict(model=args.model, max_seq_len=args.max_seq_len, batch_size=args.batch_size)
    neuron = load_backend("neuron", **options, neuron={"tp_degree": args.tp_degree})
    neuron.allocate_slots(args.batch_size)
    print("2. device state:")
    print_state(neuron)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    print(f"3. KV round trip on slot 0 while slots 1..{args.batch_size - 1} decode:")
    record(results, "KV round trip while decoding", round_trip_while_decoding(neuron, ids))
    print(f"4. prefill into line {prefill_line(neuron.options)} touches no other line:")
    record(results, "prefill touches only its line", prefill_touches_only_its_line(neuron, ids))
    print("4b. a one-token prompt's first token equals transformers' on the CPU:")
    record(results, "one-token prompt", one_token_prompt_first_token(neuron, args.model, ids[0]))
    print("5. greedy tokens equal transformers' on the CPU (bf16 on both: a late divergence can be rounding):")
    ttfts, steps, matches = [], [], []
    for prompt in PROMPTS:
        got, ttft, stats = generate(neuron, tokenizer(prompt)["input_ids"], args.new_tokens)
        ttfts.append(ttft)
        steps += stats.step_seconds[2:]
        matches.append(got[: args.new_tokens] == expected[prompt])
        print(
            f"   {'MATCH' if matches[-1] else 'DIFFER'}  {prompt!r}\n     neuron: {tokenizer.decode(got)!r}"
            f"\n     cpu:    {tokenizer.decode(expected[prompt])!r}"
        )
    record(results, "greedy tokens (in process)", all(matches))
    print(f"   time to first token: median {statistics.median(ttfts) * 1000:.1f} ms; step: median {statistics.median(steps) * 1000:.2f} ms (NxDI async off)")
    with_async = load_backend("neuron", **options, neuron={"tp_degree": args.tp_degree, "nxdi_async_mode": True})
    with_async.allocate_slots(args.batch_size)
    _, _, async_stats = generate(with_async, ids, args.new_tokens)
    print(f"8. step median with NxDI's async_mode on: {statistics.median(async_stats.step_seconds[2:]) * 1000:.2f} ms (off: above)")


def speculation_check(args, tokenizer, expected, results: dict) -> None:
    """Check 9: the prompts of check 5 with NxDI's fused speculation, as the workers run it."""
    from disagg.engine.backends.neuron.config import speculation_options

    spec = speculation_options(getattr(args, "speculative_method", "draft"), args.speculative_tokens, args.draft_model)
    backend = load_backend("neuron", model=args.model, max_seq_len=args.max_seq_len, batch_size=args.batch_size,
                           neuron={"tp_degree": args.tp_degree, **spec})
    backend.allocate_slots(args.batch_size)
    matches, steps, proposed, kept = [], [], 0, 0
    for prompt in PROMPTS:
        got, _, stats = generate(backend, tokenizer(prompt)["input_ids"], args.new_tokens)
        matches.append(got[: args.new_tokens] == expected[prompt])
        steps += stats.step_seconds[2:]
        proposed, kept = proposed + stats.proposed_tokens, kept + stats.accepted_tokens
        print(f"   {'MATCH' if matches[-1] else 'DIFFER'}  {prompt!r}: {stats.steps} steps for {len(got) - 1} tokens")
    record(results, "greedy tokens with fused speculation", all(matches))
    print(f"   guesses kept: {kept} of {proposed}; fused step median {statistics.median(steps) * 1000:.2f} ms")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    startup.install(None)  # compile progress in the log, as a worker's
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    expected, results = reference_tokens(args, tokenizer), {}
    pool = discover(args.neuron_cores or None)
    print(f"0. NeuronCores: {len(pool.cores)} ({pool.source})")
    if not args.skip_serve:  # first: the workers need the cores this process takes below
        print("1. disagg serve --backend neuron:")
        record(results, "disagg serve on split cores", serves_on_split_cores(args, pool, tokenizer, expected))
    in_process_checks(args, tokenizer, expected, results)
    if args.draft_model:
        print(f"9. fused speculation ({args.speculative_method}) with {args.draft_model}:")
        speculation_check(args, tokenizer, expected, results)
    if not args.skip_compiles:
        print("6. two processes, one new configuration:")
        record(results, "compiled once for two processes", compiled_once_for_two(args))
        print("7. a compile killed after model.pt was written:")
        record(results, "killed compile redone", killed_compile_is_redone(args))
    print("\nsummary: " + "; ".join(f"{name}: {'PASSED' if ok else 'FAILED'}" for name, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

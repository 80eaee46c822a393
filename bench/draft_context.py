"""Where a draft model's K/V of a prompt comes from: recomputed on the decode worker (as served) or sent by the
prefill worker beside the target's, measured on the benchmark's trained pair (bench/speculation.py's TARGET and DRAFT).

For each prompt length, in one process:

- recompute: the draft taking in the prompt as DraftProposer does the first time a row guesses (pieces of
  CATCH_UP_ROWS), its median seconds, against the target's decode step of --batch rows at that context (the running
  streams' step it delays, once per sequence that guesses);
- send: the bytes the draft's K/V would add to that prompt's hand-off, against the target's K/V bytes of it (every
  request's hand-off, guessing or not), and the same draft prefill, run by the prefill worker instead.

    python bench/draft_context.py [--prompt-lens 64,256,1024] [--batch 8] [--repeats 20] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(__file__))

from speculation import DRAFT, TARGET, cpu_model  # noqa: E402

from disagg.engine.backends import StepInputs  # noqa: E402
from disagg.engine.backends.torch_backend import TorchBackend, TorchBackendConfig  # noqa: E402
from disagg.engine.speculation import SpeculationConfig  # noqa: E402
from disagg.engine.speculation.draft import DraftProposer  # noqa: E402
from disagg.engine.speculation.rows import RowSpeculation  # noqa: E402
from disagg.tools.tinymodel import ensure_tiny_model  # noqa: E402


def draft_catch_up_seconds(draft: TorchBackend, prompt: list[int], repeats: int) -> float:
    """Median seconds of a fresh row's first proposal of one guess: the draft takes in the whole prompt."""
    proposer, times = DraftProposer(draft), []
    for _ in range(repeats + 2):
        row = RowSpeculation(SpeculationConfig("draft", 4), 0, tuple(prompt[:-1]), prompt[-1])
        started = time.perf_counter()
        proposer.propose([(row, 1)])
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def target_step_seconds(target: TorchBackend, batch: int, context: int, repeats: int) -> float:
    inputs = StepInputs(
        slots=torch.arange(batch), positions=torch.full((batch,), context - 1), input_ids=torch.randint(0, target.info.vocab_size, (batch,)),
        params=torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]] * batch), greedy=True, seeds=torch.zeros(batch, dtype=torch.long),
        steps=torch.zeros(batch, dtype=torch.long), kv_len=context, contiguous_from=0, min_position=context - 1,
    )
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        target.decode_step(inputs).token_ids.tolist()
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", default="64,256,1024")
    parser.add_argument("--batch", type=int, default=8, help="the target's decode step the catch-up is compared with")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    lengths = [int(n) for n in args.prompt_lens.split(",")]
    max_seq_len = max(lengths) * 2
    target = TorchBackend(TorchBackendConfig(model=str(ensure_tiny_model(TARGET)), dtype=args.dtype, max_seq_len=max_seq_len))
    draft = TorchBackend(TorchBackendConfig(model=str(ensure_tiny_model(DRAFT)), dtype=args.dtype, max_seq_len=max_seq_len))
    target.allocate_slots(args.batch)
    draft.allocate_slots(1)
    target_bytes, draft_bytes = (backend.info.kv_bytes_per_token(backend.dtype.itemsize) for backend in (target, draft))
    print(f"host: {cpu_model()}; {args.dtype}; K/V a token: target {target_bytes} B, draft {draft_bytes} B "
          f"(sending the draft's adds {draft_bytes / target_bytes:.1%} to every hand-off)")
    results = []
    for length in lengths:
        prompt = torch.randint(0, draft.info.vocab_size, (length,)).tolist()
        catch_up = draft_catch_up_seconds(draft, prompt, args.repeats)
        step = target_step_seconds(target, args.batch, length, args.repeats)
        results.append(dict(prompt_len=length, draft_catch_up_ms=catch_up * 1e3, target_step_ms=step * 1e3, draft_kv_bytes=draft_bytes * length,
                            target_kv_bytes=target_bytes * length))
        print(f"prompt {length:5d}: the draft takes it in in {catch_up * 1e3:6.2f} ms = {catch_up / step:.2f} of a {args.batch}-row target step "
              f"({step * 1e3:.2f} ms); sending instead: +{draft_bytes * length / 1024:.0f} KiB to its {target_bytes * length / 1024:.0f} KiB hand-off")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"host": cpu_model(), "dtype": args.dtype, "batch": args.batch, "results": results}, out, indent=1)


if __name__ == "__main__":
    main()

"""What the EAGLE head loses by starting its context at the first decode step (the prompt's hidden
states stay on the prefill worker) against reading the prompt's too, on the same greedy outputs.

For each prompt (the first words of a paragraph of the model's training text), the model's greedy
continuation; then at each decode position, the head's chain of --guesses greedy guesses from its
context there, and how many of them the model's own tokens keep. Two contexts: `decode` (pairs from
the first decode step's position on, as served) and `prompt` (pairs from position 0). Reports the
mean accepted guesses per step of each, in process (no service):

    python bench/eagle_context.py [--model DIR --head DIR] [--guesses 4] [--prompts 12]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())

from disagg.engine.speculation.eagle import load_eagle_head  # noqa: E402
from disagg.tools.tinymodel import paragraphs  # noqa: E402


@torch.inference_mode()
def accepted_per_step(model, head, ids: list[int], prompt_len: int, first_pair: int, guesses: int) -> list[int]:
    """At each position P from prompt_len on (the newest token t_P): how many of the head's guesses, chained from
    pairs first_pair .. P-1, equal the model's tokens t_{P+1} ..."""
    tokens = torch.tensor([ids])
    hidden = model.model(input_ids=tokens).last_hidden_state[0]
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    kept = []
    for newest in range(prompt_len + 1, len(ids) - guesses):
        pairs = torch.cat([embed(tokens[0, first_pair + 1 : newest + 1]), hidden[first_pair:newest]], dim=-1)
        chain = []
        for _ in range(guesses):
            out = head.sequence(pairs[None])[0, -1]
            guess = int(lm_head(out).argmax())
            chain.append(guess)
            pairs = torch.cat([pairs, torch.cat([embed(torch.tensor([guess])), out[None]], dim=-1)])
        truth = ids[newest + 1 : newest + 1 + guesses]
        count = 0
        while count < guesses and chain[count] == truth[count]:
            count += 1
        kept.append(count)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: bench/speculation.py's TARGET")
    parser.add_argument("--head", default=None, help="default: its EAGLE head (trained on first use)")
    parser.add_argument("--guesses", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model is None:
        sys.path.insert(0, os.path.dirname(__file__))
        from speculation import EAGLE_STEPS, TARGET

        from disagg.tools.tiny_eagle import ensure_eagle_head
        from disagg.tools.tinymodel import ensure_tiny_model

        args.model = str(ensure_tiny_model(TARGET))
        args.head = args.head or str(ensure_eagle_head(args.model, EAGLE_STEPS))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    head = load_eagle_head(args.head)
    results = {"decode": [], "prompt": []}
    for text in paragraphs()[: args.prompts]:
        prompt = tokenizer(" ".join(text.split()[:8]))["input_ids"]
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=args.output_len, do_sample=False, min_new_tokens=args.output_len)[0].tolist()
        results["decode"] += accepted_per_step(model, head, ids, len(prompt), len(prompt), args.guesses)
        results["prompt"] += accepted_per_step(model, head, ids, len(prompt), 0, args.guesses)
    summary = {name: round(sum(kept) / len(kept), 3) for name, kept in results.items()}
    print(json.dumps({"model": args.model, "head": args.head, "guesses": args.guesses, "steps": len(results["decode"]),
                      "mean_accepted_guesses": summary}, indent=1))


if __name__ == "__main__":
    main()

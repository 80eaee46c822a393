"""Greedy tokens of a llama-server (bench/peers/llama_cpp.sh serve) against transformers.

    .venv/bin/python bench/peers/llama_cpp_check.py MODEL_DIR PORT [--exact | --no-exact]

Sends a few prompts as token ids to llama-server's /completion (greedy,
`cache_prompt` off, EOS never sampled) and runs transformers' `generate()` on
the checkpoint in float32, greedy, with the same EOS rule (no stop on EOS, its
logit suppressed, as llama.cpp's `ignore_eos` does). For an f32 GGUF the tokens
should match: a mismatch exits 1, unless at the first token where they part
transformers' own logits for the two tokens are within TIE of each other (an
untrained benchmark checkpoint has such near ties, where any other order of
float32 sums may choose either; the tokens after it are not compared). For a quantized GGUF (q8_0, bf16) it prints
how many leading tokens agree and asserts nothing. --exact / --no-exact
override the choice, which is otherwise made from the served file's type.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

PROMPTS = [
    "The river runs through the old town",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4, 5,",
]


# A near tie: the two tokens' logits apart by at most this fraction of the largest logit's magnitude (float32
# sums in another order move a logit by about 1e-6 of it).
TIE = 1e-4


def near_tie(model, ids: list[int], ours: int, theirs: int) -> tuple[bool, float, float]:
    """Whether transformers' logits after `ids` have the two tokens within TIE; with both logits."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    a, b = float(logits[ours]), float(logits[theirs])
    return abs(a - b) <= TIE * float(logits.abs().max()), a, b


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("port", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--n-predict", type=int, default=16)
    exact = parser.add_mutually_exclusive_group()
    exact.add_argument("--exact", dest="exact", action="store_true", default=None, help="assert equal tokens")
    exact.add_argument("--no-exact", dest="exact", action="store_false", help="only print the agreement")
    args = parser.parse_args()
    base = f"http://{args.host}:{args.port}"

    props = get(f"{base}/props")
    ftype = str(props.get("model_ftype", ""))
    if args.exact is None:
        args.exact = ftype.lower() == "all f32"
    print(f"server: {props.get('model_path')} ({ftype or 'type unknown'}); "
          f"{'asserting equal tokens' if args.exact else 'agreement only'}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)

    failures = 0
    for i, text in enumerate(PROMPTS):
        prompt = tokenizer(text)["input_ids"]
        reply = post(f"{base}/completion", {
            "prompt": prompt, "n_predict": args.n_predict, "temperature": 0, "cache_prompt": False,
            "ignore_eos": True, "return_tokens": True,
        })
        theirs = [int(t) for t in reply["tokens"]]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=args.n_predict, min_new_tokens=args.n_predict, do_sample=False,
                eos_token_id=None, pad_token_id=pad, suppress_tokens=eos_ids or None,
            )
        ours = out[0, len(prompt):].tolist()
        agree = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        same = ours == theirs
        verdict = "match" if same else f"mismatch (first {agree} of {len(ours)} agree)"
        if not same and agree < min(len(ours), len(theirs)):
            tie, a, b = near_tie(model, prompt + ours[:agree], ours[agree], theirs[agree])
            if tie:
                same, verdict = True, f"match to token {agree}, a near tie there (logits {a:.6f} and {b:.6f}); not compared after it"
        failures += not same
        print(f"prompt {i} ({len(prompt)} tokens): {verdict}")
        if ours != theirs:
            print(f"  transformers: {ours}\n  llama-server: {theirs}")
    print(f"{len(PROMPTS) - failures}/{len(PROMPTS)} prompts match")
    return 1 if args.exact and failures else 0


if __name__ == "__main__":
    sys.exit(main())

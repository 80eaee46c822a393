"""Trains an EAGLE v1 head for a (tiny) checkpoint on the local text, as the tiny models are trained, and
saves it under the names of NxDI's EAGLE draft: a Llama config of the model's width and the head's `fc` and
`layers.*` (disagg/engine/speculation/eagle.py); the embeddings and LM head stay the model's (NxDI's own
draft would also want them in the checkpoint: docs/neuron.md#speculation).

The head learns EAGLE's two losses over the model's own features: its output at position q regresses
the model's hidden state at q + 1 (smooth L1), and through the model's LM head predicts the token at
q + 2 (cross-entropy, weight 0.1).

    python -m disagg.tools.tiny_eagle MODEL_DIR OUT_DIR [--steps N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import random

_VERSION = 1  # bump when the recipe changes, so cached heads are remade


def _token_stream(tokenizer) -> list[int]:
    from .tinymodel import paragraphs

    stream: list[int] = []
    for text in paragraphs():
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    return stream


def head_config(target_config, layers: int = 1):
    """A Llama config of the model's width, vocabulary and rotary settings: the head's."""
    from transformers import LlamaConfig

    heads = target_config.num_attention_heads
    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size, intermediate_size=target_config.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=getattr(target_config, "num_key_value_heads", heads),
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        max_position_embeddings=target_config.max_position_embeddings, rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_theta=getattr(target_config, "rope_theta", 10000.0), tie_word_embeddings=False,
    )


def make_eagle_head(model_dir: str, out_dir: str | pathlib.Path, steps: int = 400, seed: int = 0, learning_rate: float = 3e-3) -> pathlib.Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from disagg.engine.speculation.eagle import EagleHead

    out = pathlib.Path(out_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = head_config(target.config)
    data = torch.tensor(_token_stream(tokenizer))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = EagleHead(config)
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        rng = random.Random(seed)
        optimizer = torch.optim.AdamW(head.parameters(), lr=learning_rate, weight_decay=0.0)
        window, batch = 64, 16
        for _ in range(steps):
            starts = [rng.randrange(0, len(data) - window) for _ in range(batch)]
            ids = torch.stack([data[s : s + window] for s in starts])
            with torch.no_grad():
                hidden = target.model(input_ids=ids).last_hidden_state  # after the final norm: what the LM head reads
                embedded = embed(ids)
            # Pair q: (embedding of t_{q+1}, h_q), q = 0 .. window-2; its output stands for h_{q+1} and predicts t_{q+2}.
            out_q = head.sequence(torch.cat([embedded[:, 1:], hidden[:, :-1]], dim=-1))
            regression = torch.nn.functional.smooth_l1_loss(out_q, hidden[:, 1:])
            logits = lm_head(out_q[:, :-1])
            classification = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 2:].reshape(-1))
            loss = regression + 0.1 * classification
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    config_dict = config.to_dict()
    config_dict["architectures"] = ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(config_dict, indent=2))
    save_file({name: tensor.detach().contiguous() for name, tensor in head.state_dict().items()}, str(tmp / "model.safetensors"))
    tmp.rename(out)
    return out


def eagle_head_path(model_dir: str, steps: int = 400, root: pathlib.Path | None = None) -> pathlib.Path:
    """Where the head for model_dir (a cached tiny checkpoint: its name holds its recipe's key) is cached."""
    from disagg.engine.cache_dir import cache_dir

    key = hashlib.sha256(json.dumps({"model": pathlib.Path(model_dir).name, "steps": steps, "v": _VERSION}).encode()).hexdigest()[:12]
    return (root or cache_dir() / "models") / f"eagle-{pathlib.Path(model_dir).name}-{key}"


def ensure_eagle_head(model_dir: str, steps: int = 400, root: pathlib.Path | None = None) -> pathlib.Path:
    """The cached head for model_dir, trained on first use (once, where processes ask at once)."""
    from .tinymodel import made_once

    return made_once(eagle_head_path(model_dir, steps, root), lambda path: make_eagle_head(model_dir, path, steps))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    print(make_eagle_head(args.model_dir, args.out_dir, args.steps))


if __name__ == "__main__":
    main()

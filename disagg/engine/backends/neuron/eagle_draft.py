"""NxDI's EAGLE draft checkpoint, written from ours (`--speculative-method eagle` on the neuron backend).

NxDI builds the EAGLE draft as the target's model class with `is_eagle_draft` (only Llama's has one: its
`fc` over the token's embedding and the target's hidden state, layers without an input norm unless
`enable_eagle_draft_input_norm`, no final norm) and loads its weights from `draft_model_path` like any
checkpoint (`application_base.get_state_dict`): `fc`, the layers, and the draft's own `embed_tokens` and
`lm_head`. The EAGLE checkpoints the torch backend serves (speculation/eagle.py) hold `fc` and the layers,
the embeddings and LM head being the target's. So the directory NxDI reads is written once per pair of
checkpoints, under the compiled root: the head's config (with `fc_bias` where the head has `fc.bias`) and
its tensors, beside the target's `embed_tokens` and `lm_head` (its embeddings where they are tied), in a
`model.safetensors` (what NxDI's `load_state_dict` looks for in a directory).
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

from disagg.engine.cache_dir import exclusive
from disagg.rpc import startup

from . import artifacts
from .config import NeuronOptions, compiled_root

log = logging.getLogger(__name__)

EAGLE_ARCHITECTURE = "LlamaForCausalLM"  # the one NxDI model class whose model has an is_eagle_draft form


def draft_directory(options: NeuronOptions) -> pathlib.Path:
    """Where the NxDI draft of options.draft_model (the EAGLE head) for options.model is written: keyed by both
    checkpoints' files."""
    key = artifacts.digest({"eagle": artifacts.checkpoint_fingerprint(options.draft_model), "target": artifacts.checkpoint_fingerprint(options.model)})
    name = pathlib.Path(options.draft_model.rstrip("/")).name or "eagle"
    return compiled_root(options) / "eagle-drafts" / f"{name}-{key}"


def check_eagle_target(options: NeuronOptions):
    """The EAGLE head (speculation/eagle.py's EagleHead); a target NxDI has no EAGLE draft for, or a head that does not
    fit it, is refused in one line (ValueError)."""
    from transformers import AutoConfig

    from disagg.engine.speculation.eagle import check_eagle_matches, load_eagle_head

    architecture = (AutoConfig.from_pretrained(options.model).architectures or ["?"])[0]
    if architecture != EAGLE_ARCHITECTURE:
        raise ValueError(f"--speculative-method eagle on the neuron backend: NxDI builds an EAGLE draft for {EAGLE_ARCHITECTURE} "
                         f"models only (NeuronLlamaModel with is_eagle_draft), not {architecture}; use --speculative-method draft")
    check_eagle_matches(options.model, options.draft_model)
    return load_eagle_head(options.draft_model)  # every tensor by name and shape


def ensure_draft_directory(options: NeuronOptions) -> pathlib.Path:
    """The NxDI draft directory for options (written under a lock, renamed into place when complete)."""
    path = draft_directory(options)
    if artifacts.is_complete(path):
        return path
    waiting = f"waiting for another process writing the EAGLE draft {path}"
    with exclusive(path, on_wait=lambda: startup.report(startup.Phase.WAITING_FOR_COMPILE, waiting)):
        if artifacts.is_complete(path):
            return path
        partial = artifacts.partial_path(path)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        write_draft(options.model, options.draft_model, partial)
        artifacts.install_complete(partial, path, {"eagle": options.draft_model, "target": options.model})
        log.info("wrote NxDI's EAGLE draft of %s (with %s's embeddings and LM head) into %s", options.draft_model, options.model, path)
    return path


def write_draft(target: str, eagle: str, out: pathlib.Path) -> None:
    """config.json and model.safetensors of NxDI's EAGLE draft: the head's tensors and the target's embeddings and head,
    under a Llama checkpoint's names ("model." but for lm_head; NxDI's get_state_dict drops the prefix), so that
    transformers loads it as a Llama model too (fc aside), as NxDI's quantizer does (load_hf_model)."""
    from safetensors.torch import save_file

    from disagg.engine.speculation.eagle import read_eagle_config

    tensors = {f"model.{name}": t for name, t in head_tensors(eagle).items()}
    embed, lm_head = target_embeddings(target)
    tensors["model.embed_tokens.weight"], tensors["lm_head.weight"] = embed, lm_head
    save_file({name: t.to(embed.dtype).contiguous() for name, t in tensors.items()}, str(out / "model.safetensors"))
    config = read_eagle_config(eagle).to_dict()
    config.update(architectures=[EAGLE_ARCHITECTURE], model_type="llama", tie_word_embeddings=False, fc_bias="model.fc.bias" in tensors)
    (out / "config.json").write_text(json.dumps(config, indent=1))


def head_tensors(eagle: str) -> dict:
    """The EAGLE head's own tensors (fc and the layers), by their names in the head's checkpoint."""
    from disagg.engine.speculation.eagle import load_eagle_head

    return {name: t.detach().contiguous() for name, t in load_eagle_head(eagle).state_dict().items()}


FC_SHARD = "model-eagle-fc.safetensors"  # where fc goes beside a sharded quantized state dict (its index names it)


def add_fc(options: NeuronOptions, quantized: pathlib.Path) -> None:
    """NxDI's quantizer makes the EAGLE draft's quantized state dict from the draft directory loaded as a Llama model,
    which has no fc; NxD's conversion leaves the draft's fc in full precision (it is not one of the linears it
    converts), so fc goes into that state dict as it is: in float32, as the quantizer leaves the model's other
    full-precision tensors (NxDI casts them to the compile's dtype), into model.safetensors, or where the quantizer
    sharded it (save_state_dict_safetensors: over 10 GB), into a file of its own that the shards' index names."""
    from safetensors.torch import load_file, save_file

    fc = {name: t.float() for name, t in head_tensors(options.draft_model).items() if name.startswith("fc.")}
    single = quantized / "model.safetensors"
    if single.is_file():
        save_file({**load_file(str(single)), **fc}, str(single))
        return
    index_path = quantized / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    save_file(fc, str(quantized / FC_SHARD))
    index["weight_map"].update(dict.fromkeys(fc, FC_SHARD))
    index_path.write_text(json.dumps(index, indent=2))


def target_embeddings(target: str):
    """The target checkpoint's (embed_tokens, lm_head) weights; lm_head is the embeddings where they are tied."""
    from safetensors import safe_open
    from transformers import AutoConfig

    found = {}
    for file in sorted(pathlib.Path(target).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():
                short = name.removeprefix("model.")
                if short in ("embed_tokens.weight", "lm_head.weight"):
                    found[short] = weights.get_tensor(name)
    if "embed_tokens.weight" not in found:
        raise ValueError(f"--speculative-method eagle on the neuron backend: no embed_tokens weight in {target}'s *.safetensors")
    if getattr(AutoConfig.from_pretrained(target), "tie_word_embeddings", False):
        found["lm_head.weight"] = found["embed_tokens.weight"].clone()  # its own tensor: safetensors refuses shared ones
    elif "lm_head.weight" not in found:
        raise ValueError(f"--speculative-method eagle on the neuron backend: no lm_head weight in {target}'s *.safetensors")
    return found["embed_tokens.weight"], found["lm_head.weight"]

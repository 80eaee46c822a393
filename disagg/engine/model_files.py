"""Facts read from a checkpoint's files without loading weights (no torch needed)."""

from __future__ import annotations


def eos_token_ids(model_path: str, config=None) -> tuple[int, ...]:
    """The checkpoint's EOS ids: generation_config.json first, then config.json."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        config = config or AutoConfig.from_pretrained(model_path)
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def vocab_size(model_path: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.vocab_size)

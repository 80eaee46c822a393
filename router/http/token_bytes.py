"""A token's exact bytes, for the `bytes` of OpenAI's chat logprobs.

A token decoded alone can be part of a UTF-8 character (byte-level BPE splits
"ã" into two tokens), so its text holds U+FFFD; OpenAI's `bytes` exist so a
client can join tokens back into the exact text. Byte-level BPE vocabularies
(GPT-2, Llama 3, Qwen, the tiny models) spell each byte as one printable
character; SentencePiece byte fallback spells a byte as `<0xE3>`.
"""

from __future__ import annotations

import functools
import re

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character each byte is spelled with -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenBytes:
    """token id -> its bytes, cached per id."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 (one instance per router, for its lifetime)
    def __call__(self, token_id: int) -> list[int]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_level:
            alphabet = byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return [alphabet[c] for c in piece]
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return [int(match.group(1), 16)]
        return list(self._tokenizer.decode([token_id]).encode("utf-8"))

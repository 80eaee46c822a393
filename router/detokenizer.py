"""Incremental detokenization and stop sequences, both per request.

Text is released only when it is final: a multi-byte character split across
tokens is held until complete, and text that could be the start of a stop
sequence is held until it is known not to be one.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6  # prompt tokens kept as context so word boundaries decode right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int]):
        self._tokenizer = tokenizer
        self._tokens = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._tokens[start:end], skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """The text that the new tokens complete (possibly empty)."""
        self._tokens.extend(token_ids)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset)
        if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back, incomplete characters included."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._tokens)
        return text[len(prefix) :]


class StopSequenceMatcher:
    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._held = ""

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to send, the stop sequence matched or None). After a match, stop feeding."""
        if not self._stops:
            return text, None
        buffer = self._held + text
        hits = [(buffer.find(stop), stop) for stop in self._stops if stop in buffer]
        if hits:
            index, stop = min(hits)
            self._held = ""
            return buffer[:index], stop
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest

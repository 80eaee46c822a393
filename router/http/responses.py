"""OpenAI's response bodies, built from the router's chunks.

Completions: `text_completion` objects (streamed chunks too), logprobs as
`{tokens, token_logprobs, top_logprobs, text_offset}`. Chat: `chat.completion`
and `chat.completion.chunk` objects, logprobs as `{content: [{token, logprob,
bytes, top_logprobs}]}`. finish_reason is "length" for a length limit and
"stop" for EOS, a stop token or a stop string, as OpenAI and vLLM report them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.engine.requests import FinishReason

from .streams import Tagged

FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.STOP_SEQUENCE: "stop"}


def finish_reason(finish: FinishReason) -> str | None:
    return FINISH.get(finish)


@dataclass
class Envelope:
    """What every object of one response shares."""

    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, streamed: bool) -> dict:
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


# Token id -> its text as logprobs show it (decoded alone): Router.token_text.
TokenText = Callable[[int], str]


def completion_logprobs(entries, text_of: TokenText, offset: int) -> dict:
    """OpenAI's completions logprobs for some tokens; text_offset counts from `offset`."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        text = text_of(entry.token_id)
        tokens.append(text)
        logprobs.append(entry.logprob)
        top = {text_of(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)  # OpenAI: the sampled token is always there
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries, text_of: TokenText, bytes_of: Callable[[int], list[int]]) -> dict:
    def entry_of(token_id: int, logprob: float) -> dict:
        return {"token": text_of(token_id), "logprob": logprob, "bytes": bytes_of(token_id)}

    content = []
    for entry in entries:
        item = entry_of(entry.token_id, entry.logprob)
        item["top_logprobs"] = [entry_of(t, lp) for t, lp in entry.top]
        content.append(item)
    return {"content": content}


@dataclass
class Choice:
    """One choice, gathered for a response that is not streamed."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: FinishReason = FinishReason.NONE
    prompt_tokens: int = 0
    completion_tokens: int = 0


def gather(choices: dict[int, Choice], tagged: Tagged) -> None:
    choice = choices.setdefault(tagged.index, Choice())
    chunk = tagged.chunk
    choice.text += chunk.text
    choice.token_ids += chunk.token_ids
    choice.logprobs += chunk.logprobs or []
    if chunk.finish:
        choice.finish, choice.prompt_tokens, choice.completion_tokens = chunk.finish, chunk.prompt_tokens, chunk.completion_tokens


def total_usage(choices: dict[int, Choice], n: int) -> dict:
    """The prompt counts once per prompt (n choices share it), completions add up."""
    prompts = sum(c.prompt_tokens for i, c in choices.items() if i % n == 0)
    return usage(prompts, sum(c.completion_tokens for c in choices.values()))

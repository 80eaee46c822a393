"""The three prompt forms -> token ids: text, token ids, and chat messages.

Chat messages are rendered with the tokenizer's own chat template, as
transformers' apply_chat_template(add_generation_prompt=True) renders them,
then tokenized without adding special tokens (the template writes its own),
which is what apply_chat_template(tokenize=True) does too.
"""

from __future__ import annotations

import json

import jinja2

from disagg.rpc.server import RequestError

from .params import GenerateParams


def render_chat(tokenizer, messages: tuple[tuple, ...], tools: str | None = None) -> str:
    """messages: (role, content[, extras JSON]); tools: OpenAI's tools as JSON text, given to the template as `tools`."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("messages cannot be used: the model's tokenizer has no chat template; send prompt or prompt_token_ids", field="messages")
    conversation = [{"role": m[0], "content": m[1], **(json.loads(m[2]) if len(m) > 2 and m[2] else {})} for m in messages]
    extra = {"tools": json.loads(tools)} if tools else {}
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **extra)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:  # the template's own refusal (raise_exception in templates)
        raise RequestError(f"messages rejected by the chat template: {exc}", field="messages") from exc


def prompt_ids(tokenizer, params: GenerateParams) -> list[int]:
    """The prompt's token ids (runs the tokenizer: call it off the event loop)."""
    if params.prompt_token_ids is not None:
        return list(params.prompt_token_ids)
    if params.messages is not None:
        return tokenizer(render_chat(tokenizer, params.messages, params.chat_tools), add_special_tokens=False)["input_ids"]
    return tokenizer(params.prompt)["input_ids"]

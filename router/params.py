"""GenerateParams: one generation request as the router's edges hand it in.

Both public edges (the gRPC servicer and the OpenAI HTTP front) convert their
wire types to this one plain-Python type, so validation (validation.py) is
written once and names the refused field the same way for both. The field
names of a refusal are the gRPC API's dotted names ("sampling.temperature",
"stopping.max_new_tokens", "prompt"); the HTTP edge maps them to OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.engine.constraints import Constraint

# The gRPC field name of each GenerateParams field, as RequestError.field names it.
FIELD_NAMES = {
    "request_id": "request_id",
    "prompt": "prompt",
    "prompt_token_ids": "prompt_token_ids",
    "messages": "messages",
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "repetition_penalty": "sampling.repetition_penalty",
    "max_new_tokens": "stopping.max_new_tokens",
    "stop": "stopping.stop",
    "stop_token_ids": "stopping.stop_token_ids",
    "ignore_eos": "stopping.ignore_eos",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
    "n": "n",
    **{f"constraint.{name}": f"constraint.{name}" for name in ("json_object", "json_schema", "regex", "choice", "grammar")},
    "constraint": "constraint",
}


@dataclass(frozen=True)
class GenerateParams:
    """Every public request field, unvalidated. None means "not given" where that
    differs from a value (the server's default, or the feature off)."""

    request_id: str = ""  # empty: the server makes one
    # The prompt: exactly one of these three.
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    # (role, content) or (role, content, extras): rendered with the chat template; extras is the JSON text of what a
    # message holds beyond them (an assistant's tool_calls, a tool result's tool_call_id), from the HTTP edge.
    messages: tuple[tuple[str, str] | tuple[str, str, str], ...] | None = None
    chat_tools: str | None = None  # the JSON text of OpenAI's tools, which the chat template shows the model
    # Sampling (OpenAI's names and meanings; top_k and min_p as vLLM's extensions).
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0: off
    top_p: float | None = None  # None: off (1.0)
    min_p: float = 0.0  # 0: off
    seed: int | None = None  # None: a random seed
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: off (1.0)
    # Stopping.
    max_new_tokens: int | None = None  # None: the server's default
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Output.
    logprobs: bool = False  # the sampled token's log-probability with every token
    top_logprobs: int = 0  # that many most likely alternatives too (needs logprobs)
    n: int = 1  # choices generated for this one request
    # Structured output: the grammar the generated text must follow (disagg/engine/constraints).
    constraint: Constraint | None = None

"""OpenAI request bodies -> GenerateParams, and refused fields back to OpenAI's names.

The conversion only renames: every rule about the values lives in
router/validation.py, shared with the gRPC edge. A refusal names the gRPC
field (RequestError.field, e.g. "stopping.max_new_tokens"); `openai_param`
turns it into the parameter the HTTP caller sent (`max_tokens`).
"""

from __future__ import annotations

import json

from disagg.engine.constraints import Constraint, ConstraintKind
from disagg.engine.constraints.spec import choice, json_schema
from disagg.rpc.server import RequestError
from router.params import GenerateParams

from .schema import ChatCompletionRequest, CommonRequest, CompletionRequest
from .tools import tool_constraint

# gRPC field -> OpenAI parameter, where the names differ beyond the prefix.
_RENAMED = {
    "prompt_token_ids": "prompt",
    "stopping.max_new_tokens": "max_tokens",
}


def openai_param(field: str | None, request: CommonRequest) -> str | None:
    """The OpenAI parameter a refusal of the gRPC `field` is about."""
    if field is None:
        return None
    if field.startswith("constraint"):
        return constraint_param(request)
    name = _RENAMED.get(field) or field.split(".", 1)[-1]
    if isinstance(request, ChatCompletionRequest):
        if name == "prompt":
            return "messages"
        if name == "max_tokens" and request.max_completion_tokens is not None:
            return "max_completion_tokens"
    elif name == "top_logprobs":
        return "logprobs"  # completions name the number of alternatives `logprobs`
    return name


def constraint_param(request: CommonRequest) -> str | None:
    """The parameter a request's constraint came from."""
    if request.response_format is not None and request.response_format.type != "text":
        return "response_format"
    if request.structured_outputs is not None:
        given = [name for name, value in request.structured_outputs.model_dump(by_alias=True).items() if value is not None]
        return f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return "tools" if isinstance(request, ChatCompletionRequest) and request.tools else None


def request_constraint(request: CommonRequest) -> Constraint | None:
    """The one constraint response_format, structured_outputs or a forced tool_choice asks for."""
    made = {}
    if request.response_format is not None and request.response_format.type != "text":
        made["response_format"] = _response_format(request.response_format)
    if request.structured_outputs is not None:
        made["structured_outputs"] = _structured_outputs(request.structured_outputs)
    if isinstance(request, ChatCompletionRequest):
        tools = made_tools(request)
        if request.tool_choice is not None and not request.tools and request.tool_choice != "none":
            raise RequestError("tool_choice needs tools", field="tool_choice")
        choice_of = request.tool_choice if isinstance(request.tool_choice, (str, type(None))) else request.tool_choice.model_dump()
        forced = tool_constraint(tools, choice_of, request.parallel_tool_calls) if tools else None
        if forced is not None:
            made["tool_choice"] = forced
    if len(made) > 1:
        raise RequestError(f"{' and '.join(made)} each constrain the output: give one of them", field=next(iter(made)))
    return next(iter(made.values()), None)


def _response_format(fmt) -> Constraint:
    if fmt.type == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if fmt.json_schema is None:
        raise RequestError("response_format of type json_schema needs json_schema", field="response_format")
    if fmt.json_schema.json_schema is None:
        return Constraint(ConstraintKind.JSON_OBJECT)
    return json_schema(fmt.json_schema.json_schema)


def _structured_outputs(so) -> Constraint:
    given = {name: value for name, value in so.model_dump(by_alias=True).items() if value is not None}
    if len(given) != 1:
        raise RequestError(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got {sorted(given) or 'none'}",
                           field="structured_outputs")
    name, value = next(iter(given.items()))
    if name == "json":
        return json_schema(value)
    if name == "json_object":
        if not value:
            raise RequestError("structured_outputs.json_object must be true when given", field="structured_outputs")
        return Constraint(ConstraintKind.JSON_OBJECT)
    if name == "choice":
        return choice(value)
    return Constraint(ConstraintKind.REGEX if name == "regex" else ConstraintKind.GRAMMAR, value)


def made_tools(request: ChatCompletionRequest) -> list[dict]:
    return [tool.model_dump(exclude_none=True) for tool in request.tools or ()]


def _common(request: CommonRequest) -> dict:
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    top_k = request.top_k or 0
    return dict(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=0 if top_k == -1 else top_k,  # vLLM's "off"
        min_p=request.min_p or 0.0,
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=request.repetition_penalty,
        stop=tuple(stop),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        n=request.n,
        constraint=request_constraint(request),
    )


# Prompts in one completions request: each is a generation (n of them) at once,
# so a batch is bounded like the choices of one prompt are, times the queue's room.
MAX_BATCH_PROMPTS = 256


def split_prompts(prompt) -> list[str | list[int]]:
    """OpenAI's prompt forms -> one entry per completion: a string or token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise RequestError(f"prompt is a batch of {len(prompt)} prompts; at most {MAX_BATCH_PROMPTS} are allowed", field="prompt")
    return list(prompt)  # a list of strings or of token-id lists (or an empty list)


def echo_text(tokenizer, prompt: str | list[int]) -> str:
    """The prompt as `echo` returns it: a string as sent, token ids decoded."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=True)


def completion_params(request: CompletionRequest, request_id: str) -> list[GenerateParams]:
    common = _common(request)
    logprobs = request.logprobs is not None
    prompts = split_prompts(request.prompt) or [""]  # [] reaches validation as an empty prompt
    return [
        GenerateParams(
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=None if isinstance(prompt, str) else tuple(prompt),
            max_new_tokens=request.max_tokens,
            logprobs=logprobs,
            top_logprobs=request.logprobs if logprobs else 0,
            **common,
        )
        for i, prompt in enumerate(prompts)
    ]


def chat_params(request: ChatCompletionRequest, request_id: str) -> GenerateParams:
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    return GenerateParams(
        request_id=request_id,
        messages=tuple(_message(m) for m in request.messages),
        chat_tools=json.dumps(made_tools(request)) if request.tools else None,
        max_new_tokens=max_tokens,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs or 0,
        **_common(request),
    )


def _message(m) -> tuple:
    extras = m.template_extras()
    return (m.role, m.text()) if extras is None else (m.role, m.text(), json.dumps(extras))

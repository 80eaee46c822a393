"""OpenAI's request bodies as pydantic models: the HTTP edge's wire types.

Field names, types and defaults are OpenAI's (completions: `max_tokens`
defaults to 16, as OpenAI's legacy endpoint and vLLM; both: `temperature`
defaults to 1.0), plus vLLM's sampling extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `return_token_ids`).
Unknown fields are refused (400 naming them), as OpenAI refuses them: a
parameter we do not implement is never silently ignored.

Structured output: OpenAI's `response_format` (json_object, json_schema) and
vLLM's `structured_outputs` (json, regex, choice, grammar) on both endpoints;
`tools`, `tool_choice` and `parallel_tool_calls` on chat, whose history may hold
assistant messages with `tool_calls` and `tool` messages with their results.

Free-form fields have bounds of their own, below the body's (limits.py), so a
request is refused naming the field rather than the whole body (400):
`model` at most MAX_MODEL_CHARS characters (a path is accepted as the name),
`user` MAX_USER_CHARS, `messages` MAX_MESSAGES entries, each message's content
MAX_MESSAGE_CHARS characters in at most MAX_CONTENT_PARTS parts. `stop` and
`stop_token_ids` are bounded by the rules both edges share (router/validation.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

MAX_MODEL_CHARS = 1024
MAX_USER_CHARS = 256
MAX_MESSAGES = 512
MAX_MESSAGE_CHARS = 1 << 20  # a million characters: a quarter of the default body limit
MAX_CONTENT_PARTS = 64


def _unicode(value: str) -> str:
    """JSON's \\ud800 escapes parse to lone surrogates, which no tokenizer takes (a TypeError deep inside it): refused here."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"contains a lone surrogate (\\u{ord(value[exc.start]):04x}) at character {exc.start}: not valid Unicode text") from None
    return value


Text = Annotated[StrictStr, AfterValidator(_unicode)]
ModelName = Annotated[Text, Field(max_length=MAX_MODEL_CHARS)]


def _prompt_form(value):
    """A prompt as OpenAI's completions endpoint takes it: a string, token ids, or a
    list of either (a batch: one completion, n choices each, per prompt)."""
    def is_ids(x):
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str) or is_ids(value):
        return _unicode(value) if isinstance(value, str) else value
    if isinstance(value, list) and (all(isinstance(x, str) for x in value) or all(is_ids(x) for x in value)):
        for text in (x for x in value if isinstance(x, str)):
            _unicode(text)
        return value
    raise ValueError("must be a string, a list of token ids, or a list of strings or of token-id lists")


Prompt = Annotated[object, AfterValidator(_prompt_form)]


MAX_TOOLS = 128
MAX_CHOICE_STRINGS = 1024
# OpenAI's rule for function names.
FunctionName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: FunctionName
    description: Text | None = None
    json_schema: dict | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: StrictBool | None = None  # accepted; the schema is always enforced (OpenAI's strict mode)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of these."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(default=None, max_length=MAX_CHOICE_STRINGS)
    grammar: Text | None = None
    json_object: StrictBool | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class CommonRequest(BaseModel):
    """The parameters both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName | None = None  # None: the one model served (as vLLM)
    temperature: float = 1.0
    top_p: float | None = None
    top_k: StrictInt | None = None  # vLLM: -1 or 0 turns it off
    min_p: float | None = None
    seed: StrictInt | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    user: Annotated[Text, Field(max_length=MAX_USER_CHARS)] | None = None  # accepted, unused (OpenAI's abuse-monitoring tag)


class CompletionRequest(CommonRequest):
    prompt: Prompt
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None  # the sampled token's plus this many alternatives
    echo: StrictBool = False
    return_token_ids: StrictBool = False  # vLLM: each choice names its token ids


class TokenizeRequest(BaseModel):
    """vLLM's and SGLang's /tokenize (not OpenAI's): `disagg bench --api openai` uses it."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName | None = None
    prompt: Text
    add_special_tokens: StrictBool = True


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Annotated[Text, Field(max_length=MAX_USER_CHARS)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None  # None only for an assistant message with tool_calls
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)  # an assistant's calls
    tool_call_id: Annotated[Text, Field(max_length=MAX_USER_CHARS)] | None = None  # a tool message: the call it answers
    name: Annotated[Text, Field(max_length=MAX_USER_CHARS)] | None = None

    @field_validator("content")
    @classmethod
    def _bounded(cls, content):
        if content is None:
            return content
        if not isinstance(content, str) and len(content) > MAX_CONTENT_PARTS:
            raise ValueError(f"has {len(content)} parts; at most {MAX_CONTENT_PARTS} are allowed")
        chars = len(content) if isinstance(content, str) else sum(len(part.text) for part in content)
        if chars > MAX_MESSAGE_CHARS:
            raise ValueError(f"has {chars} characters; at most {MAX_MESSAGE_CHARS} are allowed in one message")
        return content

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_extras(self) -> dict | None:
        """What the chat template gets beyond role and content: an assistant's tool calls, a tool result's id."""
        extras = {}
        if self.tool_calls:
            extras["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            extras["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            extras["name"] = self.name
        return extras or None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; None: any object
    strict: StrictBool | None = None  # accepted; a forced call's arguments always follow the schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: StrictInt | None = None  # deprecated by OpenAI for max_completion_tokens; both work
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)  # OpenAI refuses an empty list
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools, none without
    parallel_tool_calls: StrictBool = True

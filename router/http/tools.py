"""OpenAI's tools at the HTTP edge: the constraint a tool_choice makes, and the model's tool
calls parsed back into OpenAI's `tool_calls`, whole or streamed.

The format is Hermes' (Qwen 2.5/3, Hermes 2/3, and the tiny models' chat template):
`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`, one block per call.
- tool_choice "required" / a named function: a grammar that allows only such blocks (one,
  or one or more with parallel_tool_calls), each's arguments valid against its function's
  parameters schema, so the calls always parse;
- "auto": unconstrained; the output is parsed by two parsers, as vLLM names them:
  "hermes" (text before the first <tool_call> is content, each block a call) and
  "llama3_json" (an output that opens with a JSON object {"name", "parameters" or "arguments"}
  naming a known tool, after optional spaces and Llama's <|python_tag|>, is a call; more
  calls may follow it after "; ", as Llama 3.x writes them);
- "none" (or no tools): text only; the tools are still shown to the chat template.

Streamed, content goes out as it comes until a <tool_call> opens; then the call's id and
name go out once the name is complete, and its arguments as they grow (OpenAI's deltas).
An output that may still become a Llama 3 call (spaces, `{`, `{"na`...) is held only until
it is known: once its name is complete the call streams the same way, and as soon as it
cannot be one (`{"city"`, an unknown name) it goes out as content, not at the end.
Whole responses run the same parser over the whole text, so the two always agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from disagg.engine.constraints import Constraint, ConstraintKind
from disagg.engine.constraints.grammars import JSON_OPTIONS
from disagg.rpc.server import RequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A block's head in the constrained layout (and what models trained on Hermes write): the name, then the arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
# Llama 3's calls: {"name": NAME, "parameters" (or "arguments"): {...}}, the first after optional spaces and its
# <|python_tag|>, each next one after "; ". The name, then the arguments' key, then their object, read in turn.
PYTHON_TAG = "<|python_tag|>"
_JSON_NAME = re.compile(r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_JSON_ARGUMENTS = re.compile(r'\s*,\s*"(?:parameters|arguments)"\s*:\s*')
_JSON_NEXT = re.compile(r"\s*\}\s*;")  # the end of one call's object and the separator before the next
_DECODER = json.JSONDecoder()


def tool_constraint(tools: list[dict], tool_choice, parallel: bool) -> Constraint | None:
    """The grammar of a forced tool call; None where the model chooses (auto, none).
    tools: OpenAI's {"type": "function", "function": {"name", "parameters", ...}}."""
    if tool_choice in (None, "auto", "none") or not tools:
        return None
    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise RequestError(f"tool_choice names the function {name!r}, which is not one of tools", field="tool_choice")
        parallel = False  # OpenAI: a named choice is one call of that function
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    body = {"anyOf": calls, "x-guidance": JSON_OPTIONS}
    grammar = f'start: call{"+" if parallel else ""}\ncall: "{OPEN}" body "{CLOSE}"\nbody: %json {json.dumps(body, ensure_ascii=False)}'
    return Constraint(ConstraintKind.GRAMMAR, grammar)


@dataclass
class _Call:
    id: str
    name: str | None = None
    arguments: str = ""  # as sent so far
    closed: bool = False


@dataclass
class ToolCallParser:
    """Streamed text in, OpenAI chat deltas out (feed); `calls` and `content` once it is done.

    known: the tools' names (llama3_json takes only a call of one of them)."""

    known: frozenset[str]
    llama3_json: bool = True  # auto: an output that opens with a JSON object may be a call (False once it is known not to be)
    json_calls: bool = False  # the output is Llama 3 JSON calls (known once the first's name is)
    text: str = ""
    content: str = ""  # sent as content so far
    calls: list[_Call] = field(default_factory=list)

    def feed(self, delta: str, final: bool = False) -> list[dict]:
        """The deltas (each {"content": ...} or {"tool_calls": [...]}) that `delta` releases."""
        self.text += delta
        if self.llama3_json and not self.json_calls:
            self._decide_json(final)
            if self.llama3_json and not self.json_calls:
                return []  # held: it may still be a call's head
        if self.json_calls:
            return self._json_calls(final)
        out = []
        first_open = self.text.find(OPEN)
        content_end = first_open if first_open >= 0 else len(self.text) - (0 if final else _partial_suffix(self.text, OPEN))
        if content_end > len(self.content) and not self.calls:
            out.append({"content": self.text[len(self.content) : content_end]})
            self.content = self.text[:content_end]
        if first_open >= 0:
            out += self._blocks(first_open, final)
        return out

    def _blocks(self, start: int, final: bool) -> list[dict]:
        out, index, at = [], 0, start
        while at >= 0:
            inner_start = at + len(OPEN)
            close = self.text.find(CLOSE, inner_start)
            inner = self.text[inner_start : close if close >= 0 else len(self.text)]
            if index == len(self.calls):
                self.calls.append(_Call(f"call_{uuid.uuid4().hex[:24]}"))
            out += self._advance(index, inner, close >= 0 or final)
            if close < 0:
                break
            at = self.text.find(OPEN, close + len(CLOSE))
            index += 1
        return out

    def _advance(self, index: int, inner: str, closed: bool) -> list[dict]:
        call = self.calls[index]
        if call.closed:
            return []
        head = _HEAD.match(inner)
        if head is None:
            if closed:  # not the layout: parse the block whole
                call.closed = True
                return self._whole_block(index, call, inner)
            return []
        out = []
        if call.name is None:
            call.name = json.loads(head.group(1))
            out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]})
        rest = inner[head.end() :]
        if closed:
            call.closed = True
            trimmed = rest.rstrip()
            ready = trimmed[:-1] if trimmed.endswith("}") else trimmed
        else:  # the object's last "}" (the last character but spaces) and a partial </tool_call> may be at the end: held back
            ready = rest[: len(rest) - _partial_suffix(rest, CLOSE)].rstrip()[:-1]
        if len(ready) > len(call.arguments) and ready.startswith(call.arguments):
            out.append({"tool_calls": [{"index": index, "function": {"arguments": ready[len(call.arguments) :]}}]})
            call.arguments = ready
        return out

    def _whole_block(self, index: int, call: _Call, inner: str) -> list[dict]:
        try:
            parsed = json.loads(inner)
            call.name, call.arguments = parsed["name"], json.dumps(parsed.get("arguments", parsed.get("parameters", {})), ensure_ascii=False)
        except (ValueError, KeyError, TypeError):
            self.calls.pop(index)
            return []
        return [{"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}]

    def _decide_json(self, final: bool) -> None:
        """llama3_json: a call once the first object's name is complete and names a known tool; content as soon as
        the text cannot open a call (or the output ended undecided); otherwise still undecided."""
        head = _JSON_NAME.match(self.text)
        if head is not None:
            self.json_calls = json.loads(head.group(1)) in self.known
            self.llama3_json = self.json_calls
        elif final or not _may_open_json_call(self.text):
            self.llama3_json = False

    def _json_calls(self, final: bool) -> list[dict]:
        """The deltas of Llama 3 JSON calls: each call's name once complete, then its arguments as they grow."""
        out, at, index = [], 0, 0
        while (head := _JSON_NAME.match(self.text, at)) is not None:
            if index == len(self.calls):
                name = json.loads(head.group(1))
                if name not in self.known:  # a later object that is no call of ours: the calls end before it
                    break
                self.calls.append(_Call(f"call_{uuid.uuid4().hex[:24]}", name))
                out.append({"tool_calls": [{"index": index, "id": self.calls[index].id, "type": "function", "function": {"name": name, "arguments": ""}}]})
            arguments, end = _json_arguments(self.text, head.end())
            out += self._grow(index, arguments)
            after = _JSON_NEXT.match(self.text, end) if end is not None else None
            if after is None:
                break
            at, index = after.end(), index + 1
        if final:  # a call cut before its arguments began (or one written without any) calls with none
            out += [delta for i, call in enumerate(self.calls) if not call.arguments for delta in self._grow(i, "{}")]
        return out

    def _grow(self, index: int, arguments: str) -> list[dict]:
        """The new fragment of call index's arguments, now `arguments` (which begin with those sent)."""
        call = self.calls[index]
        if len(arguments) <= len(call.arguments) or not arguments.startswith(call.arguments):
            return []
        fragment, call.arguments = arguments[len(call.arguments) :], arguments
        return [{"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}]

    def tool_calls(self) -> list[dict]:
        """The calls in a whole message's shape."""
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls if c.name is not None]


def _may_open_json_call(text: str) -> bool:
    """Whether text may still grow into the head of a Llama 3 call (spaces, <|python_tag|>, `{`, `"name"`, `:`, `"`)."""
    rest = text.lstrip()
    if PYTHON_TAG.startswith(rest):
        return True
    rest = rest.removeprefix(PYTHON_TAG)
    for piece in ("{", '"name"', ":", '"'):
        rest = rest.lstrip()
        if len(rest) < len(piece):
            return piece.startswith(rest)
        if not rest.startswith(piece):
            return False
        rest = rest[len(piece) :]
    return True  # the name has begun: _JSON_NAME takes it once it closes


def _json_arguments(text: str, at: int) -> tuple[str, int | None]:
    """(the arguments' text so far, the index past them once complete) where a call's arguments may begin at `at`.

    Everything from the object's `{` to its end is the arguments as the model writes them, sent as they grow;
    ("", None) while their key is incomplete, and where there is no arguments object (the call then has {})."""
    key = _JSON_ARGUMENTS.match(text, at)
    if key is None or not text.startswith("{", key.end()):
        return "", None
    try:
        value, end = _DECODER.raw_decode(text, key.end())
    except ValueError:  # still open (or malformed: then the raw text so far)
        return text[key.end() :], None
    return text[key.end() : end], end


def _partial_suffix(text: str, tag: str) -> int:
    """How many of text's last characters are the start of tag (held back: the tag may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

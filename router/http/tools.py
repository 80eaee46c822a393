"""OpenAI's tools at the HTTP edge: the constraint a tool_choice makes, and the model's tool
calls parsed back into OpenAI's `tool_calls`, whole or streamed.

The format is Hermes' (Qwen 2.5/3, Hermes 2/3, and the tiny models' chat template):
`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`, one block per call.
- tool_choice "required" / a named function: a grammar that allows only such blocks (one,
  or one or more with parallel_tool_calls), each's arguments valid against its function's
  parameters schema, so the calls always parse;
- "auto": unconstrained; the output is parsed by two parsers, as vLLM names them:
  "hermes" (text before the first <tool_call> is content, each block a call) and
  "llama3_json" (the whole output one JSON object {"name", "parameters" or "arguments"}
  naming a known tool, as Llama 3.x writes its calls);
- "none" (or no tools): text only; the tools are still shown to the chat template.

Streamed, content goes out as it comes until a <tool_call> opens; then the call's id and
name go out once the name is complete, and its arguments as they grow (OpenAI's deltas).
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
    llama3_json: bool = True  # auto: a whole-JSON output may be a call
    text: str = ""
    content: str = ""  # sent as content so far
    calls: list[_Call] = field(default_factory=list)

    def feed(self, delta: str, final: bool = False) -> list[dict]:
        """The deltas (each {"content": ...} or {"tool_calls": [...]}) that `delta` releases."""
        self.text += delta
        if self.llama3_json and not self.calls and self.text.lstrip().startswith("{"):
            return self._whole_json() if final else []  # held: a call, or content, only the end says
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

    def _whole_json(self) -> list[dict]:
        """llama3_json: the whole output one call of a known tool; otherwise it was content."""
        try:
            parsed = json.loads(self.text)
            name = parsed["name"]
            arguments = parsed["parameters"] if "parameters" in parsed else parsed["arguments"]
            if name not in self.known or not isinstance(arguments, dict):
                raise ValueError(name)
        except (ValueError, KeyError, TypeError):
            self.llama3_json = False
            return self.feed("", final=True)
        call = _Call(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False), closed=True)
        self.calls.append(call)
        return [{"tool_calls": [{"index": 0, "id": call.id, "type": "function", "function": {"name": name, "arguments": call.arguments}}]}]

    def tool_calls(self) -> list[dict]:
        """The calls in a whole message's shape."""
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls if c.name is not None]


def _partial_suffix(text: str, tag: str) -> int:
    """How many of text's last characters are the start of tag (held back: the tag may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

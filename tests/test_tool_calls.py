"""The tool-call parsers of the HTTP edge (router/http/tools.py), alone: Hermes blocks and
Llama 3 JSON, whole and streamed in pieces of every size, and the grammar of a forced call."""

from __future__ import annotations

import json
import random

import pytest

from disagg.engine.constraints import ConstraintKind
from disagg.rpc.server import RequestError
from router.http.tools import ToolCallParser, tool_constraint

KNOWN = frozenset({"weather", "time"})
HERMES = (
    'Let me look. <tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}</tool_call>'
    '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
)


def streamed(text: str, seed: int, **options) -> tuple[str, list[tuple[str, str]], set[str]]:
    """(content, [(name, arguments)], ids) from the deltas of text fed in random pieces."""
    rng, parser, deltas, at = random.Random(seed), ToolCallParser(KNOWN, **options), [], 0
    while at < len(text):
        step = rng.randint(1, 7)
        deltas += parser.feed(text[at : at + step])
        at += step
    deltas += parser.feed("", final=True)
    content, calls, ids = "", {}, set()
    for delta in deltas:
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], ["", ""])
            if "id" in piece:
                ids.add(piece["id"])
                call[0] = piece["function"]["name"]
            call[1] += piece["function"].get("arguments", "")
    return content, [tuple(calls[i]) for i in sorted(calls)], ids


@pytest.mark.parametrize("seed", range(12))
def test_hermes_calls_streamed_in_any_pieces_equal_the_whole_parse(seed):
    whole = ToolCallParser(KNOWN)
    content = "".join(d.get("content", "") for d in whole.feed(HERMES, final=True))
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls()]
    assert content == "Let me look. "
    assert expected == [("weather", '{"city": "Oslo", "days": [1, 2]}'), ("time", "{}")]
    got_content, got_calls, ids = streamed(HERMES, seed)
    assert (got_content, got_calls) == (content, expected) and len(ids) == 2


def test_llama3_json_is_a_call_of_a_known_tool_and_anything_else_is_content():
    call = ToolCallParser(KNOWN)
    call.feed('{"name": "time", "parameters": {"zone": "utc"}}', final=True)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in call.tool_calls()] == [("time", {"zone": "utc"})]
    for text in ('{"name": "rocket", "parameters": {}}', '{"city": "Oslo"}', "plain words, a <tool partial tag"):
        assert streamed(text, 0) == (text, [], set())
    assert streamed('{"name": "time", "parameters": {}}', 0, llama3_json=False)[1] == []  # forced choices use Hermes only


def test_a_forced_choice_is_a_grammar_of_the_chosen_tools_and_an_unknown_name_is_refused():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("weather", "time")]
    assert tool_constraint(tools, "auto", True) is None and tool_constraint(tools, "none", True) is None
    required = tool_constraint(tools, "required", True)
    assert required.kind is ConstraintKind.GRAMMAR and "start: call+" in required.text and '"weather"' in required.text
    named = tool_constraint(tools, {"type": "function", "function": {"name": "time"}}, True)
    assert "start: call\n" in named.text and '"weather"' not in named.text
    with pytest.raises(RequestError) as refused:
        tool_constraint(tools, {"type": "function", "function": {"name": "rocket"}}, True)
    assert refused.value.field == "tool_choice"

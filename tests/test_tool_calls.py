"""Tool calls: the parsers of the HTTP edge (router/http/tools.py) alone (Hermes blocks and
Llama 3 JSON, whole and streamed in pieces of every size, and the grammar of a forced call),
then tool_choice=auto end to end: a tiny model trained on chats where it calls the tools it is
offered (conftest's "llama-tools"), served by a cluster and asked with the official `openai` client."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
import torch
from conftest import reference, start_cluster

from disagg.engine.constraints import ConstraintKind
from disagg.rpc.server import RequestError
from disagg.tools.tinymodel import TOOL_CHAT_TOOLS
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


# Llama 3 JSON calls as written, and the calls they are: (name, arguments parsed)
LLAMA3_CALLS = [
    ('{"name": "weather", "parameters": {"city": "Oslo", "days": [1, 2], "note": "a } and a \\" inside"}}',
     [("weather", {"city": "Oslo", "days": [1, 2], "note": 'a } and a " inside'})]),
    ('  <|python_tag|>{ "name" : "time" , "arguments" : { } }', [("time", {})]),
    ('{"name": "weather", "arguments": {"city": "Rome"}}; {"name": "time", "parameters": {"zone": "utc"}}',
     [("weather", {"city": "Rome"}), ("time", {"zone": "utc"})]),
]


def timeline(text: str, parser: ToolCallParser) -> list[tuple[int, dict]]:
    """(how many characters had been fed, delta) for text fed one character at a time, then its end."""
    out = [(at + 1, delta) for at in range(len(text)) for delta in parser.feed(text[at])]
    return out + [(len(text), delta) for delta in parser.feed("", final=True)]


@pytest.mark.parametrize("text, calls", LLAMA3_CALLS, ids=["parameters", "python-tag", "two-calls"])
def test_llama3_json_streams_the_name_once_complete_then_the_arguments_as_they_grow(text, calls):
    whole = ToolCallParser(KNOWN)
    assert whole.feed(text, final=True) and not whole.content
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls()]
    assert [(name, json.loads(arguments)) for name, arguments in expected] == calls
    events = timeline(text, ToolCallParser(KNOWN))
    assert not any("content" in delta for _, delta in events)
    for index, (name, arguments) in enumerate(expected):
        pieces = [(at, piece) for at, delta in events for piece in delta["tool_calls"] if piece["index"] == index]
        opened = pieces[0][1]
        assert opened["function"]["name"] == name and opened["id"].startswith("call_") and opened["type"] == "function"
        # The name goes out with the character that closes it, not at the end.
        start = [i for i in range(len(text)) if text.startswith("{", i)][0] if index == 0 else text.index("; ") + 2
        assert pieces[0][0] == text.index(f'"{name}"', start) + len(name) + 2
        fragments = [(at, piece["function"]["arguments"]) for at, piece in pieces[1:]]
        assert "".join(f for _, f in fragments) == arguments
        if arguments != "{ }":  # several fragments, all but the last before the text's end
            assert len(fragments) > 3 and fragments[-2][0] < len(text)
    assert streamed(text, 3)[1] == expected  # in random pieces too


NOT_CALLS = [
    ('{"city": "Oslo", "days": 3}', 3),  # `{"c` cannot be `{"name"`
    ('{ "name": "rocket", "parameters": {}}', len('{ "name": "rocket"')),  # a name, but no tool's
    ("{ [1, 2, 3] }", 3),
    ("<|python_tag|>print(1)", len("<|python_tag|>p")),
    ("  plain words { braces }", 3),
]


@pytest.mark.parametrize("text, known_at", NOT_CALLS, ids=["other-object", "unknown-tool", "array", "python", "words"])
def test_text_that_opens_like_a_call_streams_as_content_once_it_cannot_be_one(text, known_at):
    events = timeline(text, ToolCallParser(KNOWN))
    assert all(set(delta) == {"content"} for _, delta in events)
    assert "".join(delta["content"] for _, delta in events) == text
    assert events[0][0] == known_at  # held only while it could still be a call
    assert len(events) > 1 and events[-2][0] < len(text)  # then it flows as it comes


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


# -- tool_choice=auto end to end: a model that calls tools by itself -------------------------------------------------

TOOL_MODEL = "llama-tools"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_CHAT_TOOLS}
CALL_ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]  # trained: a weather call for Oslo
TEXT_ASK = [{"role": "user", "content": "Who lights the lamp?"}]  # trained: answered in text
MARGIN = 0.5  # the least top-1 logit margin of a greedy step: float32 rounding (~1e-5 here) cannot flip it


@pytest.fixture(scope="module")
def oai(cluster_logs):
    cluster = start_cluster(cluster_logs, TOOL_MODEL, http_port=0)
    try:
        with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client, client.models.list().data[0].id
    finally:
        cluster.stop()


def greedy_reply(messages: list[dict]) -> str:
    """The trained model's greedy reply (transformers), whose every step wins by MARGIN: the server's must equal it."""
    ref = reference(TOOL_MODEL)
    rendered = ref.tokenizer.apply_chat_template(messages, tools=TOOL_CHAT_TOOLS, tokenize=False, add_generation_prompt=True)
    ids = ref.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = ref.model.generate(
            torch.tensor([ids]), max_new_tokens=60, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=ref.eos
        )
    top2 = torch.stack(out.scores)[:, 0].topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > MARGIN, (top2[:, 0] - top2[:, 1]).tolist()
    generated = out.sequences[0, len(ids) :].tolist()
    assert generated[-1] == ref.eos  # it ends its turn by itself
    return ref.tokenizer.decode(generated[:-1])


def ask(client, model, messages, **extra):
    return client.chat.completions.create(model=model, messages=messages, tools=TOOL_CHAT_TOOLS, tool_choice="auto", temperature=0, max_tokens=60, **extra)


def test_auto_returns_the_tool_call_the_model_makes_valid_against_its_schema(oai):
    client, model = oai
    choice = ask(client, model, CALL_ASK).choices[0]
    assert choice.finish_reason == "tool_calls" and not (choice.message.content or "").strip()
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["weather"])
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert greedy_reply(CALL_ASK).strip() == f'<tool_call>{{"name": "weather", "arguments": {call.function.arguments}}}</tool_call>'


def test_auto_returns_text_where_the_model_answers_in_text(oai):
    client, model = oai
    choice = ask(client, model, TEXT_ASK).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == greedy_reply(TEXT_ASK) and "lighthouse keeper" in choice.message.content


def test_auto_streamed_reassembles_to_the_same_call(oai):
    client, model = oai
    whole = ask(client, model, CALL_ASK).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in ask(client, model, CALL_ASK, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_tool_result_continues_the_chat_in_text(oai):
    client, model = oai
    [call] = ask(client, model, CALL_ASK).choices[0].message.tool_calls
    called = {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}
    history = CALL_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [called]},
        {"role": "tool", "tool_call_id": call.id, "content": "snow"},
    ]
    choice = ask(client, model, history).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == greedy_reply(history) and "snow in Oslo" in choice.message.content

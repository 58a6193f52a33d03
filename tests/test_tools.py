"""Function calling: the Hermes tool-call parser (pure logic), then ``/v1/chat/completions`` with
tools on the real SmolLM2 served with ``--chat-template`` (mmserve's ChatML template with tools),
through the official ``openai`` client. Two earlier calls in the conversation teach the 135M
model the format: asked about a third city, it calls the tool for that city by itself."""

from __future__ import annotations

import json
from typing import Any
from unittest.mock import ANY

import openai
import pytest

from modalities.llm.tools import (
    CHATML_TOOLS,
    ToolCall,
    ToolCallStream,
    ToolError,
    check_tools,
    parse_tool_calls,
)
from tests.helpers import streamed_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _call(city: str, k: int) -> dict[str, Any]:
    arguments = json.dumps({"city": city})
    return {"id": f"call_{k}", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


# Two calls made earlier (the tools' results left out: with them the small model answers in kind).
SHOTS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("Paris", 1)]},
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("Rome", 2)]},
    {"role": "user", "content": "Weather in Oslo?"},
]


def test_parser_splits_calls_from_text_whole_or_in_any_pieces() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g"}'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look.\n\n" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}'), ("g", "{}")]
    for size in (1, 3, 7):  # streamed: the same text and calls, and no piece of a tag leaks out
        stream = ToolCallStream()
        streamed = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
        assert "<" not in streamed
        tail, got = stream.finish()
        # (the same text but for whitespace next to a call: a blank delta waits, and is dropped at the end)
        assert (streamed + tail).strip() == content.strip() and [c.arguments for c in got] == ['{"x": 1}', "{}"]
    # not a call: kept as text, as are a lone "<" and an unclosed block that is no JSON
    for text in ("a <tool_call>not json</tool_call> b", "x < y", "<tool_call>{'name'"):
        assert parse_tool_calls(text) == (text, [])
    assert (
        parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')[1][0].arguments
        == '{"a": 2}'
    )
    # whitespace between and after calls is no text, whole or streamed
    two = (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>\n'
    )
    assert parse_tool_calls(two)[0] == ""
    stream = ToolCallStream()
    assert "".join(stream.feed(ch) for ch in two) == "" and stream.finish()[0] == ""
    # a reply cut within the closing tag still holds a whole call; an undeclared function is text
    cut = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_'
    assert parse_tool_calls(cut)[1][0].arguments == '{"x": 1}'
    assert parse_tool_calls(cut.replace('"f"', '"g"'), frozenset({"f"})) == (cut.replace('"f"', '"g"'), [])
    # a call needs a name and arguments that are a JSON object: anything else stays text
    for bad in ('{"name": "", "arguments": {}}', '{"name": "f", "arguments": null}', '{"name": "f", "arguments": "x"}'):
        assert parse_tool_calls(f"<tool_call>{bad}</tool_call>")[1] == []


def test_a_calls_arguments_stream_as_they_are_written() -> None:
    args = '{"q": "a<b } \\" {", "n": [1, {"m": 2}]}'
    text = f'Hi <tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>\n<tool_call>{{"arguments": {{}}, "name": "g"}}</tool_call>'
    stream = ToolCallStream(frozenset({"f", "g"}))
    deltas = []
    for ch in text:
        stream.feed(ch)
        deltas.append(stream.deltas())
    _, calls = stream.finish()
    assert (
        [(c.name, c.arguments) for c in calls]
        == [("f", args), ("g", "{}")]
        == [(c.name, c.arguments) for c in parse_tool_calls(text)[1]]
    )
    first = next(k for k, d in enumerate(deltas) if d)
    # announced once its name is read: then its arguments come a character at a time
    head = {"index": 0, "id": calls[0].id, "type": "function", "function": {"name": "f", "arguments": "{"}}
    assert text[: first + 1].endswith('"arguments": {') and deltas[first] == [head]
    pieces = [d["function"]["arguments"] for ds in deltas[first + 1 :] for d in ds if d["index"] == 0]
    assert len(pieces) == len(args) - 2 and "{" + "".join(pieces) == args  # ("<" waits: it may open </tool_call>)
    # a call written arguments first is read whole, once closed
    [(k, second)] = [(k, d) for k, ds in enumerate(deltas) for d in ds if d["index"] == 1]
    assert k == len(text) - 1 and second == {"index": 1, **calls[1].to_openai()}
    # a call cut short (max_tokens) after its name was read stays a call, its arguments cut
    # (OpenAI's arguments need not be valid JSON either), as does one whose object is not closed
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"q": "Os')[1][0].arguments == '{"q": "Os'
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"q": 1</tool_call>ok') == (
        "ok",
        [ToolCall("f", '{"q": 1', ANY)],
    )
    # cut short before its name was read: no call, and no markup left as text
    for cut in ("<tool_call>", '<tool_call>\n{"name": "f",', 'Hi <tool_call>{"na', '<tool_call>{"name": "f", "argum'):
        assert parse_tool_calls(cut) == (cut[: cut.index("<")], [])
    # the closing tag inside an argument string is part of the arguments, in any pieces
    tagged = '<tool_call>{"name": "f", "arguments": {"html": "</tool_call>"}}</tool_call>'
    for size in (1, 2, 5, len(tagged)):
        stream = ToolCallStream()
        text = "".join(stream.feed(tagged[i : i + size]) for i in range(0, len(tagged), size))
        tail, [call] = stream.finish()
        assert text + tail == "" and call.arguments == '{"html": "</tool_call>"}'


def test_tools_and_tool_choice_are_checked() -> None:
    class Plain:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    class Hermes:
        chat_template = CHATML_TOOLS.read_text()

    assert check_tools([WEATHER], None, Hermes()) and check_tools([WEATHER], "auto", Hermes())
    assert check_tools([WEATHER], "required", Hermes())
    assert check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, Hermes())
    assert not check_tools([WEATHER], "none", Plain())
    assert not check_tools(None, None, Plain())
    bad = [
        (None, "auto", Hermes(), "tool_choice"),  # a choice among no tools
        ([WEATHER], "always", Hermes(), "tool_choice"),
        ([WEATHER], {"type": "function"}, Hermes(), "tool_choice"),  # no name
        ([{"type": "function", "function": {}}], None, Hermes(), "tools[0].function.name"),
        ([{"type": "retrieval"}], None, Hermes(), "tools[0]"),
        ("get_weather", None, Hermes(), "tools"),
        ([], None, Hermes(), "tools"),
        ([{"type": "function", "function": {"name": "bad name!"}}], None, Hermes(), "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            None,
            Hermes(),
            "tools[0].function.parameters",
        ),
        ([WEATHER], None, Plain(), "tools"),  # a template that cannot show the model its tools
    ]
    for tools, choice, tokenizer, param in bad:
        with pytest.raises(ToolError) as err:
            check_tools(tools, choice, tokenizer)
        assert err.value.param == param


@pytest.fixture
def client(smollm2_tools_client: openai.OpenAI) -> openai.OpenAI:
    return smollm2_tools_client


def test_a_chat_completion_calls_the_tool(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="smollm2", messages=SHOTS, tools=[WEATHER], temperature=0, max_tokens=40)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    # streamed: no tag in the text, and the same call in the last delta
    chunks = list(
        client.chat.completions.create(
            model="smollm2", messages=SHOTS, tools=[WEATHER], temperature=0, max_tokens=40, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert streamed_calls(chunks) == {0: [("get_weather", call.function.arguments)]}
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 3  # its arguments streamed
    # n=2 streamed, each choice its own call; parallel_tool_calls false: one call at most
    chunks = list(
        client.chat.completions.create(
            model="smollm2", messages=SHOTS, tools=[WEATHER], temperature=0, max_tokens=40, stream=True, n=2
        )
    )
    last = {c.choices[0].index: c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason}
    assert sorted(last) == [0, 1] and all(ch.delta.content is None for ch in last.values())
    assert streamed_calls(chunks) == {i: [("get_weather", call.function.arguments)] for i in (0, 1)}
    one = client.chat.completions.create(
        model="smollm2", messages=SHOTS, tools=[WEATHER], temperature=0, max_tokens=40, parallel_tool_calls=False
    )
    assert len(one.choices[0].message.tool_calls or []) == 1
    # tool_choice "none": the model's text comes back as it is
    plain = client.chat.completions.create(
        model="smollm2", messages=SHOTS, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=40
    )
    assert plain.choices[0].message.tool_calls is None and "<tool_call>" in (plain.choices[0].message.content or "")


def test_bad_tools_are_400s(client: openai.OpenAI) -> None:
    unknown = {"type": "function", "function": {"name": "get_time"}}  # not among the tools
    for extra, param in (({"tool_choice": unknown}, "tool_choice"), ({"tools": [{"type": "web"}]}, "tools[0]")):
        kwargs: dict[str, Any] = {"tools": [WEATHER], **extra}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="smollm2", messages=SHOTS, max_tokens=4, **kwargs)
        assert err.value.status_code == 400 and err.value.body["param"] == param  # type: ignore[index]
    # a tool's message without its call's id, a history call without a function: 400s, not template errors
    call_without_function = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}
    for messages in ([{"role": "tool", "content": "x"}], [SHOTS[0], call_without_function]):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4)  # type: ignore[arg-type]
        assert "tool" in err.value.body["message"] and "template" not in err.value.body["message"]  # type: ignore[index]

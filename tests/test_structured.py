"""Structured outputs: ``response_format`` (``json_object``, ``json_schema``) and ``tool_choice``
("required", a named function) hold the real SmolLM2's tokens to a grammar (llguidance), through
the official ``openai`` client. Without a grammar the 135M model answers these prompts in prose,
and calls no tool unless the conversation shows it how (``test_tools``)."""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest

from engine.structured import closed
from modalities.llm.structured import reply_grammar
from modalities.llm.tools import ToolError
from tests.helpers import streamed_calls

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
}


def _tool(name: str, what: str) -> dict[str, Any]:
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
    return {"type": "function", "function": {"name": name, "description": what, "parameters": params}}


WEATHER, TIME = _tool("get_weather", "The weather in a city"), _tool("get_time", "The time in a city")
ASK = [{"role": "user", "content": "What's the weather like in Oslo today?"}]


def _person(text: str | None) -> None:
    """``text`` is JSON valid under ``PERSON`` (closed: no other keys)."""
    obj = json.loads(text or "")
    assert set(obj) == {"name", "age", "pets"} and isinstance(obj["name"], str) and len(obj["name"]) <= 40
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    assert isinstance(obj["pets"], list) and set(obj["pets"]) <= {"cat", "dog"} and len(obj["pets"]) <= 3


def test_schemas_are_closed_and_bad_ones_named() -> None:
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    out = closed({"anyOf": [nested, {"type": "array", "items": nested}], "$defs": {"n": nested}})
    for obj in (out["anyOf"][0], out["anyOf"][1]["items"], out["$defs"]["n"]):
        assert obj["additionalProperties"] is False and obj["properties"]["a"]["additionalProperties"] is False
    open_ = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert closed(open_) == open_  # what a schema says of other keys stands
    assert "additionalProperties" not in closed({"type": "object"})  # json_object: any object
    composed = {"properties": {"x": {"allOf": [nested, {"properties": {"c": {}}}]}}}
    assert closed(composed) == composed  # a part closed would forbid the other's keys
    assert reply_grammar(None, [WEATHER], "auto") is None  # free text, parsed for calls
    cases = [
        ({"type": "nope"}, None, None, "response_format"),
        (None, [WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
        (None, [_bad_params()], "required", "tools"),
    ]
    for schema, tools, choice, param in cases:
        with pytest.raises(ToolError) as err:
            reply_grammar(schema, tools, choice)
        assert err.value.param == param


def _bad_params() -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}


def test_response_format_holds_the_reply_to_a_schema(smollm2_tools_client: openai.OpenAI) -> None:
    client = smollm2_tools_client
    ask = [{"role": "user", "content": "Tell me about a person you know."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = client.chat.completions.create(
        model="smollm2", messages=ask, response_format=fmt, temperature=0, max_tokens=60
    )  # type: ignore[arg-type]
    assert out.choices[0].finish_reason == "stop"
    _person(out.choices[0].message.content)
    # each of n sampled choices keeps to it (a guide per sequence), streamed too
    chunks = client.chat.completions.create(
        model="smollm2",
        messages=ask,
        response_format=fmt,
        n=3,
        seed=7,
        max_tokens=60,
        stream=True,  # type: ignore[arg-type]
    )
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        _person(text)
    # json_object: an object; /v1/completions takes response_format too
    colors = [{"role": "user", "content": "List three colors."}]
    obj = client.chat.completions.create(
        model="smollm2", messages=colors, response_format={"type": "json_object"}, temperature=0, max_tokens=60
    )
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    pair = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}
    fmt = {"type": "json_schema", "json_schema": {"name": "pair", "schema": pair}}
    done = client.completions.create(
        model="smollm2", prompt="Two numbers:", extra_body={"response_format": fmt}, temperature=0, max_tokens=20
    )
    numbers = json.loads(done.choices[0].text)
    assert len(numbers) == 2 and all(isinstance(n, int) for n in numbers)


def test_bad_response_formats_are_400s(smollm2_tools_client: openai.OpenAI) -> None:
    bad = [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "response_format"),
        ({"type": "json_schema"}, "response_format"),
        (
            {"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}},
            "response_format.json_schema.name",
        ),
        ({"type": "xml"}, "response_format.type"),
    ]
    for fmt, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            smollm2_tools_client.chat.completions.create(
                model="smollm2", messages=ASK, response_format=fmt, max_tokens=4
            )  # type: ignore[arg-type]
        assert err.value.body["param"] == param  # type: ignore[index]
    for extra in ({"min_tokens": 4}, {"ignore_eos": True}):  # the grammar's end must end the reply
        with pytest.raises(openai.BadRequestError) as err:
            smollm2_tools_client.chat.completions.create(
                model="smollm2", messages=ASK, response_format={"type": "json_object"}, max_tokens=8, extra_body=extra
            )
        assert next(iter(extra)) in err.value.body["message"]  # type: ignore[index]


def test_tool_choice_required_or_named_makes_a_call(smollm2_tools_client: openai.OpenAI) -> None:
    """Asked with no example calls, the model answers in prose on "auto"; "required" and a named
    function make it call, with arguments valid under the function's parameters."""
    client = smollm2_tools_client
    prose = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=30
    )  # type: ignore[arg-type]
    assert prose.choices[0].message.tool_calls is None and prose.choices[0].message.content
    named = {"type": "function", "function": {"name": "get_time"}}
    # (a named function's reply finishes "stop", as OpenAI's; "required": "tool_calls")
    for choice, name, finish in (("required", "get_weather", "tool_calls"), (named, "get_time", "stop")):
        out = client.chat.completions.create(
            model="smollm2",
            messages=ASK,  # type: ignore[arg-type]
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
        )
        message = out.choices[0].message
        assert out.choices[0].finish_reason == finish and message.content is None
        [call] = message.tool_calls or []
        assert call.function.name == name and json.loads(call.function.arguments) == {"city": "Oslo"}
    # streamed: the call as it is written, no tag in the text
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=ASK,  # type: ignore[arg-type]
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    [[(name, args)]] = streamed_calls(chunks).values()
    assert name == "get_weather" and json.loads(args) == {"city": "Oslo"}


def _reply(client: openai.OpenAI, name: str, schema: dict[str, Any]) -> Any:
    """The one choice of a greedy chat reply held to ``schema``."""
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    out = client.chat.completions.create(
        model="smollm2", messages=ASK, response_format=fmt, temperature=0, max_tokens=30
    )  # type: ignore[arg-type,call-overload]
    return out.choices[0]


def test_a_schema_without_a_finite_instance_cuts_the_reply_short(smollm2_tools_client: openai.OpenAI) -> None:
    """Such a schema compiles, and llguidance gives up on it after a few tokens: the reply is
    cut short (``length``, the reason in ``stop_reason``), not a finished ``stop``, and the
    engine serves on. Objects put together with ``allOf`` are not closed (closing a part would
    forbid the other's keys), so such a schema is served, not refused."""
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    choice = _reply(smollm2_tools_client, "endless", endless)
    assert choice.finish_reason == "length" and len(choice.message.content or "") < 30
    assert str(choice.model_extra["stop_reason"]).startswith("grammar: ")
    parts = [{"type": "object", "properties": {k: {"type": "integer"}}, "required": [k]} for k in "ab"]
    text = _reply(smollm2_tools_client, "both", {"allOf": parts}).message.content or ""
    assert text.startswith('{"a": ') and '"b": ' in text  # (open: the model may add keys until max_tokens)


def test_vllms_guided_decoding_fields(smollm2_tools_client: openai.OpenAI) -> None:
    """``guided_choice``, ``guided_regex``, ``guided_json`` (also as JSON text) and
    ``guided_grammar`` (GBNF here), and the same under ``structured_outputs``, as vLLM takes them."""
    client = smollm2_tools_client
    ask = [{"role": "user", "content": "Is the sky green? Answer yes or no."}]

    def reply(**extra: Any) -> str:
        out = client.chat.completions.create(
            model="smollm2", messages=ask, temperature=0, max_tokens=20, extra_body=extra
        )  # type: ignore[arg-type]
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].message.content or ""

    assert reply(guided_choice=["yes", "no"]) in ("yes", "no")
    assert reply(structured_outputs={"choice": ["maybe", "never"]}) in ("maybe", "never")
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", reply(guided_regex=r"[A-Z][a-z]{2,8}"))
    assert isinstance(json.loads(reply(guided_json=json.dumps({"type": "boolean"}))), bool)
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    assert reply(structured_outputs={"grammar": gbnf}) in ("The answer is yes.", "The answer is no.")
    bad = [
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, None),  # at most one
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, None),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="smollm2", messages=ask, max_tokens=4, extra_body=extra)  # type: ignore[arg-type]
        if param is not None:
            assert err.value.body["param"] == param, err.value.body  # type: ignore[index]

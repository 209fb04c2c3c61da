"""Structured outputs and tool_choice through the whole server, over an engine of noise.

`GrammarEngine` samples random logits under each request's grammar in process, as MAX's
worker masks the tiny random model's: only the constraint can make the output valid.
"""

import contextlib
import json

import openai
import pytest
from openai import OpenAI

from gptoss_max.server.app import build_app
from grammar_engine import GrammarEngine
from server_fixtures import serving
from structured_cases import SCHEMAS, TOOL_SCHEMAS, TOOLS, WEATHER, chat_tool, valid

NAMES = list(SCHEMAS)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = GrammarEngine()
    app = build_app(engine, tmp_path_factory.mktemp("s") / "r.sqlite3", constrained_reasoning_tokens=16)
    with serving(app) as base:
        yield engine, OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0), base


def fmt(name: str, strict: bool = True) -> dict:
    return {"type": "json_schema", **chat_fmt(name, SCHEMAS[name], strict)}


def chat_fmt(name: str, schema: dict, strict: bool = True) -> dict:
    return {"name": name, "schema": schema, "strict": strict}


@pytest.mark.parametrize("name", NAMES[::2])
def test_responses_json_schema(served, name):
    engine, client, _ = served
    resp = client.responses.create(model=engine.model_name, input="JSON please", text={"format": fmt(name)},
                                   max_output_tokens=600)  # fmt: skip
    assert resp.status == "completed"
    assert resp.output[-1].type == "message" and resp.output[-1].phase == "final_answer"
    valid(resp.output_text, SCHEMAS[name])
    assert engine.params[-1].grammar is not None


@pytest.mark.parametrize("name", NAMES[1::2])
def test_responses_json_schema_streamed(served, name):
    engine, client, _ = served
    with client.responses.stream(model=engine.model_name, input="JSON please", text={"format": fmt(name)},
                                 max_output_tokens=600) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert "".join(deltas) == final.output_text
    valid(final.output_text, SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format(served, stream):
    engine, client, _ = served
    for name in NAMES[:4]:
        kw = dict(model=engine.model_name, messages=[{"role": "user", "content": "JSON"}], max_tokens=600,
                  response_format={"type": "json_schema", "json_schema": chat_fmt(name, SCHEMAS[name])})  # fmt: skip
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            out = client.chat.completions.create(**kw)
            content = out.choices[0].message.content
            assert out.choices[0].finish_reason == "stop"
        valid(content, SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "add"}])
def test_responses_forced_calls(served, choice):
    engine, client, _ = served
    for _ in range(4):
        resp = client.responses.create(model=engine.model_name, input="Go", tools=TOOLS, tool_choice=choice,
                                       max_output_tokens=600)  # fmt: skip
        call = resp.output[-1]
        assert resp.status == "completed" and call.type == "function_call"
        assert call.name == choice["name"] if isinstance(choice, dict) else call.name in TOOL_SCHEMAS
        valid(call.arguments, TOOL_SCHEMAS[call.name])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_forced_call(served, stream):
    engine, client, _ = served
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=engine.model_name, messages=[{"role": "user", "content": "Weather?"}], max_tokens=600,
              tools=[chat_tool(t) for t in TOOLS], tool_choice=named)  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        name, args = calls[0].function.name, "".join(tc.function.arguments or "" for tc in calls)
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = client.chat.completions.create(**kw)
        [call] = out.choices[0].message.tool_calls
        name, args, finish = call.function.name, call.function.arguments, out.choices[0].finish_reason
    assert (name, finish) == ("get_weather", "tool_calls")
    valid(args, WEATHER["parameters"])


def test_tool_choice_none_with_a_format_answers_and_never_calls(served):
    engine, client, _ = served
    resp = client.responses.create(model=engine.model_name, input="x", tools=TOOLS, tool_choice="none",
                                   text={"format": fmt("enum")}, max_output_tokens=600)  # fmt: skip
    assert [i.type for i in resp.output if i.type == "function_call"] == []
    valid(resp.output_text, SCHEMAS["enum"])
    assert "get_weather" not in json.dumps(json.loads(engine.params[-1].grammar))


def test_json_object_gets_a_grammar_and_plain_text_none(served):
    engine, client, _ = served
    with contextlib.suppress(Exception):  # an open object under noise may run to the budget
        client.responses.create(model=engine.model_name, input="x", text={"format": {"type": "json_object"}},
                                max_output_tokens=40)  # fmt: skip
    assert '"type":"object"' in engine.params[-1].grammar
    client.responses.create(model=engine.model_name, input="x", max_output_tokens=4)
    assert engine.params[-1].grammar is None


def bad_schema_error(client, model, **kw):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input="x", **kw)
    return err.value.body


def test_a_schema_the_grammar_cannot_enforce_is_a_400_that_says_why(served):
    engine, client, base = served
    schema = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
    strict = {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}
    body = bad_schema_error(client, engine.model_name, text=strict)
    assert body["param"] == "text.format.schema" and body["code"] == "invalid_schema"
    assert "unsupported schema keyword: not" in body["message"]
    loose = {"format": {**strict["format"], "strict": False}}  # enforced without the `not`
    assert client.responses.create(model=engine.model_name, input="x", text=loose, max_output_tokens=2)
    regex = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?<=a)b"}}}
    body = bad_schema_error(client, engine.model_name, text={"format": {**loose["format"], "schema": regex}})
    assert "Lookbehind is not supported" in body["message"]
    tool = {**TOOLS[1], "parameters": {**TOOLS[1]["parameters"], "properties": {"a": {"uniqueItems": True}}}}
    body = bad_schema_error(client, engine.model_name, tools=[tool])
    assert body["param"] == "tools[0].parameters" and "uniqueItems" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": chat_fmt("n", schema)},
        )
    assert err.value.body["param"] == "response_format.json_schema.schema"


def test_the_sdks_parse_helpers_get_their_pydantic_types_back(served):
    """`responses.parse(text_format=...)` and `chat.completions.parse(response_format=...)` send
    the SDK's strict schema of a pydantic model and validate the answer into it."""
    from typing import Literal

    from pydantic import BaseModel

    class Step(BaseModel):  # no unbounded number: noise under a grammar writes 400-digit integers
        explanation: str
        done: bool

    class Plan(BaseModel):
        step: Step
        verdict: Literal["yes", "no"]

    engine, client, _ = served
    resp = client.responses.parse(model=engine.model_name, input="Plan it", text_format=Plan, max_output_tokens=1500)
    assert resp.status == "completed" and isinstance(resp.output_parsed, Plan)
    assert resp.output_parsed.verdict in ("yes", "no")
    chat = client.chat.completions.parse(model=engine.model_name, messages=[{"role": "user", "content": "Plan it"}],
                                         response_format=Plan, max_tokens=1500)  # fmt: skip
    assert chat.choices[0].finish_reason == "stop" and isinstance(chat.choices[0].message.parsed, Plan)

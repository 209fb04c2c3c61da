"""/v1/responses over a scripted engine, driven by the official openai SDK through real HTTP."""

import contextlib
import time

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response
from prometheus_client import REGISTRY

from gptoss_max.server.app import build_app
from gptoss_max.server.engine import ScriptedEngine
from server_fixtures import (
    AFTER_TOOL,
    FINAL,
    TOOL_CALL,
    TOOL_ROUND_TRIP_PROMPT,
    WEATHER_TOOL,
    decode,
    long_script,
    serving,
)


def unparsed(obj):
    """A dump without the SDK's client-side `parsed*` additions."""
    if isinstance(obj, dict):
        return {k: unparsed(v) for k, v in obj.items() if not k.startswith("parsed")}
    if isinstance(obj, list):
        return [unparsed(v) for v in obj]
    return obj


@pytest.fixture
def make(tmp_path):
    stack = contextlib.ExitStack()

    def make(scripts, store=None, **engine_kw):
        engine = ScriptedEngine(scripts, **engine_kw)
        app = build_app(engine, store or tmp_path / "responses.sqlite3")
        base = stack.enter_context(serving(app))
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        return engine, client, base

    yield make
    stack.close()


def test_create_reasoning_then_final(make):
    engine, client, _ = make([FINAL])
    resp = client.responses.create(
        model=engine.model_name, input="Hi!", instructions="Be warm.", reasoning={"effort": "low"}
    )
    assert isinstance(resp, Response) and resp.status == "completed"
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "The user greets. Greet back."
    assert resp.output_text == "Hello there!"
    assert resp.output[1].phase == "final_answer"
    usage = resp.usage
    assert usage.input_tokens == len(engine.prompts[0])
    assert usage.output_tokens == engine.emitted[0] and engine.cancelled == 0
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    prompt = decode(engine.prompts[0])
    assert "Reasoning: low" in prompt and "# Instructions\n\nBe warm." in prompt
    assert prompt.endswith("<|start|>user<|message|>Hi!<|end|><|start|>assistant")
    assert client.responses.retrieve(resp.id).output_text == "Hello there!"


def test_stream_event_sequence_matches_the_final_object(make):
    engine, client, _ = make([TOOL_CALL])
    with client.responses.stream(
        model=engine.model_name, input="Weather?", tools=[WEATHER_TOOL]
    ) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    for kind in ("reasoning_text", "output_text", "function_call_arguments"):
        assert f"response.{kind}.delta" in types and f"response.{kind}.done" in types
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in added] == [0, 1, 2] == [e.output_index for e in done]
    assert [e.item.id for e in done] == [item.id for item in final.output]
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    preamble, call = final.output[1], final.output[2]
    assert preamble.phase == "commentary" and preamble.content[0].text == "Checking the weather."
    assert call.name == "get_weather" and call.arguments == '{"city":"Paris"}'
    assert call.call_id.startswith("call_") and call.status == "completed"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    stored = client.responses.retrieve(final.id)
    assert unparsed(stored.model_dump()) == unparsed(final.model_dump())


def test_tool_round_trip_with_previous_response_id(make):
    engine, client, _ = make([TOOL_CALL, AFTER_TOOL, FINAL])
    first = client.responses.create(model=engine.model_name, input="Weather?", tools=[WEATHER_TOOL])
    call = first.output[-1]
    second = client.responses.create(
        model=engine.model_name,
        previous_response_id=first.id,
        tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp":20}'}],
    )
    assert second.output_text == "It is 20C in Paris." and second.previous_response_id == first.id
    prompt2 = decode(engine.prompts[1])
    # the tool chain is still open: its reasoning, preamble and call are all shown again
    assert prompt2.endswith("<|start|>user<|message|>Weather?<|end|>" + TOOL_ROUND_TRIP_PROMPT)
    third = client.responses.create(
        model=engine.model_name, previous_response_id=second.id, input="Thanks!"
    )
    assert third.status == "completed"
    prompt3 = decode(engine.prompts[2])
    # that turn ended in a final answer: its reasoning is dropped, the calls stay
    assert "Need the weather" not in prompt3 and "It is 20C.<|end|>" not in prompt3
    assert '{"temp":20}' in prompt3 and "It is 20C in Paris." in prompt3
    assert prompt3.endswith("<|start|>user<|message|>Thanks!<|end|><|start|>assistant")


def test_input_items_list_the_whole_conversation_a_page_at_a_time(make):
    engine, client, base = make([TOOL_CALL, AFTER_TOOL, FINAL])
    first = client.responses.create(model=engine.model_name, input="Weather?", tools=[WEATHER_TOOL])
    call = first.output[-1]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp":20}'}
    second = client.responses.create(model=engine.model_name, previous_response_id=first.id,
                                     tools=[WEATHER_TOOL], input=[output])  # fmt: skip
    third = client.responses.create(model=engine.model_name, previous_response_id=second.id, input="Thanks!")

    # the first response's input: the string, as a user message with an id
    (item,) = client.responses.input_items.list(first.id).data
    assert item.type == "message" and item.role == "user" and item.id.startswith("msg_")
    assert [c.text for c in item.content] == ["Weather?"] and item.content[0].type == "input_text"

    # the third's: every earlier input and output (with the ids the outputs were given), then "Thanks!"
    want = [item.id, *(o.id for o in first.output)]
    listed = client.responses.input_items.list(third.id, order="asc", limit=100).data
    assert [i.id for i in listed][: len(want)] == want
    assert [i.type for i in listed] == (["message"] + [o.type for o in first.output] + ["function_call_output"]
                                        + [o.type for o in second.output] + ["message"])  # fmt: skip
    assert listed[len(want)].call_id == call.call_id and listed[len(want)].id.startswith("fco_")
    assert [c.text for c in listed[-1].content] == ["Thanks!"]
    assert [i.id for i in listed[len(want) + 1 : -1]] == [o.id for o in second.output]

    # desc (the default) is newest first; the SDK pages through `after` by itself
    pages = client.responses.input_items.list(third.id, limit=2)
    assert [i.id for i in pages.data] == [listed[-1].id, listed[-2].id] and pages.has_more
    assert [i.id for i in pages] == [i.id for i in reversed(listed)]  # every page, in order
    page = httpx.get(f"{base}/v1/responses/{third.id}/input_items",
                     params={"order": "asc", "after": listed[0].id, "before": listed[3].id}).json()  # fmt: skip
    assert [i["id"] for i in page["data"]] == [listed[1].id, listed[2].id] and not page["has_more"]
    assert page["first_id"] == listed[1].id and page["last_id"] == listed[2].id

    for params, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        r = httpx.get(f"{base}/v1/responses/{third.id}/input_items", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_deleting_a_turn_leaves_the_turns_after_it_whole(make):
    """The store keeps each turn as what it adds to the one before; a deleted turn is gone for the
    API while the turns continuing it still read (and continue) the whole conversation."""
    engine, client, base = make([TOOL_CALL, AFTER_TOOL, FINAL, FINAL])
    first = client.responses.create(model=engine.model_name, input="Weather?", tools=[WEATHER_TOOL])
    output = {"type": "function_call_output", "call_id": first.output[-1].call_id, "output": '{"temp":20}'}
    second = client.responses.create(model=engine.model_name, previous_response_id=first.id,
                                     tools=[WEATHER_TOOL], input=[output])  # fmt: skip
    third = client.responses.create(model=engine.model_name, previous_response_id=second.id, input="Thanks!")
    follow = {"model": engine.model_name, "previous_response_id": third.id, "input": "More?"}
    tokens = client.responses.input_tokens.count(**follow).input_tokens
    listed = [i.id for i in client.responses.input_items.list(third.id, order="asc", limit=100).data]

    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(second.id)
    assert client.responses.retrieve(third.id).output_text == third.output_text
    assert [i.id for i in client.responses.input_items.list(third.id, order="asc", limit=100).data] == listed
    assert client.responses.input_tokens.count(**follow).input_tokens == tokens
    fourth = client.responses.create(**follow)
    assert fourth.status == "completed" and len(engine.prompts[3]) == tokens
    assert "Weather?" in decode(engine.prompts[3]) and '{"temp":20}' in decode(engine.prompts[3])
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_truncation_auto_drops_the_oldest_turns_when_the_context_is_full(make):
    engine, client, _ = make([FINAL], max_context=400)
    first = client.responses.create(model=engine.model_name, input="alpha " * 120, max_output_tokens=16)
    assert first.truncation == "disabled"
    follow = {"model": engine.model_name, "previous_response_id": first.id, "input": "beta " * 200}
    with pytest.raises(openai.BadRequestError) as err:  # by default a full context is a 400, as at OpenAI
        client.responses.create(**follow)
    assert err.value.body["code"] == "context_length_exceeded"
    second = client.responses.create(**follow, truncation="auto")
    assert second.status == "completed" and second.truncation == "auto"
    prompt = decode(engine.prompts[-1])
    assert "alpha" not in prompt and "Hello there!" not in prompt and prompt.count("beta") == 200
    assert len(engine.prompts[-1]) < 400
    # the stored conversation keeps every turn: the input items still list the first one
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [c.text for c in items[0].content] == ["alpha " * 120]
    # a last turn too long by itself is still a 400
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=engine.model_name, input="gamma " * 500, truncation="auto")
    assert err.value.body["code"] == "context_length_exceeded"


def test_input_tokens_count_the_prompt_create_would_send(make):
    engine, client, _ = make([TOOL_CALL, FINAL], max_context=400)
    count = client.responses.input_tokens.count(model=engine.model_name, input="Weather?", tools=[WEATHER_TOOL],
                                                instructions="Be brief.")  # fmt: skip
    assert count.object == "response.input_tokens"
    first = client.responses.create(model=engine.model_name, input="Weather?", tools=[WEATHER_TOOL],
                                    instructions="Be brief.")  # fmt: skip
    assert count.input_tokens == len(engine.prompts[0]) == first.usage.input_tokens
    # with a stored conversation, model and input left out (tools and instructions are per request)
    again = client.responses.input_tokens.count(previous_response_id=first.id, tools=[WEATHER_TOOL],
                                                instructions="Be brief.")  # fmt: skip
    assert again.input_tokens > count.input_tokens  # the first turn's call is in it now
    # too long for the context: counted all the same; with truncation "auto", as create would cut it
    follow = {"input": "beta " * 250, "tools": [WEATHER_TOOL]}
    full = client.responses.input_tokens.count(**follow, previous_response_id=first.id).input_tokens
    cut = client.responses.input_tokens.count(**follow, previous_response_id=first.id, truncation="auto")
    alone = client.responses.input_tokens.count(**follow).input_tokens  # the new turn by itself
    assert full > 400 - 1 >= cut.input_tokens == alone, (full, cut, alone)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError):
        client.responses.input_tokens.count(model="gpt-5", input="x")
    assert len(engine.prompts) == 1, "counting never reaches the engine"


def test_stateless_round_trip_renders_the_same_prompt(make):
    engine, client, _ = make([TOOL_CALL, AFTER_TOOL, TOOL_CALL, AFTER_TOOL])
    first = client.responses.create(model=engine.model_name, input="Weather?", tools=[WEATHER_TOOL])
    output = {"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "20"}
    client.responses.create(
        model=engine.model_name, previous_response_id=first.id, tools=[WEATHER_TOOL], input=[output]
    )
    again = client.responses.create(
        model=engine.model_name, input="Weather?", tools=[WEATHER_TOOL], store=False
    )
    items = [{"role": "user", "content": "Weather?"}]
    items += [item.model_dump(exclude_none=True) for item in again.output]
    items.append({**output, "call_id": again.output[-1].call_id})
    client.responses.create(model=engine.model_name, input=items, tools=[WEATHER_TOOL], store=False)
    assert engine.prompts[3] == engine.prompts[1], "echoing the output back = previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)


def test_incomplete_on_max_output_tokens(make):
    engine, client, _ = make([long_script(50)])
    resp = client.responses.create(model=engine.model_name, input="Talk.", max_output_tokens=8)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 8 and engine.params[0].max_new_tokens == 8
    assert resp.output[-1].status == "incomplete" and resp.output_text.startswith(" word")
    with client.responses.stream(model=engine.model_name, input="Talk.", max_output_tokens=8) as s:
        events = list(s)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_named_tool_choice_goes_to_the_engine_as_a_grammar(make):
    engine, client, _ = make(
        ['<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>']
    )
    resp = client.responses.create(
        model=engine.model_name,
        input="Weather in Oslo?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert [(i.type, i.name, i.arguments) for i in resp.output] == [
        ("function_call", "get_weather", '{"city":"Oslo"}')
    ]
    assert decode(engine.prompts[0]).endswith("<|start|>assistant")  # nothing prefilled
    assert "commentary to=functions.get_weather" in engine.params[0].grammar


def test_engine_failure_mid_stream_ends_as_failed_with_an_error_event(make):
    engine, client, _ = make([long_script(20)], chunk_size=4)
    real = engine.generate

    async def broken(prompt_ids, params):
        n = 0
        async for chunk in real(prompt_ids, params):
            yield chunk
            n += 1
            if n == 2:
                raise RuntimeError("worker crashed")

    engine.generate = broken
    with client.responses.stream(model=engine.model_name, input="x") as s:
        events = list(s)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and "worker crashed" in failed.error.message
    assert all(item.status in ("completed", "incomplete") for item in failed.output)


def test_dropped_stream_cancels_its_generation(make):
    engine, client, base = make([long_script(400)], chunk_size=1, delay=0.01)
    cancelled_before = REGISTRY.get_sample_value("gptoss_cancelled_total") or 0
    body = {"model": engine.model_name, "input": "Talk.", "stream": True}
    with httpx.stream("POST", f"{base}/v1/responses", json=body, timeout=10) as r:
        assert r.status_code == 200
        deltas = 0
        for line in r.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                break
        assert deltas == 3
    deadline = time.monotonic() + 5
    while engine.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.cancelled == 1 and engine.active == 0
    assert REGISTRY.get_sample_value("gptoss_cancelled_total") == cancelled_before + 1
    assert "gptoss_cancelled_total" in httpx.get(f"{base}/metrics").text
    assert engine.emitted[0] < 200, "generation stopped soon after the client left"
    assert client.models.list().data[0].id == engine.model_name, "the server is still up"


def test_store_survives_a_restart(tmp_path):
    path = tmp_path / "store.sqlite3"
    engine = ScriptedEngine([TOOL_CALL, AFTER_TOOL])
    with serving(build_app(engine, path)) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        first = client.responses.create(
            model=engine.model_name, input="Weather?", tools=[WEATHER_TOOL]
        )
    engine2 = ScriptedEngine([AFTER_TOOL])
    with serving(build_app(engine2, path)) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        assert client.responses.retrieve(first.id).output[-1].call_id == first.output[-1].call_id
        out = {"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "20"}
        second = client.responses.create(
            model=engine2.model_name,
            previous_response_id=first.id,
            input=[out],
            tools=[WEATHER_TOOL],
        )
        assert second.output_text == "It is 20C in Paris."
        assert "Need the weather for Paris." in decode(engine2.prompts[0])
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)


def test_client_giving_up_on_a_non_streaming_request_cancels_it(make):
    engine, _, base = make([long_script(400)], chunk_size=1, delay=0.01)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base}/v1/responses", json={"model": engine.model_name, "input": "x"}, timeout=0.5
        )
    deadline = time.monotonic() + 5
    while engine.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.cancelled == 1 and engine.emitted[0] < 200


def test_json_schema_format_goes_to_the_developer_message(make):
    engine, client, _ = make(['<|channel|>final<|message|>{"answer":42}<|return|>'])
    fmt = {"type": "json_schema", "name": "answer", "strict": True,
           "schema": {"type": "object", "properties": {"answer": {"type": "integer"}}}}  # fmt: skip
    resp = client.responses.create(model=engine.model_name, input="6*7?", text={"format": fmt})
    assert resp.output_text == '{"answer":42}' and resp.text.format.name == "answer"
    assert '# Response Formats\n\n## answer\n\n{"type":"object"' in decode(engine.prompts[0])


def test_required_tool_choice_forces_a_call(make):
    engine, client, _ = make(['<|channel|>commentary to=functions.get_weather<|message|>{}<|call|>'])
    resp = client.responses.create(
        model=engine.model_name, input="Hi", tools=[WEATHER_TOOL], tool_choice="required"
    )
    assert [(i.type, i.name) for i in resp.output] == [("function_call", "get_weather")]
    assert '"value":"final"' not in engine.params[0].grammar  # no final answer allowed

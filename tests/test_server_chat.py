"""Harmony-correct /v1/chat/completions through the openai SDK."""

import contextlib
import json

import openai
import pytest
from openai import OpenAI

from gptoss_max.server.app import build_app
from gptoss_max.server.engine import ScriptedEngine
from server_fixtures import AFTER_TOOL, FINAL, TOOL_CALL, TOOL_ROUND_TRIP_PROMPT, decode, long_script, serving

CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
def make(tmp_path):
    with contextlib.ExitStack() as stack:

        def make(scripts):
            engine = ScriptedEngine(scripts)
            base = stack.enter_context(serving(build_app(engine, tmp_path / "r.sqlite3")))
            return engine, OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)

        yield make


def test_reasoning_content_and_content_are_split(make):
    engine, client = make([FINAL])
    out = client.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "system", "content": "Be warm."}, {"role": "user", "content": "Hi"}],
        reasoning_effort="high",
    )
    choice = out.choices[0]
    assert choice.message.content == "Hello there!" and choice.finish_reason == "stop"
    assert choice.message.model_extra["reasoning_content"] == "The user greets. Greet back."
    assert out.usage.completion_tokens == engine.emitted[0]
    assert out.usage.completion_tokens_details.reasoning_tokens > 0
    prompt = decode(engine.prompts[0])
    assert "Reasoning: high" in prompt and "# Instructions\n\nBe warm." in prompt


def test_tool_calls_then_tool_result_keeps_the_chain(make):
    engine, client = make([TOOL_CALL, AFTER_TOOL])
    messages = [{"role": "user", "content": "Weather?"}]
    first = client.chat.completions.create(
        model=engine.model_name, messages=messages, tools=[CHAT_TOOL]
    )
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking the weather."
    [call] = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    messages += [
        {
            "role": "assistant",
            "content": msg.content,
            "reasoning_content": msg.model_extra["reasoning_content"],
            "tool_calls": [call.model_dump(exclude_none=True)],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp":20}'},
    ]
    second = client.chat.completions.create(
        model=engine.model_name, messages=messages, tools=[CHAT_TOOL]
    )
    assert second.choices[0].message.content == "It is 20C in Paris."
    prompt = decode(engine.prompts[1])
    assert prompt.endswith(TOOL_ROUND_TRIP_PROMPT)


def test_stream_deltas_assemble_to_the_same_message(make):
    engine, client = make([TOOL_CALL])
    stream = client.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[CHAT_TOOL],
        stream=True,
        stream_options={"include_usage": True},
    )
    reasoning, content, args, names, finish, usage = "", "", "", [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                names += [tc.function.name] if tc.function.name else []
                args += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert reasoning == "Need the weather for Paris." and content == "Checking the weather."
    assert names == ["get_weather"] and json.loads(args) == {"city": "Paris"}
    assert finish == "tool_calls" and usage.completion_tokens == engine.emitted[0]


def test_length_finish_reason(make):
    engine, client = make([long_script(40)])
    out = client.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "Talk"}], max_tokens=6
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6


def test_unknown_tool_call_id_is_400(make):
    engine, client = make([FINAL])

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "tool", "tool_call_id": "nope", "content": "x"}],
        )
    assert err.value.body["param"] == "messages[0].tool_call_id"


def test_json_schema_response_format(make):
    engine, client = make(['<|channel|>final<|message|>{"a":1}<|return|>'])
    out = client.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": "json please"}],
        response_format={"type": "json_schema", "json_schema": {"name": "obj", "schema": {}}},
    )
    assert out.choices[0].message.content == '{"a":1}'
    assert "# Response Formats\n\n## obj\n\n{}" in decode(engine.prompts[0])


def test_client_defaults_pass_but_real_penalties_are_refused(make):
    engine, client = make([FINAL])
    ok = dict(frequency_penalty=0, presence_penalty=0, logprobs=False, n=1, stop=[])
    msgs = [{"role": "user", "content": "Hi"}]
    assert client.chat.completions.create(model=engine.model_name, messages=msgs, **ok).choices
    bad_stops = ({"stop": [""]}, {"stop": ["a", "b", "c", "d", "e"]})  # empty, and more than OpenAI's 4
    odd_types = ({"n": True}, {"logprobs": 0}, {"store": 0})  # Literal[1] took true, Literal[False] 0
    for bad in ({"frequency_penalty": 0.5}, {"logprobs": True}, {"n": 2}, *bad_stops, *odd_types):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=engine.model_name, messages=msgs, **bad)
        assert err.value.body["param"].startswith(next(iter(bad)))  # e.g. stop[0]


def test_preamble_and_final_are_separated(make):
    script = (
        "<|channel|>commentary<|message|>Let me think.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    )
    engine, client = make([script, script])
    msgs = [{"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=engine.model_name, messages=msgs)
    assert out.choices[0].message.content == "Let me think.\n\nDone."
    stream = client.chat.completions.create(model=engine.model_name, messages=msgs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
        "Let me think.\n\nDone."
    )


STOP_SCRIPT = (
    "<|channel|>analysis<|message|>Plan: say it, then Observation: none.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Thought: look it up.\nObservation: it rains.<|return|>"
)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3])
def test_stop_sequences_end_the_content(tmp_path, stream, chunk_size):
    """`stop` cuts the content before the first stop sequence (never the reasoning), ends as
    finish_reason "stop", and cancels the rest of the generation; a stream never shows text a
    stop takes back, however the sequence falls across chunks."""
    engine = ScriptedEngine([STOP_SCRIPT], chunk_size=chunk_size)
    with serving(build_app(engine, tmp_path / "r.sqlite3")) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Rain?"}]
        for stop, want in ((["Observation:", "zzz"], "Thought: look it up.\n"), ("up", "Thought: look it "),
                           (["never"], "Thought: look it up.\nObservation: it rains.")):  # fmt: skip
            before = engine.cancelled
            out = client.chat.completions.create(model=engine.model_name, messages=msgs, stop=stop, stream=stream)
            if stream:
                content, reasoning, finish = "", "", None
                for chunk in out:
                    for choice in chunk.choices:
                        content += choice.delta.content or ""
                        reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                        finish = choice.finish_reason or finish
            else:
                message, finish = out.choices[0].message, out.choices[0].finish_reason
                content, reasoning = message.content, message.model_extra["reasoning_content"]
            assert content == want and finish == "stop", (stop, content)
            assert reasoning == "Plan: say it, then Observation: none."  # stops do not apply there
            cut_short = stop != ["never"]
            assert engine.cancelled == before + cut_short, "a stop cancels what was left to generate"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_in_the_chunk_that_reaches_max_tokens_is_a_completed_stop(tmp_path, stream):
    """The whole answer comes as one chunk that also reaches max_tokens: the stop sequence in it
    still ends the completion as finish_reason "stop", and the request counts as completed (it
    counted as incomplete, the status of a completion cut by its length)."""
    from gptoss_max.server import metrics
    from gptoss_max.tokenizer import harmony_encoding

    total = len(harmony_encoding().encode(STOP_SCRIPT, allowed_special="all"))
    engine = ScriptedEngine([STOP_SCRIPT], chunk_size=total)
    completed = metrics.REQUESTS.labels("chat", "completed")
    incomplete = metrics.REQUESTS.labels("chat", "incomplete")
    with serving(build_app(engine, tmp_path / "r.sqlite3")) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Rain?"}]
        for stop, finish_want, status in (("Observation:", "stop", completed), ("never", "length", incomplete)):
            before = status._value.get()
            out = client.chat.completions.create(model=engine.model_name, messages=msgs, stop=stop,
                                                 max_tokens=total - 1, stream=stream)  # fmt: skip
            if stream:
                chunks = list(out)
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            else:
                content, finish = out.choices[0].message.content, out.choices[0].finish_reason
            assert finish == finish_want and content.startswith("Thought: look it up.\n"), (stop, finish, content)
            assert ("Observation" in content) == (stop == "never")
            assert status._value.get() == before + 1, (stop, "counted under another status")

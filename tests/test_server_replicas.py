"""Two replicas (two servers, each its own engine and store object) sharing one PostgreSQL
database, as behind a load balancer: each continues the other's conversations."""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest
from openai import OpenAI

from gptoss_max.server.app import build_app
from gptoss_max.server.engine import ScriptedEngine
from gptoss_max.server.store_pg import PostgresStore
from pg_fixtures import pg_server_url, pg_url  # noqa: F401 - fixtures
from server_fixtures import AFTER_TOOL, FINAL, TOOL_CALL, TOOL_ROUND_TRIP_PROMPT, WEATHER_TOOL, decode, serving


@pytest.fixture
def replicas(pg_url):  # noqa: F811
    with contextlib.ExitStack() as stack:
        out = []
        for scripts in ([TOOL_CALL, FINAL], [AFTER_TOOL, FINAL]):
            engine = ScriptedEngine(scripts)
            base = stack.enter_context(serving(build_app(engine, PostgresStore(pg_url))))
            out.append((engine, OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0), base))
        yield out


def test_replicas_continue_each_others_conversations(replicas):
    (engine_a, a, base_a), (engine_b, b, base_b) = replicas
    call = a.responses.create(model=engine_a.model_name, input="Weather in Paris?", tools=[WEATHER_TOOL])
    assert call.output[-1].type == "function_call"
    # the tool's result goes to the other replica, which has never seen this conversation
    after = b.responses.create(
        model=engine_b.model_name, previous_response_id=call.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.output[-1].call_id, "output": '{"temp":20}'}],
    )  # fmt: skip
    assert after.output_text == "It is 20C in Paris."
    prompt = decode(engine_b.prompts[0])
    assert "<|start|>user<|message|>Weather in Paris?<|end|>" in prompt
    assert prompt.endswith(TOOL_ROUND_TRIP_PROMPT)
    # and back: A continues B's response (streamed), B and A both read it
    with a.responses.stream(model=engine_a.model_name, input="Thanks!", previous_response_id=after.id) as s:
        third = s.get_final_response()
    assert third.output_text == "Hello there!"
    assert "It is 20C in Paris." in decode(engine_a.prompts[1])
    assert b.responses.retrieve(third.id).output_text == "Hello there!"
    assert a.responses.retrieve(after.id).previous_response_id == call.id
    # a delete on one is seen by the other
    assert httpx.delete(f"{base_b}/v1/responses/{call.id}").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(call.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.create(model=engine_a.model_name, input="x", previous_response_id=call.id)

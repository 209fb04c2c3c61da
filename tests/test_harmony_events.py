"""Parse events -> Responses streaming events, checked against the official SDK's types."""

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gptoss_max.harmony.events import ResponseEvents
from gptoss_max.harmony.parse import parse_completion
from gptoss_max.harmony.render import encode_harmony

EVENT = TypeAdapter(ResponseStreamEvent)
SCRIPT = (
    "<|channel|>analysis<|message|>Need weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
)


def skeleton():
    return {"id": "resp_1", "object": "response", "created_at": 0, "status": "in_progress",
            "model": "m", "output": [], "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": []}  # fmt: skip


def run(script, status="completed", error=None, truncated=False):
    builder = ResponseEvents(skeleton())
    events = builder.opening()
    for parsed in parse_completion(encode_harmony(script), truncated=truncated):
        events += builder.on(parsed)
    builder.response["status"] = status
    builder.response["error"] = error
    events += builder.closing()
    return builder, events


def test_every_event_is_a_valid_sdk_event_with_dense_numbers():
    builder, events = run(SCRIPT)
    parsed = [EVENT.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * 3, "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 2, "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * 5, "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = Response.model_validate(parsed[-1].response.model_dump())
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    for e in parsed:
        if hasattr(e, "output_index") and hasattr(e, "item_id"):
            assert final.output[e.output_index].id == e.item_id
    assert builder.function_calls() == {final.output[2].call_id: "get_weather"}


@pytest.mark.parametrize("status", ["incomplete", "failed"])
def test_closing_events(status):
    error = {"code": "server_error", "message": "boom"} if status == "failed" else None
    _, events = run("<|channel|>final<|message|>Hello wor", status, error, truncated=True)
    parsed = [EVENT.validate_python(e) for e in events]
    tail = ["error", "response.failed"] if status == "failed" else ["response.incomplete"]
    assert [e.type for e in parsed[-len(tail) :]] == tail
    assert parsed[-1].response.output[0].status == "incomplete"

"""Parse events -> Responses API output items and streaming events.

The state machine of one streamed response: every `ItemStarted` opens an output item at
the next dense `output_index`, every `TextDelta` becomes the delta event of that item's
kind, every `ItemDone` closes it. The items built here are the very ones the final
response object carries, so ids agree between the stream and the object. Shapes follow
`openai.types.responses` (the SDK is not imported: plain dicts go on the wire).
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from gptoss_max.harmony.parse import ItemDone, ItemStarted, ParseEvent, TextDelta

_PART_TYPE = {"reasoning": "reasoning_text", "message": "output_text"}
_DELTA_EVENT = {
    "reasoning": "response.reasoning_text.delta",
    "message": "response.output_text.delta",
    "function_call": "response.function_call_arguments.delta",
}
_CLOSING_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part(kind: str, text: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": _PART_TYPE[kind], "text": text}
    if kind == "message":
        part.update(annotations=[], logprobs=[])
    return part


def _new_item(start: ItemStarted) -> dict:
    if start.kind == "reasoning":
        return {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
    if start.kind == "message":
        msg_id = new_id("msg")
        return {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "phase": start.phase,
        }
    call_id = new_id("call")
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": start.name,
        "arguments": "",
    }


class ResponseEvents:
    """Builds `response["output"]` from parse events and returns the matching SSE events."""

    def __init__(self, response: dict):
        self.response = response
        self.sequence = 0
        self._kind: str | None = None
        self._item: dict | None = None

    def _event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _where(self) -> dict:
        assert self._item is not None
        return {"item_id": self._item["id"], "output_index": len(self.response["output"]) - 1}

    def opening(self) -> list[dict]:
        return [
            self._event("response.created", response=copy.deepcopy(self.response)),
            self._event("response.in_progress", response=copy.deepcopy(self.response)),
        ]

    def on(self, event: ParseEvent) -> list[dict]:
        if isinstance(event, ItemStarted):
            return self._started(event)
        if isinstance(event, TextDelta):
            return self._delta(event.text)
        return self._done(event)

    def _started(self, start: ItemStarted) -> list[dict]:
        self._kind, self._item = start.kind, _new_item(start)
        self._item["status"] = "in_progress"
        self.response["output"].append(self._item)
        index = len(self.response["output"]) - 1
        item = copy.deepcopy(self._item)
        events = [self._event("response.output_item.added", output_index=index, item=item)]
        if start.kind != "function_call":
            part = _part(start.kind, "")
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def _delta(self, text: str) -> list[dict]:
        assert self._kind is not None
        fields = self._where()
        if self._kind != "function_call":
            fields["content_index"] = 0
        if self._kind == "message":
            fields["logprobs"] = []
        return [self._event(_DELTA_EVENT[self._kind], **fields, delta=text)]

    def _done(self, done: ItemDone) -> list[dict]:
        kind, item, where = self._kind, self._item, self._where()
        assert kind is not None and item is not None
        item["status"] = "completed" if done.complete else "incomplete"
        events = []
        if kind == "function_call":
            item["arguments"] = done.text
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=done.text,
                )
            )
        else:
            part = _part(kind, done.text)
            item["content"] = [part]
            if kind == "reasoning":
                text_done = self._event("response.reasoning_text.done", **where, content_index=0, text=done.text)
            else:
                text_done = self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=done.text,
                    logprobs=[],
                )
            events.append(text_done)
            events.append(self._event("response.content_part.done", **where, content_index=0, part=copy.deepcopy(part)))
        index = where["output_index"]
        events.append(self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
        self._kind = self._item = None
        return events

    def closing(self) -> list[dict]:
        """The terminal events for `response["status"]` (with an `error` event on failure)."""
        events = []
        error = self.response.get("error")
        if self.response["status"] == "failed" and error:
            events.append(self._event("error", code=error.get("code"), message=error["message"], param=None))
        closing = _CLOSING_EVENT[self.response["status"]]
        events.append(self._event(closing, response=copy.deepcopy(self.response)))
        return events

    def function_calls(self) -> dict[str, str]:
        """call_id -> function name for every call in the output."""
        return {item["call_id"]: item["name"] for item in self.response["output"] if item["type"] == "function_call"}


def sse(event: dict) -> str:
    """One server-sent event as the SDK reads it: named after its type, JSON data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

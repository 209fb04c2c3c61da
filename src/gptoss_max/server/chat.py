"""A Harmony-correct /v1/chat/completions: reasoning_content and tool_calls split out."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request, Response

from gptoss_max.harmony import messages as hm
from gptoss_max.harmony.events import new_id
from gptoss_max.harmony.parse import ItemStarted, ParseEvent, TextDelta
from gptoss_max.harmony.render import TurnSpec, render_prompt
from gptoss_max.server import grammar, tools
from gptoss_max.server.engine import GenParams
from gptoss_max.server.errors import bad_request, read_json_object, server_error, shutting_down
from gptoss_max.server.generation import Generation, reply
from gptoss_max.server.schemas import ChatRequest, parse_request
from gptoss_max.server.state import ServerState


def _spec(req: ChatRequest) -> TurnSpec:
    fns = [t.function for t in req.tools or []]
    defs = [(f.name, f.description, f.parameters, f.strict) for f in fns]
    funcs = tools.function_tools(defs, "tools")
    choice = req.tool_choice
    named = None if isinstance(choice, str) else choice.function.name
    fmt = req.response_format
    fmt_dict = None
    if fmt is not None:
        schema = fmt.json_schema.model_dump(by_alias=True) if fmt.json_schema else {}
        fmt_dict = {**schema, "type": fmt.type}
    return TurnSpec(
        effort=req.reasoning_effort or "medium",
        tools=funcs,
        tool_choice=tools.tool_choice(choice if isinstance(choice, str) else None, named, funcs),
        response_format=tools.response_format(fmt_dict, "response_format.json_schema"),
    )


class ChatRun:
    """Parse events -> one chat completion, or its stream of chunks."""

    def __init__(self, state: ServerState, req: ChatRequest, gen: Generation):
        self.req, self.gen = req, gen
        self.id, self.created, self.model = (
            new_id("chatcmpl"),
            int(time.time()),
            state.engine.model_name,
        )
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[dict] = []
        self._kind: str | None = None
        # `stop`: content ends before the first of these; content that could still begin one is
        # held back (`_held`) until it cannot, so no stream shows text a stop later takes back.
        self.stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self.stopped = False
        self._held = ""

    def on(self, event: ParseEvent) -> dict | None:
        """Take one event; return the streaming delta it makes, if any."""
        if self.stopped:  # a stop sequence ended the completion: the rest is not shown
            return None
        if isinstance(event, ItemStarted):
            self._kind = event.kind
            if event.kind == "message":
                return self._content("\n\n") if self.content or self._held else None  # a preamble, then more
            tail = self.flush() or {}  # text held for a stop sequence goes out before what follows it
            if event.kind != "function_call":
                return tail or None
            call = {
                "id": new_id("call"),
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            self.tool_calls.append(call)
            return {**tail, "tool_calls": [{"index": len(self.tool_calls) - 1, **copy.deepcopy(call)}]}
        if not isinstance(event, TextDelta):
            return None
        if self._kind == "reasoning":
            self.reasoning.append(event.text)
            return {"reasoning_content": event.text}
        if self._kind == "message":
            return self._content(event.text)
        self.tool_calls[-1]["function"]["arguments"] += event.text
        index = len(self.tool_calls) - 1
        return {"tool_calls": [{"index": index, "function": {"arguments": event.text}}]}

    def _content(self, text: str) -> dict | None:
        if not self.stops:
            self.content.append(text)
            return {"content": text}
        buf = self._held + text
        found = [i for i in (buf.find(stop) for stop in self.stops) if i >= 0]
        if found:
            shown, self._held, self.stopped = buf[: min(found)], "", True
            self.gen.stop_early()
        else:
            split = max(len(buf) - (max(map(len, self.stops)) - 1), 0)
            shown, self._held = buf[:split], buf[split:]
        if not shown:
            return None
        self.content.append(shown)
        return {"content": shown}

    def flush(self) -> dict | None:
        """The content held back for a stop sequence that did not come, at the end."""
        held, self._held = self._held, ""
        if not held:
            return None
        self.content.append(held)
        return {"content": held}

    def finish_reason(self) -> str:
        if self.stopped:
            return "stop"
        if self.gen.status == "incomplete":
            return "length"
        return "tool_calls" if self.tool_calls else "stop"

    def usage(self) -> dict:
        prompt, out = len(self.gen.prompt.ids), len(self.gen.output_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": out,
            "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": self.gen.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.gen.harmony.reasoning_tokens},
        }

    def _chunk(self, choices: list[dict], **extra) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _choice(self, delta: dict, finish: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    async def sse(self) -> AsyncIterator[str]:
        yield self._chunk([self._choice({"role": "assistant", "content": ""})])
        async for event in self.gen.events():
            delta = self.on(event)
            if delta:
                yield self._chunk([self._choice(delta)])
        tail = self.flush()
        if tail and not self.gen.failure:
            yield self._chunk([self._choice(tail)])
        self.gen.record_metrics("chat")
        if self.gen.failure:
            err = {
                "message": self.gen.failure,
                "type": "server_error",
                "param": None,
                "code": "server_shutting_down" if self.gen.aborted else "server_error",
            }
            yield f"data: {json.dumps({'error': err})}\n\n"
        else:
            yield self._chunk([self._choice({}, self.finish_reason())])
            if self.req.stream_options and self.req.stream_options.include_usage:
                yield self._chunk([], usage=self.usage())
        yield "data: [DONE]\n\n"

    async def complete(self) -> dict:
        async for event in self.gen.events():
            self.on(event)
        self.flush()
        self.gen.record_metrics("chat")
        if self.gen.aborted:
            raise shutting_down()
        if self.gen.failure:
            raise server_error(self.gen.failure)
        message = {
            "role": "assistant",
            "content": "".join(self.content) or None,
            "reasoning_content": "".join(self.reasoning) or None,
            "tool_calls": self.tool_calls or None,
        }
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": self.finish_reason(),
                }
            ],
            "usage": self.usage(),
        }


async def create(request: Request, state: ServerState) -> Response:
    req = parse_request(ChatRequest, await read_json_object(request))
    state.check_model(req.model)
    calls: dict[str, str] = {}
    try:
        history = hm.from_chat_messages(
            [m.model_dump(exclude_none=True) for m in req.messages], calls
        )
    except hm.HistoryError as exc:
        raise bad_request(str(exc), exc.param) from None
    spec = _spec(req)
    prompt = render_prompt(spec, history)
    budget = state.token_budget(
        len(prompt.ids), req.max_completion_tokens or req.max_tokens, "messages"
    )
    constraint = grammar.for_turn(spec, state.constrained_reasoning_tokens)
    params = GenParams(budget, temperature=req.temperature, top_p=req.top_p, seed=req.seed, grammar=constraint)
    gen = Generation(state.engine, prompt, params, state.generations)
    return await reply(request, gen, lambda g: ChatRun(state, req, g), req.stream)

"""The Responses API: create (JSON or SSE), retrieve, delete."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request, Response
from openai_harmony import Message

from gptoss_max.harmony import messages as hm
from gptoss_max.harmony.events import ResponseEvents, new_id, sse
from gptoss_max.harmony.render import Prompt, TurnSpec, render_prompt, render_prompt_within
from gptoss_max.server import grammar, tools
from gptoss_max.server.engine import GenParams
from gptoss_max.server.errors import bad_request, not_found, read_json_object
from gptoss_max.server.generation import Generation, reply
from gptoss_max.server.schemas import InputTokensRequest, NamedFunction, ResponsesRequest, parse_request
from gptoss_max.server.state import ServerState
from gptoss_max.server.store import Parent, StoredResponse

logger = logging.getLogger("gptoss_max.server")


@dataclass(frozen=True)
class Turn:
    """Everything decided before generation: the settings, the conversation, the prompt."""

    spec: TurnSpec
    history: list[Message]  # the stored conversation plus this request's input
    calls: dict[str, str]
    prompt: Prompt
    params: GenParams
    input_items: list[dict]  # what `GET /v1/responses/{id}/input_items` lists, oldest first
    parent: Parent | None = None  # the stored response continued, and its share of the two lists


def _input_items(req: ResponsesRequest) -> list[dict]:
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [item.model_dump(exclude_none=True, by_alias=True) for item in req.input]


_ITEM_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco"}


def listed_item(item: dict) -> dict:
    """An input item as the input-items list returns it: an id (the client's, else a new one), a
    status, and a message's text as parts (`input_text`, or `output_text` for the assistant)."""
    kind = item.get("type", "message")
    out = {"type": kind, "id": item.get("id") or new_id(_ITEM_ID_PREFIX[kind])}
    out.update({k: v for k, v in item.items() if k not in ("type", "id", "status")})
    if kind == "message":
        part = "output_text" if item["role"] == "assistant" else "input_text"
        texts = hm.content_texts(item["content"])
        out["content"] = [{"type": part, "text": t, **({"annotations": []} if part == "output_text" else {})}
                          for t in texts]  # fmt: skip
    out["status"] = item.get("status") or "completed"
    return out


def _spec(req: ResponsesRequest) -> TurnSpec:
    funcs = tools.function_tools([(t.name, t.description, t.parameters, t.strict) for t in req.tools], "tools")
    choice = req.tool_choice
    named = choice.name if isinstance(choice, NamedFunction) else None
    fmt = req.text.format if req.text else None
    return TurnSpec(
        effort=(req.reasoning.effort if req.reasoning else None) or "medium",
        instructions=req.instructions,
        tools=funcs,
        tool_choice=tools.tool_choice(choice if isinstance(choice, str) else None, named, funcs),
        response_format=tools.response_format(
            fmt.model_dump(by_alias=True) if fmt else None, "text.format"
        ),
    )


def _prompt(
    state: ServerState, req: ResponsesRequest, stored: StoredResponse | None
) -> tuple[TurnSpec, list[Message], dict[str, str], int, Prompt]:
    """The turn's settings, the conversation (stored plus this request's input), its function
    calls, how many of its messages were stored, and the prompt it renders to, with `truncation:
    "auto"` dropping the oldest turns until the input leaves room for one token."""
    calls = dict(stored.calls) if stored else {}
    history = hm.from_json(stored.history) if stored else []
    n_stored = len(history)
    try:
        history += hm.from_response_items(_input_items(req), calls)
    except hm.HistoryError as exc:
        raise bad_request(str(exc), exc.param) from None
    spec = _spec(req)
    if req.truncation == "auto":
        prompt, _dropped = render_prompt_within(spec, history, state.engine.max_context - 1)
    else:
        prompt = render_prompt(spec, history)
    return spec, history, calls, n_stored, prompt


def plan_turn(state: ServerState, req: ResponsesRequest, stored: StoredResponse | None) -> Turn:
    spec, history, calls, n_stored, prompt = _prompt(state, req, stored)
    earlier = stored.input_items + stored.response.get("output", []) if stored else []
    input_items = earlier + [listed_item(item) for item in _input_items(req)]
    budget = state.token_budget(len(prompt.ids), req.max_output_tokens, "input")
    constraint = grammar.for_turn(spec, state.constrained_reasoning_tokens)
    params = GenParams(budget, temperature=req.temperature, top_p=req.top_p, grammar=constraint)
    parent = None
    if stored is not None and req.previous_response_id:
        parent = Parent(req.previous_response_id, n_stored, len(stored.input_items))
    return Turn(spec, history, calls, prompt, params, input_items, parent)


async def _previous(state: ServerState, req: ResponsesRequest) -> StoredResponse | None:
    """The stored response `previous_response_id` names (404 if none), or None without one."""
    if not req.previous_response_id:
        return None
    stored = await asyncio.to_thread(state.store.get, req.previous_response_id)
    if stored is None:
        raise not_found(
            f"Previous response with id {req.previous_response_id!r} not found.",
            "previous_response_id",
        )
    return stored


def response_object(state: ServerState, req: ResponsesRequest, turn: Turn) -> dict:
    text_format = req.text.format if req.text and req.text.format else None
    return {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": state.engine.model_name,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": turn.spec.effort, "summary": None},
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format
            else {"type": "text"}
        },
        "tool_choice": req.model_dump(include={"tool_choice"})["tool_choice"],
        "tools": [t.model_dump(exclude_none=True) for t in req.tools],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def usage(gen: Generation) -> dict:
    inp, out = len(gen.prompt.ids), len(gen.output_ids)
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": gen.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": gen.harmony.reasoning_tokens},
        "total_tokens": inp + out,
    }


class ResponseRun:
    """Drives one generation into a response object, as SSE or as one JSON body."""

    def __init__(self, state: ServerState, req: ResponsesRequest, turn: Turn, gen: Generation):
        self.state, self.req, self.turn, self.gen = state, req, turn, gen
        self.events = ResponseEvents(response_object(state, req, turn))

    async def sse(self) -> AsyncIterator[str]:
        for event in self.events.opening():
            yield sse(event)
        async for parsed in self.gen.events():
            for event in self.events.on(parsed):
                yield sse(event)
        await self._finish()
        for event in self.events.closing():
            yield sse(event)

    async def complete(self) -> dict:
        async for parsed in self.gen.events():
            self.events.on(parsed)
        await self._finish()
        return self.events.response

    async def _finish(self) -> None:
        resp, gen = self.events.response, self.gen
        resp["status"] = gen.status
        resp["usage"] = usage(gen)
        if gen.status == "incomplete":
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        elif gen.status == "failed":
            resp["error"] = {"code": "server_error", "message": gen.failure}
        else:
            resp["completed_at"] = int(time.time())
        gen.record_metrics("responses")
        if self.req.store:
            history = hm.to_json(self.turn.history + gen.harmony.messages)
            calls = self.turn.calls | self.events.function_calls()
            try:
                await asyncio.to_thread(
                    self.state.store.put, resp, history, calls, self.turn.input_items, self.turn.parent
                )
            except Exception:  # the answer still goes out; only its continuation is lost
                logger.exception("could not store response %s", resp["id"])


async def create(request: Request, state: ServerState) -> Response:
    req = parse_request(ResponsesRequest, await read_json_object(request))
    state.check_model(req.model)
    turn = plan_turn(state, req, await _previous(state, req))
    gen = Generation(state.engine, turn.prompt, turn.params, state.generations)
    return await reply(request, gen, lambda g: ResponseRun(state, req, turn, g), req.stream)


async def count_input_tokens(request: Request, state: ServerState) -> dict:
    """`POST /v1/responses/input_tokens` (the SDK's `responses.input_tokens.count`): the tokens
    of the prompt a create request with this body would send the model. `model` and `input` may
    be left out; the prompt is the same one create renders, truncation included."""
    req = parse_request(InputTokensRequest, await read_json_object(request))
    state.check_model(req.model or state.engine.model_name)
    *_, prompt = _prompt(state, req, await _previous(state, req))
    return {"object": "response.input_tokens", "input_tokens": len(prompt.ids)}


async def retrieve(response_id: str, state: ServerState) -> dict:
    stored = await asyncio.to_thread(state.store.get, response_id)
    if stored is None:
        raise not_found(f"Response with id {response_id!r} not found.")
    return stored.response


async def input_items(
    response_id: str, state: ServerState, limit: int, order: str, after: str | None, before: str | None
) -> dict:
    """`GET /v1/responses/{id}/input_items`: the items the response was generated from, earlier
    turns' inputs and outputs included, a page at a time (OpenAI's cursor list: `order` desc by
    default, newest first; `after` / `before` are item ids of the list in that order)."""
    if not 1 <= limit <= 100:
        raise bad_request(f"Invalid value for 'limit': {limit}; it must be 1 to 100.", "limit", "invalid_value")
    if order not in ("asc", "desc"):
        raise bad_request(f"Invalid value for 'order': {order!r}; expected 'asc' or 'desc'.", "order", "invalid_value")
    stored = await asyncio.to_thread(state.store.get, response_id)
    if stored is None:
        raise not_found(f"Response with id {response_id!r} not found.")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    ids = [item["id"] for item in items]
    start, end = 0, len(items)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise bad_request(f"No input item with id {cursor!r} in this response.", name, "invalid_value")
    if after is not None:
        start = ids.index(after) + 1
    if before is not None:
        end = ids.index(before)
    page = items[start:end][:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + len(page) < end,
    }


async def delete(response_id: str, state: ServerState) -> dict:
    if not await asyncio.to_thread(state.store.delete, response_id):
        raise not_found(f"Response with id {response_id!r} not found.")
    return {"id": response_id, "object": "response", "deleted": True}

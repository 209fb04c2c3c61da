"""Our routes, as a standalone app (tests, scripted engine) or mounted on MAX's serving app."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from gptoss_max.server import chat, responses
from gptoss_max.server.bench import run_bench
from gptoss_max.server.engine import Engine
from gptoss_max.server.errors import install_handlers, not_found
from gptoss_max.server.guard import OPEN_PATHS, Guard
from gptoss_max.server.schemas import ChatRequest, InputTokensRequest, ResponsesRequest
from gptoss_max.server.state import DEFAULT_MAX_BODY_BYTES, ServerState
from gptoss_max.server.store import ResponseStore, open_store

STARTED = int(time.time())

# MAX's routes that are no use with this server and would take a local path from the request
# (LoRA adapters: `lora_path`) or run another task: answered 404 by never being mounted.
REMOVED_MAX_PATHS = frozenset(
    {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/embeddings", "/v1/audio/speech"}
)
__all__ = ["OPEN_PATHS", "REMOVED_MAX_PATHS", "build_app", "build_router", "mount"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


_SCHEMA_PREFIX = "gptoss_"
_BODIES: tuple[type[BaseModel], ...] = (ResponsesRequest, InputTokensRequest, ChatRequest)


def _errors(*codes: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (*codes, 401, 503)}
    if stream:  # JSON, or server-sent events with "stream": true
        out[200] = {"content": {"application/json": {}, "text/event-stream": {}}}
    return out


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The route's request body, in the OpenAPI schema (the route itself validates it: a 400 naming the field)."""
    ref = {"$ref": f"#/components/schemas/{_SCHEMA_PREFIX}{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _with_body_schemas(app: FastAPI) -> None:
    """`app.openapi()` with our request bodies' schemas among its components."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        schema = base()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _BODIES:
            ref_template = f"#/components/schemas/{_SCHEMA_PREFIX}{{model}}"
            body = model.model_json_schema(ref_template=ref_template, by_alias=True)
            for name, sub in body.pop("$defs", {}).items():
                components[f"{_SCHEMA_PREFIX}{name}"] = sub
            components[f"{_SCHEMA_PREFIX}{model.__name__}"] = body
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/responses", responses=_errors(400, 404, 413, 429, stream=True),
              openapi_extra=_json_body(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        return await responses.create(request, state)

    @api.post("/v1/responses/input_tokens", responses=_errors(400, 404, 413),
              openapi_extra=_json_body(InputTokensRequest))
    async def count_input_tokens(request: Request) -> dict:
        return await responses.count_input_tokens(request, state)

    @api.get("/v1/responses/{response_id}", responses=_errors(404))
    async def get_response(response_id: str) -> dict:
        return await responses.retrieve(response_id, state)

    @api.get("/v1/responses/{response_id}/input_items", responses=_errors(400, 404))
    async def list_input_items(
        response_id: str,
        limit: int = 20,
        order: str = "desc",
        after: str | None = None,
        before: str | None = None,
    ) -> dict:  # `include`, if sent, is ignored like any other query parameter: nothing more to include
        return await responses.input_items(response_id, state, limit, order, after, before)

    @api.delete("/v1/responses/{response_id}", responses=_errors(404))
    async def delete_response(response_id: str) -> dict:
        return await responses.delete(response_id, state)

    @api.post("/v1/chat/completions", responses=_errors(400, 413, 429, stream=True),
              openapi_extra=_json_body(ChatRequest))
    async def chat_completions(request: Request) -> Response:
        return await chat.create(request, state)

    def model_object() -> dict:
        return {
            "id": state.engine.model_name,
            "object": "model",
            "created": STARTED,
            "owned_by": "gptoss-max",
            "max_model_len": state.engine.max_context,
        }

    @api.get("/v1/models", responses=_errors())
    async def models() -> dict:
        return {"object": "list", "data": [model_object()]}

    @api.get("/v1/models/{model_id:path}", responses=_errors(404))
    async def model(model_id: str) -> dict:  # ids like openai/gpt-oss-20b hold a slash
        if model_id != state.engine.model_name:
            raise not_found(f"The model {model_id!r} does not exist; this server serves "
                            f"{state.engine.model_name!r}.", "model")  # fmt: skip
        return model_object()

    @api.get("/bench", responses=_errors(400, 404))
    async def bench(n: int = 8, max_new_tokens: int = 64, temperature: float = 1.0) -> dict:
        if not state.enable_bench:
            raise not_found("The decode probe is off; start the server with --enable-bench.")
        return await run_bench(state.engine, n, max_new_tokens, temperature)

    router = APIRouter()

    @router.get("/health", responses={503: {"description": "shutting down"}})
    async def health() -> Response:
        if state.draining:  # a load balancer's cue to send new requests elsewhere
            return JSONResponse({"status": "draining", "model": state.engine.model_name}, 503)
        return JSONResponse({"status": "ok", "model": state.engine.model_name})

    @router.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        """Ours and MAX's serving metrics (both live in prometheus_client's registry)."""
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    router.include_router(api)
    return router


def build_app(
    engine: Engine,
    store: ResponseStore | Path | str | None = None,
    *,
    enable_bench: bool = False,
    constrained_reasoning_tokens: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """A self-contained app over any `Engine` (the store: `open_store`'s spec, default the data dir)."""
    state = ServerState(engine, open_store(store), enable_bench, constrained_reasoning_tokens, max_body_bytes)
    app = FastAPI(title="gptoss-max")
    app.state.gptoss = state
    app.include_router(build_router(state))
    _with_body_schemas(app)
    install_handlers(app)
    app.add_middleware(Guard, state=state)
    return app


def mount(app: FastAPI, state: ServerState) -> None:
    """Put our routes on MAX's app ahead of MAX's own, so ours answer at the paths we share."""
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in REMOVED_MAX_PATHS]
    before = len(app.router.routes)
    app.include_router(build_router(state))
    ours = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[:0] = ours  # routes match in order: ours first
    app.state.gptoss = state
    _with_body_schemas(app)
    install_handlers(app, http_errors=False)
    app.add_middleware(Guard, state=state)  # MAX's own routes (e.g. /v1/completions) pass it too

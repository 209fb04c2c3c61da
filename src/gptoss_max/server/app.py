"""Our routes, as a standalone app (tests, scripted engine) or mounted on MAX's serving app."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from gptoss_max import settings
from gptoss_max.server import chat, responses
from gptoss_max.server.bench import run_bench
from gptoss_max.server.engine import Engine
from gptoss_max.server.errors import APIError, install_handlers, not_found
from gptoss_max.server.state import ServerState
from gptoss_max.server.store import ResponseStore

STARTED = int(time.time())


OPEN_PATHS = frozenset({"/health", "/metrics"})


def _key_error(request: Request) -> APIError | None:
    key = settings.api_key()
    if key and request.headers.get("authorization") != f"Bearer {key}":
        return APIError(401, "Missing or invalid API key.", code="invalid_api_key")
    return None


def _check_key(request: Request) -> None:
    if error := _key_error(request):
        raise error


def build_router(state: ServerState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(_check_key)])

    @api.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.create(request, state)

    @api.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return await responses.retrieve(response_id, state)

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        return await responses.delete(response_id, state)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat.create(request, state)

    @api.get("/v1/models")
    async def models() -> dict:
        model = {
            "id": state.engine.model_name,
            "object": "model",
            "created": STARTED,
            "owned_by": "gptoss-max",
            "max_model_len": state.engine.max_context,
        }
        return {"object": "list", "data": [model]}

    @api.get("/bench")
    async def bench(n: int = 8, max_new_tokens: int = 64) -> dict:
        if not state.enable_bench:
            raise not_found("The decode probe is off; start the server with --enable-bench.")
        return await run_bench(state.engine, n, max_new_tokens)

    router = APIRouter()

    @router.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": state.engine.model_name}

    @router.get("/metrics")
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
) -> FastAPI:
    """A self-contained app over any `Engine` (the store defaults to the data dir)."""
    if not isinstance(store, ResponseStore):
        store = ResponseStore(store)
    state = ServerState(engine, store, enable_bench, constrained_reasoning_tokens)
    app = FastAPI(title="gptoss-max")
    app.state.gptoss = state
    app.include_router(build_router(state))
    install_handlers(app)
    return app


def mount(app: FastAPI, state: ServerState) -> None:
    """Put our routes on MAX's app ahead of MAX's own, so ours answer at the paths we share."""
    app.include_router(build_router(state))
    app.router.routes.insert(0, app.router.routes.pop())  # routes match in order
    app.state.gptoss = state
    install_handlers(app, http_errors=False)

    @app.middleware("http")
    async def require_key(request: Request, call_next):  # MAX's own routes (e.g. /v1/completions) too
        error = None if request.url.path in OPEN_PATHS else _key_error(request)
        return error.response() if error else await call_next(request)

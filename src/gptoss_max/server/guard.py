"""The one gate every HTTP request passes, ours and (mounted) MAX's: key, shutdown, body size.

In order: the API key (401, before any body is read); while the server drains for a
shutdown, 503 (`/health` then says 503 too, so a load balancer stops sending); then the
body is read here, at most `max_body_bytes` of it (413 past that, whatever Content-Length
claimed), and handed on whole. It also counts the requests inside the app, which the
shutdown waits for. `/health` and `/metrics` pass without a key or a count.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gptoss_max import settings
from gptoss_max.server.errors import APIError, body_too_large, invalid_api_key, shutting_down
from gptoss_max.server.state import ServerState

OPEN_PATHS = frozenset({"/health", "/metrics"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def key_error(authorization: str | None) -> APIError | None:
    key = settings.api_key()
    if key and not hmac.compare_digest((authorization or "").encode(), f"Bearer {key}".encode()):
        return invalid_api_key()
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class Guard:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        error = key_error(_header(scope, b"authorization"))
        if error is None and self.state.draining:
            error = shutting_down()
        if error is None and scope["method"] in _BODY_METHODS:
            body = await self._read_body(scope, receive)
            if body is None:
                return  # the client left
            if isinstance(body, APIError):
                error = body
            else:
                receive = _replay(body, receive)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | APIError | None:
        limit = self.state.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            return body_too_large(limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return body_too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body, read already, as the app's first message; then the connection's own (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

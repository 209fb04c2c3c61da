"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("gptoss_max.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, param=param, code="not_found")


def queue_full() -> APIError:
    return APIError(429, "The server is at capacity; retry shortly.", code="rate_limit_exceeded")


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; retry on another replica or shortly.",
                    code="server_shutting_down")  # fmt: skip


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    code="request_too_large")  # fmt: skip


def invalid_api_key() -> APIError:
    return APIError(401, "Missing or invalid API key.", code="invalid_api_key")


def server_error(
    message: str = "The server had an error while processing the request.",
) -> APIError:
    return APIError(500, message, code="server_error")


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(
            f"The request body is not valid JSON: {exc}.", code="invalid_json"
        ) from None
    except RecursionError:  # Python's parser recurses per level of nesting
        raise bad_request("The request body nests arrays or objects too deeply.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    where = _unpaired_surrogate(body)
    if where is not None:  # JSON may escape one (\ud800); no UTF-8 text holds it, so nothing downstream could
        raise bad_request(
            f"Invalid value for {where!r}: it holds an unpaired UTF-16 surrogate escape, which is not text.",
            where,
            "invalid_value",
        )
    return body


def _unpaired_surrogate(body: dict[str, Any]) -> str | None:
    """The parameter path of the first string (value or key) in `body` that holds an unpaired
    UTF-16 surrogate, else None; a key's own surrogates are written as escapes in the path.
    Walked without recursion: the parser takes nesting deeper than Python's stack would."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if not _is_utf8(value):
                return path
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                here = f"{path}.{key}" if path else str(key)
                if not _is_utf8(key):
                    return here.encode("utf-8", "backslashreplace").decode()
                items.append((here, item))
            todo.extend(reversed(items))  # popped in order: the first offender is reported
        elif isinstance(value, list):
            todo.extend(reversed([(f"{path}[{i}]", item) for i, item in enumerate(value)]))
    return None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    return bad_request(str(exc)).response()


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code in (404, 405):  # the router's own: say what was asked for
        message = f"{exc.detail}: {request.method} {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, code=_HTTP_CODES.get(exc.status_code)).response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return server_error().response()


def install_handlers(app: FastAPI, *, http_errors: bool = True) -> None:
    """OpenAI-shaped bodies for our errors (and, standalone, for every other error too).

    On MAX's app (`http_errors=False`) MAX's handlers stay for its validation errors, its
    `fastapi.HTTPException`s and the rest; only the router's own 404 / 405 (Starlette's
    HTTPException, which MAX leaves as `{"detail": ...}`) get ours."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    if http_errors:
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(Exception, _unexpected)

"""A real HTTP server on 127.0.0.1 (uvicorn in a thread) over any app, for SDK-driven tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from gptoss_max.harmony.render import encode_harmony

FINAL = (
    "<|channel|>analysis<|message|>The user greets. Greet back.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"
)
TOOL_CALL = (
    "<|channel|>analysis<|message|>Need the weather for Paris.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
)
AFTER_TOOL = (
    "<|channel|>analysis<|message|>It is 20C.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 20C in Paris.<|return|>"
)
# How a reasoning -> preamble -> get_weather call -> tool result turn renders back into the prompt.
TOOL_ROUND_TRIP_PROMPT = (
    "<|start|>assistant<|channel|>analysis<|message|>Need the weather for Paris.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
    "<|start|>functions.get_weather to=assistant<|channel|>commentary"
    '<|message|>{"temp":20}<|end|><|start|>assistant'
)

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def long_script(n: int) -> str:
    return "<|channel|>final<|message|>" + " word" * n + "<|return|>"


def decode(ids: list[int]) -> str:
    from gptoss_max.tokenizer import harmony_encoding

    return harmony_encoding().decode(ids)


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Serve `app` on a free local port; yields the base URL (without /v1)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


__all__ = [
    "AFTER_TOOL",
    "FINAL",
    "TOOL_CALL",
    "WEATHER_TOOL",
    "decode",
    "encode_harmony",
    "serving",
]

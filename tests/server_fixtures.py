"""A real HTTP server on 127.0.0.1 (uvicorn in a thread) over any app, for SDK-driven tests."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import uvicorn

from gptoss_max.harmony.render import encode_harmony
from gptoss_max.ports import free_port

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


def wait_healthy(
    proc: subprocess.Popen, base: str, timeout: float, poll: float, output: Callable[[], str], probe: float = 2
) -> None:
    """Polls `GET {base}/health` until it answers 200; fails if `proc` exits first or after
    `timeout` s, with `output()` (the server's log) in the message."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"server exited ({proc.returncode}):\n{output()}"
        assert time.monotonic() < deadline, f"server not ready after {timeout} s:\n{output()}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=probe).status_code == 200:
                return
        time.sleep(poll)


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
    "free_port",
    "serving",
    "wait_healthy",
]

"""What every route shares: the engine, the response store, the server's options and lifecycle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gptoss_max.server.engine import Engine
from gptoss_max.server.errors import bad_request
from gptoss_max.server.store import ResponseStore

if TYPE_CHECKING:
    from gptoss_max.server.generation import Generation

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # ~2M tokens of text: far past any context served here


@dataclass
class ServerState:
    engine: Engine
    store: ResponseStore
    enable_bench: bool = False
    constrained_reasoning_tokens: int | None = None  # cap per reasoning message under a grammar
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    kv: Any = None  # a KVProbe (kv_probe.py) when the engine is MAX's: its worker's KV cache figures
    draining: bool = False  # set on SIGTERM: new requests get 503, running ones may finish
    inflight: int = 0  # HTTP requests inside the app, streams until their last byte
    generations: set[Generation] = field(default_factory=set)  # admitted, not yet closed

    def check_model(self, model: str) -> None:
        if model != self.engine.model_name:
            raise bad_request(
                f"The model {model!r} does not exist; "
                f"this server serves {self.engine.model_name!r}.",
                "model",
                "model_not_found",
            )

    def token_budget(self, prompt_len: int, requested: int | None, param: str) -> int:
        """New tokens allowed: the request's limit, capped by what is left of the context."""
        room = self.engine.max_context - prompt_len
        if room < 1:
            raise bad_request(
                f"The input is {prompt_len} tokens; this model's context is "
                f"{self.engine.max_context} tokens.",
                param,
                "context_length_exceeded",
            )
        return min(requested or room, room)

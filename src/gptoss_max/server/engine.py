"""What the server needs from a model: prompt ids in, chunks of new ids out.

`MaxEngine` (max_engine.py) implements it over MAX's model worker; `ScriptedEngine` plays
back token scripts, so the whole server runs in tests without a model.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gptoss_max.harmony.render import STOP_TOKEN_IDS, encode_harmony


class QueueFull(Exception):
    """The engine cannot admit another request now (HTTP 429)."""


class PromptTooLong(ValueError):
    """The prompt does not fit the engine's context (HTTP 400)."""


class Rejected(ValueError):
    """The engine refused the request as given, e.g. a grammar it cannot compile (HTTP 400)."""


@dataclass(frozen=True)
class GenParams:
    max_new_tokens: int
    temperature: float | None = None  # None: the model's default
    top_p: float | None = None
    stop_token_ids: tuple[int, ...] = STOP_TOKEN_IDS
    ignore_eos: bool = False  # decode exactly max_new_tokens (benchmarks)
    seed: int | None = None
    grammar: str | None = None  # every token masked by this structural tag (harmony/grammar.py)


class Chunk(list[int]):
    """A chunk of new token ids; the first may say how many prompt tokens hit the cache."""

    cached_tokens: int | None = None


class Engine(Protocol):
    model_name: str
    max_context: int

    def generate(self, prompt_ids: list[int], params: GenParams) -> AsyncIterator[list[int]]:
        """New ids in chunks until a stop token (included) or `max_new_tokens`.

        Admission errors (`QueueFull`, `PromptTooLong`, `Rejected`) are raised by the
        first `__anext__`. Closing the iterator, or cancelling the task awaiting it, cancels
        the generation.
        """
        ...


Script = Sequence[int] | str


@dataclass
class ScriptedEngine:
    """Plays back token scripts (Harmony text or ids), one per request, in order.

    `script` may also be a function of the prompt ids. With `delay` each chunk waits
    that long, so a test can drop a stream mid-generation and see it cancelled.
    """

    scripts: list[Script] | Callable[[list[int]], Script]
    model_name: str = "gpt-oss-scripted"
    max_context: int = 8192
    chunk_size: int = 2
    delay: float = 0.0
    capacity: int | None = None  # concurrent requests before QueueFull
    prompts: list[list[int]] = field(default_factory=list)
    params: list[GenParams] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)  # tokens emitted per request
    cancelled: int = 0
    active: int = 0

    def _next_script(self, prompt_ids: list[int]) -> list[int]:
        if callable(self.scripts):
            script = self.scripts(prompt_ids)
        else:
            script = self.scripts[min(len(self.prompts) - 1, len(self.scripts) - 1)]
        return encode_harmony(script) if isinstance(script, str) else list(script)

    async def generate(self, prompt_ids: list[int], params: GenParams) -> AsyncIterator[list[int]]:
        if self.capacity is not None and self.active >= self.capacity:
            raise QueueFull()
        if len(prompt_ids) >= self.max_context:
            raise PromptTooLong(f"{len(prompt_ids)} prompt tokens exceed {self.max_context}")
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        script = self._next_script(prompt_ids)
        slot = len(self.emitted)
        self.emitted.append(0)
        self.active += 1
        out = _until_stop(script, params)
        try:
            for i in range(0, len(out), self.chunk_size):
                await asyncio.sleep(self.delay)
                chunk = Chunk(out[i : i + self.chunk_size])
                if i == 0:
                    chunk.cached_tokens = 0
                self.emitted[slot] += len(chunk)
                yield chunk
        finally:
            self.active -= 1
            if self.emitted[slot] < len(out):
                self.cancelled += 1


def _until_stop(script: list[int], params: GenParams) -> list[int]:
    out: list[int] = []
    for token in script[: params.max_new_tokens]:
        out.append(token)
        if token in params.stop_token_ids and not params.ignore_eos:
            break
    return out

"""One request's token loop, shared by /v1/responses and /v1/chat/completions.

The engine's chunks go through a `HarmonyStream`; generation ends at a stop token, at
the token budget, on malformed output the parser cannot recover from, when the client
goes away (the consuming task is cancelled and the engine iterator closed), or when the
server stops it (`abort`, at the end of a shutdown's grace period: it ends as failed).

Each chunk is awaited as a task of its own, so `abort` can cancel just that wait: the
engine iterator stops (MAX's worker is told to cancel the request) while the consumer
goes on to close the response properly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
from fastapi import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gptoss_max.harmony.parse import HarmonyStream, ParseEvent
from gptoss_max.harmony.render import Prompt
from gptoss_max.server import metrics
from gptoss_max.server.engine import Engine, GenParams, PromptTooLong, QueueFull, Rejected
from gptoss_max.server.errors import APIError, bad_request, queue_full, shutting_down

logger = logging.getLogger("gptoss_max.server")
T = TypeVar("T")


class Generation:
    def __init__(
        self, engine: Engine, prompt: Prompt, params: GenParams, registry: set[Generation] | None = None
    ):
        self.prompt = prompt
        self.params = params
        self.harmony = HarmonyStream()
        self.output_ids: list[int] = []
        self.cached_tokens = 0
        self.stop_token: int | None = None
        self.failure: str | None = None
        self.aborted: str | None = None  # why the server stopped it, if it did
        self.stopped_early = False  # ended by its consumer (a chat stop sequence): completed
        self._chunks = aiter(engine.generate(prompt.ids, params))
        self._first: list[int] | None = None
        self._pending: asyncio.Future | None = None
        self._registry = registry
        self._ended = False  # no more tokens will be taken

    async def start(self) -> None:
        """Wait for admission and the first chunk, so refusals are still HTTP statuses."""
        if self._registry is not None:
            self._registry.add(self)
        try:
            self._first = await self._pull()
        except BaseException as exc:
            await self.close()
            if isinstance(exc, QueueFull):
                raise queue_full() from None
            if isinstance(exc, PromptTooLong):
                raise bad_request(str(exc), "input", "context_length_exceeded") from None
            if isinstance(exc, Rejected):
                raise bad_request(str(exc)) from None
            raise
        if self.aborted:
            await self.close()
            raise shutting_down()

    async def _pull(self) -> list[int] | None:
        """The engine's next chunk; None at its end or once aborted."""
        if self.aborted:
            return None
        pending = self._pending = asyncio.ensure_future(anext(self._chunks, None))
        try:
            await asyncio.wait({pending})
        except asyncio.CancelledError:  # our consumer is cancelled (its client left): stop the engine
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
            raise
        if pending.cancelled():  # abort()
            return None
        return pending.result()

    def abort(self, reason: str) -> None:
        """Stop generating now; the response ends as failed with `reason` (unless it has ended)."""
        if self.aborted or self._ended:
            return
        self.aborted = reason
        self.failure = self.failure or reason
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()

    def stop_early(self) -> None:
        """End generating now as completed: what the consumer wanted has come (a stop sequence).
        Called by the consumer of `events`, between two of them: events already parsed from the
        current chunk still arrive; no more chunks are taken, and the engine is told to cancel the
        request when the events end. Also when that chunk has reached max_tokens: the stop came
        within the tokens allowed, so the request completed (not `incomplete`, its length's)."""
        if not self.aborted:
            self.stopped_early = True

    @property
    def status(self) -> str:
        if self.failure:
            return "failed"
        return "completed" if self.stop_token is not None or self.stopped_early else "incomplete"

    async def events(self) -> AsyncIterator[ParseEvent]:
        ended = False
        try:
            chunk = self._first
            while chunk is not None:
                events, done = self._take(chunk)
                for event in events:
                    yield event
                if done or self.stopped_early:
                    break
                chunk = await self._next_chunk()
            ended = True
        finally:
            self._ended = True
            if not ended:
                metrics.CANCELLED.inc()
            await self.close()
        cut = self.status == "incomplete" or self.aborted is not None or self.stopped_early
        for event in self.harmony.finish(truncated=cut):
            yield event

    def _take(self, chunk: list[int]) -> tuple[list[ParseEvent], bool]:
        cached = getattr(chunk, "cached_tokens", None)
        if cached is not None:
            self.cached_tokens = cached
        events: list[ParseEvent] = []
        for token in chunk:
            self.output_ids.append(token)
            events += self.harmony.feed(token)
            if token in self.params.stop_token_ids:
                self.stop_token = token
            elif self.harmony.error:
                self.failure = self.harmony.error
            elif len(self.output_ids) < self.params.max_new_tokens:
                continue
            self._ended = True
            return events, True
        return events, False

    async def _next_chunk(self) -> list[int] | None:
        try:
            return await self._pull()
        except Exception as exc:  # the engine broke mid-generation: end this request only
            logger.exception("generation failed")
            self.failure = f"generation failed: {type(exc).__name__}: {exc}"
            return None

    def record_metrics(self, endpoint: str) -> None:
        metrics.record(
            endpoint,
            self.status,
            prompt=len(self.prompt.ids),
            cached=self.cached_tokens,
            output=len(self.output_ids),
            reasoning=self.harmony.reasoning_tokens,
        )

    async def close(self) -> None:
        if self._registry is not None:
            self._registry.discard(self)
        aclose = getattr(self._chunks, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work` (after the body was read); a client that hangs up cancels it."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise APIError(499, "The client closed the request.", code="client_closed_request")
    return task.result()


class EventStream(StreamingResponse):
    """Server-sent events whose source (and generation) is closed once the client leaves."""

    def __init__(self, content: AsyncIterator[str], generation: Generation):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            await self.generation.close()  # also when the stream never started


class Run(Protocol):
    """One route's view of a generation: its SSE stream, or its whole JSON body."""

    def sse(self) -> AsyncIterator[str]: ...

    async def complete(self) -> dict: ...


async def reply(request: Request, gen: Generation, run_for: Callable[[Generation], Run], stream: bool) -> Response:
    """Starts `gen` (a client that leaves first cancels it), then answers with the run's event
    stream or its JSON body; the generation is closed either way."""
    await until_disconnected(request, gen.start())
    run = run_for(gen)
    if stream:
        return EventStream(run.sse(), gen)
    try:
        return JSONResponse(await until_disconnected(request, run.complete()))
    finally:
        await gen.close()

"""Graceful shutdown: on SIGTERM (or Ctrl-C) running streams get a grace period, then end properly.

The first signal starts a drain: new requests get 503 (`/health` too, so a load balancer
sends them elsewhere) while running generations go on for up to `grace` seconds. Those
still running then are aborted: each ends as a failed response (`response.failed` on a
stream, with the response stored as failed), not as a cut connection. Then uvicorn stops,
MAX's lifespan stops the model worker, and the store is closed. A second signal skips the
rest of the grace period.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import AbstractAsyncContextManager, nullcontext
from types import FrameType
from typing import Any

from uvicorn import Config, Server

from gptoss_max.server.state import ServerState

logger = logging.getLogger("gptoss_max.server")

DEFAULT_GRACE_S = 25.0  # under Docker's and Kubernetes' usual 30 s before SIGKILL, with room to stop
FLUSH_S = 5.0  # after aborting: time for the last events to go out and responses to be stored
ABORTED = "The server shut down before this response was finished."


async def drain(state: ServerState, grace: float, forced: asyncio.Event | None = None) -> dict[str, Any]:
    """Refuse new work, wait up to `grace` s for running work, abort what is left; what happened."""
    loop = asyncio.get_running_loop()
    state.draining = True
    t0 = loop.time()
    running = len(state.generations)
    logger.info("shutting down: %d generation(s), %d request(s) running; grace %.0f s",
                running, state.inflight, grace)  # fmt: skip
    while (state.generations or state.inflight) and loop.time() - t0 < grace:
        if forced is not None and forced.is_set():
            break
        await asyncio.sleep(0.05)
    left = list(state.generations)
    for gen in left:
        gen.abort(ABORTED)
    t1 = loop.time()
    while (state.generations or state.inflight) and loop.time() - t1 < FLUSH_S:
        await asyncio.sleep(0.05)
    report = {"running": running, "finished": running - len(left), "aborted": len(left),
              "waited_s": round(t1 - t0, 2), "unfinished_requests": state.inflight}  # fmt: skip
    logger.info("drained: %s", report)
    return report


class DrainingServer(Server):
    """uvicorn's server, whose exit signal starts a drain instead of cutting connections."""

    def __init__(self, config: Config, state: ServerState, grace: float = DEFAULT_GRACE_S):
        super().__init__(config)
        self.state = state
        self.grace = grace
        self.drain_report: dict[str, Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._forced: asyncio.Event | None = None
        self._draining = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._forced = asyncio.Event()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None:  # before serving: nothing to drain
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # uvicorn raises them again once it has stopped
        if self._draining:
            self._loop.call_soon_threadsafe(self._force)
        else:
            self._draining = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    def _force(self) -> None:
        assert self._forced is not None
        self._forced.set()

    async def _drain_then_exit(self) -> None:
        try:
            self.drain_report = await drain(self.state, self.grace, self._forced)
        finally:
            self.should_exit = True


async def serve(server: DrainingServer, lifespan: AbstractAsyncContextManager | None = None) -> None:
    """Serve until a signal has drained and stopped the server; the store is closed at the end."""
    try:
        async with lifespan or nullcontext():
            await server.serve()
    finally:
        server.state.store.close()


def exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Installed before serving: uvicorn re-raises SIGTERM once it has stopped, and this turns it
    into SystemExit, which unwinds MAX's lifespan (stopping its model worker) instead of killing us."""
    raise SystemExit(128 + signum)


def install_exit_handler() -> None:
    signal.signal(signal.SIGTERM, exit_on_sigterm)

"""MAX's paged KV cache, as seen from the API process: blocks in use and requests holding them.

MAX's own `maxserve_cache_num_used_blocks` gauge is recorded in the model worker, which
(with the in-process metric recording `gptoss-max serve` uses) does not report it, and is
only refreshed when a batch runs, so it would still show a dropped stream's blocks after
the last batch. So the worker publishes its KV manager's figures itself: `ProbedFactory`
wraps MAX's pipeline factory (it is pickled into the worker and called there), and a daemon
thread writes `block_count()` and the number of requests holding blocks to a small JSON
file every `interval` s. The API process reads the file (`KVProbe`) into `gptoss_kv_*`
gauges on `/metrics`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("gptoss_max.server")


def snapshot(kv_manager: Any) -> dict[str, Any]:
    """The manager's occupancy now (read through the MAX adapter, `maxapi.kv_occupancy`)."""
    from gptoss_max.maxapi import kv_occupancy

    used, total, requests = kv_occupancy(kv_manager)
    return {"used_blocks": used, "total_blocks": total, "requests": requests, "time": time.time()}


def _publish(kv_manager: Any, path: Path, interval: float) -> None:
    tmp = path.with_suffix(".tmp")
    failed = False
    while True:
        try:
            tmp.write_text(json.dumps(snapshot(kv_manager)))
            os.replace(tmp, path)
        except Exception:
            if not failed:
                logger.exception("KV probe: could not publish the KV cache figures")
            failed = True
        time.sleep(interval)


class ProbedFactory:
    """MAX's pipeline factory, plus the publishing thread once the pipeline exists (in the worker);
    with `replay_small_graphs` on or check, the overlap pipeline's small per-step graphs
    (`GPTOSS_MAX_REPLAY_GRAPHS`: the samplers by default) wrapped to replay device graphs
    (`maxapi.replay_in_mode`; check: each replay also compared with an eager call); with
    `isolate`, the thread that builds the pipeline (the worker's scheduler thread, which runs every
    step) on a CPU core of its own (`affinity`)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        path: Path | str,
        interval: float = 0.2,
        replay_small_graphs: str = "off",
        isolate: bool = False,
    ):
        self.factory = factory
        self.path = str(path)
        self.interval = interval
        self.replay_small_graphs = replay_small_graphs
        self.isolate = isolate

    def __call__(self) -> Any:
        pipeline = self.factory()
        if self.replay_small_graphs != "off":
            from gptoss_max import maxapi

            wrapped = maxapi.replay_in_mode(pipeline, self.replay_small_graphs)
            logger.info(
                "replaying device graphs for: %s%s",
                ", ".join(w.name for w in wrapped) or "nothing",
                " (each checked against an eager call)" if self.replay_small_graphs == "check" else "",
            )
        if self.isolate:
            from gptoss_max import affinity

            state = affinity.isolate_main_thread()
            affinity.keep_isolating(state, threading.get_native_id())
            logger.info("scheduler thread isolated: %s", state)
        kv_manager = getattr(pipeline, "kv_manager", None)
        if kv_manager is None:
            logger.warning("KV probe: the pipeline has no KV manager; no gptoss_kv_* figures")
            return pipeline
        args = (kv_manager, Path(self.path), self.interval)
        threading.Thread(target=_publish, args=args, name="gptoss-kv-probe", daemon=True).start()
        return pipeline


class KVProbe:
    """The API process's side: the worker's latest figures, or None if there are none (yet)."""

    def __init__(self, path: Path | str, stale_after: float = 5.0):
        self.path = Path(path)
        self.stale_after = stale_after

    def read(self) -> dict[str, Any] | None:
        try:
            figures = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        figures["stale"] = time.time() - figures.get("time", 0) > self.stale_after
        return figures


_current: list[KVProbe] = []


class _Collector:
    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        figures = _current[-1].read() if _current else None
        if not figures or figures["stale"]:
            return
        yield GaugeMetricFamily("gptoss_kv_blocks_used", "KV cache blocks in use in MAX's worker",
                                value=figures["used_blocks"])  # fmt: skip
        yield GaugeMetricFamily("gptoss_kv_blocks_total", "KV cache blocks in MAX's worker",
                                value=figures["total_blocks"])  # fmt: skip
        if figures["requests"] is not None:
            yield GaugeMetricFamily("gptoss_kv_requests", "Requests holding KV cache blocks in MAX's worker",
                                    value=figures["requests"])  # fmt: skip


_collector = _Collector()


def expose(probe: KVProbe) -> None:
    """Report `probe`'s figures on /metrics (prometheus_client's default registry)."""
    from prometheus_client import REGISTRY

    if not _current:
        REGISTRY.register(_collector)
    _current.append(probe)

"""Every environment variable the project reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def _env_path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else default


def cache_dir() -> Path:
    """Derived files (tokenizer data, built kernels): `GPTOSS_MAX_CACHE`."""
    xdg = _env_path("XDG_CACHE_HOME", Path.home() / ".cache")
    return _env_path("GPTOSS_MAX_CACHE", xdg / "gptoss-max")


def data_dir() -> Path:
    """Persistent state (the response store, the tiny model): `GPTOSS_MAX_DATA`."""
    return _env_path("GPTOSS_MAX_DATA", Path.home() / ".local" / "share" / "gptoss-max")


def api_key() -> str | None:
    """Optional bearer key required by the server: `GPTOSS_MAX_API_KEY`."""
    return os.environ.get("GPTOSS_MAX_API_KEY") or None


def attention_impl() -> str:
    """`GPTOSS_MAX_ATTENTION`: `ours` (our sink-attention op), `max` (MAX's flash attention), or `auto`.

    `auto` is ours: MAX 26.7's GPU decode disagrees with the reference (see docs/GPU.md). `max`
    applies on a GPU only: on a CPU ours is always used (MAX's over-counts sinks past 128 keys and
    rejects windows < 256). Read in the process that builds the graph.
    """
    value = os.environ.get("GPTOSS_MAX_ATTENTION", "auto")
    if value not in ("auto", "ours", "max"):
        raise ValueError(f"GPTOSS_MAX_ATTENTION must be auto, ours or max, not {value!r}")
    return "ours" if value == "auto" else value

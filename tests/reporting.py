"""Figures tests want a reader to see (fidelity, compile times): printed after the run, captured or not."""

from __future__ import annotations

LINES: list[str] = []


def report(tag: str, line: str) -> None:
    LINES.append(f"[{tag}] {line}")

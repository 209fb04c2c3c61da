"""Prometheus counters of our own, next to MAX's serving metrics on GET /metrics."""

from __future__ import annotations

from prometheus_client import Counter

REQUESTS = Counter(
    "gptoss_requests", "Generation requests by endpoint and final status", ["endpoint", "status"]
)
TOKENS = Counter("gptoss_tokens", "Tokens by kind: prompt, cached, output, reasoning", ["kind"])
CANCELLED = Counter("gptoss_cancelled", "Generations stopped because their client went away")


def record(
    endpoint: str, status: str, prompt: int, cached: int, output: int, reasoning: int
) -> None:
    REQUESTS.labels(endpoint, status).inc()
    for kind, n in (
        ("prompt", prompt),
        ("cached", cached),
        ("output", output),
        ("reasoning", reasoning),
    ):
        TOKENS.labels(kind).inc(n)

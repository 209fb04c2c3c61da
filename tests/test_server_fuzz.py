"""Fuzzing the server: schemathesis over our routes' OpenAPI schema, through real HTTP.

Valid and invalid requests (schemathesis's positive and negative modes) against every route
of the standalone app: only 4xx for bad requests, never a 5xx, every status and content type
the schema declares, every error in OpenAI's shape; and afterwards the server still answers
`/health`. (Token sequences through the Harmony parser: test_harmony_fuzz.py.)
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    status_code_conformance,
)

from gptoss_max.server.app import build_app
from gptoss_max.server.engine import ScriptedEngine
from reporting import report
from server_fixtures import FINAL, TOOL_CALL, serving

ENGINE = ScriptedEngine([FINAL, TOOL_CALL], max_context=4096)
APP = build_app(ENGINE, ":memory:", enable_bench=True)
schema = schemathesis.openapi.from_dict(APP.openapi())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=100,
                                deterministic=True, database="none")  # fmt: skip
CALLS: dict[str, dict[int, int]] = {}  # operation -> status -> count


@pytest.fixture(scope="module")
def base():
    with serving(APP) as url:
        yield url


def openai_shaped_errors(ctx, response, case):
    """Every 4xx body is `{"error": {"message", "type", "param", "code"}}`."""
    if 400 <= response.status_code < 500:
        body = json.loads(response.content)
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_routes_never_fail_on_any_request(case, base):
    response = case.call_and_validate(
        base_url=base,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, negative_data_rejection],
        additional_checks=[openai_shaped_errors],
    )
    counts = CALLS.setdefault(f"{case.operation.method.upper()} {case.operation.path}", {})
    counts[response.status_code] = counts.get(response.status_code, 0) + 1


def test_server_still_healthy_after_fuzzing(base):
    assert httpx.get(f"{base}/health", timeout=5).json()["status"] == "ok"
    total = sum(sum(c.values()) for c in CALLS.values())
    assert total > 0, "the fuzz tests ran first"
    every = {f"{op.ok().method.upper()} {op.ok().path}" for op in schema.get_all_operations()}
    assert set(CALLS) == every, f"operations never fuzzed: {sorted(every - set(CALLS))}"
    statuses = sorted({s for c in CALLS.values() for s in c})
    assert all(s < 500 for s in statuses)
    report("fuzz", f"schemathesis: {total} requests over {len(CALLS)} operations, statuses {statuses}; "
                   f"{len(ENGINE.prompts)} reached the engine")  # fmt: skip

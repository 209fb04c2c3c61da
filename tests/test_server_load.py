"""bench/load.py at full scale against the server over a scripted engine: 256 concurrent SDK
streams, 100 of them dropping mid-stream, and a queue too small for all of them (429s).

The HTTP side of the server is what is loaded here (the engine answers at once); the same
benchmark against the real tiny model, at reduced scale, is in test_server_e2e.py.
"""

from __future__ import annotations

import httpx

from bench_load import load
from gptoss_max.server.app import build_app
from gptoss_max.server.engine import ScriptedEngine
from reporting import report
from server_fixtures import long_script, serving


def test_256_streams_100_dropping(tmp_path):
    # 30 ms a token: a dropped stream's disconnect has ~2 s to reach the engine before the engine
    # has played its whole script (at 10 ms, a loaded CI machine once let 29 of 100 finish first)
    engine = ScriptedEngine([long_script(60)], delay=0.03, chunk_size=1)
    with serving(build_app(engine, tmp_path / "r.sqlite3")) as base:
        r = load.run(base, n=256, drop=100, max_output_tokens=64)
        assert r["improper_errors"] == 0 and r["errors_by_kind"] == {}
        assert r["outcomes"] == {"completed": 156, "dropped": 100}
        assert r["ttft_ms"]["n"] == 156 and r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert r["itl_ms"]["n"] > 156 * 50 and r["tpot_ms"]["p99"] > 0
        assert r["output_tokens"] == 156 * 64  # the 60 words, the header and the stop: all of them
        assert r["cancelled"] == 100 and engine.cancelled == 100, "every dropped stream stopped its generation"
        assert engine.active == 0
        assert r["after_run"]["request_status"] == "incomplete" and r["after_run"]["health"] == 200 and r["ok"]
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
    report("load", f"scripted engine, 256 SDK streams (100 dropping) in one process: TTFT p50 {r['ttft_ms']['p50']} "
                   f"ms p99 {r['ttft_ms']['p99']} ms, ITL p50 {r['itl_ms']['p50']} ms p99 {r['itl_ms']['p99']} ms, "
                   f"errors {r['errors_by_kind'] or 'none'}, cancelled {r['cancelled']:.0f}")  # fmt: skip


def test_full_queue_gives_proper_429s(tmp_path):
    engine = ScriptedEngine([long_script(40)], delay=0.01, chunk_size=1, capacity=32)
    with serving(build_app(engine, tmp_path / "r.sqlite3")) as base:
        r = load.run(base, n=256, max_output_tokens=64)
    assert r["improper_errors"] == 0 and r["ok"]
    assert r["errors_by_kind"]["http_429"] == r["outcomes"]["error"] > 0
    assert r["outcomes"]["completed"] + r["outcomes"]["error"] == 256
    assert r["outcomes"]["completed"] >= 32

"""Graceful shutdown on SIGTERM, in a real process (tests/scripted_server.py: the serve path without a model).

Streams running at the signal finish within the grace period, or end with `response.failed`
(not a cut connection); new requests and `/health` get 503 meanwhile; the process then exits
by itself, and every response is in the store when the server is started again (SQLite and
PostgreSQL).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pg_fixtures import pg_server_url, pg_url  # noqa: F401 - fixtures
from server_fixtures import free_port, wait_healthy

SCRIPT = Path(__file__).with_name("scripted_server.py")


@contextlib.contextmanager
def server_process(store: str, *extra: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--port", str(port), "--store", store, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        # its output is read only once it has exited (reading a live pipe would block)
        out = lambda: proc.stdout.read() if proc.poll() is not None else "scripted server did not start"  # noqa: E731
        wait_healthy(proc, base, 60, poll=0.1, output=out, probe=1)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


class Stream(threading.Thread):
    """One streamed /v1/responses request, read to its end in a thread."""

    def __init__(self, base: str, text: str):
        super().__init__(daemon=True)
        self.base, self.text = base, text
        self.events: list[dict] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": "gpt-oss-scripted", "input": self.text, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base}/v1/responses", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        if any(e["type"].endswith(".delta") for e in self.events[-1:]):
                            self.started.set()
        except BaseException as exc:  # noqa: BLE001 - asserted on by the test
            self.error = exc
        self.started.set()

    @property
    def last(self) -> dict:
        return self.events[-1]


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "r.sqlite3")
    return request.getfixturevalue("pg_url")


def test_sigterm_lets_streams_finish_or_fail_properly_and_keeps_the_store(store):
    with server_process(store, "--grace", "3", "--words", "100") as (proc, base):
        done = httpx.post(f"{base}/v1/responses", json={"model": "gpt-oss-scripted", "input": "hi"}, timeout=30)
        assert done.json()["status"] == "completed"
        short, long_ = Stream(base, "short"), Stream(base, "long")
        short.start(), long_.start()
        assert short.started.wait(20) and long_.started.wait(20)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(f"{base}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{base}/v1/responses", json={"model": "gpt-oss-scripted", "input": "x"}, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        short.join(30), long_.join(30)
        assert short.error is None and long_.error is None, (short.error, long_.error)
        assert short.last["type"] == "response.completed"  # ~1 s of words: within the 3 s grace
        assert time.monotonic() - t0 < 3 + 5
        assert long_.last["type"] == "response.failed"  # 100000 words: cut at the grace period, properly
        failed = long_.last["response"]
        assert failed["status"] == "failed" and "shut down" in failed["error"]["message"]
        assert [e["type"] for e in long_.events].count("error") == 1
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM  # it stopped by itself
        assert time.monotonic() - t0 < 3 + 10
    ids = {done.json()["id"]: "completed", short.last["response"]["id"]: "completed", failed["id"]: "failed"}
    with server_process(store) as (_, base):  # the store after a restart
        for rid, status in ids.items():
            got = httpx.get(f"{base}/v1/responses/{rid}", timeout=5).json()
            assert got["status"] == status, got
        cont = httpx.post(f"{base}/v1/responses", timeout=30, json={
            "model": "gpt-oss-scripted", "input": "more", "previous_response_id": done.json()["id"]})  # fmt: skip
        assert cont.json()["status"] == "completed"


def test_second_signal_cuts_the_grace_short(tmp_path):
    with server_process(str(tmp_path / "r.sqlite3"), "--grace", "60") as (proc, base):
        stream = Stream(base, "long")
        stream.start()
        assert stream.started.wait(20)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert stream.is_alive(), "still running in its grace period"
        proc.send_signal(signal.SIGTERM)
        stream.join(15)
        assert stream.last["type"] == "response.failed"
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 15, "not the 60 s grace"

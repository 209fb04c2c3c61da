"""Hostile requests: the API key, the body size limit, and no way to make the server read a local path."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time

import fastapi
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from openai import OpenAI

from gptoss_max.server.app import REMOVED_MAX_PATHS, build_app, mount
from gptoss_max.server.cli import add_serve_parser, export_api_key
from gptoss_max.server.engine import ScriptedEngine
from gptoss_max.server.state import ServerState
from gptoss_max.server.store import SQLiteStore
from server_fixtures import FINAL, WEATHER_TOOL, serving

KEY = "sk-test-0123456789"


@pytest.fixture
def server(tmp_path):
    with contextlib.ExitStack() as stack:

        def start(**kw):
            engine = ScriptedEngine([FINAL])
            base = stack.enter_context(serving(build_app(engine, tmp_path / "r.sqlite3", **kw)))
            return engine, base

        yield start


def test_api_key_flag_and_env(monkeypatch):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    monkeypatch.setenv("GPTOSS_MAX_API_KEY", "")  # restored afterwards, whatever export_api_key sets
    monkeypatch.delenv("GPTOSS_MAX_API_KEY")
    export_api_key(parser.parse_args(["serve", "--api-key", KEY]))
    assert os.environ["GPTOSS_MAX_API_KEY"] == KEY
    monkeypatch.setenv("GPTOSS_MAX_API_KEY", "from-env")
    export_api_key(parser.parse_args(["serve"]))  # no flag: the environment's key stays
    assert os.environ["GPTOSS_MAX_API_KEY"] == "from-env"


def test_every_route_but_health_and_metrics_needs_the_key(server, monkeypatch):
    monkeypatch.setenv("GPTOSS_MAX_API_KEY", KEY)
    engine, base = server(enable_bench=True)
    ok = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    resp = ok.responses.create(model=engine.model_name, input="hi")
    calls = [("GET", "/v1/models", None), ("GET", f"/v1/responses/{resp.id}", None),
             ("DELETE", f"/v1/responses/{resp.id}", None), ("GET", "/bench?n=1", None),
             ("POST", "/v1/responses", {"model": engine.model_name, "input": "x", "stream": True}),
             ("POST", "/v1/chat/completions",
              {"model": engine.model_name, "messages": [{"role": "user", "content": "x"}]}),
             ("GET", "/openapi.json", None), ("GET", "/docs", None), ("POST", "/v1/nope", {})]  # fmt: skip
    before = len(engine.prompts)
    for auth in (None, "Bearer wrong", f"bearer {KEY}", KEY, f"Bearer {KEY}x", f"Basic {KEY}", f"Bearer {KEY[:-1]}"):
        headers = {"authorization": auth} if auth else {}
        for method, path, body in calls:
            r = httpx.request(method, f"{base}{path}", json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (auth, method, path, r.status_code)
            assert r.json() == {"error": {"message": "Missing or invalid API key.", "type": "authentication_error",
                                          "param": None, "code": "invalid_api_key"}}  # fmt: skip
    assert len(engine.prompts) == before, "nothing reached the engine"
    assert ok.responses.retrieve(resp.id).id == resp.id
    for path in ("/health", "/metrics"):
        assert httpx.get(f"{base}{path}").status_code == 200


def test_body_size_limit(server):
    engine, base = server(max_body_bytes=10_000)
    small = {"model": engine.model_name, "input": "x" * 5_000}
    assert httpx.post(f"{base}/v1/responses", json=small, timeout=10).status_code == 200
    big = {"model": engine.model_name, "input": "x" * 20_000}
    r = httpx.post(f"{base}/v1/responses", json=big, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(100):
            yield b"x" * 1000

    r = httpx.post(f"{base}/v1/chat/completions", content=chunks(), timeout=10,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # claims a terabyte, sends 2 bytes
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000000\r\n\r\n{}")  # fmt: skip
        head = sock.recv(65536).decode()
    assert head.startswith("HTTP/1.1 413 "), head  # refused on the header: the body is never waited for
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    assert len(engine.prompts) == 1


def test_max_routes_that_take_paths_are_not_mounted(tmp_path):
    app = FastAPI()
    hits = []
    for path in sorted(REMOVED_MAX_PATHS) + ["/v1/completions"]:
        app.add_api_route(path, lambda p=path: hits.append(p) or {"from": "max"}, methods=["POST"])

    def max_raises():
        raise fastapi.HTTPException(status_code=418, detail="teapot")

    def max_handler(request, exc):  # as MAX's api_server registers one for fastapi's HTTPException
        return JSONResponse({"max": exc.status_code}, status_code=exc.status_code)

    app.add_api_route("/max-raises", max_raises, methods=["GET"])
    app.add_exception_handler(fastapi.HTTPException, max_handler)
    engine = ScriptedEngine([FINAL], model_name="gpt-oss-max")
    mount(app, ServerState(engine, SQLiteStore(tmp_path / "r.sqlite3")))
    with serving(app) as base:
        for path in REMOVED_MAX_PATHS:
            body = {"lora_name": "x", "lora_path": str(tmp_path)}
            assert httpx.post(f"{base}{path}", json=body).status_code == 404, path
        assert httpx.post(f"{base}/v1/completions", json={}).json() == {"from": "max"}
        # the router's own 404 / 405 get OpenAI's error shape on MAX's app too (MAX leaves them
        # as {"detail": ...}); MAX's handler for its own HTTPExceptions stays
        r = httpx.get(f"{base}/v1/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = httpx.get(f"{base}/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        assert httpx.get(f"{base}/max-raises").json() == {"max": 418}
    assert hits == ["/v1/completions"]


class _Audit:
    """Python's audit events (file opens, directory listings, sockets) seen while `recording`."""

    events: list[tuple[str, tuple]] = []
    recording = False
    installed = False

    @classmethod
    def hook(cls, event: str, args: tuple) -> None:
        if cls.recording and event in ("open", "os.listdir", "os.scandir", "socket.connect", "socket.getaddrinfo",
                                       "shutil.copyfile", "subprocess.Popen", "os.system"):  # fmt: skip
            cls.events.append((event, args))

    @classmethod
    @contextlib.contextmanager
    def record(cls):
        if not cls.installed:
            sys.addaudithook(cls.hook)  # for the rest of the process; idle unless recording
            cls.installed = True
        cls.events.clear()
        cls.recording = True
        try:
            yield cls.events
        finally:
            cls.recording = False


def test_no_request_makes_the_server_read_a_local_path(server, tmp_path):
    """Paths and file:// URLs in every field a client controls: the server opens none of them."""
    canary = tmp_path / "canary-secret.json"
    canary.write_text('{"type": "object"}')
    remote = "http://169.254.169.254/latest/meta-data"
    paths = [str(canary), f"file://{canary}", os.path.relpath(canary), remote]
    engine, base = server()
    bodies = []
    for p in paths:
        ref_schema = {"type": "object", "properties": {"a": {"$ref": p}}, "$id": p}
        bodies += [
            ("/v1/responses", {"model": p, "input": "hi"}),
            ("/v1/responses", {"model": engine.model_name, "input": p, "instructions": p, "previous_response_id": p}),
            ("/v1/responses", {"model": engine.model_name, "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": p}]}]}),
            ("/v1/responses", {"model": engine.model_name, "input": [{"role": "user", "content": [
                {"type": "input_file", "file_url": p}]}]}),
            ("/v1/responses", {"model": engine.model_name, "input": "hi", "tools": [
                {**WEATHER_TOOL, "parameters": ref_schema, "strict": True}]}),
            ("/v1/responses", {"model": engine.model_name, "input": "hi", "tools": [
                {**WEATHER_TOOL, "parameters": ref_schema}]}),
            ("/v1/responses", {"model": engine.model_name, "input": "hi", "text": {"format": {
                "type": "json_schema", "name": "x", "schema": ref_schema, "strict": False}}}),
            ("/v1/chat/completions", {"model": engine.model_name, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": p}}]}]}),
            ("/v1/chat/completions", {"model": engine.model_name, "messages": [{"role": "user", "content": p}],
                                      "response_format": {"type": "json_schema", "json_schema": {
                                          "name": "x", "schema": ref_schema}}}),
        ]  # fmt: skip
    with httpx.Client(base_url=base, timeout=10) as http:
        http.get("/health")  # the connection exists before recording
        statuses = []
        with _Audit.record() as events:
            for path, body in bodies:
                statuses.append(http.post(path, json=body).status_code)
            for p in paths:
                statuses.append(http.get(f"/v1/responses/{p}").status_code)
            time.sleep(0.2)
            (tmp_path / "control.txt").write_text("the hook is live")
        assert all(s < 500 for s in statuses), statuses
        touched = [e for e in events if "canary" in repr(e[1]) or "169.254" in repr(e[1])]
        assert touched == [], "opened, listed or connected to what a request named"
        assert not [e for e in events if e[0] in ("subprocess.Popen", "os.system")]
        assert [e for e in events if e[0] == "open" and "control.txt" in repr(e[1])], "the audit hook records"
    assert 200 in statuses, "some of them were served"



